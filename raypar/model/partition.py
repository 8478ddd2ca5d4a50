"""Split the model's layers into contiguous pipeline stages and build one stage."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from raypar.config import ModelConfig
from raypar.schedule.layout import Layout
from raypar.model.experts import unstacked
from raypar.expert_placement import layer_orders
from raypar.model.tensor_parallel import TensorParallel
from raypar.model.transformer import HALVES, LayerPart, Transformer, head_flops, init_weights, layer_flops

__all__ = ["PartitionError", "split_layers", "balanced_halves", "listed_halves", "stage_halves", "layer_parts",
           "stage_sizes",
           "build_stage", "stage_param_names", "stage_param_shapes"]


class PartitionError(ValueError):
    """A pipeline split that cannot work."""


def _remainder_order(n_stages: int) -> list[int]:
    # Stage 0 holds the embedding and the last stage the norm, head and loss (a
    # vocab-sized matmul), so extra layers go to interior stages first, nearest the
    # middle first; then stage 0 (an embedding lookup is cheap), then the last stage.
    interior = sorted(range(1, n_stages - 1), key=lambda i: (abs(2 * i - (n_stages - 1)), i))
    ends = [0, n_stages - 1] if n_stages > 1 else [0]
    return interior + ends


def split_layers(n_layers: int, n_stages: int, layers_per_stage: Sequence[int] | None = None) -> list[range]:
    """Contiguous global layer ranges, one per pipeline stage.

    Explicit `layers_per_stage` is used as given (n_stages entries, each >= 1, summing to
    n_layers). Otherwise every stage gets n_layers // n_stages layers and the remainder
    goes one layer each to the interior stages nearest the middle, then to the first
    stage, then to the last; e.g. 10 layers on 4 stages -> [2, 3, 3, 2], 7 on 3 -> [2, 3, 2],
    5 on 2 -> [3, 2].
    """
    if n_layers < 1:
        raise PartitionError(f"cannot split {n_layers} layers: the model needs at least one layer")
    if n_stages < 1:
        raise PartitionError(f"cannot split into {n_stages} pipeline stages: use at least 1 stage")
    if layers_per_stage is None:
        if n_stages > n_layers:
            raise PartitionError(
                f"cannot split {n_layers} layers into {n_stages} pipeline stages: each stage needs at least "
                f"one layer; use at most {n_layers} stages"
            )
        counts = [n_layers // n_stages] * n_stages
        for stage in _remainder_order(n_stages)[: n_layers % n_stages]:
            counts[stage] += 1
    else:
        counts = list(layers_per_stage)
        if len(counts) != n_stages:
            raise PartitionError(
                f"layers_per_stage={counts} has {len(counts)} entries but there are {n_stages} pipeline stages; "
                f"give one count per stage"
            )
        if any(isinstance(c, bool) or not isinstance(c, int) for c in counts):
            raise PartitionError(f"layers_per_stage={counts} must hold integers")
        if any(c < 1 for c in counts):
            raise PartitionError(f"layers_per_stage={counts}: every stage needs at least one layer")
        if sum(counts) != n_layers:
            raise PartitionError(
                f"layers_per_stage={counts} sums to {sum(counts)} but the model has {n_layers} layers"
            )
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def balanced_halves(cfg: ModelConfig, n_stages: int) -> list[int]:
    """Half layers per stage (`parallel.layers_per_stage: auto`) that make the costliest stage
    as cheap as contiguous halves allow, by modelled training FLOPs per token: each half's
    (`layer_flops`: attention at model.max_seq_len, or the MLP; MoE layers by their top_k
    experts) and the head's on the last stage (the embedding is a lookup). A cut may fall
    inside a layer, between its attention and its MLP: whole layers alone cannot even out a
    stage carrying the head. Among splits with the same costliest stage, the most even one.
    E.g. `configs/gpt-1b.yaml` (14 layers; a head costing 1.2 layers, an attention half 0.38):
    [15, 13] halves on 2 stages (7.5 and 6.5 layers), whose costliest stage carries 7.8
    layers' work against whole layers' 8."""
    n = 2 * cfg.n_layers
    if not 1 <= n_stages <= cfg.n_layers:
        raise PartitionError(f"cannot split {cfg.n_layers} layers into {n_stages} pipeline stages: "
                             f"use 1 to {cfg.n_layers} stages")
    prefix = [0]
    for u in range(n):
        prefix.append(prefix[-1] + layer_flops(cfg, u // 2, cfg.max_seq_len, HALVES[u % 2]))
    head = head_flops(cfg)
    # best[k][j]: (costliest stage, sum of squared stage costs) of halves 0..j-1 on k stages.
    best: list[list[tuple[int, int] | None]] = [[None] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = (0, 0)
    for k in range(1, n_stages + 1):
        for j in range(k, n - (n_stages - k) + 1):
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev is None:
                    continue
                cost = prefix[j] - prefix[i] + (head if k == n_stages else 0)
                cand = (max(prev[0], cost), prev[1] + cost * cost)
                if best[k][j] is None or cand < best[k][j]:
                    best[k][j], cut[k][j] = cand, i
    counts, j = [], n
    for k in range(n_stages, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def listed_halves(n_layers: int, n_stages: int, layers_per_stage: Sequence[float]) -> list[int]:
    """Half layers per stage from one count of layers per stage, each whole or a half more
    (7.5: seven layers and the attention of the next, whose MLP starts the next stage)."""
    counts = list(layers_per_stage)
    if len(counts) != n_stages:
        raise PartitionError(f"layers_per_stage={counts} has {len(counts)} entries but there are {n_stages} "
                             f"pipeline stages; give one count per stage")
    if any(isinstance(c, bool) or not isinstance(c, (int, float)) or 2 * c != int(2 * c) for c in counts):
        raise PartitionError(f"layers_per_stage={counts}: each count is whole or ends in .5 (a cut between a "
                             f"layer's attention and its MLP), e.g. [7.5, 6.5]")
    if any(c < 0.5 for c in counts):
        raise PartitionError(f"layers_per_stage={counts}: every stage needs at least half a layer")
    if sum(counts) != n_layers:
        raise PartitionError(f"layers_per_stage={counts} sums to {sum(counts):g} but the model has {n_layers} layers")
    return [int(2 * c) for c in counts]


def stage_halves(cfg: ModelConfig, n_stages: int, layers_per_stage: Sequence[float] | str | None) -> list[range]:
    """Each stage's run of half layers (half `u` is layer `u // 2`'s attention when `u` is
    even, its MLP when odd): "auto" cuts by cost (`balanced_halves`), a list counts each
    stage's layers in whole and half layers (`listed_halves`), and None is the even split
    between whole layers (`split_layers`)."""
    if layers_per_stage == "auto":
        counts = balanced_halves(cfg, n_stages)
    elif layers_per_stage is None:
        counts = [2 * len(r) for r in split_layers(cfg.n_layers, n_stages)]
    else:
        counts = listed_halves(cfg.n_layers, n_stages, layers_per_stage)
    ranges, start = [], 0
    for c in counts:
        ranges.append(range(start, start + c))
        start += c
    return ranges


def layer_parts(halves: range) -> list[LayerPart]:
    """A run of half layers as the layers a `Transformer` holds: whole layer ids, and
    `(id, "mlp")` / `(id, "attn")` where the run starts or ends inside a layer."""
    parts: list[LayerPart] = []
    u = halves.start
    while u < halves.stop:
        layer, second = divmod(u, 2)
        if not second and u + 1 < halves.stop:
            parts.append(layer)
            u += 2
        else:
            parts.append((layer, HALVES[second]))
            u += 1
    return parts


def stage_sizes(cfg: ModelConfig, n_stages: int, layers_per_stage: Sequence[float] | str | None) -> list[float]:
    """Layers per stage, halves counted as 0.5 (what a cut looks like in a table)."""
    return [len(r) / 2 for r in stage_halves(cfg, n_stages, layers_per_stage)]


def layout_flops(cfg: ModelConfig, seq_len: int, layout: Layout,
                 layers_per_stage: Sequence[float] | str | None = None) -> list[float]:
    """Training FLOPs per token each worker of `layout` runs: its chunks' layers, and the
    head on the worker holding the last virtual stage."""
    n = layout.n_virtual
    flops = [0.0] * layout.n_actors
    for vs, halves in enumerate(stage_halves(cfg, n, layers_per_stage)):
        worker = layout.place(vs)[0]
        flops[worker] += (sum(layer_flops(cfg, u // 2, seq_len, HALVES[u % 2]) for u in halves)
                          + (head_flops(cfg) if vs == n - 1 else 0))
    return flops


def _stage_module(cfg: ModelConfig, stage: int, n_stages: int, layers_per_stage: Sequence[float] | str | None,
                  ep_rank: int = 0, ep_size: int = 1, layout: Layout | None = None,
                  tp: TensorParallel | None = None,
                  expert_placement: Sequence[Sequence[int]] | None = None) -> Transformer:
    placed = layer_orders(cfg, expert_placement)
    if not 0 <= stage < n_stages:
        raise PartitionError(f"stage {stage} does not exist in a {n_stages}-stage pipeline; use 0..{n_stages - 1}")
    if layout is None or layout.n_chunks == 1:
        ranges = stage_halves(cfg, n_stages, layers_per_stage)
        return Transformer(cfg, layer_ids=layer_parts(ranges[stage]), has_embed=stage == 0,
                           has_head=stage == n_stages - 1, ep_rank=ep_rank, ep_size=ep_size, tp=tp,
                           expert_placement=placed)
    if layout.n_actors != n_stages:
        raise PartitionError(f"a layout of {layout.n_actors} stage(s) for a {n_stages}-stage pipeline")
    # An interleaved schedule cuts the model into stages x chunks virtual stages (layers_per_stage
    # counts each of them) and places them by its layout.
    ranges = stage_halves(cfg, layout.n_virtual, layers_per_stage)
    chunks = range(layout.n_chunks)
    return Transformer(cfg, chunks=[layer_parts(ranges[layout.virtual(stage, c)]) for c in chunks],
                       embed_chunk=next((c for c in chunks if layout.is_first(stage, c)), None),
                       head_chunk=next((c for c in chunks if layout.is_last(stage, c)), None),
                       ep_rank=ep_rank, ep_size=ep_size, tp=tp, expert_placement=placed)


def build_stage(
    cfg: ModelConfig,
    stage: int,
    n_stages: int,
    layers_per_stage: Sequence[float] | str | None = None,
    seed: int = 0,
    device: torch.device | str | None = None,
    ep_rank: int = 0,
    ep_size: int = 1,
    init: bool = True,
    layout: Layout | None = None,
    tp: TensorParallel | None = None,
    expert_placement: Sequence[Sequence[int]] | None = None,
) -> Transformer:
    """Pipeline stage `stage` of `n_stages`, initialised with `init_weights(seed)`.

    Stage 0 holds the embedding, the last stage the final norm and head; with n_stages=1
    this is the whole model. Built on the meta device first so tensors are allocated once,
    directly on `device` (default: CPU), and never filled with a throwaway default init.
    With `init=False` the parameters are left as allocated, for a stage whose every
    parameter is loaded next (a checkpoint): drawing them on the CPU costs seconds.
    `layout`: an interleaved schedule's chunks (`raypar.schedule.layout`); the stage then
    holds one run of layers per chunk, `layers_per_stage` counting each virtual stage's.
    `tp`: this worker's slice of the stage's layers (tensor parallelism).
    `expert_placement`: which experts each ep worker holds (`raypar.expert_placement`).
    """
    with torch.device("meta"):
        model = _stage_module(cfg, stage, n_stages, layers_per_stage, ep_rank, ep_size, layout, tp, expert_placement)
    _allocate(model, torch.device(device if device is not None else "cpu"))
    model.reset_buffers()
    if init:
        init_weights(model, cfg, seed)
    return model


def _allocate(model: nn.Module, device: torch.device) -> None:
    """`model.to_empty(device)` for a model built on the meta device, by shape: to_empty's
    empty_like runs meta tensors' Python kernels, whose first use imports sympy and torch's
    compiler stack (over half a second of every worker's start on a 2-core machine)."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                        requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)


def stage_param_names(
    cfg: ModelConfig, stage: int, n_stages: int, layers_per_stage: Sequence[float] | str | None = None,
    layout: Layout | None = None,
) -> list[str]:
    """Global parameter names of a stage, without allocating any tensor."""
    return [name for name, _, _ in stage_param_shapes(cfg, stage, n_stages, layers_per_stage, layout=layout)]


def stage_param_shapes(
    cfg: ModelConfig, stage: int, n_stages: int, layers_per_stage: Sequence[float] | str | None = None,
    ep_rank: int = 0, ep_size: int = 1, layout: Layout | None = None,
) -> list[tuple[str, torch.Size, torch.dtype]]:
    """(name, shape, dtype) of each parameter of a stage, without allocating any tensor."""
    with torch.device("meta"):
        model = _stage_module(cfg, stage, n_stages, layers_per_stage, ep_rank, ep_size, layout)
    return [(name, t.shape, t.dtype) for name, t in unstacked(model)]
