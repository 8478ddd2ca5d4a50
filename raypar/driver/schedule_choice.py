"""`parallel.schedule: auto` on one grid: time the units, predict, run the finalists, choose.

The states, one step at a time (no step is sent ahead while choosing):

1. TIMING: the first TIMING_STEPS steps run zero-bubble H1, whose F, I and W are timed
   apart; the last of them (the first pays for the device's warm-up: cuBLAS handles, the
   allocator's first blocks) gives the unit costs, and every schedule is predicted from them.
2. TRYING: each other finalist (predicted within MEASURE_WITHIN of the fastest that fits the
   memory budget) runs TRIAL_STEPS steps; the last one's time is its measurement.
3. CHOSEN: the fastest measured finalist (or the one finalist) runs from the next step on.

Every step of the choice is a real training step: nothing is run twice or thrown away.
"""
from __future__ import annotations

from dataclasses import asdict

from raypar.driver.stats import report_costs
from raypar.runtime.report import StepReport
from raypar.schedule import Prepared
from raypar.schedule.choice import (TIMING_SCHEDULE, TIMING_STEPS, TRIAL_STEPS, Prediction, UnitCosts, choose,
                                    finalists, format_table, predict_all)
from raypar.topology import Grid


class ScheduleChooser:
    """Which schedule the next step on `grid` runs while `parallel.schedule: auto` chooses."""

    def __init__(self, grid: Grid, microbatches: int):
        self.grid, self.microbatches = grid, microbatches
        self.costs: UnitCosts | None = None
        self.predictions: list[Prediction] | None = None
        self.budget: int | None = None
        self.measured: dict[str, float] = {}  # schedule -> seconds its last trial step took
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
            self.predictions = predict_all(self.microbatches, self.costs)
            finals = finalists(self.predictions, budget_bytes)
            if len(finals) <= 1:
                chosen, why = choose(self.predictions, budget_bytes)  # raises when none fits
                self.schedule = chosen.schedule
                self._chosen(why)
                return
            self._finals = [p.schedule for p in finals]
            self._trials = [s for s in self._finals if s not in self.measured]
        if self._trials:
            self.schedule, self._left = self._trials.pop(0), TRIAL_STEPS
            return
        tried = {s: t for s, t in self.measured.items() if s in self._finals}
        chosen, why = choose(self.predictions, self.budget, tried)
        self.schedule = chosen.schedule
        self._chosen(why)

    def table(self) -> str:
        chosen = next((p for p in self.predictions or [] if p.schedule == self.schedule), None)
        return format_table(self.predictions, chosen, self.budget, self.measured) if self.predictions else ""

    def _chosen(self, why: str) -> None:
        self.choice = {
            "grid": str(self.grid), "schedule": self.schedule, "reason": why, "memory_budget_bytes": self.budget,
            "costs": asdict(self.costs) if self.costs is not None else None,
            "predictions": [asdict(p) for p in self.predictions or []], "measured_step_s": dict(self.measured)}
