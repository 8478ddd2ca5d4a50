"""Step statistics from the stage reports: measured and simulated bubble, loss, memory."""
from __future__ import annotations

from statistics import fmean

from raypar.runtime.stage import StepReport
from raypar.schedule import Action, Prepared, simulate
from raypar.topology import Grid


def is_compute(label: str, kind: str) -> bool:
    """Whether an event label (see `unit_labels`) is a forward ("F") or backward ("B") unit."""
    return label.startswith(kind) and label[1:].isdigit()


def mean_durations(reports: list[StepReport], kind: str) -> float:
    d = [e - b for r in reports for label, b, e in r.events if is_compute(label, kind)]
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
    t_f = [max(mean_durations([r], "F"), 1e-9) for r in line]
    t_b = [max(mean_durations([r], "B"), 1e-9) for r in line]
    return simulate(programs, t_f=t_f, t_b=t_b).bubble_fraction


def step_loss(reports: list[StepReport]) -> float:
    """Mean over replicas of each replica's mean micro-batch loss."""
    per_replica = [fmean(r.losses) for r in reports if r.losses]
    return fmean(per_replica) if per_replica else float("nan")
