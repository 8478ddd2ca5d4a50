"""Llama-style decoder-only transformer that can be built whole or as one pipeline stage.

Parameter names are global and topology-free (`layers.7.attn.wq.weight` is layer 7's
query projection wherever layer 7 lives), so checkpoints, optimizer state and the
deterministic initialisation below do not depend on how the model is split.
"""
from __future__ import annotations

import hashlib
import math
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from raypar.config import ModelConfig
from raypar.kernels import dropout_add, site_salt, swiglu_pair
from raypar.model.layers import FeedForward, RMSNorm, apply_rope, rope_tables
from raypar.model.experts import named_slices
from raypar.model.moe import MoE
from raypar.model.split_backward import Linear
from raypar.model.tensor_parallel import (ALIGN, TensorParallel, gather_from_tensor_parallel, vocab_parallel_cross_entropy,
                                          vocab_parallel_embedding)

__all__ = [
    "Attention",
    "Block",
    "Transformer",
    "build_mlp",
    "init_weights",
    "flops_per_token",
    "num_params",
    "param_dtype",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def param_dtype(cfg: ModelConfig) -> torch.dtype:
    """The torch dtype parameters are created in (`cfg.dtype`)."""
    try:
        return _DTYPES[cfg.dtype]
    except KeyError:
        raise ValueError(f"model.dtype={cfg.dtype!r} is not supported; choose one of {', '.join(_DTYPES)}") from None


# ---------------------------------------------------------------------------------------
# Blocks


class Attention(nn.Module):
    """Causal self-attention with rotary positions and grouped key/value heads. With `tp`,
    this rank holds n_heads / tp query heads and n_kv_heads / tp key/value heads (wq, wk,
    wv by output rows, wo by input columns: `tensor_parallel`), or, where tp does not divide
    the head counts, a slice of the model dimension (wq, wk, wv by input columns, wo by
    output rows; every head on every rank), or all of it."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        dtype = param_dtype(cfg)
        self.tp = tp
        self.along = tp.part(cfg, "attention").along if tp else None
        by_heads, by_dim = self.along == "model.n_heads", self.along == "model.dim"
        self.head_dim = cfg.dim // cfg.n_heads
        self.n_heads = cfg.n_heads // tp.size if by_heads else cfg.n_heads
        self.n_kv_heads = cfg.kv_heads // tp.size if by_heads else cfg.kv_heads
        width = cfg.dim // tp.size if by_dim else cfg.dim
        self.wq = Linear(width, self.n_heads * self.head_dim, bias=False, dtype=dtype)
        self.wk = Linear(width, self.n_kv_heads * self.head_dim, bias=False, dtype=dtype)
        self.wv = Linear(width, self.n_kv_heads * self.head_dim, bias=False, dtype=dtype)
        self.wo = Linear(self.n_heads * self.head_dim, width, bias=False, dtype=dtype)
        if by_heads or by_dim:
            for w, heads in ((self.wq, cfg.n_heads), (self.wk, cfg.kv_heads), (self.wv, cfg.kv_heads)):
                tp.mark(w, "weight", (heads * self.head_dim, cfg.dim), 1 if by_dim else 0)
            tp.mark(self.wo, "weight", (cfg.dim, cfg.n_heads * self.head_dim), 0 if by_dim else 1)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        tp = self.tp
        if tp is None:
            return self.wo(self._attend(self.wq(x), self.wk(x), self.wv(x), cos, sin))
        if self.along == "model.n_heads":
            x = tp.enter(x)
            return tp.leave(self.wo(self._attend(self.wq(x), self.wk(x), self.wv(x), cos, sin)))
        if self.along == "model.dim":
            x = tp.feature_slice(x)
            q, k, v = (tp.sum_partials(w(x)) for w in (self.wq, self.wk, self.wv))
            return tp.gather_features(self.wo(tp.into_split(self._attend(q, k, v, cos, sin))))
        x = tp.whole_in(x)
        return tp.whole_out(self.wo(self._attend(self.wq(x), self.wk(x), self.wv(x), cos, sin)))

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Attention of this rank's heads from their projections [b, t, heads * head_dim];
        [b, t, n_heads * head_dim], the input of wo."""
        b, t, _ = q.shape
        # Rotated in the projections' own layout [b, t, heads, head_dim], where they are
        # contiguous: on the transposed views every elementwise op of the rotation, forward and
        # backward, ran strided (on 1 x H200, 1B model, 14% of the step); SDPA takes the
        # transposed views as they are.
        cos, sin = cos[:, None], sin[:, None]
        q = apply_rope(q.view(b, t, self.n_heads, self.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(b, t, self.n_kv_heads, self.head_dim), cos, sin).transpose(1, 2)
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            # Explicit repeat rather than SDPA's enable_gqa: every backend (CPU math,
            # flash, mem-efficient) accepts it, at the cost of materialising k/v per head.
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)


def build_mlp(cfg: ModelConfig, layer_id: int, ep_rank: int = 0, ep_size: int = 1,
              tp: TensorParallel | None = None, placement: Sequence[int] | None = None) -> nn.Module:
    """The MLP of layer `layer_id`.

    This is the seam for mixture-of-experts: a MoE layer (for chosen layer ids, e.g. every
    other one) is returned from here and keeps the `layers.<i>.mlp.` name prefix, so the
    rest of the model, partitioning and initialisation stay unchanged. Its module must map
    [b, t, dim] -> [b, t, dim]; any auxiliary loss needs its own channel out of the block.
    """
    if cfg.is_moe_layer(layer_id):
        # Experts split over ep, not tp: under tp every tp rank runs the layer whole on the
        # same tokens (its input and output are whole on every rank, as around a norm; under
        # sequence parallelism on the gathered sequence, keeping its slice of the output).
        return MoE(cfg, layer_id, ep_rank, ep_size, dtype=param_dtype(cfg), tp=tp, placement=placement)
    if tp is None:
        return FeedForward(cfg.dim, cfg.hidden_dim, dtype=param_dtype(cfg))
    kind = {"model.ffn_dim": ParallelFeedForward, "model.dim": FeatureParallelFeedForward,
            None: WholeFeedForward}[tp.part(cfg, "mlp").along]
    return kind(cfg.dim, cfg.hidden_dim, tp, dtype=param_dtype(cfg))


class ParallelFeedForward(FeedForward):
    """The SwiGLU MLP split over `tp`: w1 and w3 by output rows (hidden units), w2 by input
    columns; one all-reduce forward (the partial outputs) and one backward (the input's
    gradient). Each rank's hidden units start at a multiple of `ALIGN`, so pieces may differ
    by that much: the all-reduce sums outputs of the model's width either way."""

    def __init__(self, dim: int, hidden_dim: int, tp: TensorParallel, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, tp.piece(hidden_dim, ALIGN), dtype=dtype)
        self.tp = tp
        tp.mark(self.w1, "weight", (hidden_dim, dim), 0, ALIGN)
        tp.mark(self.w3, "weight", (hidden_dim, dim), 0, ALIGN)
        tp.mark(self.w2, "weight", (dim, hidden_dim), 1, ALIGN)

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.leave(super().forward(self.tp.enter(x)))


class FeatureParallelFeedForward(FeedForward):
    """The SwiGLU MLP over `tp` ranks where tp does not divide its hidden size: w1 and w3 by
    input columns, w2 by output rows (slices of the model dimension); the hidden activations
    are summed and whole on every rank, the outputs gathered."""

    def __init__(self, dim: int, hidden_dim: int, tp: TensorParallel, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim // tp.size, hidden_dim, dtype=dtype)
        self.tp = tp
        tp.mark(self.w1, "weight", (hidden_dim, dim), 1)
        tp.mark(self.w3, "weight", (hidden_dim, dim), 1)
        tp.mark(self.w2, "weight", (dim, hidden_dim), 0)

    def forward(self, x: Tensor) -> Tensor:
        tp = self.tp
        x = tp.feature_slice(x)
        hidden = swiglu_pair(tp.sum_partials(self.w1(x)), tp.sum_partials(self.w3(x)))
        return tp.gather_features(self.w2(tp.into_split(hidden)))


class WholeFeedForward(FeedForward):
    """The SwiGLU MLP held whole on every one of `tp` ranks (tp divides neither its hidden
    size nor the model dimension)."""

    def __init__(self, dim: int, hidden_dim: int, tp: TensorParallel, dtype: torch.dtype | None = None) -> None:
        super().__init__(dim, hidden_dim, dtype=dtype)
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        return self.tp.whole_out(super().forward(self.tp.whole_in(x)))


HALVES = ("attn", "mlp")  # a layer's two halves, in the order they run: a pipeline may cut between them


class Block(nn.Module):
    """One transformer layer, or the `halves` of it a stage holds (a cut inside the layer
    puts its attention on one stage and its MLP on the next)."""

    def __init__(self, layer_id: int, cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1,
                 tp: TensorParallel | None = None, halves: Sequence[str] = HALVES,
                 placement: Sequence[int] | None = None) -> None:
        super().__init__()
        dtype = param_dtype(cfg)
        self.layer_id = layer_id
        self.dropout = cfg.dropout
        self.tp = tp
        self.halves = tuple(h for h in HALVES if h in halves)
        # Norms and the residual stream are whole on every tensor-parallel rank (with
        # sequence parallelism, each rank's slice of the sequence).
        if "attn" in self.halves:
            self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype)
            self.attn = Attention(cfg, tp)
        if "mlp" in self.halves:
            self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype)
            self.mlp = build_mlp(cfg, layer_id, ep_rank, ep_size, tp, placement)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, seeds: Tensor | None = None,
                half: str | None = None) -> Tensor:
        """The whole layer, or one half of it (`half`: "attn" or "mlp")."""
        if half != "mlp":
            x = self._residual(self.attn(self.attn_norm(x), cos, sin), x, seeds, site=0)
        if half != "attn":
            x = self._residual(self.mlp(self.mlp_norm(x)), x, seeds, site=1)
        return x

    def _residual(self, branch: Tensor, x: Tensor, seeds: Tensor | None, site: int) -> Tensor:
        if not (self.dropout and self.training):
            return x + branch
        if seeds is None:
            raise ValueError("model.dropout > 0 needs one dropout seed per sample in training: pass "
                             "seeds=raypar.kernels.sample_seeds(seed, step, sample_ids), or call model.eval()")
        # With sequence parallelism x is this rank's slice of each sample's tokens: its part of the mask.
        first = self.tp.rank * x[0].numel() if self.tp is not None and self.tp.sequence else 0
        return dropout_add(branch, x, seeds, self.dropout, site_salt(self.layer_id, site), first)


# ---------------------------------------------------------------------------------------
# Whole model or pipeline stage


LayerPart = int | tuple[int, str]  # a layer id, or (id, "attn" | "mlp"): half of the layer


def _layer_part(p: LayerPart) -> tuple[int, str | None]:
    if isinstance(p, tuple):
        i, half = p
        if half not in HALVES:
            raise ValueError(f"({i}, {half!r}) names no half of a layer: use {HALVES}")
        return int(i), half
    return int(p), None


class Transformer(nn.Module):
    """The whole model (defaults) or one pipeline stage of it.

    A stage holds the layers `layer_ids` (global indices, contiguous or not), the token
    embedding if `has_embed` and the final norm plus output head if `has_head`. Without an
    embedding the input is hidden states [b, t, dim]; without a head the output is too. A
    layer id may also be half a layer, `(id, "attn")` or `(id, "mlp")`: a cut inside it.

    A stage of an interleaved schedule holds several model chunks (`chunks`: each chunk's
    layer ids, in the order `forward(chunk=...)` runs them); the embedding then belongs to
    chunk `embed_chunk` and the head to chunk `head_chunk` (None: the stage has none).
    """

    recompute: bool
    on_block_input: Callable[[Tensor], None] | None

    def __init__(
        self,
        cfg: ModelConfig,
        layer_ids: Sequence[LayerPart] | None = None,
        has_embed: bool = True,
        has_head: bool = True,
        ep_rank: int = 0,
        ep_size: int = 1,
        chunks: Sequence[Sequence[LayerPart]] | None = None,
        embed_chunk: int | None = None,
        head_chunk: int | None = None,
        tp: TensorParallel | None = None,
        expert_placement: Mapping[int, Sequence[int]] | None = None,
    ) -> None:
        super().__init__()
        dtype = param_dtype(cfg)
        self.cfg = cfg
        self.tp = tp if tp is not None and tp.size > 1 else None
        if chunks is not None:
            if layer_ids is not None:
                raise ValueError("give a stage's layers as layer_ids or as chunks, not both")
            has_embed, has_head = embed_chunk is not None, head_chunk is not None
        else:
            chunks = [list(range(cfg.n_layers)) if layer_ids is None else list(layer_ids)]
            embed_chunk, head_chunk = 0, 0
        # Per chunk, what forward runs: (layer id, None for the whole layer or the half).
        parts = [[_layer_part(p) for p in chunk] for chunk in chunks]
        halves: dict[int, list[str]] = {}
        for chunk in parts:
            for i, half in chunk:
                if not 0 <= i < cfg.n_layers:
                    raise ValueError(f"layer id {i} is outside the model's layers 0..{cfg.n_layers - 1}")
                for h in HALVES if half is None else (half,):
                    if h in halves.setdefault(i, []):
                        raise ValueError(f"layer {i}'s {h} half is given twice in {[list(c) for c in chunks]}")
                    halves[i].append(h)
        self.layer_ids = list(halves)
        self.has_embed = has_embed
        self.has_head = has_head
        self.chunk_layers = [[(str(i), half) for i, half in chunk] for chunk in parts]
        self.embed_chunk = embed_chunk if has_embed else None
        self.head_chunk = head_chunk if has_head else None
        for which, c in (("embed_chunk", self.embed_chunk), ("head_chunk", self.head_chunk)):
            if c is not None and not 0 <= c < len(self.chunk_layers):
                raise ValueError(f"{which}={c} names no chunk of this stage's {len(self.chunk_layers)}")
        self.recompute = False
        self.on_block_input = None

        tp = self.tp
        # With tensor parallelism the embedding and the head hold this rank's slice of the
        # vocabulary (ids vocab_first .. vocab_first + vocab_size / tp - 1), or where tp does
        # not divide it, of the model dimension, or all of it.
        self.vocab_along = tp.part(cfg, "vocabulary").along if tp else None
        by_vocab, by_dim = self.vocab_along == "model.vocab_size", self.vocab_along == "model.dim"
        vocab = cfg.vocab_size // tp.size if by_vocab else cfg.vocab_size
        width = cfg.dim // tp.size if by_dim else cfg.dim
        self.vocab_first = tp.rank * vocab if by_vocab else 0
        if has_embed:
            # Given its (uninitialised) weight, the embedding skips its own normal_ draw, which
            # on the meta device imports torch's compiler stack (a second of every worker's start);
            # init_weights fills it.
            self.embed = nn.Embedding(vocab, width, _weight=torch.empty(vocab, width, dtype=dtype))
            if by_vocab or by_dim:
                tp.mark(self.embed, "weight", (cfg.vocab_size, cfg.dim), 1 if by_dim else 0)
        placed = expert_placement or {}
        self.layers = nn.ModuleDict({str(i): Block(i, cfg, ep_rank, ep_size, tp, hs, placed.get(i))
                                     for i, hs in halves.items()})
        if has_head:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps, dtype=dtype)
            # Untied from embed: the two live on different pipeline stages.
            self.head = Linear(width, vocab, bias=False, dtype=dtype)
            if by_vocab or by_dim:
                tp.mark(self.head, "weight", (cfg.vocab_size, cfg.dim), 1 if by_dim else 0)

        # Non-persistent: derived from cfg, so they stay out of checkpoints and names.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self._rope_cast: tuple[tuple, Tensor, Tensor] | None = None
        if not self.rope_cos.is_meta:  # a meta build computes them after to_empty (build_stage)
            self.reset_buffers()

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the rotary tables and the MoE layers' slot tables, e.g. after building
        on the meta device and `to_empty`."""
        if device is None:
            device = self.rope_cos.device
        cfg = self.cfg
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta, device=device)
        self.rope_cos, self.rope_sin = cos, sin
        self._rope_cast: tuple[tuple, Tensor, Tensor] | None = None
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_buffers(device)

    def _rope(self, t: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The first `t` positions of the rotary tables in `dtype`, cast once, not per layer."""
        key = (self.rope_cos.device, self.rope_cos.data_ptr(), dtype)  # the pointer moves with .to(), to_empty
        if self._rope_cast is None or self._rope_cast[0] != key:
            self._rope_cast = (key, self.rope_cos.to(dtype), self.rope_sin.to(dtype))
        _, cos, sin = self._rope_cast
        return cos[:t], sin[:t]

    def forward(self, x: Tensor, labels: Tensor | None = None, seeds: Tensor | None = None, chunk: int = 0) -> Tensor:
        """Loss (with labels), logits, or hidden states; `seeds`: per-sample dropout seeds [b];
        `chunk`: which of the stage's model chunks runs."""
        if not 0 <= chunk < len(self.chunk_layers):
            raise ValueError(f"chunk {chunk} does not exist: this stage holds {len(self.chunk_layers)} chunk(s)")
        if self.embed_chunk == chunk:
            if x.dtype.is_floating_point:
                raise TypeError(f"this stage embeds tokens and expects integer token ids [b, t], got {x.dtype}")
            h = self._embed(x)
        else:
            if x.dim() != 3 or x.shape[-1] != self.cfg.dim:
                raise ValueError(f"this stage expects hidden states [b, t, {self.cfg.dim}], got shape {tuple(x.shape)}")
            h = x
        # Sequence parallelism: the residual stream holds this rank's slice of the sequence.
        t = h.shape[1] * (self.tp.size if self.tp and self.tp.sequence else 1)
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self._rope(t, h.dtype)

        use_recompute = self.recompute and torch.is_grad_enabled()
        for key, half in self.chunk_layers[chunk]:
            block = self.layers[key]
            if use_recompute:
                if self.on_block_input is not None:
                    self.on_block_input(h)
                h = checkpoint(block, h, cos, sin, seeds, half, use_reentrant=False)
            else:
                h = block(h, cos, sin, seeds, half)

        if self.head_chunk != chunk:
            if labels is not None:
                raise ValueError("labels were given to a stage without the output head")
            return h
        return self._head(self.norm(h), labels)

    def _embed(self, tokens: Tensor) -> Tensor:
        tp = self.tp
        if tp is None:
            return self.embed(tokens)
        if self.vocab_along == "model.vocab_size":
            return vocab_parallel_embedding(tokens, self.embed, self.vocab_first, tp.group, tp.sequence,
                                            tp.backward_group)
        if self.vocab_along == "model.dim":
            return tp.gather_features(self.embed(tokens))
        return tp.whole_out(self.embed(tokens))

    def _head(self, h: Tensor, labels: Tensor | None) -> Tensor:
        """The loss (mean over the tokens whose label is not -100, in fp32) or the logits
        from the final norm's output `h`."""
        tp = self.tp
        if tp is not None and self.vocab_along == "model.vocab_size":
            # This rank's vocabulary slice of the logits; the loss never gathers them.
            logits = self.head(tp.enter(h))
            if labels is None:
                return gather_from_tensor_parallel(logits, tp.group)
            return vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), self.vocab_first, tp.group)
        if tp is not None and self.vocab_along == "model.dim":
            logits = tp.sum_partials(self.head(tp.feature_slice(h)))
        elif tp is not None and tp.sequence:
            # The head whole on every rank, each on its slice of the sequence: the loss is the
            # sum of the ranks' token losses over all the tokens.
            if labels is None:
                return self.head(tp.whole_in(h))
            logits = self.head(h)
            mine = F.cross_entropy(logits.float().flatten(0, 1), tp.whole_out(labels).flatten(), reduction="sum")
            return tp.sum_partials(mine) / (labels != -100).sum().clamp(min=1)
        else:
            logits = self.head(h)
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


# ---------------------------------------------------------------------------------------
# Initialisation and accounting


def _param_seed(seed: int, name: str) -> int:
    # A stable digest (not Python's salted hash) of (seed, global name): every process
    # and every pipeline split derives the same stream for the same parameter.
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


_RESIDUAL_OUT = ("wo", "w2")  # projections that write into the residual stream


@torch.no_grad()
def init_weights(module: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Initialise every parameter of `module` deterministically from (seed, its name).

    `module` must name its parameters globally (a `Transformer`, whole or stage). Values are
    drawn on the CPU in fp32 and then copied, so they are bitwise identical across
    pipeline splits, expert-parallel splits, devices and parameter dtypes (up to the final
    cast): each tensor a checkpoint names (an expert's w1, not the stack of them) has its
    own seed.
    """
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    slices = named_slices(module)
    for mod_name, mod in module.named_modules():
        for p_name, p in mod.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if p.is_meta:
                raise ValueError(f"parameter {name} is on the meta device; call module.to_empty(device=...) first")
            if isinstance(mod, RMSNorm):
                p.fill_(1.0)
                continue
            if p_name == "bias":
                p.zero_()
                continue
            for key, index in slices[name]:
                module_name = key.rsplit(".", 1)[0]  # the Linear's: stacked experts name theirs
                std = residual_std if module_name.rsplit(".", 1)[-1] in _RESIDUAL_OUT else cfg.init_std
                gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed, key))
                # A tensor-parallel slice takes its part of the whole tensor's draw: any tp
                # initialises the same model.
                piece, shape = getattr(mod, "tp_slices", {}).get(p_name, (None, p[index].shape))
                values = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
                if piece is not None:
                    values = piece.of(values)
                p[index].copy_(values.to(p.dtype))


def layer_flops(cfg: ModelConfig, layer_id: int, seq_len: int, half: str | None = None) -> int:
    """Training FLOPs per token (forward + backward) of one block, or of its `half`: 6 x the
    matmul parameters a token passes through (attention projections; the MLP, or for an MoE
    layer the router and top_k experts) + 12 x dim x seq_len for attention scores and values."""
    hd = cfg.dim // cfg.n_heads
    attn = 6 * (2 * cfg.dim * cfg.n_heads * hd + 2 * cfg.dim * cfg.kv_heads * hd) + 12 * cfg.dim * seq_len
    if cfg.is_moe_layer(layer_id):
        mlp = 6 * (cfg.dim * cfg.n_experts + cfg.moe_top_k * 3 * cfg.dim * (cfg.moe_ffn_dim or cfg.hidden_dim))
    else:
        mlp = 6 * 3 * cfg.dim * cfg.hidden_dim
    return {None: attn + mlp, "attn": attn, "mlp": mlp}[half]


def head_flops(cfg: ModelConfig) -> int:
    """Training FLOPs per token of the output head (the embedding is a lookup: none)."""
    return 6 * cfg.dim * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of the whole model, for MFU."""
    return float(sum(layer_flops(cfg, i, seq_len) for i in range(cfg.n_layers)) + head_flops(cfg))


def num_params(module: nn.Module) -> int:
    """Number of parameter elements (shared parameters counted once)."""
    return sum(p.numel() for p in module.parameters())
