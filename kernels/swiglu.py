"""SwiGLU on rows that hold gate and up side by side: silu(gate) * up, fused on CUDA.

The stacked experts compute gate and up with one grouped GEMM ([rows, 2h]); torch would
run the activation on the two strided halves, keep silu's output for backward and join
the halves' gradients with a copy. `swiglu` is one kernel each way (swiglu.cu) and keeps
only its input for backward.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from raypar.kernels import loader

SOURCE = "swiglu.cu"
THREADS = 256
MAX_BLOCKS = 8192  # blocks stride over the packs beyond this


def swiglu_reference(gu: Tensor) -> Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def _launch(name: str, tensors: tuple[Tensor, ...], rows: int, h: int, dtype: torch.dtype) -> None:
    width = loader.vector_width(dtype)
    vector = h % width == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)
    packs = rows * (h // width if vector else h)
    blocks = min(-(-packs // THREADS), MAX_BLOCKS)
    suffix = f"{loader.dtype_suffix(dtype)}_{'v' if vector else 's'}"
    loader.launch(SOURCE, f"{name}_{suffix}", blocks, THREADS, (*tensors, np.int64(rows), np.int64(h)))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu: Tensor) -> Tensor:
        gu = gu.contiguous()
        h = gu.shape[-1] // 2
        out = gu.new_empty((*gu.shape[:-1], h))
        ctx.save_for_backward(gu)
        if out.numel():
            _launch("swiglu_forward", (gu, out), out.numel() // h, h, gu.dtype)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (gu,) = ctx.saved_tensors
        grad = grad.contiguous()
        h = grad.shape[-1]
        grad_gu = torch.empty_like(gu)
        if grad.numel():
            _launch("swiglu_backward", (gu, grad, grad_gu), grad.numel() // h, h, gu.dtype)
        return grad_gu


def swiglu(gu: Tensor) -> Tensor:
    """silu(gate) * up for gu = [..., 2h] (gate in the first h columns, up in the last)."""
    if gu.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension ({gu.shape[-1]}) must hold gate and up, an even size")
    reason = loader.unavailable_reason(gu, SOURCE)
    if reason is None and loader.dtype_suffix(gu.dtype) is None:
        reason = f"{gu.dtype} is not fp32, bf16 or fp16"
    if reason is not None:
        if gu.is_cuda:
            loader.say_once(f"swiglu/{gu.dtype}", f"SwiGLU runs unfused in torch: {reason}")
        return swiglu_reference(gu)
    return _SwiGLU.apply(gu)
