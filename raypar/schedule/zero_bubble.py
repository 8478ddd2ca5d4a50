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
from raypar.schedule.layout import Layout, single

_INF = float("inf")


def zero_bubble_orders(n_stages: int, n_microbatches: int, max_live: list[int], t_f: float = 1.0,
                       t_i: float = 1.0, t_w: float = 1.0, t_comm: float = 0.0,
                       layout: Layout | None = None) -> list[list[Action]]:
    """Per-stage orders of F, I and W (see the module) for these costs (per chunk).

    `max_live[k]` >= 1 bounds the micro-batches live on virtual stage k (a stage with one
    chunk per worker, else a chunk of `layout`); a bound per chunk, not per worker, so one
    chunk's micro-batches never take every slot while they wait for another chunk's F.
    Where a worker could run an I or an F of more than one chunk, the I that became ready
    first and the F of the latest virtual stage go first (depth first: it is nearer its loss,
    whose backward frees memory).
    """
    layout = layout or single(n_stages)
    p, m, v, n_vs = n_stages, n_microbatches, layout.n_chunks, layout.n_virtual
    if layout.n_actors != p:
        raise ScheduleError(f"zero-bubble orders for {p} stage(s) got a layout of {layout.n_actors} worker(s)")
    if len(max_live) != n_vs or min(max_live) < 1:
        raise ScheduleError(f"max_live needs one value >= 1 per virtual stage, got {max_live} for {n_vs}")
    if min(t_f, t_i, t_w) <= 0 or t_comm < 0:
        raise ScheduleError(f"costs must be > 0 (communication >= 0), got F {t_f}, I {t_i}, W {t_w}, comm {t_comm}")
    place = [layout.place(k) for k in range(n_vs)]
    mine = [[layout.virtual(a, c) for c in range(v)] for a in range(p)]
    f_done = [[_INF] * m for _ in range(n_vs)]  # when each F ended
    i_done = [[_INF] * m for _ in range(n_vs)]
    clock = [0.0] * p
    next_f, next_i = [0] * n_vs, [0] * n_vs  # F and I run in micro-batch order on every virtual stage
    pending_w: list[list[int]] = [[] for _ in range(p)]  # virtual stages, one entry per pending W
    pending_mb: list[list[int]] = [[] for _ in range(p)]
    live = [0] * n_vs
    orders: list[list[Action]] = [[] for _ in range(p)]
    per_actor = 3 * m * v

    def hop(k: int, other: int) -> float:
        return t_comm if place[k][0] != place[other][0] else 0.0

    def f_ready(k: int) -> float:
        mb = next_f[k]
        if mb >= m or live[k] >= max_live[k]:
            return _INF
        return 0.0 if k == 0 else f_done[k - 1][mb] + hop(k, k - 1)

    def i_ready(k: int) -> float:
        mb = next_i[k]
        if mb >= next_f[k]:
            return _INF
        return f_done[k][mb] if k == n_vs - 1 else i_done[k + 1][mb] + hop(k, k + 1)

    def can_run(a: int) -> bool:
        return any(i_ready(k) <= clock[a] or f_ready(k) <= clock[a] for k in mine[a]) or bool(pending_w[a])

    scheduled = 0
    while scheduled < per_actor * p:
        # The worker whose clock is earliest (every event that ends before it is known), one
        # that can run something first among equals.
        a = min((u for u in range(p) if len(orders[u]) < per_actor), key=lambda u: (clock[u], not can_run(u)))
        now = clock[a]
        ready_i = [(i_ready(k), k) for k in mine[a] if i_ready(k) <= now]
        ready_f = [k for k in mine[a] if f_ready(k) <= now]
        if ready_i:
            k = min(ready_i)[1]
            mb = next_i[k]
            next_i[k] += 1
            clock[a] = now + t_i
            i_done[k][mb] = clock[a]
            pending_w[a].append(k)
            pending_mb[a].append(mb)
            orders[a].append(Action(Op.I, mb, chunk=place[k][1]))
        elif ready_f:
            k = max(ready_f)
            mb = next_f[k]
            next_f[k] += 1
            live[k] += 1
            clock[a] = now + t_f
            f_done[k][mb] = clock[a]
            orders[a].append(Action(Op.F, mb, chunk=place[k][1]))
        elif pending_w[a]:
            k, mb = pending_w[a].pop(0), pending_mb[a].pop(0)
            live[k] -= 1
            clock[a] = now + t_w
            orders[a].append(Action(Op.W, mb, chunk=place[k][1]))
        else:
            # Nothing to run: wait for the next arrival, or until another worker's clock
            # passes this one's (what it runs may be what this one waits for).
            others = [clock[u] for u in range(p) if u != a and len(orders[u]) < per_actor and clock[u] > now]
            arrivals = [t for k in mine[a] for t in (f_ready(k), i_ready(k))]
            wake = min([*arrivals, *others], default=_INF)
            if wake == _INF or wake <= now:
                raise ScheduleError(f"zero-bubble orders: stage {a} cannot go on at t={now} "
                                    f"(max_live {max_live}); this is a bug in the scheduler")
            clock[a] = wake
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


def zb_v(layout: Layout, n_microbatches: int) -> list[list[Action]]:
    """ZB-V: two chunks per stage in a V, split backward, at most 1F1B's peak activations.

    Each virtual stage keeps at most n_stages micro-batches live, so a stage holds at most
    2 n_stages chunk micro-batches: n_stages stage micro-batches, 1F1B's first stage's peak.
    At F = I = W the list scheduler's bubble is a fraction of 1F1B's (at 4 stages and 8
    micro-batches 0.06 of the work against 0.38)."""
    check_sizes(layout.n_actors, n_microbatches)
    _v_layout(layout, "zb-v")
    p = layout.n_actors
    return zero_bubble_orders(p, n_microbatches, [p] * layout.n_virtual, layout=layout)


def zb_v_half(layout: Layout, n_microbatches: int) -> list[list[Action]]:
    """ZB-V with about half of 1F1B's activations: virtual stage k keeps at most
    max(1, n_stages - k // 2) micro-batches live, so stage 0, which holds the first and the
    last virtual stage, peaks at n_stages + 1 chunk micro-batches ((n_stages + 1) / (2
    n_stages) of 1F1B's peak); the other stages at no more. At F = I = W its step is
    shorter than 1F1B's where micro-batches are few against stages (4 stages, 8 micro-batches:
    0.89 of 1F1B's step at 0.62 of its peak); with many more, the caps slow its steady state
    to about 1F1B's pace or a little below (2 stages, 32 micro-batches: 1.06 of its step)."""
    check_sizes(layout.n_actors, n_microbatches)
    _v_layout(layout, "zb-v-half")
    p = layout.n_actors
    return zero_bubble_orders(p, n_microbatches, [max(1, p - k // 2) for k in range(layout.n_virtual)],
                              layout=layout)


def _v_layout(layout: Layout, name: str) -> None:
    if layout.placement != "v" or layout.n_chunks != 2:
        raise ScheduleError(f"{name} runs 2 chunks per stage in a V, not {layout.n_chunks} placed {layout.placement!r}")
