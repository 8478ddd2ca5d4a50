"""Mixture-of-experts MLP with optional expert parallelism.

Routing: softmax over E experts, top-k, weights renormalised over the chosen k (for
k > 1; top-1 keeps the probability as its weight, as Switch does). The
load-balancing loss and the token capacity are defined per sequence (sample), not per
micro-batch, so the loss and the dropped tokens do not depend on how a batch is split
into micro-batches or data-parallel replicas: any grid computes the same model.

With expert parallelism the `ep` workers of a pipeline stage each hold E/ep experts and
different tokens; tokens travel to their expert's worker and back by all-to-all over the
stage's ep group (counts first, then rows with variable split sizes). Every rank enters
every collective, also with zero rows to send or receive.
"""
from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from raypar import host_wait
from raypar.config import ModelConfig
from raypar.kernels import permute, unpermute
from raypar.model.layers import FeedForward


class MoEStats:
    """Per-step counters of one MoE layer, kept on the device until read."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.routed: Tensor | None = None  # assignments per global expert (before capacity)
        self.dropped: Tensor | None = None  # assignments dropped by the capacity limit
        self.alltoall_bytes = 0  # bytes this rank sent to other ranks, forward and backward
        # Host time in the exchanges (counts and rows, forward and backward). On GPU this
        # is launch time plus the waits the split sizes force, not kernel time.
        self.alltoall_s = 0.0

    def add(self, routed: Tensor, dropped: Tensor) -> None:
        routed, dropped = routed.detach(), dropped.detach()
        self.routed = routed if self.routed is None else self.routed + routed
        self.dropped = dropped if self.dropped is None else self.dropped + dropped


class _AllToAll(torch.autograd.Function):
    """Rows to ranks by split sizes; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group, stats: MoEStats) -> Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.stats = send, recv, group, stats
        t0 = time.perf_counter()
        out = x.new_empty((sum(recv), x.shape[1]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        stats.alltoall_bytes += _remote_bytes(send, group, x)
        stats.alltoall_s += time.perf_counter() - t0
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        t0 = time.perf_counter()
        out = g.new_empty((sum(ctx.send), g.shape[1]))
        dist.all_to_all_single(out, g.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        ctx.stats.alltoall_bytes += _remote_bytes(ctx.recv, ctx.group, g)
        ctx.stats.alltoall_s += time.perf_counter() - t0
        return out, None, None, None, None


def _remote_bytes(splits: list[int], group, x: Tensor) -> int:
    me = dist.get_rank(group)
    return (sum(splits) - splits[me]) * x.shape[1] * x.element_size()


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the activation whose backward also seeds the auxiliary loss.

    The aux loss of a layer on an early pipeline stage never reaches the last stage's
    loss; attaching it here gives it its gradient (d total / d aux = scale) when the
    activation's gradient passes through.
    """

    @staticmethod
    def forward(ctx, h: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return h

    @staticmethod
    def backward(ctx, g: Tensor):
        return g, torch.full(ctx.aux_shape, ctx.scale, dtype=torch.float32, device=g.device), None


def route(logits: Tensor, top_k: int, capacity_factor: float):
    """Top-k routing for logits [b, t, E] (fp32).

    Returns weights [b, t, k], expert ids [b, t, k], keep mask [b, t, k], the
    load-balancing loss and the z-loss. The capacity is per sample and expert,
    ceil(capacity_factor * t * k / E); first choices take precedence over second ones,
    earlier tokens over later ones.
    """
    b, t, n_experts = logits.shape
    probs = logits.softmax(dim=-1)
    weights, experts = probs.topk(top_k, dim=-1)
    if top_k > 1:
        # Mixtral-style: the chosen experts' weights sum to one. With one expert that would
        # be a constant 1 and the router would learn nothing from the loss (Switch keeps p).
        weights = weights / weights.sum(dim=-1, keepdim=True)
    chosen = F.one_hot(experts, n_experts).float()  # [b, t, k, E]
    # Sequence-level balance: E * sum_e f_e * P_e per sample, averaged over samples.
    f = chosen.sum(dim=(1, 2)) / (t * top_k)
    p = probs.mean(dim=1)
    aux = n_experts * (f * p).sum(dim=-1).mean()
    z = torch.logsumexp(logits, dim=-1).pow(2).mean()
    if capacity_factor > 0:
        capacity = math.ceil(capacity_factor * t * top_k / n_experts)
        by_priority = chosen.transpose(1, 2).reshape(b, top_k * t, n_experts)  # slot-major
        position = (by_priority.cumsum(dim=1) - 1) * by_priority
        fits = (position < capacity) & (by_priority > 0)
        keep = fits.any(dim=-1).reshape(b, top_k, t).transpose(1, 2)
    else:
        keep = torch.ones_like(experts, dtype=torch.bool)
    return weights, experts, keep, aux, z


class MoE(nn.Module):
    """Router plus experts `layers.<i>.mlp.experts.<j>` (this rank's share of them)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, ep_rank: int = 0, ep_size: int = 1,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.n_experts = cfg.n_experts
        self.top_k = cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_coef = cfg.moe_aux_loss_coef
        self.z_coef = cfg.moe_z_loss_coef
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.local = cfg.n_experts // ep_size
        first = ep_rank * self.local
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False, dtype=dtype)
        hidden = cfg.moe_ffn_dim or cfg.hidden_dim
        # Each expert is the dense MLP, so its parameters are named like one (w1, w2, w3).
        self.experts = nn.ModuleDict({str(j): FeedForward(cfg.dim, hidden, dtype=dtype)
                                      for j in range(first, first + self.local)})
        self.ep_group = None  # set by the runtime when ep_size > 1
        self.aux_scale = 1.0  # d(step loss) / d(this micro-batch's loss), set by the runtime
        self.stats = MoEStats()

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        logits = self.router(x).float()
        weights, experts, keep, aux, z = route(logits, self.top_k, self.capacity_factor)
        self.stats.add(torch.bincount(experts.flatten(), minlength=self.n_experts), (~keep).sum())

        # A slot is one kept (token, choice); slots are sorted by expert. slots[n, j] is the
        # slot of token n's j-th choice, -1 when the capacity dropped it.
        kept = keep.flatten().nonzero().squeeze(1)
        kept = kept[torch.argsort(experts.flatten()[kept], stable=True)]
        token = kept // self.top_k
        expert = experts.flatten()[kept]
        weight = weights.flatten()[kept]
        slots = torch.full((b * t * self.top_k,), -1, dtype=torch.int64, device=x.device)
        slots[kept] = torch.arange(kept.numel(), device=x.device)
        slots = slots.view(b * t, self.top_k)
        rows = permute(x.reshape(b * t, d), token, slots)
        counts = torch.bincount(expert, minlength=self.n_experts)
        if self.ep_size == 1:
            out_rows = self._run_experts(rows, host_wait.to_host(counts, "expert split sizes").tolist())
        else:
            out_rows = self._exchange_and_run(rows, counts)
        out = unpermute(out_rows, weight, token, slots).reshape(b, t, d)
        loss = self.aux_coef * aux + self.z_coef * z
        if torch.is_grad_enabled() and (self.aux_coef or self.z_coef):
            out = _AttachAuxLoss.apply(out, loss, self.aux_scale)
        return out

    def _run_experts(self, rows: Tensor, sizes: list[int]) -> Tensor:
        """Rows grouped by this rank's experts, in expert order; `sizes`: rows per local expert."""
        # Every expert runs, also on zero rows, so each one has a (zero) gradient and all
        # replicas reduce and step the same tensors.
        chunks = rows.split(sizes)
        return torch.cat([expert(chunk) for expert, chunk in zip(self.experts.values(), chunks)])

    def _exchange_and_run(self, rows: Tensor, counts: Tensor) -> Tensor:
        group, ep, local = self.ep_group, self.ep_size, self.local
        # Counts first: how many rows each rank will send to each of my experts.
        t0 = time.perf_counter()
        send_counts = counts.reshape(ep, local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
        # One wait per layer for every size the host needs: rows to send to and receive from
        # each rank, and rows per local expert.
        sizes = torch.cat([send_counts.sum(dim=1), recv_counts.sum(dim=1), recv_counts.sum(dim=0)])
        sizes = host_wait.to_host(sizes, "all-to-all split sizes").tolist()
        send, recv, per_expert = sizes[:ep], sizes[ep:2 * ep], sizes[2 * ep:]
        self.stats.alltoall_s += time.perf_counter() - t0
        received = _AllToAll.apply(rows, send, recv, group, self.stats)
        # Received rows are grouped by source rank, then expert; regroup by expert. The output
        # size is known on the host already, so repeat_interleave need not wait for the device.
        expert_of_row = torch.arange(local, device=rows.device).repeat(ep).repeat_interleave(
            recv_counts.flatten(), output_size=sum(recv))
        by_expert = torch.argsort(expert_of_row, stable=True)
        by_source = torch.argsort(by_expert)
        # A permutation is a permute whose every token has one slot: its inverse.
        out_local = self._run_experts(permute(received, by_expert, by_source.unsqueeze(1)), per_expert)
        back = permute(out_local, by_source, by_expert.unsqueeze(1))
        return _AllToAll.apply(back, recv, send, group, self.stats)
