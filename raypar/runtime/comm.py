"""Tensor traffic among stage workers over torch.distributed (NCCL on GPU, gloo on CPU)."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from raypar import host_wait


class CollectiveTimeout(RuntimeError):
    """A peer did not take part in a p2p exchange or collective in time."""


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
             timeout: timedelta) -> None:
    """Post every send and receive of one comm unit as one batch, then wait for all.

    Posting a unit's sends and receives together is what keeps a schedule's paired
    exchanges (e.g. 1F1B's send-forward/receive-backward) from deadlocking on NCCL.
    """
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        _wait(work, timeout, f"p2p exchange with ranks {sorted({p for _, p in sends + recvs})}")


def connect_neighbours(prev: int | None, next_: int | None, device: torch.device, timeout: timedelta) -> None:
    """One exchange with each pipeline neighbour, both directions in one batch, before any step.

    NCCL connects a pair of ranks lazily, inside their first send or receive. Without this,
    forward-then-backward's first connection from the next stage back to this one is made
    in the batch that pairs the last forward send with the first gradient receive, while
    the peer sits in a plain receive of that forward: on the 1B model that step never
    finished (BENCHMARKS.md). Here every rank posts both directions to both neighbours at
    once, so the connections exist before a schedule's asymmetric batches run.
    """
    peers = [p for p in (prev, next_) if p is not None]
    if not peers:
        return
    sends = [(torch.zeros(1, device=device), p) for p in peers]
    recvs = [(torch.empty(1, device=device), p) for p in peers]
    exchange(sends, recvs, timeout)
    host_wait.synchronize(device, "connecting pipeline neighbours")


def all_reduce_(tensors: list[torch.Tensor], group, timeout: timedelta, average: bool = False) -> None:
    """Sum (or average) tensors in place over `group`, as one flat buffer."""
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    _wait(dist.all_reduce(flat, group=group, async_op=True), timeout, "gradient all-reduce")
    if average:
        flat /= dist.get_world_size(group)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def check_world(device: torch.device, timeout: timedelta) -> None:
    """Raise unless every rank of the world gets here with working process groups.

    One element summed over the world: a communicator aborted after a timeout (whose
    collectives then leave garbage without raising where they ran) fails here instead.
    """
    why = world_check_failed(host_wait.to_host(queue_world_check(device, timeout), "peer check over the world"))
    if why is not None:
        raise CollectiveTimeout(why)


def queue_world_check(device: torch.device, timeout: timedelta) -> torch.Tensor:
    """`check_world` without waiting on the host: the all-reduce is queued and the stream
    waits for it, so whatever is queued next (a snapshot's copies) sees its result. Returns
    the one-element sum, which must read the world size (`world_check_failed`)."""
    one = torch.ones(1, device=device)
    _wait(dist.all_reduce(one, async_op=True), timeout, "peer check over the world")
    return one


def world_check_failed(total: torch.Tensor) -> str | None:
    """None when `queue_world_check`'s sum (copied to the host) reads the world size, else why not."""
    world = dist.get_world_size()
    value = float(total.reshape(-1)[0])
    return None if int(value) == world else f"peer check over the world summed {value:g}, not {world}: a peer is broken"


def _wait(work, timeout: timedelta, what: str) -> None:
    # No per-call timeout: on NCCL that would block the CPU until the kernel finishes and
    # stop it from queueing the next compute. The process group's own timeout bounds the
    # wait (gloo raises; NCCL's watchdog aborts the communicator).
    try:
        work.wait()
    except RuntimeError as e:
        raise CollectiveTimeout(f"{what} failed or timed out (limit {timeout.total_seconds():.0f}s): {e}") from e
