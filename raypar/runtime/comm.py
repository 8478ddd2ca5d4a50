"""Tensor traffic among stage workers over torch.distributed (NCCL on GPU, gloo on CPU)."""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from raypar import host_wait


class CollectiveTimeout(RuntimeError):
    """A peer did not take part in a p2p exchange or collective in time."""


def all_reduce_(tensors: list[torch.Tensor], group, timeout: timedelta, average: bool = False) -> None:
    """Sum (or average) tensors in place over `group`, as one flat buffer."""
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    wait_for(dist.all_reduce(flat, group=group, async_op=True), timeout, "gradient all-reduce")
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
    wait_for(dist.all_reduce(one, async_op=True), timeout, "peer check over the world")
    return one


def world_check_failed(total: torch.Tensor) -> str | None:
    """None when `queue_world_check`'s sum (copied to the host) reads the world size, else why not."""
    world = dist.get_world_size()
    value = float(total.reshape(-1)[0])
    return None if int(value) == world else f"peer check over the world summed {value:g}, not {world}: a peer is broken"


def wait_for(work, timeout: timedelta, what: str) -> None:
    """Wait for a collective or p2p `work`; a failure or timeout raises CollectiveTimeout."""
    # No per-call timeout: on NCCL that would block the CPU until the kernel finishes and
    # stop it from queueing the next compute. The process group's own timeout bounds the
    # wait (gloo raises; NCCL's watchdog aborts the communicator).
    try:
        work.wait()
    except RuntimeError as e:
        raise CollectiveTimeout(f"{what} failed or timed out (limit {timeout.total_seconds():.0f}s): {e}") from e
