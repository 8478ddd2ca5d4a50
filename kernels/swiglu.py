"""SwiGLU, silu(gate) * up, fused on CUDA: one kernel each way (swiglu.cu).

Two layouts of gate and up reach the same kernels:
- `swiglu(gu)`: the stacked experts compute gate and up with one grouped GEMM, so each row
  holds them side by side ([rows, 2h]); torch would run the activation on the two strided
  halves and join the halves' gradients with a copy.
- `swiglu_pair(gate, up)`: the dense MLP's w1 and w3 give two tensors [..., h] (separate
  parameters: their names are part of the checkpoint format).
Unfused, torch keeps gate, silu(gate) and up for backward and runs five elementwise
kernels; the kernels keep only gate and up and read and write each tensor once.
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


def swiglu_pair_reference(gate: Tensor, up: Tensor) -> Tensor:
    """The dense MLP's formula as it ran before the kernel (CPU runs stay bit for bit)."""
    return F.silu(gate) * up


def _launch(name: str, tensors: tuple[Tensor, ...], rows: int, h: int, ld: int, dtype: torch.dtype) -> None:
    """`tensors`: gate, up, then the direction's others; gate, up and their gradients are
    rows `ld` elements apart, the output and its gradient [rows, h] contiguous."""
    width = loader.vector_width(dtype)
    vector = h % width == 0 and ld % width == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)
    packs = rows * (h // width if vector else h)
    blocks = min(-(-packs // THREADS), MAX_BLOCKS)
    suffix = f"{loader.dtype_suffix(dtype)}_{'v' if vector else 's'}"
    loader.launch(SOURCE, f"{name}_{suffix}", blocks, THREADS,
                  (*tensors, np.int64(rows), np.int64(h), np.int64(ld)))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gu: Tensor) -> Tensor:
        gu = gu.contiguous()
        h = gu.shape[-1] // 2
        out = gu.new_empty((*gu.shape[:-1], h))
        ctx.save_for_backward(gu)
        if out.numel():
            # The halves as views: the launch passes their first elements' addresses.
            _launch("swiglu_forward", (gu[..., :h], gu[..., h:], out), out.numel() // h, h, 2 * h, gu.dtype)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (gu,) = ctx.saved_tensors
        grad = grad.contiguous()
        h = grad.shape[-1]
        grad_gu = torch.empty_like(gu)
        if grad.numel():
            _launch("swiglu_backward", (gu[..., :h], gu[..., h:], grad, grad_gu[..., :h], grad_gu[..., h:]),
                    grad.numel() // h, h, 2 * h, gu.dtype)
        return grad_gu


class _SwiGLUPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        gate, up = gate.contiguous(), up.contiguous()
        out = torch.empty_like(gate)
        ctx.save_for_backward(gate, up)  # not silu(gate): backward recomputes it from gate
        if out.numel():
            h = out.shape[-1]
            _launch("swiglu_forward", (gate, up, out), out.numel() // h, h, h, gate.dtype)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up = ctx.saved_tensors
        grad = grad.contiguous()
        grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
        if grad.numel():
            h = grad.shape[-1]
            _launch("swiglu_backward", (gate, up, grad, grad_gate, grad_up), grad.numel() // h, h, h, gate.dtype)
        return grad_gate, grad_up


def swiglu(gu: Tensor) -> Tensor:
    """silu(gate) * up for gu = [..., 2h] (gate in the first h columns, up in the last)."""
    if gu.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dimension ({gu.shape[-1]}) must hold gate and up, an even size")
    if _falls_back(gu, "SwiGLU"):
        return swiglu_reference(gu)
    return _SwiGLU.apply(gu)


def swiglu_pair(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up for two tensors of one shape [..., h], dtype and device.

    The kernel runs for fp32/bf16/fp16 on CUDA (non-contiguous inputs are made contiguous
    first); anything else runs `swiglu_pair_reference` (said once when the inputs are on
    CUDA). Returns a contiguous tensor shaped like gate.
    """
    if gate.dim() == 0 or gate.shape != up.shape:
        raise ValueError(f"swiglu_pair: gate and up must have one shape [..., h], got {tuple(gate.shape)} "
                         f"and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"swiglu_pair: gate is {gate.dtype}, up is {up.dtype}; they must share a dtype")
    if gate.device != up.device:
        raise ValueError(f"swiglu_pair: gate is on {gate.device}, up on {up.device}")
    if _falls_back(gate, "SwiGLU of separate gate and up"):
        return swiglu_pair_reference(gate, up)
    return _SwiGLUPair.apply(gate, up)


def _falls_back(t: Tensor, what: str) -> bool:
    """Whether `what` runs its torch reference on `t`; says why once per process on CUDA."""
    reason = loader.unavailable_reason(t, SOURCE)
    if reason is None and loader.dtype_suffix(t.dtype) is None:
        reason = f"{t.dtype} is not fp32, bf16 or fp16"
    if reason is not None and t.is_cuda:
        loader.say_once(f"{what}/{t.dtype}", f"{what} runs unfused in torch: {reason}")
    return reason is not None
