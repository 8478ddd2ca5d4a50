"""The dp x pp x ep grid of stage workers: ranks, coordinates and process-group members."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Coord:
    dp: int
    pp: int
    ep: int

    def __str__(self) -> str:
        return f"(dp={self.dp}, pp={self.pp}, ep={self.ep})"


@dataclass(frozen=True)
class Grid:
    """Rank layout: ep varies fastest, then pp, then dp, so a pipeline's stages and a
    stage's expert group sit on neighbouring ranks (and, with PACK, on one node)."""

    dp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.ep

    def rank(self, c: Coord) -> int:
        return (c.dp * self.pp + c.pp) * self.ep + c.ep

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a grid of {self.size} workers")
        ep = rank % self.ep
        pp = (rank // self.ep) % self.pp
        dp = rank // (self.ep * self.pp)
        return Coord(dp, pp, ep)

    def coords(self) -> list[Coord]:
        return [self.coord(r) for r in range(self.size)]

    def pipeline_ranks(self, dp: int, ep: int) -> list[int]:
        """Ranks of one pipeline, stage 0 first: p2p neighbours and grad-norm group."""
        return [self.rank(Coord(dp, s, ep)) for s in range(self.pp)]

    def ep_ranks(self, dp: int, pp: int) -> list[int]:
        """The expert-parallel group of stage `pp` in replica `dp`: all-to-all of tokens."""
        return [self.rank(Coord(dp, pp, e)) for e in range(self.ep)]

    def replica_ranks(self, dp: int) -> list[int]:
        """Every worker of data-parallel replica `dp`: together they hold the whole model once."""
        return [self.rank(Coord(dp, s, e)) for s in range(self.pp) for e in range(self.ep)]

    @property
    def data_parallel_size(self) -> int:
        """Pipelines that read distinct data: one per (dp, ep) pair."""
        return self.dp * self.ep

    def data_rank(self, c: Coord) -> int:
        return c.dp * self.ep + c.ep

    def dense_grad_ranks(self, pp: int) -> list[int]:
        """Ranks holding the same dense parameters of stage `pp` (all-reduce over dp x ep)."""
        return [self.rank(Coord(d, pp, e)) for d in range(self.dp) for e in range(self.ep)]

    def expert_grad_ranks(self, pp: int, ep: int) -> list[int]:
        """Ranks holding the same expert group (all-reduce over dp only)."""
        return [self.rank(Coord(d, pp, ep)) for d in range(self.dp)]

    def __str__(self) -> str:
        return f"dp={self.dp} x pp={self.pp} x ep={self.ep}"
