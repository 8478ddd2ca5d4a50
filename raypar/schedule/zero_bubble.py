"""Zero-bubble orders: backward split into I (input gradient) and W (weight gradient).

I is on the critical path (the previous stage waits for its gradient); W waits for nobody,
so it fills what would otherwise be bubbles (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024). `zb-h1` is the paper's hand-made order (`zb_h1`); `zb-h2`'s comes from a list
scheduler run on a cost model (`zero_bubble_orders`): whenever a
stage is free it runs, in this order of preference, an I whose output gradient has arrived,
an F whose input has arrived while fewer than `max_live` micro-batches are live on it (a
micro-batch is live from its F to its W: W still needs the layers' inputs), else a pending
W, else it waits for the next arrival.

- `zb-h1`: no stage holds more than the number of stages, 1F1B's first stage's peak: at
  F = I = W a third of 1F1B's bubble.
- `zb-h2`: `max_live` = 2 x stages - 1, which fills the warm-up bubble too, for more memory.
"""
from __future__ import annotations

from raypar.schedule.ir import Action, Op, ScheduleError, check_sizes

_INF = float("inf")


def zero_bubble_orders(n_stages: int, n_microbatches: int, max_live: list[int], t_f: float = 1.0,
                       t_i: float = 1.0, t_w: float = 1.0, t_comm: float = 0.0) -> list[list[Action]]:
    """Per-stage orders of F, I and W (see the module) for these costs; `max_live[s]` >= 1."""
    p, m = n_stages, n_microbatches
    if len(max_live) != p or min(max_live) < 1:
        raise ScheduleError(f"max_live needs one value >= 1 per stage, got {max_live} for {p} stage(s)")
    if min(t_f, t_i, t_w) <= 0 or t_comm < 0:
        raise ScheduleError(f"costs must be > 0 (communication >= 0), got F {t_f}, I {t_i}, W {t_w}, comm {t_comm}")
    f_done = [[_INF] * m for _ in range(p)]  # when each F ended
    i_done = [[_INF] * m for _ in range(p)]
    clock = [0.0] * p
    next_f, next_i = [0] * p, [0] * p  # F and I run in micro-batch order on every stage
    pending_w: list[list[int]] = [[] for _ in range(p)]
    live = [0] * p
    orders: list[list[Action]] = [[] for _ in range(p)]
    total = 3 * m * p

    def f_ready(s: int) -> float:
        mb = next_f[s]
        if mb >= m or live[s] >= max_live[s]:
            return _INF
        return 0.0 if s == 0 else f_done[s - 1][mb] + t_comm

    def i_ready(s: int) -> float:
        mb = next_i[s]
        if mb >= next_f[s]:
            return _INF
        return f_done[s][mb] if s == p - 1 else i_done[s + 1][mb] + t_comm

    def can_run(s: int) -> bool:
        return i_ready(s) <= clock[s] or f_ready(s) <= clock[s] or bool(pending_w[s])

    scheduled = 0
    while scheduled < total:
        # The stage whose clock is earliest (every event that ends before it is known), one
        # that can run something first among equals.
        s = min((u for u in range(p) if len(orders[u]) < 3 * m), key=lambda u: (clock[u], not can_run(u)))
        now = clock[s]
        if i_ready(s) <= now:
            mb = next_i[s]
            next_i[s] += 1
            clock[s] = now + t_i
            i_done[s][mb] = clock[s]
            pending_w[s].append(mb)
            orders[s].append(Action(Op.I, mb))
        elif f_ready(s) <= now:
            mb = next_f[s]
            next_f[s] += 1
            live[s] += 1
            clock[s] = now + t_f
            f_done[s][mb] = clock[s]
            orders[s].append(Action(Op.F, mb))
        elif pending_w[s]:
            mb = pending_w[s].pop(0)
            live[s] -= 1
            clock[s] = now + t_w
            orders[s].append(Action(Op.W, mb))
        else:
            # Nothing to run: wait for the next arrival, or until another stage's clock
            # passes this one's (what it runs may be what this stage waits for).
            others = [clock[u] for u in range(p) if u != s and len(orders[u]) < 3 * m and clock[u] > now]
            wake = min([f_ready(s), i_ready(s), *others], default=_INF)
            if wake == _INF or wake <= now:
                raise ScheduleError(f"zero-bubble orders: stage {s} cannot go on at t={now} "
                                    f"(max_live {max_live}); this is a bug in the scheduler")
            clock[s] = wake
            continue
        scheduled += 1
    return orders


def zb_h1(n_stages: int, n_microbatches: int) -> list[list[Action]]:
    """ZB-H1: no stage holds more micro-batches than 1F1B's first stage (`n_stages`).

    The paper's hand-made order rather than the list scheduler's: 1F1B's warm-up, then each
    F is followed by an I, and stage s holds back the W of its first s micro-batches, doing
    one W after each I from then on; the held-back Ws close the step. The Ws that stage s
    defers fill the waits of 1F1B's cool-down, so at F = I = W (and at least as many
    micro-batches as stages) every stage idles n_stages - 1 units, a third of 1F1B's
    3 (n_stages - 1), with the same peak as 1F1B's first stage.
    """
    check_sizes(n_stages, n_microbatches)
    p, m = n_stages, n_microbatches
    orders = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
        order = [Action(Op.F, mb) for mb in range(warmup)]
        next_f, next_w = warmup, 0
        for i in range(m):
            if next_f < m:
                order.append(Action(Op.F, next_f))
                next_f += 1
            order.append(Action(Op.I, i))
            if i >= s:  # stage s holds back s Ws
                order.append(Action(Op.W, next_w))
                next_w += 1
        order += [Action(Op.W, mb) for mb in range(next_w, m)]
        orders.append(order)
    return orders


def zb_h2(n_stages: int, n_microbatches: int) -> list[list[Action]]:
    """ZB-H2: up to 2 x stages - 1 micro-batches live, which fills the warm-up bubble as well."""
    return zero_bubble_orders(n_stages, n_microbatches, [2 * n_stages - 1] * n_stages)
