"""Process groups of one worker, created the same way, in the same order, on every rank."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from raypar.topology import Grid


@dataclass
class StageGroups:
    pipeline: object | None  # this pipeline's stages: global gradient norm
    dense_grad: object | None  # replicas of this stage's dense parameters: gradient all-reduce
    prev_rank: int | None  # global rank of the previous stage (p2p)
    next_rank: int | None


def init_world(backend: str, master_addr: str, master_port: int, rank: int, world_size: int,
               timeout: timedelta) -> None:
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )


def build_groups(grid: Grid, rank: int, timeout: timedelta) -> StageGroups:
    """new_group is collective over the whole world, so every rank walks every group."""
    me = grid.coord(rank)
    pipeline = dense = None
    for d in range(grid.dp):
        for e in range(grid.ep):
            ranks = grid.pipeline_ranks(d, e)
            g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
            if rank in ranks:
                pipeline = g
    for s in range(grid.pp):
        ranks = grid.dense_grad_ranks(s)
        g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
        if rank in ranks:
            dense = g
    line = grid.pipeline_ranks(me.dp, me.ep)
    return StageGroups(
        pipeline=pipeline,
        dense_grad=dense,
        prev_rank=line[me.pp - 1] if me.pp > 0 else None,
        next_rank=line[me.pp + 1] if me.pp < grid.pp - 1 else None,
    )
