"""When a run moves experts between its ep workers, and where (`parallel.rebalance_experts_every`).

The driver keeps the rows routed to each expert of each MoE layer (`StepRecord.expert_tokens`,
over every replica) in each step since the last look. Every `rebalance_experts_every` steps
it finds a placement whose busiest workers receive fewer rows (`raypar.expert_placement`);
the controller moves the workers to it as to another cut of the model
(`raypar.driver.cut_move`): the stages are rebuilt with the new placement and every
expert's weights, masters and moments go to their new worker. Results are unchanged: where
an expert runs is not what it computes.

A move is made only where it saves at least `MIN_GAIN` of the rows the layers' busiest
workers receive, twice over: on the steps since the last look, and, placed by the first half
of those steps, on the second half. The placement is made from steps already run and
serves the steps to come; on 2 x H200 from initialisation the router moved on within 2-5
steps, so that each move evened loads that were gone by the next look (BENCHMARKS.md). The
second test turns such moves down while routing drifts and lets them through once it holds.
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
        self._steps: list[dict[str, list[int]]] = []  # routed rows per layer and expert, each step since the last look
        self._looked_at = -1  # the step before which the placement was last looked at

    def observe(self, record: StepRecord) -> None:
        if record.expert_tokens:
            self._steps.append(record.expert_tokens)

    def due(self, cfg: Config, grid: Grid, step: int) -> bool:
        """Whether the placement is looked at before `step` (nothing may be in flight then)."""
        every = cfg.parallel.rebalance_experts_every
        return (every > 0 and grid.ep > 1 and cfg.model.n_experts > 0 and 0 < step < cfg.train.steps
                and step % every == 0 and step != self._looked_at)

    def propose(self, cfg: Config, grid: Grid, step: int) -> tuple[Placement, dict] | None:
        """The placement to move to before `step`, with what it saves, or None where it would
        not save MIN_GAIN (see the module's doc), or nothing was routed."""
        self._looked_at = step
        steps, self._steps = self._steps, []
        window = lambda part: loads_by_layer(cfg.model, sum_expert_tokens(part))  # noqa: E731
        loads, early, late = window(steps), window(steps[:len(steps) // 2]), window(steps[len(steps) // 2:])
        current = cfg.parallel.expert_placement or identity(cfg.model)
        before = busiest(current, loads, grid.ep)
        if before == 0:
            return None
        placement = balanced_placement(loads, grid.ep, current)
        after = busiest(placement, loads, grid.ep)
        even = sum(map(sum, loads)) / grid.ep  # the busiest workers' rows if every worker got as many
        # Placed by the first half of the steps, the rows of the second half's busiest workers.
        late_before = busiest(current, late, grid.ep)
        held = busiest(balanced_placement(early, grid.ep, current), late, grid.ep) / late_before if late_before else 1.0
        record = {"step": step, "busiest_before": before / even, "busiest_after": after / even,
                  "held_out_share": held, "experts_moved": moved_experts(current, placement, grid.ep)}
        why = None
        if after > (1 - MIN_GAIN) * before:
            why = (f"the busiest workers receive {record['busiest_before']:.3f}x an even share of the rows, "
                   f"{record['busiest_after']:.3f}x at best")
        elif len(steps) < 2:
            why = "one step since the last look cannot tell whether routing holds still"
        elif held > 1 - MIN_GAIN:
            half = len(steps) // 2
            why = (f"routing moves: placed by the first {half} of the {len(steps)} steps since the last look, the "
                   f"busiest workers of the other {len(steps) - half} would have received {held:.3f}x their rows")
        if why is not None:
            self.log(f"raypar: experts stay on their workers at step {step}: {why} (parallel.rebalance_experts_every "
                     f"moves them for a {MIN_GAIN:.0%} saving)")
            return None
        return placement, record
