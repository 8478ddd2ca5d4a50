"""Elastic training without Ray: the controller's states and the grid re-planner.

When workers are lost, the run goes on with the grid `plan_grid` picks for what is left:
first the configured grid with fewer data-parallel replicas, then other splits of the
pipeline and expert dimensions. The global batch never changes: each replica gets a
larger share, run as more micro-batches of the same size.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from raypar.config import Config, ConfigError, validate
from raypar.topology import Grid


class State(str, enum.Enum):
    PLANNING = "PLANNING"  # choosing a grid for the resources the cluster has
    STARTING = "STARTING"  # placing workers, wiring process groups, loading a checkpoint
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"  # a worker or node was lost: tearing down, then planning again
    GROWING = "GROWING"  # resources came back: restarting on a larger grid at a checkpoint
    FINISHED = "FINISHED"
    FAILED = "FAILED"


TRANSITIONS = {
    State.PLANNING: {State.STARTING, State.FAILED},
    State.STARTING: {State.RUNNING, State.RECOVERING, State.FAILED},
    State.RUNNING: {State.RECOVERING, State.GROWING, State.FINISHED, State.FAILED},
    State.RECOVERING: {State.PLANNING, State.FAILED},
    State.GROWING: {State.PLANNING, State.FAILED},
    State.FINISHED: set(),
    State.FAILED: set(),
}


@dataclass
class StateMachine:
    state: State = State.PLANNING
    history: list[tuple[float, State, str]] = field(default_factory=list)
    on_change: Callable[[State, str], None] | None = None  # logging and metrics

    def to(self, new: State, why: str = "") -> None:
        if new not in TRANSITIONS[self.state]:
            raise RuntimeError(f"controller cannot go from {self.state.value} to {new.value}")
        self.state = new
        self.history.append((time.time(), new, why))
        if self.on_change is not None:
            self.on_change(new, why)


@dataclass(frozen=True)
class Plan:
    grid: Grid
    microbatches: int

    def __str__(self) -> str:
        return f"{self.grid} with {self.microbatches} micro-batches"


def _fits(cfg: Config, grid: Grid, microbatch_size: int) -> Plan | None:
    m = cfg.model
    if grid.pp > m.n_layers or (m.n_experts and m.n_experts % grid.ep) or (not m.n_experts and grid.ep > 1):
        return None
    if cfg.parallel.layers_per_stage is not None and grid.pp != cfg.parallel.pp:
        return None  # an explicit split belongs to its pipeline depth
    share, rest = divmod(cfg.train.global_batch_size, grid.data_parallel_size)
    if rest or share == 0:
        return None
    microbatches = share // microbatch_size if share % microbatch_size == 0 else share
    return Plan(grid, microbatches)


def plan_grid(cfg: Config, workers: int, min_workers: int = 1) -> Plan | None:
    """The grid for `workers` available worker slots, or None if nothing fits.

    Shrinks dp first (same pp and ep); only when no dp fits does it re-split pp and ep,
    preferring more workers, then the configured pipeline depth and expert split.
    """
    p = cfg.parallel
    mb = cfg.microbatch_size
    for dp in range(p.dp, 0, -1):
        grid = Grid(dp, p.pp, p.ep)
        if min_workers <= grid.size <= workers and (plan := _fits(cfg, grid, mb)):
            return plan
    candidates = []
    for pp in range(1, cfg.model.n_layers + 1):
        for ep in range(1, max(cfg.model.n_experts, 1) + 1):
            for dp in range(1, p.dp + 1):
                grid = Grid(dp, pp, ep)
                if min_workers <= grid.size <= workers and (plan := _fits(cfg, grid, mb)):
                    candidates.append(plan)
    if not candidates:
        return None
    return max(candidates, key=lambda c: (c.grid.size, -abs(c.grid.pp - p.pp), -abs(c.grid.ep - p.ep), c.grid.dp))


def with_plan(cfg: Config, plan: Plan) -> Config:
    """The config the workers of a re-planned grid run with."""
    parallel = replace(cfg.parallel, dp=plan.grid.dp, pp=plan.grid.pp, ep=plan.grid.ep,
                       microbatches=plan.microbatches)
    new = replace(cfg, parallel=parallel)
    try:
        validate(new)
    except ConfigError as e:  # plan_grid only proposes valid grids; this is a bug guard
        raise RuntimeError(f"re-planned grid {plan} is invalid: {e}") from e
    return new
