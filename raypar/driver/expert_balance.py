"""When a run moves experts between its ep workers, and where (`parallel.rebalance_experts_every`).

The driver sums the rows routed to each expert of each MoE layer (`StepRecord.expert_tokens`,
over every replica) since the last look. Every `rebalance_experts_every` steps it finds a
placement whose busiest workers receive fewer rows (`raypar.expert_placement`); where that
saves at least `MIN_GAIN` of the rows the layers' busiest workers receive, the controller
moves the workers to it as to another cut of the model (`raypar.driver.cut_move`): the
stages are rebuilt with the new placement and every expert's weights, masters and moments
go to their new worker. Results are unchanged: where an expert runs is not what it computes.
"""
from __future__ import annotations

from typing import Callable

from raypar.config import Config
from raypar.driver.records import StepRecord, sum_expert_tokens
from raypar.expert_placement import Placement, balanced_placement, busiest, identity, loads_by_layer, moved_experts
from raypar.topology import Grid

# A placement that saves less than this share of the busiest workers' rows is not worth a
# move (the stages are rebuilt: seconds on a GPU).
MIN_GAIN = 0.02


class ExpertBalance:
    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.moves: list[dict] = []  # each placement moved to (summary.expert_moves)
        self._tokens: dict[str, list[int]] = {}  # routed rows per layer and expert since the last look
        self._looked_at = -1  # the step before which the placement was last looked at

    def observe(self, record: StepRecord) -> None:
        if record.expert_tokens:
            self._tokens = sum_expert_tokens([self._tokens, record.expert_tokens])

    def due(self, cfg: Config, grid: Grid, step: int) -> bool:
        """Whether the placement is looked at before `step` (nothing may be in flight then)."""
        every = cfg.parallel.rebalance_experts_every
        return (every > 0 and grid.ep > 1 and cfg.model.n_experts > 0 and 0 < step < cfg.train.steps
                and step % every == 0 and step != self._looked_at)

    def propose(self, cfg: Config, grid: Grid, step: int) -> tuple[Placement, dict] | None:
        """The placement to move to before `step`, with what it saves, or None where the
        current one is within MIN_GAIN of it (or nothing was routed)."""
        self._looked_at = step
        loads, self._tokens = loads_by_layer(cfg.model, self._tokens), {}
        current = cfg.parallel.expert_placement or identity(cfg.model)
        before = busiest(current, loads, grid.ep)
        if before == 0:
            return None
        placement = balanced_placement(loads, grid.ep, current)
        after = busiest(placement, loads, grid.ep)
        even = sum(map(sum, loads)) / grid.ep  # the busiest workers' rows if every worker got as many
        record = {"step": step, "busiest_before": before / even, "busiest_after": after / even,
                  "experts_moved": moved_experts(current, placement, grid.ep)}
        if after > (1 - MIN_GAIN) * before:
            self.log(f"raypar: experts stay on their workers at step {step}: the busiest workers receive "
                     f"{record['busiest_before']:.3f}x an even share of the rows, {record['busiest_after']:.3f}x "
                     f"at best (parallel.rebalance_experts_every moves them for a {MIN_GAIN:.0%} saving)")
            return None
        return placement, record
