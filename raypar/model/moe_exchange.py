"""How an MoE layer's rows travel to their experts' ranks and back (expert parallelism).

Two ways, chosen by `runtime.moe_alltoall`:

- exact (`AllToAll`): the host reads every rank's split sizes (one wait per layer) and
  rows travel with variable split sizes.
- padded (the default; `send_rows` ... `return_rows`): every rank sends each peer a block
  of `n` rows (n: its slot count, which bounds what routing can send one rank), its routed
  rows first, then padding. Rows past n in each block carry the block's per-expert counts,
  so the receiver lays out its rows from what arrived, with no host wait and no separate
  exchange of counts.

The padded exchange is four autograd functions, each one step of the path and its mirror
in backward: `send_rows` gathers the rows into blocks and queues the all-to-all;
`receive_rows` waits for it and gathers the received rows into expert order; `send_back`
gathers the experts' output back into block order and queues the return; `return_rows`
waits and sums each token's rows with its router weights. In backward the gradient's
exchange is queued where forward waited and waited for where forward queued it, so work
between the two runs while rows travel (on the GPU the exchange runs on the
communicator's stream). In a whole backward that work is the weight gradients left by the
layers since the last exchange (`split_backward.run_while_exchanging`); without them the
exchange is waited for right after it leaves.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from raypar.kernels.moe_layout import padded_recv_layout, padded_send_layout
from raypar.kernels.moe_permute import combine_rows, gather_rows, row_dot
from raypar.model.split_backward import run_while_exchanging

COUNT_BYTES = 8  # an int64 count


class Exchange:
    """One all-to-all of equal blocks: `queue` starts it and returns its output buffer,
    `wait` makes the current stream wait for it. `stats` (an MoE layer's MoEStats) counts
    bytes sent to other ranks and host time spent here. Backward's exchanges go over
    `backward_group` (the same ranks, another communicator) when there is one."""

    def __init__(self, group, ep: int, stats, backward_group=None) -> None:
        self.group, self.ep, self.stats = group, ep, stats
        self.backward_group = backward_group if backward_group is not None else group
        self.work = None

    def queue(self, x: Tensor, backward: bool = False) -> Tensor:
        t0 = time.perf_counter()
        x = x.contiguous()
        out = torch.empty_like(x)
        group = self.backward_group if backward else self.group
        self.work = dist.all_to_all_single(out, x, group=group, async_op=True)
        self.stats.alltoall_bytes += x.numel() * x.element_size() * (self.ep - 1) // self.ep
        self.stats.alltoall_s += time.perf_counter() - t0
        return out

    def wait(self) -> None:
        t0 = time.perf_counter()
        self.work.wait()
        self.work = None
        self.stats.alltoall_s += time.perf_counter() - t0


def count_rows(local: int, row: Tensor) -> int:
    """Rows per block that carry `local` int64 counts, for rows like `row` [*, d]."""
    row_bytes = row.shape[-1] * row.element_size()
    return -(-local * COUNT_BYTES // row_bytes)


def _write_counts(rows: Tensor, counts: Tensor, n: int) -> None:
    """Put counts [ep, local] into the rows past n of each of rows' ep blocks, as bytes."""
    ep, local = counts.shape
    blocks = rows.view(torch.uint8).view(ep, rows.shape[0] // ep, -1)[:, n:]  # [ep, c, row bytes]
    raw = F.pad(counts.contiguous().view(torch.uint8), (0, blocks[0].numel() - local * COUNT_BYTES))
    blocks.copy_(raw.view(blocks.shape))


def _read_counts(rows: Tensor, ep: int, n: int, local: int) -> Tensor:
    """`_write_counts`'s counts [ep, local] back from received rows."""
    blocks = rows.view(torch.uint8).view(ep, rows.shape[0] // ep, -1)[:, n:]
    return blocks.reshape(ep, -1)[:, :local * COUNT_BYTES].contiguous().view(torch.int64)


class _SendRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, token: Tensor, slots: Tensor, counts: Tensor, n: int, exchange: Exchange) -> Tensor:
        ctx.save_for_backward(slots)
        ctx.tokens, ctx.exchange = x.shape[0], exchange
        rows = gather_rows(x, token)
        _write_counts(rows, counts, n)
        return exchange.queue(rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.exchange.wait()
        (slots,) = ctx.saved_tensors
        return combine_rows(grad, slots, None, ctx.tokens), None, None, None, None, None


class _ReceiveRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, received: Tensor, n: int, local: int, align: int, exchange: Exchange):
        exchange.wait()
        ep = exchange.ep
        recv_counts = _read_counts(received, ep, n, local)
        # Count rows sit past every block's routed rows: the layout takes them for padding.
        row_of, ends, source, back_slots, _ = padded_recv_layout(recv_counts, received.shape[0] // ep, align)
        ctx.save_for_backward(row_of)
        ctx.rows, ctx.exchange = received.shape[0], exchange
        ctx.mark_non_differentiable(ends, row_of, back_slots)
        return gather_rows(received, source), ends, row_of, back_slots

    @staticmethod
    def backward(ctx, grad: Tensor, *_):
        (row_of,) = ctx.saved_tensors
        out = ctx.exchange.queue(combine_rows(grad, row_of.unsqueeze(1), None, ctx.rows), backward=True)
        run_while_exchanging()
        return out, None, None, None, None


class _SendBack(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, row_of: Tensor, back_slots: Tensor, exchange: Exchange) -> Tensor:
        ctx.save_for_backward(back_slots)
        ctx.rows, ctx.exchange = y.shape[0], exchange
        return exchange.queue(gather_rows(y, row_of))

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.exchange.wait()
        (back_slots,) = ctx.saved_tensors
        return combine_rows(grad, back_slots, None, ctx.rows), None, None, None


class _ReturnRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, returned: Tensor, weight: Tensor, row_weight: Tensor, token: Tensor, slots: Tensor,
                exchange: Exchange) -> Tensor:
        exchange.wait()
        ctx.save_for_backward(returned, row_weight, token, slots)
        ctx.exchange = exchange
        return combine_rows(returned, slots, row_weight, slots.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        returned, row_weight, token, slots = ctx.saved_tensors
        grad = grad.contiguous()
        grad_weight = None
        if ctx.needs_input_grad[1]:
            # d out[t] / d weight of slot (t, j) = <grad[t], returned row of that slot>;
            # row_weight is `weight` by sent row, so its gradient maps back through slots.
            by_row = row_dot(grad, token, returned)
            grad_weight = torch.where(slots >= 0, by_row[slots.clamp(min=0)], 0.0).flatten()
        # Every rank enters every exchange: the rows' gradient always travels.
        out = ctx.exchange.queue(gather_rows(grad, token, row_weight), backward=True)
        run_while_exchanging()
        return out, grad_weight, None, None, None, None


class PaddedPiece:
    """One piece of a layer's tokens on its way through the padded exchange."""

    def __init__(self, x: Tensor, sorted_expert: Tensor, order: Tensor, weight: Tensor, send_counts: Tensor,
                 k: int, group, stats, backward_group=None) -> None:
        """x [tokens, d]; sorted_expert, order: the piece's slots sorted by expert (dropped
        ones as expert E, last); weight [tokens * k] router weights by slot; send_counts
        [ep, local] slots for each rank's experts; backward_group: see `Exchange`."""
        ep, self.local = send_counts.shape
        self.n = order.numel()
        block = self.n + count_rows(self.local, x)
        self.slots, self.token, self.row_weight = padded_send_layout(sorted_expert, order, send_counts,
                                                                     weight.detach(), k, block)
        self.weight = weight
        self.there = Exchange(group, ep, stats, backward_group)
        self.back = Exchange(group, ep, stats, backward_group)
        self.received = _SendRows.apply(x, self.token, self.slots, send_counts, self.n, self.there)

    def receive(self, align: int) -> tuple[Tensor, Tensor]:
        """The rows this rank's experts run, grouped by expert, and the groups' int32 ends."""
        rows, ends, self.row_of, self.back_slots = _ReceiveRows.apply(self.received, self.n, self.local, align,
                                                                     self.there)
        return rows, ends

    def send_back(self, y: Tensor) -> None:
        """Return the experts' output (grouped as `receive` gave it) to the rows' ranks."""
        self.returned = _SendBack.apply(y, self.row_of, self.back_slots, self.back)

    def combine(self) -> Tensor:
        """[tokens, d]: each token's returned rows summed with its router weights."""
        return _ReturnRows.apply(self.returned, self.weight, self.row_weight, self.token, self.slots, self.back)


class AllToAll(torch.autograd.Function):
    """Rows to ranks by split sizes (the exact exchange); backward sends the gradients back
    the same way."""

    @staticmethod
    def forward(ctx, x: Tensor, send: list[int], recv: list[int], group, me: int, stats) -> Tensor:
        ctx.send, ctx.recv, ctx.group, ctx.me, ctx.stats = send, recv, group, me, stats
        t0 = time.perf_counter()
        out = x.new_empty((sum(recv), x.shape[1]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        stats.alltoall_bytes += _remote_bytes(send, me, x)
        stats.alltoall_s += time.perf_counter() - t0
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        t0 = time.perf_counter()
        out = g.new_empty((sum(ctx.send), g.shape[1]))
        dist.all_to_all_single(out, g.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        ctx.stats.alltoall_bytes += _remote_bytes(ctx.recv, ctx.me, g)
        ctx.stats.alltoall_s += time.perf_counter() - t0
        return out, None, None, None, None, None


def _remote_bytes(splits: list[int], me: int, x: Tensor) -> int:
    # `me` is the caller's rank in the group (its ep rank), not dist.get_rank(group): that
    # lookup costs more host time than the all-to-all's launch.
    return (sum(splits) - splits[me]) * x.shape[1] * x.element_size()
