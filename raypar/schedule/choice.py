"""Choose a pipeline schedule from per-unit costs: predict each one's step time and peak memory.

Costs come from a model (`modelled_costs`: FLOPs per stage, I = W = F) or from a step that
ran (`measured_costs`: the mean F, I and W of every stage, the cheapest transfer, and the
activation bytes one live micro-batch holds). Each candidate schedule's programs are
simulated with those costs; a schedule's peak memory is the stage's fixed bytes (weights,
gradients, optimizer) plus its peak number of live micro-batches times the bytes one holds
on average. For the zero-bubble orders that is a bound (a micro-batch between its I and its
W holds less than one between F and I); it leaves out a receive posted ahead of its
forward, which 1F1B's last stage holds beside its one live micro-batch.

The choice is the fastest prediction whose peak fits the memory budget; predictions within
`TIE` of the fastest count as equally fast, and among them the one holding least memory
wins (1F1B over fthenb at one stage, where every order takes the same time). A trainer
runs the `finalists` (predicted within MEASURE_WITHIN of the fastest) a step or two each
and passes their measured step times: then the fastest measured wins, unless trial steps
measured within `TIE` of each other, where the prediction breaks the tie. The simulator
times each order from per-unit costs; what the host and the device add to an order
(issuing W's extra GEMMs, allocations for more live micro-batches) it cannot see.

Schedules of several chunks per stage cut the model otherwise (`candidate_layouts`):
costs measured on one cut are carried over to another by FLOPs (`on_layout`,
`predict_cuts`), so one timed step predicts every cut.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import fmean
from typing import Callable, Sequence

from raypar.schedule.generators import CHUNKED_SCHEDULES, SCHEDULES, schedule_fits, schedule_layout
from raypar.schedule.ir import Op, ScheduleError
from raypar.schedule.layout import Layout
from raypar.schedule.lower import build_programs
from raypar.schedule.simulator import prepare, simulate

# Predicted step times this close to the fastest (relative) are a tie, broken by memory.
TIE = 0.01
# Schedules predicted this close to the fastest are each run (`finalists`) and the fastest
# measured wins: the simulator leaves out what the host and the device add to each order.
MEASURE_WITHIN = 0.05
# A trainer times the units with this schedule (F, I and W apart) over this many steps,
# then runs each other finalist this many steps (a schedule's first step may allocate what
# its order holds more of; the last one's time counts).
TIMING_SCHEDULE = "zb-h1"
TIMING_STEPS = 2
TRIAL_STEPS = 2
# Among schedules equally fast and holding as much memory, the first of these.
SIMPLEST_FIRST = ("1f1b", "fthenb", "zb-h1", "zb-h2")


@dataclass(frozen=True)
class UnitCosts:
    """Per stage: seconds of one micro-batch's forward (F), input gradient (I) and weight
    gradient (W; a whole backward B is I + W); one transfer between stages; the bytes one live
    micro-batch holds and the bytes a stage holds whatever the schedule (None: not known)."""

    forward: list[float]
    input_grad: list[float]
    weight_grad: list[float]
    transfer: float = 0.0
    activation_bytes: list[int] | None = None
    fixed_bytes: list[int] | None = None
    source: str = "modelled"  # or "measured at step N with <schedule>"

    def __post_init__(self) -> None:
        n = len(self.forward)
        if n == 0 or len(self.input_grad) != n or len(self.weight_grad) != n:
            raise ScheduleError(f"costs need F, I and W for each of the same stages, got {len(self.forward)}, "
                                f"{len(self.input_grad)} and {len(self.weight_grad)}")
        if min(self.forward + self.input_grad) <= 0 or min(self.weight_grad) < 0 or self.transfer < 0:
            raise ScheduleError("F and I must take > 0 s, W and transfers >= 0 s")
        for name in ("activation_bytes", "fixed_bytes"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ScheduleError(f"{name} needs one value per stage ({n}), got {len(value)}")

    @property
    def n_stages(self) -> int:
        return len(self.forward)


@dataclass(frozen=True)
class Prediction:
    schedule: str
    step_s: float  # the pipeline's forward/backward window, in the costs' units
    bubble: float
    peak_live: list[int]  # per stage: most micro-batches holding activations at once
    peak_bytes: list[int] | None  # per stage: fixed bytes + peak_live x bytes per micro-batch

    def fits(self, budget_bytes: int | None) -> bool:
        return budget_bytes is None or self.peak_bytes is None or max(self.peak_bytes) <= budget_bytes


def predict(schedule: str, microbatches: int, costs: UnitCosts, chunks: int | None = None) -> Prediction:
    """Simulate `schedule`'s programs on `costs.n_stages` stages with these costs.

    A schedule of several chunks per stage (`chunks`, default its own) runs each stage's
    work in that many equal parts: a chunk's unit costs and holds 1 / chunks of the stage's
    (the stage's costs must be those of its layers under that schedule's layout). Its
    `peak_live` counts chunk micro-batches."""
    layout = schedule_layout(schedule, costs.n_stages, chunks)
    v = layout.n_chunks
    programs = prepare(build_programs(schedule, costs.n_stages, microbatches, chunks=chunks), layout)
    part = lambda values: [x / v for x in values]  # noqa: E731
    backward = [(i + w) / v for i, w in zip(costs.input_grad, costs.weight_grad)]
    sim = simulate(programs, t_f=part(costs.forward), t_b=backward, t_w=part(costs.weight_grad), t_comm=costs.transfer)
    peak_bytes = None
    if costs.activation_bytes is not None:
        fixed = costs.fixed_bytes or [0] * costs.n_stages
        peak_bytes = [f + live * a // v for f, live, a in zip(fixed, sim.peak_live, costs.activation_bytes)]
    return Prediction(schedule, sim.makespan, sim.bubble_fraction, list(sim.peak_live), peak_bytes)


def on_layout(costs: UnitCosts, flops_to: Sequence[float], layout_name: str) -> UnitCosts:
    """`costs` measured on one cut of the model, carried over to the stages of another cut
    (`flops_to`: each stage's FLOPs there, e.g. under a schedule's chunks per stage): each
    stage's F, I, W and activation bytes are the measured totals in proportion to its FLOPs
    (the head's extra cost goes where the head goes). A stage's fixed bytes are bounded by
    the most any measured stage held (every cut splits the same weights over as many
    stages; ZB-V's first stage holds the embedding and the head, as much as one chunk's first
    and last stages together)."""
    if len(flops_to) != costs.n_stages or min(flops_to) <= 0:
        raise ScheduleError(f"need the positive FLOPs of each of {costs.n_stages} stages, got {list(flops_to)}")
    shares = [f / sum(flops_to) for f in flops_to]
    spread = lambda values: [sum(values) * share for share in shares]  # noqa: E731
    activation = None if costs.activation_bytes is None else [int(a) for a in spread(costs.activation_bytes)]
    fixed = None if costs.fixed_bytes is None else [max(costs.fixed_bytes)] * costs.n_stages
    return UnitCosts(spread(costs.forward), spread(costs.input_grad), spread(costs.weight_grad), costs.transfer,
                     activation, fixed, f"{costs.source}, carried over to {layout_name} by FLOPs")


def describe(layout: Layout) -> str:
    """How `layout` cuts the model, in words."""
    if layout.n_chunks == 1:
        return "one chunk per stage"
    return f"{layout.n_chunks} chunks per stage " + ("in a V" if layout.placement == "v" else "in a loop")


def candidate_layouts(n_stages: int, microbatches: int, n_layers: int, chunks: int | None = None,
                      several_chunks: bool = True) -> dict[str, Layout]:
    """The schedules `parallel.schedule: auto` chooses among on `n_stages` stages, each with
    how it cuts the model: those of one chunk per stage, and with `several_chunks` those of
    several that fit the model and the micro-batches (interleaved-1f1b with `chunks`, else
    its default)."""
    layouts = {name: Layout(n_stages) for name in SCHEDULES}
    if not several_chunks or n_stages == 1:
        return layouts
    for name, spec in CHUNKED_SCHEDULES.items():
        count = spec.chunks or (chunks if chunks and chunks > 1 else None)
        if schedule_fits(name, n_stages, microbatches, n_layers, count) is None:
            layouts[name] = schedule_layout(name, n_stages, count)
    return layouts


def predict_cuts(microbatches: int, costs: UnitCosts, measured_on: Layout, layouts: dict[str, Layout],
                 stage_flops: Callable[[Layout], list[float]]) -> list[Prediction]:
    """Each schedule of `layouts` predicted on its own cut, fastest first: with `costs` where
    they were measured on its cut (`measured_on`), else with them carried over (`on_layout`)."""
    out = []
    for name, layout in layouts.items():
        on_cut = costs if layout == measured_on else on_layout(costs, stage_flops(layout), describe(layout))
        out.append(predict(name, microbatches, on_cut, chunks=layout.n_chunks))
    return sorted(out, key=lambda p: p.step_s)


def predict_all(microbatches: int, costs: UnitCosts, schedules: Sequence[str] | None = None) -> list[Prediction]:
    """A prediction per schedule (default: every registered one), fastest first."""
    names = list(SCHEDULES) if schedules is None else list(schedules)
    return sorted((predict(name, microbatches, costs) for name in names), key=lambda p: p.step_s)


def finalists(predictions: Sequence[Prediction], budget_bytes: int | None = None) -> list[Prediction]:
    """The schedules worth running to choose by measurement: those that fit, predicted within
    MEASURE_WITHIN of the fastest that fits, fastest first."""
    fitting = [p for p in predictions if p.fits(budget_bytes)]
    if not fitting:
        return []
    fastest = min(p.step_s for p in fitting)
    return sorted((p for p in fitting if p.step_s <= fastest * (1 + MEASURE_WITHIN)), key=lambda p: p.step_s)


def choose(predictions: Sequence[Prediction], budget_bytes: int | None = None,
           measured: dict[str, float] | None = None) -> tuple[Prediction, str]:
    """The chosen prediction and why (see the module). With `measured` (schedule -> seconds a
    step took), the fastest measured among those that fit wins instead. Measured within TIE
    of each other, a trial step cannot tell them apart: the fastest predicted of those wins,
    then the least memory. Raises ScheduleError when none fits."""
    fitting = [p for p in predictions if p.fits(budget_bytes)]
    if measured and fitting:
        tried = [p for p in fitting if p.schedule in measured]
        if tried:
            best = min(measured[p.schedule] for p in tried)
            tied = [p for p in tried if measured[p.schedule] <= best * (1 + TIE)]
            chosen, predicted_tie = _fastest_then_least_memory(tied)
            runs = ", ".join(f"{p.schedule} {measured[p.schedule] * 1000:.1f} ms"
                             for p in sorted(tried, key=lambda p: measured[p.schedule]))
            reason = f"fastest measured of those predicted within {MEASURE_WITHIN:.0%} of the fastest ({runs} a step)"
            if len(tied) > 1:
                reason += f"; {', '.join(p.schedule for p in tied)} measured within {TIE:.0%}: " + (
                    f"least memory among {', '.join(p.schedule for p in predicted_tie)}, also predicted within "
                    f"{TIE:.0%}" if len(predicted_tie) > 1 else "the fastest predicted of them")
            return chosen, reason
    if not fitting:
        least = min(predictions, key=lambda p: (_peak(p), _simpler(p.schedule)))
        raise ScheduleError(
            f"no schedule fits the memory budget of {_gib(budget_bytes)}: the least, {least.schedule}, needs "
            f"{_gib(max(least.peak_bytes or [0]))} on its fullest stage; use more stages (parallel.pp), fewer "
            f"micro-batches, runtime.recompute=block, or a larger parallel.memory_budget_gb")
    fastest = min(p.step_s for p in fitting)
    chosen, tied = _fastest_then_least_memory(fitting)
    others = [p.schedule for p in predictions if p not in fitting]
    reason = "fastest predicted" if chosen.step_s == fastest else \
        f"predicted {chosen.step_s / fastest - 1:.1%} slower than the fastest"
    if len(tied) > 1:
        reason += f", least memory among {', '.join(p.schedule for p in tied)} (within {TIE:.0%} of the fastest)"
    if others:
        reason += f"; over the memory budget of {_gib(budget_bytes)}: {', '.join(others)}"
    return chosen, reason


def _fastest_then_least_memory(candidates: Sequence[Prediction]) -> tuple[Prediction, list[Prediction]]:
    """The one of least memory (then the simplest) among those predicted within TIE of the
    fastest, and those."""
    fastest = min(p.step_s for p in candidates)
    tied = [p for p in candidates if p.step_s <= fastest * (1 + TIE)]
    return min(tied, key=lambda p: (_peak(p), _simpler(p.schedule))), tied


def _peak(p: Prediction) -> float:
    return max(p.peak_bytes) if p.peak_bytes is not None else max(p.peak_live)


def _simpler(schedule: str) -> int:
    """Among equals, the schedule with the fewest moving parts (1F1B's whole backwards can
    run as CUDA graphs at one stage; a split backward cannot)."""
    return SIMPLEST_FIRST.index(schedule) if schedule in SIMPLEST_FIRST else len(SIMPLEST_FIRST)


def modelled_costs(stage_flops: Sequence[float]) -> UnitCosts:
    """Costs from each stage's training FLOPs per token (forward + backward, as MFU counts
    them): F a third, I and W a third each (a matmul's backward is two of the same size)."""
    if not stage_flops or min(stage_flops) <= 0:
        raise ScheduleError(f"every stage needs positive FLOPs, got {list(stage_flops)}")
    third = [f / 3 for f in stage_flops]
    return UnitCosts(third, list(third), list(third))


def measured_costs(spans: Sequence[Sequence[tuple[Op, float]]], peak_live: Sequence[int],
                   activation_bytes: Sequence[int], device_bytes: Sequence[int], source: str) -> UnitCosts:
    """Unit costs from one step: `spans[s]` the (op, seconds) of every unit its stage's
    workers ran, `peak_live[s]` the most micro-batches the step's programs kept live on it,
    and per stage its peak activation and device bytes (device bytes 0: not measured).

    F, I and W are their units' means; a whole backward B counts as I = W = B / 2. A transfer
    costs the shortest receive seen: one whose data was there when it started takes only
    the transfer itself, where longer ones also waited for the other stage.
    """
    forward, input_grad, weight_grad = [], [], []
    for stage in spans:
        by_op: dict[Op, list[float]] = defaultdict(list)
        for op, seconds in stage:
            by_op[op].append(seconds)
        mean = lambda op: fmean(by_op[op]) if by_op[op] else 0.0  # noqa: E731
        b = mean(Op.B)
        forward.append(max(mean(Op.F), 1e-9))
        input_grad.append(max(mean(Op.I), b / 2, 1e-9))
        weight_grad.append(max(mean(Op.W), b / 2))
    receives = [d for stage in spans for o, d in stage if o in (Op.RECV_F, Op.RECV_B)]
    per_mb = [a // max(1, live) for a, live in zip(activation_bytes, peak_live)]
    fixed = [max(0, d - a) for d, a in zip(device_bytes, activation_bytes)] if all(device_bytes) else None
    return UnitCosts(forward, input_grad, weight_grad, transfer=min(receives, default=0.0),
                     activation_bytes=per_mb, fixed_bytes=fixed, source=source)


def format_table(predictions: Sequence[Prediction], chosen: Prediction | None = None,
                 budget_bytes: int | None = None, measured: dict[str, float] | None = None,
                 baseline: float | None = None) -> str:
    """The predictions as a text table: step time relative to the fastest (or to `baseline`
    seconds), bubble, live micro-batches and peak bytes per stage, over the budget marked;
    with `measured`, the seconds a step of each schedule run took."""
    fastest = baseline if baseline is not None else min(p.step_s for p in predictions)
    measured = measured or {}
    width = max(10, *(len(p.schedule) for p in predictions))
    lines = [f"{'schedule':<{width}} {'step (x best)':>13} {'bubble':>7} {'measured':>9}  {'live per stage':<16} "
             "peak per stage"]
    for p in predictions:
        peak = " ".join(_gib(b) for b in p.peak_bytes) if p.peak_bytes is not None else "-"
        mark = "  <- chosen" if chosen is not None and p.schedule == chosen.schedule else ""
        if not p.fits(budget_bytes):
            mark += "  (over budget)"
        live = " ".join(str(n) for n in p.peak_live)
        ran = f"{measured[p.schedule] * 1000:.1f} ms" if p.schedule in measured else "-"
        lines.append(f"{p.schedule:<{width}} {p.step_s / fastest:>13.3f} {p.bubble:>7.3f} {ran:>9}  {live:<16} {peak}{mark}")
    return "\n".join(lines)


def _gib(nbytes: float | None) -> str:
    if nbytes is None:
        return "none"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"
