"""Rotary position embedding of q or k in their projections' layout, fused on CUDA.

The attention rotates q and k as [b, t, heads, head_dim] (contiguous views of the
projections) with `rope_tables`' cos and signed sin tables. Unfused, torch runs broadcast
multiplies (not vectorised), a roll copy and adds: eight elementwise launches for a
forward and backward. `rope` is one kernel each way (rope.cu), and backward keeps only
the tables, not x.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from raypar.kernels import loader

SOURCE = "rope.cu"
THREADS = 256
MAX_BLOCKS = 8192  # blocks stride over the packs beyond this


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [..., head_dim] rotated by cos and signed sin tables already shaped to broadcast over x.

    The formula the model ran before the kernel, for any layout; `rope(x, cos, sin)` on
    CPU is this with the tables' first t rows viewed as [t, 1, head_dim].
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def _tables(x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The tables' first t rows as [t, 1, hd]; raises ValueError on shapes outside the contract."""
    if x.dim() != 4:
        raise ValueError(f"rope: x must be [b, t, heads, head_dim], got shape {tuple(x.shape)}")
    t, hd = x.shape[1], x.shape[3]
    if hd % 2:
        raise ValueError(f"rope: head_dim ({hd}) must be even: element i rotates with i + head_dim/2")
    for name, table in (("cos", cos), ("sin", sin)):
        ok = table.dim() in (2, 3) and table.shape[-1] == hd and table.shape[0] >= t
        if not ok or (table.dim() == 3 and table.shape[1] != 1):
            raise ValueError(f"rope: {name} must be [T, {hd}] or [T, 1, {hd}] with T >= t = {t} "
                             f"for x of shape {tuple(x.shape)}, got {tuple(table.shape)}")
        if table.device != x.device:
            raise ValueError(f"rope: {name} is on {table.device}, x on {x.device}")
    return cos[:t].reshape(t, 1, hd), sin[:t].reshape(t, 1, hd)


def _launch(name: str, src: Tensor, cos: Tensor, sin: Tensor, out: Tensor) -> None:
    b, t, heads, hd = src.shape
    width = loader.vector_width(src.dtype)
    tensors = (src, cos, sin, out)
    vector = (hd // 2) % width == 0 and all(a.data_ptr() % 16 == 0 for a in tensors)
    rows = b * t * heads
    packs = rows * (hd // 2 // width if vector else hd // 2)
    blocks = min(-(-packs // THREADS), MAX_BLOCKS)
    suffix = f"{loader.dtype_suffix(src.dtype)}_{'v' if vector else 's'}"
    loader.launch(SOURCE, f"{name}_{suffix}", blocks, THREADS,
                  (*tensors, np.int64(rows), np.int64(heads), np.int64(t), np.int64(hd)))


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        ctx.save_for_backward(cos, sin)  # the rotation is linear in x: backward needs no activation
        if x.numel():
            _launch("rope_forward", x, cos, sin, out)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        cos, sin = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = torch.empty_like(grad)
        if grad.numel():
            _launch("rope_backward", grad, cos, sin, grad_x)
        return grad_x, None, None


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [b, t, heads, head_dim] rotated by `rope_tables`' cos and signed sin tables.

    cos and sin: [T, head_dim] or [T, 1, head_dim] with T >= t; position s of x uses row s
    of the tables (longer tables are sliced to their first t rows). head_dim must be even.
    The kernel runs for fp32/bf16/fp16 x on CUDA with tables in x's dtype that need no
    gradient; anything else runs `rope_reference` (said once when x is on CUDA).
    Returns a contiguous tensor shaped like x.
    """
    cos, sin = _tables(x, cos, sin)
    reason = loader.unavailable_reason(x, SOURCE)
    if reason is None and loader.dtype_suffix(x.dtype) is None:
        reason = f"{x.dtype} is not fp32, bf16 or fp16"
    if reason is None and (cos.dtype != x.dtype or sin.dtype != x.dtype):
        reason = f"the tables are {cos.dtype}/{sin.dtype}, x is {x.dtype} (cast them once to x's dtype)"
    if reason is None and (cos.requires_grad or sin.requires_grad):
        reason = "cos/sin require grad, the kernel gives x's gradient only"
    if reason is not None:
        if x.is_cuda:
            loader.say_once(f"rope/{reason}", f"rotary embedding runs unfused in torch: {reason}")
        return rope_reference(x, cos, sin)
    return _Rope.apply(x, cos.contiguous(), sin.contiguous())
