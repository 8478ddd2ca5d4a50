"""`parallel.schedule: auto` on one grid: time the units, predict, run the finalists, choose.

The states, one step at a time (no step is sent ahead while choosing):

1. TIMING: the first TIMING_STEPS steps run zero-bubble H1, whose F, I and W are timed
   apart; the last of them (the first pays for the device's warm-up: cuBLAS handles, the
   allocator's first blocks) gives the unit costs, and every schedule is predicted from them.
   A schedule of several chunks per stage cuts the model otherwise: its stages' costs are
   the timed ones carried over to its cut by FLOPs (`on_layout`).
2. TRYING: each other finalist (predicted within MEASURE_WITHIN of the fastest that fits the
   memory budget) runs TRIAL_STEPS steps; the last one's time is its measurement. Those of
   the cut running go first, then the others grouped by cut, so the model is cut anew at
   most once per cut and once more for the choice.
3. CHOSEN: the fastest measured finalist (or the one finalist) runs from the next step on.

Every step of the choice is a real training step: nothing is run twice or thrown away.
The controller moves the workers to another cut (`layout`: `raypar.driver.cut_move`); when
it cannot (`unavailable`), the schedules of that cut drop out of the choice.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Callable

from raypar.driver.stats import report_costs
from raypar.runtime.report import StepReport
from raypar.schedule import SCHEDULES, Layout, Prepared
from raypar.schedule.choice import (TIMING_SCHEDULE, TIMING_STEPS, TRIAL_STEPS, Prediction, UnitCosts, choose,
                                    describe, finalists, format_table, predict_cuts)
from raypar.topology import Grid


class ScheduleChooser:
    """Which schedule the next step on `grid` runs while `parallel.schedule: auto` chooses."""

    def __init__(self, grid: Grid, microbatches: int, layouts: dict[str, Layout] | None = None,
                 stage_flops: Callable[[Layout], list[float]] | None = None):
        """`layouts`: the schedules to choose among and how each cuts the model (default:
        those of one chunk per stage); `stage_flops`: each stage's FLOPs on a cut, which
        carries the costs timed on one chunk per stage over to the other cuts."""
        self.grid, self.microbatches = grid, microbatches
        self.layouts = layouts or {name: Layout(grid.pp) for name in SCHEDULES}
        if stage_flops is None and any(layout.n_chunks > 1 for layout in self.layouts.values()):
            raise ValueError("schedules of several chunks per stage need stage_flops to be predicted")
        self.stage_flops = stage_flops
        self.costs: UnitCosts | None = None
        self.predictions: list[Prediction] | None = None
        self.budget: int | None = None
        self.measured: dict[str, float] = {}  # schedule -> seconds its last trial step took
        self.dropped: dict[str, str] = {}  # schedule -> why it cannot run (its cut could not be made)
        # Each move of the workers to another cut, as the controller made it (the choice's
        # record shares this list: the move to the chosen cut comes after the choice).
        self.moves: list[dict] = []
        self._finals: list[str] = []  # schedules predicted close enough to the fastest to run
        self._trials: list[str] = []  # finalists still to run
        self.steps_run = 0  # steps of the choice finished
        self.choice: dict | None = None  # once chosen: what `summary.schedule_choices` keeps
        if grid.pp == 1:
            self.schedule, self._left = "1f1b", 0
            self._chosen("one stage: every order takes the same time there, and 1f1b holds one micro-batch")
        else:
            self.schedule, self._left = TIMING_SCHEDULE, TIMING_STEPS

    @property
    def layout(self) -> Layout:
        """How the schedule to run next cuts the model."""
        return self.layouts[self.schedule]

    @property
    def choosing(self) -> bool:
        return self.choice is None

    @property
    def state(self) -> str:
        if not self.choosing:
            return "chosen"
        return "timing" if self.predictions is None else "trying"

    def step_done(self, reports: list[StepReport], programs: Prepared, step_time_s: float,
                  budget_bytes: int | None) -> None:
        """A step of the choice finished (its reports, the programs it ran, its time); moves
        `schedule` on. Raises ScheduleError when no schedule fits the budget."""
        self.steps_run += 1
        self._left -= 1
        if self._left > 0:
            return
        self.measured[self.schedule] = step_time_s
        if self.predictions is None:
            self.budget = budget_bytes
            self.costs = report_costs(reports, self.grid, programs, self.schedule)
            # Every schedule predicted from these costs, timed on one chunk per stage.
            self.predictions = predict_cuts(self.microbatches, self.costs, Layout(self.grid.pp), self.layouts,
                                            self.stage_flops)
            self._finals = [p.schedule for p in finalists(self.predictions, budget_bytes)]
            running = self.layout
            # Stable: within a cut, the fastest predicted first.
            self._trials = sorted((s for s in self._finals if s not in self.measured),
                                  key=lambda s: (self.layouts[s] != running, describe(self.layouts[s])))
            if len(self._finals) <= 1:
                self._trials = []
        self._next()

    def unavailable(self, why: str) -> None:
        """The workers could not be moved to the cut `schedule` needs: its schedules drop out
        and the choice goes on with the others."""
        cut = self.layout
        for name, layout in self.layouts.items():
            if layout == cut:
                self.dropped[name] = why
        self._finals = [s for s in self._finals if s not in self.dropped]
        self._trials = [s for s in self._trials if s not in self.dropped]
        self.choice = None
        self._next()

    def _next(self) -> None:
        if self._trials:
            self.schedule, self._left = self._trials.pop(0), TRIAL_STEPS
            return
        candidates = [p for p in self.predictions if p.schedule not in self.dropped]
        tried = {s: t for s, t in self.measured.items() if s in self._finals} if len(self._finals) > 1 else None
        chosen, why = choose(candidates, self.budget, tried)  # raises when none fits
        if self.dropped:
            why += f"; not run: {', '.join(self.dropped)} ({next(iter(self.dropped.values()))})"
        self.schedule = chosen.schedule
        self._chosen(why)

    def table(self) -> str:
        chosen = next((p for p in self.predictions or [] if p.schedule == self.schedule), None)
        return format_table(self.predictions, chosen, self.budget, self.measured) if self.predictions else ""

    def _chosen(self, why: str) -> None:
        self.choice = {
            "grid": str(self.grid), "schedule": self.schedule, "reason": why, "memory_budget_bytes": self.budget,
            "costs": asdict(self.costs) if self.costs is not None else None,
            "predictions": [asdict(p) for p in self.predictions or []], "measured_step_s": dict(self.measured),
            "layouts": {name: describe(layout) for name, layout in self.layouts.items()},
            "dropped": dict(self.dropped), "moves": self.moves}
