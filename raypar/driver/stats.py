"""Step statistics from the stage reports: measured and simulated bubble, loss, per-worker times."""
from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean
from typing import Sequence

from raypar.runtime.report import StepReport
from raypar.schedule import Action, Op, Prepared, simulate
from raypar.schedule.choice import UnitCosts, measured_costs
from raypar.topology import Grid


def mean_durations(reports: list[StepReport], op: Op) -> float:
    """Mean seconds of the units of kind `op` (F, B, I or W) in these (labelled) reports."""
    d = [s.seconds for r in reports for s in r.events if s.op == op]
    return fmean(d) if d else 0.0


def pipelines(reports: list[StepReport], grid: Grid) -> list[list[StepReport]]:
    """Reports grouped by pipeline (dp, ep), each ordered by stage."""
    by_rank = {r.rank: r for r in reports}
    return [[by_rank[k] for k in grid.pipeline_ranks(d, e)] for d in range(grid.dp) for e in range(grid.ep)]


def measured_bubble(reports: list[StepReport], grid: Grid) -> float:
    """Idle share of the pipeline's forward/backward window, averaged over pipelines.

    The window runs from the first stage's first action to the last backward of any
    stage; gradient reduction and the optimizer step are outside it, as in the schedule
    formulas.
    """
    fractions = []
    for line in pipelines(reports, grid):
        window = max(r.end_of_backward for r in line) - min(r.start for r in line)
        if window <= 0:
            continue
        busy = sum(r.compute_s for r in line)
        fractions.append(max(0.0, 1.0 - busy / (len(line) * window)))
    return fmean(fractions) if fractions else 0.0


def simulated_bubble(programs: list[list[Action]] | Prepared, line: list[StepReport]) -> float:
    """Bubble the simulator predicts for these programs with this pipeline's measured F/B times.

    Pass `raypar.schedule.prepare(programs)` to check the programs once rather than every step.
    """
    t_f = [max(mean_durations([r], Op.F), 1e-9) for r in line]
    t_w = [mean_durations([r], Op.W) for r in line]  # 0 without a split backward
    t_b = [max(mean_durations([r], Op.B) + mean_durations([r], Op.I) + w, 1e-9) for r, w in zip(line, t_w)]
    return simulate(programs, t_f=t_f, t_b=t_b, t_w=[min(w, b) for w, b in zip(t_w, t_b)]).bubble_fraction


def step_loss(reports: list[StepReport]) -> float:
    """Mean over replicas of each replica's mean micro-batch loss."""
    per_replica = [fmean(r.losses) for r in reports if r.losses]
    return fmean(per_replica) if per_replica else float("nan")


@dataclass(frozen=True)
class WorkerTimes:
    """One stage worker's forward, backward and idle seconds in one step."""

    stage: int
    dp: int
    ep: int
    forward_s: float
    backward_s: float
    idle_s: float  # pipeline window (first action of the pipeline to its last backward) - F - B


def unit_seconds(reports: Sequence[StepReport], op: Op, stage: int | None = None) -> float:
    """The longest any worker (of `stage`, when given) spent in `op`'s units among the spans
    these reports bring (a step's optimizer, which the device finishes after the report,
    comes in the next step's late spans)."""
    return max((sum(s.seconds for s in (r.events or []) + (r.late_events or []) if s.op == op)
                for r in reports if stage is None or r.stage == stage), default=0.0)


def stage_times(reports: Sequence[StepReport], grid: Grid) -> list[WorkerTimes]:
    """Forward/backward/idle per worker from the step's reports.

    Idle uses the same window as `measured_bubble`, so a pipeline's idle seconds over
    (stages x window) is its measured bubble.
    """
    coords = {r.rank: grid.coord(r.rank) for r in reports}
    windows: dict[tuple[int, int], tuple[float, float]] = {}
    for r in reports:
        key = (coords[r.rank].dp, coords[r.rank].ep)
        lo, hi = windows.get(key, (r.start, r.end_of_backward))
        windows[key] = (min(lo, r.start), max(hi, r.end_of_backward))
    out = []
    for r in sorted(reports, key=lambda r: r.rank):
        c = coords[r.rank]
        lo, hi = windows[(c.dp, c.ep)]
        fwd = sum(s.seconds for s in r.events if s.op == Op.F)
        bwd = sum(s.seconds for s in r.events if s.op.is_backward)
        out.append(WorkerTimes(c.pp, c.dp, c.ep, fwd, bwd, max(0.0, (hi - lo) - fwd - bwd)))
    return out


def report_costs(reports: list[StepReport], grid: Grid, programs: Prepared, schedule: str) -> UnitCosts:
    """`measured_costs` of a step from its reports, run with `programs` of `schedule`."""
    spans = [[(s.op, s.seconds) for r in reports if r.stage == stage for s in r.events] for stage in range(grid.pp)]
    by_stage = lambda attr: [max(getattr(r, attr) for r in reports if r.stage == s) for s in range(grid.pp)]  # noqa: E731
    return measured_costs(spans, programs.peak_live, by_stage("peak_activation_bytes"), by_stage("peak_device_bytes"),
                          f"measured at step {reports[0].step} with {schedule}")
