"""Moving the workers' state to another cut of the model without leaving the devices.

A schedule with another number of chunks per stage cuts the model into other stages
(`raypar.schedule.Layout`): after the move every worker holds other layers. Through a
checkpoint, the whole state goes to host memory, is written, read back and copied onto the
devices again: on one H200, 17-30 s for a 0.84B model's 11.7 GB (BENCHMARKS.md). Here each
worker instead keeps its state's tensors where they are while its stage is rebuilt
(`held_state`), then every tensor goes where the new cut needs it: a tensor the worker
itself holds is read in place, any other is sent by its holder point to point over the
world's process group (NCCL between GPUs, gloo on CPU). The keys are those of the copies in
memory (`RecentStates`): whole tensors, tp slices and flat pieces of optimizer shares, so
the new stage loads them as it loads a copy in memory.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from raypar.checkpoint import dtype_from_name, dtype_name
from raypar.config import Config
from raypar.model.partition import stage_param_shapes
from raypar.runtime.recent_states import tensor_name
from raypar.schedule import run_layout
from raypar.topology import Grid

# key -> (dtype name, shape): what a worker holds, as the driver plans with it.
Manifest = dict[str, tuple[str, tuple[int, ...]]]
# Per receiving worker, each key it loads and the worker it comes from (itself: read in place).
MovePlan = list[list[tuple[str, int]]]


class MoveFailed(RuntimeError):
    """A move to another cut failed once the stages were cut anew (a new stage needs a tensor
    no worker holds, a send or receive failed): a failure the elastic path recovers from."""


def manifest(tensors: dict[str, torch.Tensor]) -> Manifest:
    return {key: (dtype_name(t.dtype), tuple(t.shape)) for key, t in tensors.items()}


def nbytes(entry: tuple[str, tuple[int, ...]]) -> int:
    dtype, shape = entry
    return torch.Size(shape).numel() * dtype_from_name(dtype).itemsize


def stage_parameters(cfg: Config, grid: Grid, rank: int) -> int:
    """Parameters of the stage `rank` holds on `cfg`'s cut (its tp share aside)."""
    coord = grid.coord(rank)
    layout = run_layout(cfg.parallel.schedule, grid.pp, cfg.parallel.chunks)
    shapes = stage_param_shapes(cfg.model, coord.pp, grid.pp, cfg.parallel.layers_per_stage, coord.ep, grid.ep,
                                layout)
    return sum(shape.numel() for _, shape, _ in shapes)


def plan_move(held: list[Manifest], needed: list[set[str]]) -> MovePlan:
    """For each worker (index into `needed`), the keys of every tensor its new stage loads,
    each from a worker of `held` that holds it: the worker itself where it does, else the
    holder sending the fewest bytes so far (dp replicas share the sending). A key is any
    piece of the named tensor (`tensor_name`): all of them go, as from a copy in memory."""
    holders: dict[str, list[int]] = {}
    for worker, keys in enumerate(held):
        for key in keys:
            holders.setdefault(key, []).append(worker)
    by_name: dict[str, list[str]] = {}
    for key in sorted(holders):
        by_name.setdefault(tensor_name(key), []).append(key)
    sending = [0] * len(held)
    plan: MovePlan = []
    for worker, names in enumerate(needed):
        missing = sorted(n for n in names if n not in by_name)
        if missing:
            raise MoveFailed(f"worker {worker}'s new stage needs {len(missing)} tensors no worker holds "
                            f"(first: {missing[:3]})")
        loads = []
        for key in (k for name in sorted(names) for k in by_name[name]):
            if worker in holders[key]:
                loads.append((key, worker))
                continue
            src = min(holders[key], key=lambda w: (sending[w], w))
            sending[src] += nbytes(held[src][key])
            loads.append((key, src))
        plan.append(loads)
    return plan


def moved_bytes(plan: MovePlan, held: list[Manifest]) -> tuple[int, int]:
    """Bytes read in place, bytes sent between workers."""
    local = sent = 0
    for worker, loads in enumerate(plan):
        for key, src in loads:
            size = nbytes(held[src][key])
            local, sent = (local + size, sent) if src == worker else (local, sent + size)
    return local, sent


def exchange(plan: MovePlan, held_manifests: list[Manifest], rank: int, held: dict[str, torch.Tensor],
             device: torch.device) -> dict[str, torch.Tensor]:
    """This worker's part of the move, on every worker of the world at once (rank = index in
    `plan`): its sends of `held` to the others and its receives, point to point in one batch;
    returns what its new stage loads, the tensors it holds itself in place. Tensors travel as
    their bytes, so any dtype goes over gloo and NCCL alike; on NCCL from and into `device`."""
    comm_device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    ops: list[dist.P2POp] = []
    mine: dict[str, torch.Tensor] = {}
    # Every worker walks the whole plan in one order, so the sends between a pair of workers
    # are posted in the order of their receives.
    for dst, loads in enumerate(plan):
        for key, src in loads:
            if dst == rank and src == rank:
                mine[key] = held[key]
            elif nbytes(held_manifests[src][key]) == 0:
                if dst == rank:
                    dtype, shape = held_manifests[src][key]
                    mine[key] = torch.empty(shape, dtype=dtype_from_name(dtype), device=comm_device)
            elif src == rank:
                raw = held[key].to(comm_device).contiguous().reshape(-1).view(torch.uint8)
                ops.append(dist.P2POp(dist.isend, raw, dst))
            elif dst == rank:
                dtype, shape = held_manifests[src][key]
                raw = torch.empty(nbytes(held_manifests[src][key]), dtype=torch.uint8, device=comm_device)
                ops.append(dist.P2POp(dist.irecv, raw, src))
                mine[key] = raw.view(dtype_from_name(dtype)).reshape(shape)
    # A batch of point-to-point operations that is the group's first must be called by every
    # rank (NCCL): one all-reduce first, which every worker calls, makes the world's communicator.
    dist.all_reduce(torch.zeros(1, device=comm_device))
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    if comm_device.type == "cuda":
        torch.cuda.synchronize(comm_device)
    return mine
