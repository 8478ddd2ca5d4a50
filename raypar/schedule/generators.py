"""Compute-only pipeline orders: for each stage, the order of its F and B (or I and W) actions.

Communication and memory release are added later by `lower`, so a new schedule only has to
say in which order each stage runs its forwards and backwards.
"""
from __future__ import annotations

from typing import Callable

from raypar.schedule.ir import Action, Op, ScheduleError, check_sizes
from raypar.schedule.zero_bubble import zb_h1, zb_h2

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


SCHEDULES: dict[str, Callable[[int, int], ComputeOrders]] = {
    "fthenb": forward_then_backward,
    "1f1b": one_f_one_b,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
}


def get_schedule(name: str) -> Callable[[int, int], ComputeOrders]:
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ScheduleError(
            f"unknown schedule {name!r}; valid schedules: {', '.join(sorted(SCHEDULES))}"
        ) from None
