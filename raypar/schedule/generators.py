"""Compute-only pipeline orders: for each stage, the order of its F and B (or I and W) actions.

Communication and memory release are added later by `lower`, so a new schedule only has to
say in which order each stage runs its forwards and backwards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from raypar.schedule.ir import Action, Op, ScheduleError, check_sizes
from raypar.schedule.layout import Layout, single
from raypar.schedule.zero_bubble import zb_h1, zb_h2, zb_v, zb_v_half

ComputeOrders = list[list[Action]]


def forward_then_backward(n_stages: int, n_microbatches: int) -> ComputeOrders:
    """GPipe order: every stage runs all forwards, then all backwards."""
    check_sizes(n_stages, n_microbatches)
    order = [Action(Op.F, mb) for mb in range(n_microbatches)]
    order += [Action(Op.B, mb) for mb in range(n_microbatches)]
    return [list(order) for _ in range(n_stages)]


def one_f_one_b(n_stages: int, n_microbatches: int) -> ComputeOrders:
    """1F1B: warm up with enough forwards to fill the pipe, then alternate F and B.

    Stage s keeps at most n_stages - s micro-batches alive, instead of all of them as in GPipe,
    with the same bubble.
    """
    check_sizes(n_stages, n_microbatches)
    m = n_microbatches
    orders = []
    for s in range(n_stages):
        warmup = min(n_stages - 1 - s, m)
        order = [Action(Op.F, mb) for mb in range(warmup)]
        for i in range(m - warmup):
            order += [Action(Op.F, warmup + i), Action(Op.B, i)]
        order += [Action(Op.B, mb) for mb in range(m - warmup, m)]
        orders.append(order)
    return orders


def interleaved_1f1b(layout: Layout, n_microbatches: int) -> ComputeOrders:
    """Interleaved 1F1B (Narayanan et al., SC'21): v chunks per stage, placed in a loop.

    Micro-batches go in groups of n_stages: a stage runs the group's forwards on chunk 0,
    then on chunk 1, ..., and its backwards in the reverse chunk order. Stage s warms up with
    2 (n_stages - 1 - s) + (v - 1) n_stages forwards (the factor 2 lets a stage's send and
    its neighbour's receive meet without a wait that would deadlock the in-order channels),
    then alternates one forward and one backward. The bubble is (n_stages - 1) / (v m) of the
    work, 1/v of 1F1B's, for about 1 + (n_stages - 1) / (v n_stages) of 1F1B's first stage's
    activations at most.
    """
    p, v, m = layout.n_actors, layout.n_chunks, n_microbatches
    check_sizes(p, m)
    if layout.placement != "loop":
        raise ScheduleError(f"interleaved 1F1B places its chunks in a loop, not {layout.placement!r}")
    if m % p:
        raise ScheduleError(f"interleaved-1f1b runs micro-batches in groups of pp={p}: microbatches={m} is not "
                            f"a multiple of it; use {max(p, m // p * p)} or {(m // p + 1) * p}")
    n = m * v

    def forward(k: int) -> Action:
        group, within = divmod(k, p * v)
        return Action(Op.F, group * p + within % p, chunk=within // p)

    def backward(k: int) -> Action:
        f = forward(k)
        return Action(Op.B, f.mb, chunk=v - 1 - f.chunk)

    orders = []
    for s in range(p):
        warmup = min(2 * (p - 1 - s) + (v - 1) * p, n)
        order = [forward(k) for k in range(warmup)]
        for i in range(n - warmup):
            order += [forward(warmup + i), backward(i)]
        order += [backward(k) for k in range(n - warmup, n)]
        orders.append(order)
    return orders


SCHEDULES: dict[str, Callable[[int, int], ComputeOrders]] = {
    "fthenb": forward_then_backward,
    "1f1b": one_f_one_b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
}


DEFAULT_CHUNKS = 2  # chunks per stage of an interleaved schedule when parallel.chunks leaves it open


@dataclass(frozen=True)
class ChunkedSchedule:
    """A schedule that runs more than one model chunk per stage."""
    placement: str  # raypar.schedule.layout.PLACEMENTS
    orders: Callable[[Layout, int], ComputeOrders]
    chunks: int | None = None  # the only chunk count it takes; None: any >= 2 (parallel.chunks)
    # Runs micro-batches in groups of n_stages: their count must be a multiple of it.
    groups_of_stages: bool = False


CHUNKED_SCHEDULES: dict[str, ChunkedSchedule] = {
    "interleaved-1f1b": ChunkedSchedule("loop", interleaved_1f1b, groups_of_stages=True),
    "zb-v": ChunkedSchedule("v", zb_v, chunks=2),
    "zb-v-half": ChunkedSchedule("v", zb_v_half, chunks=2),
}
SCHEDULE_NAMES = sorted(SCHEDULES) + sorted(CHUNKED_SCHEDULES)


def _unknown(name: object) -> ScheduleError:
    return ScheduleError(f"unknown schedule {name!r}; valid schedules: {', '.join(SCHEDULE_NAMES)}")


def schedule_layout(name: str, n_stages: int, chunks: int | None = None) -> Layout:
    """Where schedule `name` puts the model's chunks on `n_stages` stages; `chunks`: chunks per
    stage (None: the schedule's own count)."""
    if name in SCHEDULES:
        if chunks not in (None, 1):
            raise ScheduleError(f"schedule {name!r} runs one model chunk per stage, not {chunks}; for more, "
                                f"use {' or '.join(sorted(CHUNKED_SCHEDULES))}")
        return single(n_stages)
    spec = CHUNKED_SCHEDULES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise _unknown(name)
    if spec.chunks is not None and chunks not in (None, spec.chunks):
        raise ScheduleError(f"schedule {name!r} runs exactly {spec.chunks} model chunks per stage, not {chunks}")
    count = spec.chunks if spec.chunks is not None else DEFAULT_CHUNKS if chunks is None else chunks
    if not isinstance(count, int) or isinstance(count, bool) or count < 2:
        raise ScheduleError(f"schedule {name!r} needs at least 2 model chunks per stage, got {count!r}")
    return Layout(n_stages, count, spec.placement)


def run_layout(schedule: str, n_stages: int, chunks: int | None = None) -> Layout:
    """The layout a run's workers are built for (`parallel.schedule`, `parallel.chunks`):
    `auto` chooses among the schedules of one chunk per stage."""
    return single(n_stages) if schedule == "auto" else schedule_layout(schedule, n_stages, chunks)


def schedule_fits(name: str, n_stages: int, n_microbatches: int, n_layers: int,
                  chunks: int | None = None) -> str | None:
    """Why schedule `name` cannot run `n_microbatches` on `n_stages` stages of a model of
    `n_layers` layers; None when it can."""
    try:
        layout = run_layout(name, n_stages, chunks)
    except ScheduleError as e:
        return str(e)
    if layout.n_chunks > 1 and layout.n_virtual > n_layers:
        return (f"{name} cuts the model into {n_stages} stages x {layout.n_chunks} chunks = {layout.n_virtual} "
                f"virtual stages of at least one layer each, but the model has {n_layers} layers")
    spec = CHUNKED_SCHEDULES.get(name)
    if spec is not None and spec.groups_of_stages and n_microbatches % n_stages:
        return (f"{name} runs micro-batches in groups of pp={n_stages}: {n_microbatches} micro-batches is not a "
                f"multiple of it")
    return None


def compute_orders(name: str, layout: Layout, n_microbatches: int) -> ComputeOrders:
    """Every stage's compute order for one step of schedule `name` on `layout`."""
    if name in SCHEDULES:
        if layout.n_chunks != 1:
            raise ScheduleError(f"schedule {name!r} runs one model chunk per stage, not {layout.n_chunks}")
        return SCHEDULES[name](layout.n_actors, n_microbatches)
    spec = CHUNKED_SCHEDULES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise _unknown(name)
    return spec.orders(layout, n_microbatches)


def get_schedule(name: str) -> Callable[[int, int], ComputeOrders]:
    """The compute-order generator of a one-chunk-per-stage schedule."""
    if name in CHUNKED_SCHEDULES:
        raise ScheduleError(f"schedule {name!r} runs several model chunks per stage: use compute_orders "
                            f"with its layout (schedule_layout)")
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise _unknown(name) from None
