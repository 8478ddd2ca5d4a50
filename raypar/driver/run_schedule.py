"""Which pipeline schedule a run's workers run, on which cut of the model, and how it changes.

A fixed `parallel.schedule` runs as configured until `request` asks for another
(`Trainer.switch_schedule`); `auto` follows its chooser (`raypar.driver.schedule_choice`).
Either may need the workers on another cut of the model (a schedule of other chunks per
stage): `apply` then asks the controller to move them (`raypar.driver.cut_move`), and goes on
with what could be done. The controller sends the workers its programs after each change.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from raypar.config import Config, ConfigError
from raypar.driver.schedule_choice import ScheduleChooser
from raypar.runtime.report import StepReport
from raypar.schedule import CHUNKED_SCHEDULES, Action, Layout, Prepared, build_programs, prepare, schedule_fits, \
    schedule_layout
from raypar.schedule.choice import candidate_layouts, describe
from raypar.topology import Grid

# Moves the workers to `layout` (how `schedule` cuts the model); returns why not, else None.
Mover = Callable[[str, Layout], str | None]


@dataclass(frozen=True)
class Switched:
    """A requested switch that took place: the run's config names this schedule from now on."""

    schedule: str
    chunks: int | None


class RunSchedule:
    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.choices: list[dict] = []  # auto's choice on each grid run (summary.schedule_choices)
        self.moves: list[dict] = []  # each move of the workers to another cut (summary.moves)
        self.chooser: ScheduleChooser | None = None
        self.schedule = ""
        self.layout: Layout | None = None  # the cut the workers hold
        self.programs: list[list[Action]] = []
        self.prepared: Prepared | None = None  # the programs, checked; each step only times them
        self._cfg: Config | None = None
        self._grid: Grid | None = None
        self._follow_due = False  # the chooser moved on: the next step runs what it says
        self._requested: tuple[str, Layout] | None = None  # `request`'s, until the steps in flight end

    def start(self, cfg: Config, grid: Grid) -> None:
        """A grid run begins with `cfg`: its schedule on its cut; `auto`: the one its chooser
        runs first, on one chunk per stage."""
        self._cfg, self._grid = cfg, grid
        p = cfg.parallel
        self.chooser = ScheduleChooser(grid, p.microbatches, *self._candidates()) if p.schedule == "auto" else None
        self.schedule = self.chooser.schedule if self.chooser else p.schedule
        self.layout = self.chooser.layout if self.chooser else schedule_layout(p.schedule, grid.pp, p.chunks)
        self._follow_due, self._requested = False, None
        self._build()

    @property
    def choosing(self) -> bool:
        return self.chooser is not None and self.chooser.choosing

    @property
    def due(self) -> bool:
        """Something changes before the next step: it must wait for the steps in flight."""
        return self._follow_due or self._requested is not None

    def label(self) -> str:
        """The schedule running, and how it came: "1f1b", "auto: 1f1b", "auto: timing zb-h1"."""
        if self.chooser is None:
            return self.schedule
        return f"auto: {self.chooser.state + ' ' if self.choosing else ''}{self.schedule}"

    def started(self) -> None:
        """The workers hold the first programs: with one stage `auto` has chosen already."""
        if self.chooser is not None and not self.chooser.choosing:
            self.choices.append({**self.chooser.choice, "steps": None})
            self.log(f"raypar: parallel.schedule=auto runs {self.schedule} on {self._grid}: "
                     f"{self.chooser.choice['reason']}")

    def step_done(self, step: int, reports: list[StepReport], step_time_s: float, budget_bytes: int | None) -> None:
        """`auto`: a step of the choice finished; the next one runs what the chooser says (`apply`)."""
        self.chooser.step_done(reports, self.prepared, step_time_s, budget_bytes)
        if not self.chooser.choosing:
            # The steps the choice took: from the grid run's first to this one.
            first = step - self.chooser.steps_run + 1
            self.choices.append({**self.chooser.choice, "steps": [first, step]})
            c = self.chooser.choice
            self.log(f"raypar: parallel.schedule=auto chose {c['schedule']} on {self._grid}: {c['reason']}; costs "
                     f"{self.chooser.costs.source}\n" + self.chooser.table())
        self._follow_due = self.chooser.schedule != self.schedule

    def request(self, schedule: str, chunks: int | None = None) -> None:
        """Run `schedule` (with `chunks` per stage) once the steps in flight are done. Raises
        ConfigError at once when it cannot run on this grid."""
        cfg, grid = self._cfg, self._grid
        p = cfg.parallel
        if p.schedule == "auto":
            raise ConfigError("parallel.schedule=auto chooses the schedule itself: switch_schedule needs a run with "
                              "a fixed parallel.schedule")
        why = schedule_fits(schedule, grid.pp, p.microbatches, cfg.model.n_layers, chunks)
        if why is not None:
            raise ConfigError(f"cannot switch to schedule {schedule!r} (chunks={chunks}) on {grid} with "
                              f"{p.microbatches} micro-batches: {why}")
        layout = schedule_layout(schedule, grid.pp, chunks)
        if isinstance(p.layers_per_stage, list) and layout != self.layout:
            raise ConfigError(f"parallel.layers_per_stage={p.layers_per_stage} counts the layers of this cut of the "
                              f"model; {schedule} cuts it otherwise ({describe(layout)}): switch to a schedule of "
                              f"{describe(self.layout)}, or run without a list")
        self._requested = (schedule, layout)

    def apply(self, move: Mover) -> Switched | None:
        """Before the next step, with nothing in flight: what `request` asked for, or what the
        chooser runs next, moving the workers to its cut first where it has another. A
        requested switch that cannot move is dropped; a cut auto cannot move to drops out of
        its choice (`ScheduleChooser.unavailable`). Returns the requested switch made."""
        if self._requested is not None:
            (schedule, layout), self._requested = self._requested, None
            if layout != self.layout:
                why = move(schedule, layout)
                if why is not None:
                    self.log(f"raypar: not switching to {schedule}: {why}; {self.schedule} runs on")
                    return None
                self.layout = layout
            self._run(schedule)
            self.log(f"raypar: switched to {schedule}")
            return Switched(schedule, layout.n_chunks if schedule in CHUNKED_SCHEDULES else None)
        self._follow_due = False
        recorded = not self.chooser.choosing
        while self.chooser.layout != self.layout:
            why = move(self.chooser.schedule, self.chooser.layout)
            if why is None:
                self.layout = self.chooser.layout
                self.chooser.moves.append(self.moves[-1])
                break
            self.log(f"raypar: parallel.schedule=auto cannot run {self.chooser.schedule}: {why}")
            self.chooser.unavailable(why)
            if recorded:  # the choice made was of that cut: it is made again
                self.choices[-1] = {**self.chooser.choice, "steps": self.choices[-1]["steps"]}
                self.log(f"raypar: parallel.schedule=auto chose {self.chooser.schedule} instead: "
                         f"{self.chooser.choice['reason']}")
        self._run(self.chooser.schedule)
        return None

    def _run(self, schedule: str) -> None:
        if schedule != self.schedule:
            self.schedule = schedule
            self._build()

    def _build(self) -> None:
        self.programs = build_programs(self.schedule, self._grid.pp, self._cfg.parallel.microbatches,
                                       release=self._cfg.runtime.release, chunks=self.layout.n_chunks)
        self.prepared = prepare(self.programs, self.layout)

    def _candidates(self) -> tuple[dict[str, Layout], Callable[[Layout], list[float]]]:
        """`auto`'s candidates, each with how it cuts the model, and each stage's FLOPs on a
        cut. Schedules of several chunks per stage are among them unless
        parallel.layers_per_stage lists the layers of each of pp stages (a cut of its own)."""
        from raypar.model.partition import layout_flops

        cfg, pp = self._cfg, self._grid.pp
        p = cfg.parallel
        flops = functools.partial(layout_flops, cfg.model, cfg.data.seq_len, layers_per_stage=p.layers_per_stage)
        listed = isinstance(p.layers_per_stage, list)
        if listed and pp > 1:
            self.log("raypar: parallel.schedule=auto chooses among schedules of one chunk per stage: "
                     "parallel.layers_per_stage lists each stage's layers")
        return candidate_layouts(pp, p.microbatches, cfg.model.n_layers, p.chunks, not listed), flops
