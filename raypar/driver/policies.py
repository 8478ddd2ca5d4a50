"""The controller's decisions, as small pure objects: what grid, recover or fail, when to save.

Each takes plain values (a config, counts, a step number) and returns a decision, so it
is tested without Ray; the controller gathers the values and acts on the answer.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from raypar.config import CheckpointConfig, Config, ConfigError, ElasticConfig, validate
from raypar.schedule import schedule_fits
from raypar.topology import Grid

# -- grid: what the cluster can hold ------------------------------------------------------------


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
    if isinstance(cfg.parallel.layers_per_stage, list) and grid.pp != cfg.parallel.pp:
        return None  # an explicit split belongs to its pipeline depth ("auto" splits any)
    if cfg.parallel.sequence_parallel and grid.tp > 1 and cfg.data.seq_len % grid.tp:
        return None  # each tp worker holds an equal slice of the sequence
    share, rest = divmod(cfg.train.global_batch_size, grid.data_parallel_size)
    if rest or share == 0:
        return None
    microbatches = share // microbatch_size if share % microbatch_size == 0 else share
    p = cfg.parallel
    if schedule_fits(p.schedule, grid.pp, microbatches, m.n_layers, p.chunks) is not None:
        return None  # e.g. interleaved-1f1b's micro-batches in groups of pp
    return Plan(grid, microbatches)


def plan_grid(cfg: Config, workers: int, min_workers: int = 1, node_room: int | None = None) -> Plan | None:
    """The grid for `workers` available worker slots, or None if nothing fits.

    Shrinks dp first (same pp, ep and tp); only when no dp fits does it re-split pp and ep,
    preferring more workers, then the configured pipeline depth and expert split. The
    global batch never changes: each replica gets a larger share, run as more micro-batches
    of the same size. tp changes only where the configured one cannot work: when no grid
    with it fits, or a node holds fewer than `node_room` workers (a cell's tp workers share
    a node); then the largest smaller tp that fits, its parts split as that tp allows
    (`tensor_parallel.split_parts`).
    """
    p = cfg.parallel
    mb = cfg.microbatch_size
    most_tp = p.tp if node_room is None else max(1, min(p.tp, node_room))
    if most_tp == p.tp:
        for dp in range(p.dp, 0, -1):
            grid = Grid(dp, p.pp, p.ep, p.tp)
            if min_workers <= grid.size <= workers and (plan := _fits(cfg, grid, mb)):
                return plan
    for tp in range(most_tp, 0, -1):
        candidates = []
        for pp in range(1, cfg.model.n_layers + 1):
            for ep in range(1, max(cfg.model.n_experts, 1) + 1):
                for dp in range(1, p.dp + 1):
                    grid = Grid(dp, pp, ep, tp)
                    if min_workers <= grid.size <= workers and (plan := _fits(cfg, grid, mb)):
                        candidates.append(plan)
        if candidates:
            return max(candidates, key=lambda c: (c.grid.size, -abs(c.grid.pp - p.pp), -abs(c.grid.ep - p.ep),
                                                  c.grid.dp))
    return None


def grow_plan(cfg: Config, grid: Grid, slots: int, node_room: int | None = None) -> Plan | None:
    """A larger grid to grow to, when `slots` workers fit (the running grid's included) and
    the run is below its configured grid; else None."""
    e = cfg.elastic
    if not (e.enabled and e.grow) or grid == cfg.parallel.grid:
        return None
    plan = plan_grid(cfg, slots, e.min_workers, node_room)
    return plan if plan is not None and plan.grid.size > grid.size else None


def with_plan(cfg: Config, plan: Plan) -> Config:
    """The config the workers of a re-planned grid run with."""
    parallel = replace(cfg.parallel, dp=plan.grid.dp, pp=plan.grid.pp, ep=plan.grid.ep, tp=plan.grid.tp,
                       microbatches=plan.microbatches,
                       sequence_parallel=cfg.parallel.sequence_parallel and plan.grid.tp > 1)
    new = replace(cfg, parallel=parallel)
    try:
        validate(new)
    except ConfigError as e:  # plan_grid only proposes valid grids; this is a bug guard
        raise RuntimeError(f"re-planned grid {plan} is invalid: {e}") from e
    return new


def worker_slots(resources: dict[str, float], cpus_per_worker: float, device: str) -> int:
    """How many stage workers `resources` (Ray's resource dict) can hold."""
    slots = int(resources.get("CPU", 0.0) / cpus_per_worker + 1e-9)
    if device == "cuda":
        slots = min(slots, int(resources.get("GPU", 0.0)))
    return slots


# -- failures: recover or fail ------------------------------------------------------------------


class Decision(str, enum.Enum):
    RECOVER = "recover"
    FAIL = "fail"


@dataclass(frozen=True)
class FailurePolicy:
    """Recover from lost workers (and hung collectives) while restarts are left; fail on
    anything else: a bug in a worker would only repeat."""

    elastic: ElasticConfig

    def decide(self, lost_worker: bool, restarts: int) -> tuple[Decision, str]:
        """(decision, why) for a failure, after `restarts` earlier restarts."""
        if not lost_worker:
            return Decision.FAIL, "not recovering from an error in a worker (not a lost one): it would only repeat"
        if not self.elastic.enabled:
            return Decision.FAIL, "elastic.enabled is false"
        if restarts >= self.elastic.max_restarts:
            return Decision.FAIL, f"giving up after {restarts} restarts (elastic.max_restarts={self.elastic.max_restarts})"
        return Decision.RECOVER, f"restart {restarts + 1} of at most {self.elastic.max_restarts}"


# -- checkpoints: when to save ------------------------------------------------------------------


@dataclass(frozen=True)
class SavePolicy:
    """Which steps save a checkpoint, counted in steps done. (The EMA is the workers' own:
    they fold it after every `checkpoint.ema_every` optimizer steps.)"""

    checkpoint: CheckpointConfig
    total_steps: int

    def save_due(self, steps_done: int) -> bool:
        every = self.checkpoint.every
        return every > 0 and (steps_done % every == 0 or steps_done == self.total_steps)

    def snapshot_options(self) -> dict[str, bool]:
        """What a save's snapshot copies beside the weights (and the EMA, when kept)."""
        return {"save_optimizer": self.checkpoint.save_optimizer, "save_master": self.checkpoint.save_master}
