"""The dp x pp x ep x tp grid of stage workers: ranks, coordinates and process-group members."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Coord:
    dp: int
    pp: int
    ep: int
    tp: int = 0  # this worker's slice of its stage cell's layers (`parallel.tp`)

    def __str__(self) -> str:
        return f"(dp={self.dp}, pp={self.pp}, ep={self.ep}" + (f", tp={self.tp})" if self.tp else ")")


@dataclass(frozen=True)
class Grid:
    """Rank layout: tp varies fastest, then ep, then pp, then dp, so a stage cell's tensor-
    parallel workers, a stage's expert group and a pipeline's stages sit on neighbouring
    ranks (and, with PACK, on one node)."""

    dp: int = 1
    pp: int = 1
    ep: int = 1
    tp: int = 1  # workers a stage cell's layers are split over (tensor parallelism)

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.ep * self.tp

    def rank(self, c: Coord) -> int:
        return ((c.dp * self.pp + c.pp) * self.ep + c.ep) * self.tp + c.tp

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a grid of {self.size} workers")
        tp = rank % self.tp
        cell = rank // self.tp
        ep = cell % self.ep
        pp = (cell // self.ep) % self.pp
        dp = cell // (self.ep * self.pp)
        return Coord(dp, pp, ep, tp)

    def coords(self) -> list[Coord]:
        return [self.coord(r) for r in range(self.size)]

    def pipeline_ranks(self, dp: int, ep: int, tp: int = 0) -> list[int]:
        """Ranks of one pipeline, stage 0 first: p2p neighbours (tp rank to the same tp rank)."""
        return [self.rank(Coord(dp, s, ep, tp)) for s in range(self.pp)]

    def ep_ranks(self, dp: int, pp: int, tp: int = 0) -> list[int]:
        """The expert-parallel group of stage `pp` in replica `dp`: all-to-all of tokens."""
        return [self.rank(Coord(dp, pp, e, tp)) for e in range(self.ep)]

    def tp_ranks(self, dp: int, pp: int, ep: int) -> list[int]:
        """The workers of one stage cell, each holding a slice of its layers."""
        return [self.rank(Coord(dp, pp, ep, t)) for t in range(self.tp)]

    def replica_ranks(self, dp: int) -> list[int]:
        """Every worker of data-parallel replica `dp`: together they hold the whole model once."""
        return [self.rank(Coord(dp, s, e, t)) for s in range(self.pp) for e in range(self.ep) for t in range(self.tp)]

    @property
    def data_parallel_size(self) -> int:
        """Pipelines that read distinct data: one per (dp, ep) pair (a cell's tp workers read the same)."""
        return self.dp * self.ep

    def data_rank(self, c: Coord) -> int:
        return c.dp * self.ep + c.ep

    def dense_grad_ranks(self, pp: int, tp: int = 0) -> list[int]:
        """Ranks holding the same dense parameters of stage `pp` (all-reduce over dp x ep)."""
        return [self.rank(Coord(d, pp, e, tp)) for d in range(self.dp) for e in range(self.ep)]

    def expert_grad_ranks(self, pp: int, ep: int, tp: int = 0) -> list[int]:
        """Ranks holding the same expert group (all-reduce over dp only)."""
        return [self.rank(Coord(d, pp, ep, tp)) for d in range(self.dp)]

    def __str__(self) -> str:
        return f"dp={self.dp} x pp={self.pp} x ep={self.ep}" + (f" x tp={self.tp}" if self.tp > 1 else "")


def cells_across_nodes(grid: Grid, nodes: list[str]) -> dict[Coord, list[str]]:
    """The stage cells whose tp workers (ranks by `nodes[rank]`) are not all on one node:
    their every block's all-reduces then cross the network. Cell -> its workers' nodes."""
    spread: dict[Coord, list[str]] = {}
    for rank in range(0, grid.size, grid.tp):
        held = nodes[rank:rank + grid.tp]
        if len(set(held)) > 1:
            spread[grid.coord(rank)] = held
    return spread
