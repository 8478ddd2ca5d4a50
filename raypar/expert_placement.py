"""Which experts of each MoE layer each expert-parallel worker holds, and placements that
even out the rows the workers' experts receive.

By default worker r of `ep` holds experts r x E/ep .. (r + 1) x E/ep - 1. A placement
lists, per MoE layer in model order, the expert in each slot: worker r holds slots
r x E/ep .. (r + 1) x E/ep - 1. The router still scores experts by id and checkpoints
still name them by id; only the worker a chosen expert's rows travel to changes. So a
placement changes no result, and any checkpoint loads under any placement.

Why: every exchange of a layer waits for the worker whose experts received the most rows.
An untrained router (and a trained one, less) sends some experts more rows than others, so
with the default placement one worker computes longer at the same layers every
micro-batch while the other waits inside the all-to-all (BENCHMARKS.md, issue 24).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # raypar.config checks placements with this module
    from raypar.config import ModelConfig

# Per MoE layer (model order), the expert each slot holds.
Placement = list[list[int]]


def moe_layer_ids(cfg: ModelConfig) -> list[int]:
    return [i for i in range(cfg.n_layers) if cfg.is_moe_layer(i)]


def placement_problem(cfg: ModelConfig, placement: Sequence[Sequence[int]]) -> str | None:
    """Why `placement` does not fit `cfg`'s model, or None."""
    layers = moe_layer_ids(cfg)
    if not layers:
        return "the model has no MoE layers (model.n_experts=0)"
    if len(placement) != len(layers):
        return (f"it lists {len(placement)} layers; the model has {len(layers)} MoE layers ({layers}): give one "
                f"list of the {cfg.n_experts} expert ids per MoE layer")
    for i, order in enumerate(placement):
        if sorted(order) != list(range(cfg.n_experts)):
            return f"entry {i} (layer {layers[i]}) is {list(order)}, not an order of the expert ids 0..{cfg.n_experts - 1}"
    return None


def layer_orders(cfg: ModelConfig, placement: Sequence[Sequence[int]] | None) -> dict[int, list[int]]:
    """Layer id -> its slots' experts, for the MoE layers `placement` places otherwise than
    the default (none for None)."""
    if placement is None:
        return {}
    identity = list(range(cfg.n_experts))
    return {layer: list(order) for layer, order in zip(moe_layer_ids(cfg), placement) if list(order) != identity}


def identity(cfg: ModelConfig) -> Placement:
    return [list(range(cfg.n_experts)) for _ in moe_layer_ids(cfg)]


def worker_loads(order: Sequence[int], loads: Sequence[int], ep: int) -> list[int]:
    """Rows each of `ep` workers' experts received, with experts in slots `order`."""
    local = len(order) // ep
    return [sum(loads[e] for e in order[w * local:(w + 1) * local]) for w in range(ep)]


def busiest(placement: Sequence[Sequence[int]], loads: Sequence[Sequence[int]], ep: int) -> int:
    """The rows of each layer's busiest worker, summed over layers: what the layers' exchanges
    wait for."""
    return sum(max(worker_loads(order, layer, ep)) for order, layer in zip(placement, loads))


def balanced_placement(loads: Sequence[Sequence[int]], ep: int, current: Sequence[Sequence[int]]) -> Placement:
    """Per layer, experts on `ep` workers so that the busiest worker's rows (by `loads`,
    per layer and expert) are as few as this finds, moving as few experts off their worker
    of `current` as reaches that."""
    return [_balance_layer(layer, ep, list(order)) for layer, order in zip(loads, current)]


def _balance_layer(loads: Sequence[int], ep: int, current: list[int]) -> list[int]:
    local = len(current) // ep
    # Two starts: the current placement (few moves) and a greedy one (largest first onto the
    # least loaded worker with a slot free); each improved by swaps.
    greedy: list[list[int]] = [[] for _ in range(ep)]
    for e in sorted(range(len(loads)), key=lambda e: (-loads[e], e)):
        w = min((w for w in range(ep) if len(greedy[w]) < local), key=lambda w: (sum(loads[x] for x in greedy[w]), w))
        greedy[w].append(e)
    options = [_improved([current[w * local:(w + 1) * local] for w in range(ep)], loads),
               _keep_workers(_improved(greedy, loads), current, local)]

    def moved(groups: list[list[int]]) -> int:
        return sum(e not in current[w * local:(w + 1) * local] for w, group in enumerate(groups) for e in group)

    best = min(options, key=lambda g: (sorted((sum(loads[e] for e in x) for x in g), reverse=True), moved(g)))
    # Within a worker, experts that stay keep their slots; the ones arriving take the others.
    order: list[int] = []
    for w, group in enumerate(best):
        was = current[w * local:(w + 1) * local]
        arriving = iter(sorted(e for e in group if e not in was))
        order += [e if e in group else next(arriving) for e in was]
    return order


def _improved(groups: list[list[int]], loads: Sequence[int]) -> list[list[int]]:
    """Swap an expert of the busiest worker with one of another worker while that lowers the
    pair's larger load below the busiest's (each swap lowers the sum of squared loads, so
    this ends)."""
    groups = [list(g) for g in groups]
    while True:
        load = [sum(loads[e] for e in g) for g in groups]
        h = max(range(len(groups)), key=lambda w: (load[w], -w))
        best: tuple[int, int, int, int] | None = None  # (pair's new larger load, w, i, j)
        for w in range(len(groups)):
            if w == h:
                continue
            for i, a in enumerate(groups[h]):
                for j, b in enumerate(groups[w]):
                    delta = loads[a] - loads[b]
                    larger = max(load[h] - delta, load[w] + delta)
                    if larger < load[h] and (best is None or larger < best[0]):
                        best = (larger, w, i, j)
        if best is None:
            return groups
        _, w, i, j = best
        groups[h][i], groups[w][j] = groups[w][j], groups[h][i]


def _keep_workers(groups: list[list[int]], current: list[int], local: int) -> list[list[int]]:
    """The same groups, each given to the worker that already holds most of its experts."""
    free = list(range(len(groups)))
    out: list[list[int]] = [[] for _ in groups]
    for g in sorted(groups, key=lambda g: -max(len(set(g) & set(current[w * local:(w + 1) * local])) for w in free)):
        w = max(free, key=lambda w: (len(set(g) & set(current[w * local:(w + 1) * local])), -w))
        free.remove(w)
        out[w] = g
    return out


def moved_experts(before: Sequence[Sequence[int]], after: Sequence[Sequence[int]], ep: int) -> int:
    """Experts (over all layers) on another worker in `after` than in `before`."""
    n = 0
    for a, b in zip(before, after):
        local = len(a) // ep
        n += sum(a.index(e) // local != b.index(e) // local for e in a)
    return n


def loads_by_layer(cfg: ModelConfig, tokens: Mapping[str, Sequence[int]]) -> list[list[int]]:
    """Per MoE layer in model order, the rows routed to each expert (`StepRecord.expert_tokens`,
    keyed by layer id; a layer without counts: zeros)."""
    return [list(tokens.get(str(layer), [0] * cfg.n_experts)) for layer in moe_layer_ids(cfg)]
