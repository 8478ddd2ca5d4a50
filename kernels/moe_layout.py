"""Row layouts of the MoE padded all-to-all: one kernel each side, or their torch references.

The sender puts every kept slot's row into the block of its expert's rank (n rows per
rank, padding after the routed rows); the receiver places each received row in its local
expert's group of the grouped-GEMM input (groups start on multiples of `align`) and
inverts that placement. In torch each side is some forty small ops, whose launches, not
their kernels, bounded an MoE step on the GPU; each kernel is one launch.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from raypar.kernels import loader

SOURCE = "moe_layout.cu"
MAX_EXPERTS = 1024  # MAX_EXPERTS in moe_layout.cu: the count tables live in shared memory
THREADS = 256


def _kernel_reason(t: Tensor, n_experts: int) -> str | None:
    reason = loader.unavailable_reason(t, SOURCE)
    if reason is None and n_experts > MAX_EXPERTS:
        reason = f"{n_experts} experts; the layout kernels take up to {MAX_EXPERTS}"
    return reason


def _blocks(threads: int) -> int:
    return max(1, -(-threads // THREADS))


def padded_send_layout(sorted_expert: Tensor, order: Tensor, send_counts: Tensor, weight: Tensor,
                       k: int, block: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Sender side for n = order.numel() slots and ep = send_counts.shape[0] ranks.

    sorted_expert [n]: slots' experts in sorted order (E or more: dropped); order [n]: the
    sort's permutation of slot ids (slot = token * k + choice); send_counts [ep, local]
    slots per expert; weight [n] fp32 router weights by slot id; block (>= n, default n):
    rows per rank. Returns slots [n / k, k] (the sent row of each slot, -1 when dropped),
    token [ep * block] and row_weight [ep * block] (each sent row's token and weight; 0 for
    padding rows).
    """
    ep, local = send_counts.shape
    n = order.numel()
    block = n if block is None else block
    if block < n:
        raise ValueError(f"padded_send_layout: block {block} < {n} slots: a rank may receive every slot")
    if _kernel_reason(order, ep * local) is not None:
        return _send_reference(sorted_expert, order, send_counts, weight, k, block)
    dev = order.device
    slots = torch.empty(n, dtype=torch.int64, device=dev)
    token = torch.empty(ep * block, dtype=torch.int64, device=dev)
    row_weight = torch.empty(ep * block, dtype=torch.float32, device=dev)
    loader.launch(SOURCE, "padded_send_layout", _blocks(ep * block), THREADS,
                  (sorted_expert.contiguous(), order.contiguous(), send_counts.contiguous(),
                   weight.float().contiguous(), slots, token, row_weight,
                   np.int64(n), np.int64(block), np.int32(k), np.int32(ep), np.int32(local)))
    return slots.view(-1, k), token, row_weight


def padded_recv_layout(recv_counts: Tensor, n: int, align: int) -> tuple[Tensor, Tensor, Tensor, Tensor, int]:
    """Receiver side for blocks of n rows from each of ep = recv_counts.shape[0] ranks.

    recv_counts [ep, local]: rows for each local expert in each source's block. Returns
    position [ep * n] (where each received row goes in the expert input), the groups'
    int32 ends, source [rows_n] (the received row at each expert row, 0 in gaps),
    back_slots [rows_n, 1] (the same, -1 in gaps) and rows_n, known on the host.
    """
    ep, local = recv_counts.shape
    rows_n = ep * n + local * (align - 1)
    if _kernel_reason(recv_counts, ep * local) is not None:
        return (*_recv_reference(recv_counts, n, align, rows_n), rows_n)
    dev = recv_counts.device
    position = torch.empty(ep * n, dtype=torch.int64, device=dev)
    ends = torch.empty(local, dtype=torch.int32, device=dev)
    source = torch.empty(rows_n, dtype=torch.int64, device=dev)
    back = torch.empty(rows_n, dtype=torch.int64, device=dev)
    loader.launch(SOURCE, "padded_recv_layout", _blocks(max(ep * n, rows_n, local)), THREADS,
                  (recv_counts.contiguous(), position, ends, source, back,
                   np.int64(n), np.int32(ep), np.int32(local), np.int32(align), np.int64(rows_n)))
    return position, ends, source, back.unsqueeze(1), rows_n


def invert_rows(row_of: Tensor, rows_n: int) -> tuple[Tensor, Tensor]:
    """For rows placed at `row_of` in an [rows_n] layout: the row at each place (0 where
    none is) and the same as [rows_n, 1] slots (-1 where none is)."""
    ids = torch.arange(row_of.numel(), device=row_of.device)
    source = torch.zeros(rows_n, dtype=torch.int64, device=row_of.device).index_copy_(0, row_of, ids)
    back = torch.full((rows_n, 1), -1, dtype=torch.int64, device=row_of.device).index_copy_(
        0, row_of, ids.unsqueeze(1))
    return source, back


def _send_reference(sorted_expert: Tensor, order: Tensor, send_counts: Tensor, weight: Tensor,
                    k: int, block: int) -> tuple[Tensor, Tensor, Tensor]:
    ep, local = send_counts.shape
    n, dev = order.numel(), order.device
    rows = ep * block
    # Sorted slot i goes to rank r = its expert // local, row i - (r's first slot) of block r;
    # dropped slots (expert E) to a spare row past the blocks.
    per_rank = send_counts.sum(dim=1)
    rank = (sorted_expert // local).clamp(max=ep)
    first = torch.cat([per_rank.cumsum(0) - per_rank, per_rank.new_zeros(1)])
    sent_row = torch.where(rank < ep, rank * block + torch.arange(n, device=dev) - first[rank], rows)
    slots = torch.empty(n, dtype=torch.int64, device=dev).index_copy_(0, order, sent_row)
    slots = torch.where(slots < rows, slots, -1).view(-1, k)
    token = torch.zeros(rows + 1, dtype=torch.int64, device=dev).index_copy_(0, sent_row, order // k)[:-1]
    row_weight = torch.zeros(rows + 1, dtype=torch.float32, device=dev).index_copy_(
        0, sent_row, weight.float()[order])[:-1]
    return slots, token, row_weight


def _recv_reference(recv_counts: Tensor, n: int, align: int, rows_n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    ep, local = recv_counts.shape
    dev = recv_counts.device
    j = torch.arange(n, device=dev).repeat(ep)  # row within its source's block
    source_rank = torch.arange(ep, device=dev).repeat_interleave(n)
    ends_in_block = recv_counts.cumsum(dim=1)  # [ep, local]
    expert = torch.searchsorted(ends_in_block, j.view(ep, n), right=True).flatten()  # local: padding
    routed = expert < local
    e = expert.clamp(max=local - 1)
    per_expert = recv_counts.sum(dim=0)
    padded = (per_expert + align - 1) // align * align
    group_start = padded.cumsum(0) - padded
    before_source = recv_counts.cumsum(dim=0) - recv_counts  # rows of e from lower ranks
    in_block_start = ends_in_block - recv_counts
    position = group_start[e] + before_source[source_rank, e] + j - in_block_start[source_rank, e]
    # Padding rows go after every group, where no GEMM reads them.
    position = torch.where(routed, position, padded.sum() + (~routed).cumsum(0) - 1)
    source, back = invert_rows(position, rows_n)
    return position, padded.cumsum(0).to(torch.int32), source, back
