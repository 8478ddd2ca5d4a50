"""Mixture-of-experts MLP with optional expert parallelism.

Routing: softmax over E experts, top-k, weights renormalised over the chosen k (for
k > 1; top-1 keeps the probability as its weight, as Switch does). The
load-balancing loss and the token capacity are defined per sequence (sample), not per
micro-batch, so the loss and the dropped tokens do not depend on how a batch is split
into micro-batches or data-parallel replicas: any grid computes the same model.

With expert parallelism the `ep` workers of a pipeline stage each hold E/ep experts and
different tokens; tokens travel to their expert's worker and back by all-to-all over the
stage's ep group (`moe_exchange`). Every rank enters every collective, also with zero rows
to send or receive.
"""
from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from raypar import host_wait
from raypar.config import ModelConfig
from raypar.kernels import permute, unpermute
from raypar.kernels.moe_layout import invert_rows
from raypar.model.experts import GroupedExperts, group_alignment, grouped_layout
from raypar.model.moe_exchange import AllToAll, PaddedPiece
from raypar.model.split_backward import Linear
from raypar.model.tensor_parallel import TensorParallel


class MoEStats:
    """Per-step counters of one MoE layer, kept on the device until read.

    The device counters accumulate in place into tensors that live as long as the layer, so
    a CUDA graph that captured a forward keeps counting when replayed (`runtime/graphs.py`).
    """

    def __init__(self) -> None:
        self.routed: Tensor | None = None  # assignments per global expert (before capacity)
        self.dropped: Tensor | None = None  # assignments dropped by the capacity limit
        self.reset()

    def reset(self) -> None:
        for counter in (self.routed, self.dropped):
            if counter is not None:
                counter.zero_()
        self.alltoall_bytes = 0  # bytes this rank sent to other ranks, forward and backward
        # Host time in the exchanges (counts and rows, forward and backward). On GPU this
        # is launch time plus the waits the split sizes force, not kernel time.
        self.alltoall_s = 0.0

    def saved(self) -> tuple:
        """Every counter as it is now, for `restore`."""
        return (None if self.routed is None else self.routed.clone(),
                None if self.dropped is None else self.dropped.clone(), self.alltoall_bytes, self.alltoall_s)

    def restore(self, saved: tuple) -> None:
        """Put the counters back to `saved`, the device ones in place (a captured graph adds
        into those tensors); one made since then goes back to zero."""
        routed, dropped, self.alltoall_bytes, self.alltoall_s = saved
        for counter, value in ((self.routed, routed), (self.dropped, dropped)):
            if counter is not None and value is not None:
                counter.copy_(value)
            elif counter is not None:
                counter.zero_()

    def add(self, routed: Tensor, dropped: Tensor | None) -> None:
        """dropped: None when nothing can be (dropless routing)."""
        if self.routed is None:
            self.routed = torch.zeros_like(routed)
        self.routed.add_(routed.detach())
        if dropped is not None:
            if self.dropped is None:
                self.dropped = torch.zeros_like(dropped)
            self.dropped.add_(dropped.detach())


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


def route(logits: Tensor, top_k: int, capacity_factor: float, z_loss: bool = True, bias: Tensor | None = None):
    """Top-k routing for logits [b, t, E] (fp32).

    Returns weights [b, t, k], expert ids [b, t, k], keep mask [b, t, k], the
    load-balancing loss and the z-loss (0 without `z_loss`: logsumexp costs more host
    time than the rest of the router). The capacity is per sample and expert,
    ceil(capacity_factor * t * k / E); first choices take precedence over second ones,
    earlier tokens over later ones. `bias` [E] (`update_expert_bias`) moves which experts
    are chosen, not their weights.
    """
    b, t, n_experts = logits.shape
    probs = logits.softmax(dim=-1)
    if bias is None:
        weights, experts = probs.topk(top_k, dim=-1)
    else:
        experts = (probs + bias.to(probs.dtype)).topk(top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
    if top_k > 1:
        # Mixtral-style: the chosen experts' weights sum to one. With one expert that would
        # be a constant 1 and the router would learn nothing from the loss (Switch keeps p).
        weights = weights / weights.sum(dim=-1, keepdim=True)
    chosen = F.one_hot(experts, n_experts).float()  # [b, t, k, E]
    # Sequence-level balance: E * sum_e f_e * P_e per sample, averaged over samples.
    f = chosen.sum(dim=(1, 2)) / (t * top_k)
    p = probs.mean(dim=1)
    aux = n_experts * (f * p).sum(dim=-1).mean()
    z = torch.logsumexp(logits, dim=-1).pow(2).mean() if z_loss else logits.new_zeros(())
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
    """Router plus this rank's share of the experts, stacked (`layers.<i>.mlp.experts`)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, ep_rank: int = 0, ep_size: int = 1,
                 dtype: torch.dtype | None = None, tp: TensorParallel | None = None,
                 placement: Sequence[int] | None = None) -> None:
        """`placement`: the expert in each slot (`raypar.expert_placement`); ep worker r holds
        slots r x E/ep onwards. None, or with ep=1: expert e in slot e."""
        super().__init__()
        self.tp = tp
        self.n_experts = cfg.n_experts
        self.top_k = cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_coef = cfg.moe_aux_loss_coef
        self.z_coef = cfg.moe_z_loss_coef
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.local = cfg.n_experts // ep_size
        self.router = Linear(cfg.dim, cfg.n_experts, bias=False, dtype=dtype)
        identity = list(range(cfg.n_experts))
        self.slot_experts = list(placement) if placement is not None and ep_size > 1 else identity
        if sorted(self.slot_experts) != identity:
            raise ValueError(f"layer {layer_id}: placement {self.slot_experts} is not an order of the expert ids "
                             f"0..{cfg.n_experts - 1}")
        self.placed = self.slot_experts != identity
        mine = self.slot_experts[ep_rank * self.local:(ep_rank + 1) * self.local]
        self.experts = GroupedExperts(cfg.dim, cfg.moe_ffn_dim or cfg.hidden_dim, mine, dtype=dtype)
        # Expert id -> slot, on the device (a CUDA graph reads it): derived, not saved.
        self.register_buffer("slot_of", torch.empty(0, dtype=torch.int64), persistent=False)
        if not self.slot_of.is_meta:  # a meta build fills it after allocating (`reset_buffers`)
            self.reset_buffers()
        self.ep_group = None  # set by the runtime when ep_size > 1
        # Another communicator over ep_group's ranks for the padded exchange's backward
        # (runtime.moe_microbatch_overlap), set by the runtime; None: ep_group.
        self.ep_group_backward = None
        self.padded_alltoall = False  # set by the runtime (runtime.moe_alltoall)
        self.chunks = 1  # pieces of a padded exchange that overlap (runtime.moe_chunks)
        self.aux_scale = 1.0  # d(step loss) / d(this micro-batch's loss), set by the runtime
        self.stats = MoEStats()
        # model.moe_bias_update_rate: the experts' routing biases, moved after each step by the
        # runtime (`update_expert_bias`); run state the driver keeps, not a parameter.
        self.bias_rate = cfg.moe_bias_update_rate
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, dtype=torch.float64, device=self.slot_of.device),
                             persistent=False)

    def reset_buffers(self, device: torch.device | str | None = None) -> None:
        slot_of = [0] * self.n_experts
        for slot, expert in enumerate(self.slot_experts):
            slot_of[expert] = slot
        self.slot_of = torch.tensor(slot_of, dtype=torch.int64, device=device or self.slot_of.device)
        if hasattr(self, "expert_bias"):  # not yet while __init__ runs; a fresh build's biases are zero
            self.expert_bias = torch.zeros(self.n_experts, dtype=torch.float64, device=self.slot_of.device)

    def forward(self, x: Tensor) -> Tensor:
        tp = self.tp
        if tp is None or not tp.sequence:
            return self._route_and_run(x, self.aux_scale)
        # Sequence parallelism: routing, capacity and the aux loss are over the micro-batch's
        # tokens, so every tp rank runs the layer on the gathered sequence and keeps its slice.
        # Each rank seeds its share of the aux loss's gradient: summed over tp (the router's
        # and experts' gradients are, like the norms'), the whole of it.
        return tp.whole_out(self._route_and_run(tp.whole_in(x), self.aux_scale / tp.size))

    def _route_and_run(self, x: Tensor, aux_scale: float) -> Tensor:
        b, t, d = x.shape
        n, k = b * t * self.top_k, self.top_k
        logits = self.router(x).float()
        weights, experts, keep, aux, z = route(logits, k, self.capacity_factor, z_loss=self.z_coef > 0,
                                               bias=self.expert_bias if self.bias_rate > 0 else None)
        expert, weight = experts.flatten(), weights.flatten()
        routed = _count(expert, self.n_experts)
        if self.placed:
            # From here on, where each choice's row goes: its expert's slot.
            expert = self.slot_of[expert]
        # A forward recomputed in the backward (runtime.recompute) routes the same rows again:
        # the step has counted them.
        counted = torch._C._current_graph_task_id() != -1
        # Slots the capacity dropped sort after all others (as expert n_experts), so every
        # size below is known on the host without reading the device.
        if self.capacity_factor > 0:
            if not counted:
                self.stats.add(routed, (~keep).sum())
            expert = torch.where(keep.flatten(), expert, self.n_experts)
            weight = torch.where(keep.flatten(), weight, 0.0)  # no gradient to the router through a drop
            counts = None
        else:
            if not counted:
                self.stats.add(routed, None)
            counts = _count(expert, self.n_experts) if self.placed else routed
        if self.ep_size > 1 and self.padded_alltoall:
            out = self._exchange_padded(x.reshape(b * t, d), expert, weight, counts).reshape(b, t, d)
        else:
            if counts is None:
                counts = _count(expert, self.n_experts + 1)[:self.n_experts]
            sorted_expert, order = torch.sort(expert, stable=True)
            if self.ep_size == 1:
                # slots[token, j]: the row of token's j-th choice, -1 when dropped.
                position, ends, rows_n = grouped_layout(sorted_expert, counts, group_alignment(x))
                slots = _slots(order, position, keep, n)
                token = x.new_zeros(rows_n, dtype=torch.int64).index_copy_(0, position, order // k)
                row_weight = weight.new_zeros(rows_n).index_copy(0, position, weight[order])
                rows = permute(x.reshape(b * t, d), token, slots)
                out = unpermute(self.experts(rows, ends), row_weight, token, slots).reshape(b, t, d)
            else:
                out = self._exchange_and_run(x.reshape(b * t, d), order, counts, weight, keep).reshape(b, t, d)
        loss = self.aux_coef * aux + self.z_coef * z if self.z_coef else self.aux_coef * aux
        if torch.is_grad_enabled() and (self.aux_coef or self.z_coef):
            out = _AttachAuxLoss.apply(out, loss, aux_scale)
        return out

    def _exchange_and_run(self, x: Tensor, order: Tensor, counts: Tensor, weight: Tensor, keep: Tensor) -> Tensor:
        """Send each kept slot's row to its expert's rank, run the experts there, send the
        results back and sum them per token."""
        group, ep, k = self.ep_group, self.ep_size, self.top_k
        n = order.numel()
        # The host needs the rows to send to and receive from each rank (one wait per
        # layer), and reads them after the rows are gathered, so that work is queued meanwhile.
        send_counts, recv_counts = self._exchange_counts(counts)
        sizes = host_wait.HostCopy(torch.cat([send_counts.sum(dim=1), recv_counts.sum(dim=1)]))
        slots = _slots(order, torch.arange(n, device=x.device), keep, n)
        token = order // k
        rows = permute(x, token, slots)
        t0 = time.perf_counter()
        sizes = sizes.result("all-to-all split sizes").tolist()
        send, recv = sizes[:ep], sizes[ep:]
        self.stats.alltoall_s += time.perf_counter() - t0
        kept = sum(send)  # the dropped slots' rows sort after these and stay here
        received = AllToAll.apply(rows[:kept], send, recv, group, self.ep_rank, self.stats)
        out_local, back = self._run_received(received, recv_counts, sum(recv))
        returned = AllToAll.apply(back(out_local), recv, send, group, self.ep_rank, self.stats)
        return unpermute(returned, weight[order[:kept]], token[:kept], slots)

    def _exchange_padded(self, x: Tensor, expert: Tensor, weight: Tensor, counts: Tensor | None) -> Tensor:
        """`_exchange_and_run` without a host wait (`moe_exchange.PaddedPiece`), in `chunks`
        pieces of the tokens whose exchanges overlap the other pieces' work.

        All pieces' rows leave before any piece's experts run, and each piece's results
        leave as soon as its experts are done, so the device computes one piece while
        another's rows travel (or wait for the peer). `counts`: slots per expert of the
        whole micro-batch when known (dropless), else counted per piece.
        """
        k, tokens, shape = self.top_k, x.shape[0], (self.ep_size, self.local)
        chunks = max(1, min(self.chunks, tokens))
        bounds = [tokens * i // chunks for i in range(chunks + 1)]
        pieces = []
        for a, b in zip(bounds, bounds[1:]):
            ids = expert[a * k:b * k]
            piece_counts = counts if chunks == 1 and counts is not None else _count(ids, self.n_experts + 1)
            sorted_ids, order = torch.sort(ids, stable=True)
            pieces.append(PaddedPiece(x[a:b], sorted_ids, order, weight[a * k:b * k],
                                      piece_counts[:self.n_experts].view(shape), k, self.ep_group, self.stats,
                                      self.ep_group_backward))
        for piece in pieces:
            piece.send_back(self.experts(*piece.receive(group_alignment(x))))
        out = [piece.combine() for piece in pieces]
        return out[0] if chunks == 1 else torch.cat(out)

    def _exchange_counts(self, counts: Tensor) -> tuple[Tensor, Tensor]:
        """counts [E] -> [ep, local]: rows this rank sends to each rank's experts, and
        receives from each rank for its own experts."""
        t0 = time.perf_counter()
        send_counts = counts.reshape(self.ep_size, self.local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.ep_group)
        self.stats.alltoall_s += time.perf_counter() - t0
        return send_counts, recv_counts

    def _run_received(self, received: Tensor, recv_counts: Tensor, r: int):
        """Run the experts on rows grouped by source rank, then local expert; returns their
        output (grouped by expert) and the function that puts it back in received order."""
        ep, local = self.ep_size, self.local
        # The output size is known on the host, so repeat_interleave need not wait for the device.
        expert_of_row = torch.arange(local, device=received.device).repeat(ep).repeat_interleave(
            recv_counts.flatten(), output_size=r)
        by_expert = torch.argsort(expert_of_row, stable=True)
        align = group_alignment(received) if r else 1  # padding rows copy row 0: there must be one
        position, ends, rows_n = grouped_layout(expert_of_row[by_expert], recv_counts.sum(dim=0), align)
        row_of = torch.empty_like(position).index_copy_(0, by_expert, position)  # received row -> expert row
        # Input rows no received row fills copy row 0 and are never read back. A permutation
        # is a permute whose every token has one slot: its inverse.
        source, back_slots = invert_rows(row_of, rows_n)
        out_local = self.experts(permute(received, source, row_of.unsqueeze(1)), ends)
        return out_local, lambda y: permute(y, row_of, back_slots)


def update_expert_bias(bias: Tensor, counts: Tensor, rate: float) -> None:
    """One step of loss-free balancing, in place: `bias` [..., E] (float64) moves by `rate`
    towards an even load of `counts` [..., E] (rows routed to each expert over a whole step),
    up for an expert below the mean, down above it, less the mean move so the biases keep
    summing to what they did.

    Exact in float64 for any device: counts and signs are whole numbers, so the only
    roundings are one product and one sum, the same on every worker and in the reference.
    """
    n_experts = counts.shape[-1]
    c = counts.to(torch.float64)
    below = torch.sign(c.sum(dim=-1, keepdim=True) - n_experts * c)  # +1 under the mean, -1 over
    bias.add_((n_experts * below - below.sum(dim=-1, keepdim=True)) * (rate / n_experts))


def _count(ids: Tensor, n: int) -> Tensor:
    """How often each of 0 .. n-1 occurs in `ids`. Not torch.bincount: on a GPU it reads the
    largest id on the host to size its output, a wait per call."""
    return torch.zeros(n, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def _slots(order: Tensor, position: Tensor, keep: Tensor, n: int) -> Tensor:
    """[tokens, k]: the row of each (token, choice), -1 where the capacity dropped it."""
    slots = torch.empty(n, dtype=torch.int64, device=order.device).index_copy_(0, order, position)
    return torch.where(keep.flatten(), slots, -1).view(-1, keep.shape[-1])
