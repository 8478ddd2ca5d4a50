"""Process groups of one worker, created the same way, in the same order, on every rank."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from raypar.schedule.layout import Layout, single
from raypar.topology import Grid


@dataclass
class StageGroups:
    replica: object | None  # every stage and expert group of this dp replica: global grad norm
    dense_grad: object | None  # replicas of this stage's dense parameters (dp x ep): all-reduce
    expert_grad: object | None  # replicas of this stage's experts (dp): all-reduce
    ep: object | None  # this stage's expert-parallel group: token all-to-all
    line: list[int]  # global rank of each stage of this worker's pipeline (p2p peers)
    tp: object | None = None  # this stage cell's tensor-parallel group: the split layers' collectives
    # Second communicators over the ep and tp groups, for backward's collectives when a
    # forward runs beside another micro-batch's backward (`runtime.moe_microbatch_overlap`,
    # `runtime.tp_microbatch_overlap`): the two directions then reach their collectives in
    # the same order on every rank.
    ep_backward: object | None = None
    tp_backward: object | None = None
    # The pipeline's channels this stage takes part in, each a communicator of its own (so
    # a send waiting for its receiver holds up nothing on another channel), by (kind, sending
    # stage, receiving stage): activations ("F") go along the layout's links, gradients ("B")
    # back. One chunk per stage: "F" from each stage to the next, "B" from each to the one before.
    channels: dict[tuple[str, int, int], object] = field(default_factory=dict)


def _wait_on(what: str) -> None:
    """The default `check` of a rendezvous: nothing ends the wait but its timeout."""


def init_world(backend: str, master_addr: str, master_port: int, rank: int, world_size: int,
               timeout: timedelta, check: Callable[[str], None] = _wait_on) -> float:
    """Join the world's process group once every rank has reached its store (`rendezvous`);
    returns the seconds until they all had (on a worker kept after a failure: mostly the
    start of the new ones)."""
    t0 = time.perf_counter()
    store = rendezvous(master_addr, master_port, rank, world_size, timeout, check)
    arrived = time.perf_counter() - t0
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return arrived


# How long one attempt to reach the store's host waits, and how often the wait for the other
# ranks looks again: the waits in between give `check` its turn.
_CONNECT_TRY_S = 1.0
_ARRIVAL_POLL_S = 0.01


def rendezvous(master_addr: str, master_port: int, rank: int, world_size: int, timeout: timedelta,
               check: Callable[[str], None] = _wait_on) -> dist.TCPStore:
    """The world's store (rank 0 hosts it), once every rank has arrived at it.

    torch's own rendezvous blocks until the timeout when a rank never comes, and nothing can
    end it sooner: a worker waiting there for a peer that died cannot be reset for the next
    plan. Here the waits are short and `check(what)` runs between them; it raises to give up
    (a recovery's abort, `host_wait.check`). Once all have arrived, the process group's own
    connections are made among ranks that were alive a moment ago."""
    deadline = time.monotonic() + timeout.total_seconds()
    what = f"rank {rank}: joining the world of {world_size} ranks at {master_addr}:{master_port}"
    while True:
        check(what)
        try:
            store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                                  timeout=timedelta(seconds=_CONNECT_TRY_S), wait_for_workers=False)
            break
        except (RuntimeError, OSError):
            # The host (rank 0) is not listening yet, or is gone; rank 0 itself could not bind.
            if rank == 0 or time.monotonic() > deadline:
                raise
    store.set_timeout(timeout)
    keys = [f"raypar/arrived/{r}" for r in range(world_size)]
    store.set(keys[rank], "1")
    while not store.check(keys):
        check(what)
        if time.monotonic() > deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            raise TimeoutError(f"{what}: ranks {missing} did not arrive within {timeout.total_seconds():g}s")
        time.sleep(_ARRIVAL_POLL_S)
    return store


def build_groups(grid: Grid, rank: int, timeout: timedelta, layout: Layout | None = None,
                 backward_groups: bool = False, high_priority: bool = False) -> StageGroups:
    """new_group is collective over the whole world, so every rank walks every group.
    `layout`: where the model's chunks sit (default one per stage), which says which
    stages exchange activations. `backward_groups`: also a second communicator per ep group
    and per tp group (where that dimension is > 1). `high_priority` (NCCL): the ep and tp
    communicators run on high-priority streams, then always groups of their own.

    A group of every rank is the world's own: a second communicator over the same ranks
    would have its own stream and, on 2 x H200, the last two backwards before the norm's
    all-reduce ran ~0.4 ms longer each with it (BENCHMARKS.md).
    """
    me = grid.coord(rank)
    mine: dict[str, object | None] = {}
    world = dist.get_world_size()

    urgent = _high_priority_options() if high_priority else None

    def walk(kind: str, members: list[list[int]], options=None) -> None:
        for ranks in members:
            if len(ranks) == 1:
                g = None
            elif len(ranks) == world and options is None:
                g = dist.group.WORLD
            else:
                g = _new_group(ranks, timeout, options)
            if rank in ranks:
                mine[kind] = g

    tps = range(grid.tp)
    walk("replica", [grid.replica_ranks(d) for d in range(grid.dp)])
    walk("dense_grad", [grid.dense_grad_ranks(s, t) for s in range(grid.pp) for t in tps])
    walk("expert_grad", [grid.expert_grad_ranks(s, e, t) for s in range(grid.pp) for e in range(grid.ep) for t in tps])
    walk("ep", [grid.ep_ranks(d, s, t) for d in range(grid.dp) for s in range(grid.pp) for t in tps], urgent)
    walk("tp", [grid.tp_ranks(d, s, e) for d in range(grid.dp) for s in range(grid.pp) for e in range(grid.ep)],
         urgent)
    if backward_groups:
        # Always groups of their own, also over the whole world: a second communicator.
        seconds = {"ep_backward": [grid.ep_ranks(d, s, t) for d in range(grid.dp) for s in range(grid.pp) for t in tps],
                   "tp_backward": [grid.tp_ranks(d, s, e) for d in range(grid.dp) for s in range(grid.pp)
                                   for e in range(grid.ep)]}
        for kind, members in seconds.items():
            for ranks in members:
                if len(ranks) > 1:
                    g = _new_group(ranks, timeout, urgent)
                    if rank in ranks:
                        mine[kind] = g
    line = grid.pipeline_ranks(me.dp, me.ep, me.tp)
    links = (layout or single(grid.pp)).forward_links()
    channels: dict[tuple[str, int, int], object] = {}
    for d in range(grid.dp):
        for e, t in ((e, t) for e in range(grid.ep) for t in tps):
            ranks = grid.pipeline_ranks(d, e, t)
            for a, b in links:
                for kind, src, dst in (("F", a, b), ("B", b, a)):
                    # Always a group of its own, also when the pair is the whole world.
                    g = dist.new_group(sorted([ranks[src], ranks[dst]]), timeout=timeout)
                    if rank in (ranks[src], ranks[dst]):
                        channels[kind, src, dst] = g
    return StageGroups(
        replica=mine.get("replica"),
        dense_grad=mine.get("dense_grad"),
        expert_grad=mine.get("expert_grad"),
        ep=mine.get("ep"),
        line=line,
        channels=channels,
        tp=mine.get("tp"),
        ep_backward=mine.get("ep_backward"),
        tp_backward=mine.get("tp_backward"),
    )


def _new_group(ranks: list[int], timeout: timedelta, options=None):
    return dist.new_group(ranks, timeout=timeout) if options is None else \
        dist.new_group(ranks, timeout=timeout, pg_options=options)


def _high_priority_options():
    """NCCL process group options for communicators on high-priority streams; None on gloo."""
    if dist.get_backend() != "nccl":
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = True
    return options


def abort_groups() -> None:
    """Abort every process group of this process at once, then forget them (NCCL only).

    torch aborts each group's communicators on a thread of that group, one group after
    another. An idle communicator's abort then waits for the device, where a kernel of a
    communicator not aborted yet waits for the lost peer forever: a survivor of a lost
    pipeline neighbour never got out (bench/nccl_abort_check.py, variants `3comms` and
    `stage`). Aborting every group at once lets every stuck kernel see its abort flag.
    """
    c10d = dist.distributed_c10d
    if not dist.is_initialized():
        return

    def abort(group) -> None:
        try:
            group.abort()
        except Exception:  # noqa: BLE001 - an abort that fails leaves the group unusable, as wanted
            pass

    # Every group of the process, the world's included: torch lists them only privately.
    threads = [threading.Thread(target=abort, args=(g,), daemon=True) for g in list(c10d._world.pg_names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # The communicators are aborted: this only drops torch's records of the groups.
    c10d._abort_process_group()
