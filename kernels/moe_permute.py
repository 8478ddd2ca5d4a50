"""MoE token permute and un-permute with weighted combine, as autograd functions.

A slot is one kept (token, expert) assignment; `token[s]` is slot s's token and
`slots[n, j]` is the slot of token n's j-th choice, or -1 when that choice was dropped.
permute gathers x[token] into expert order; unpermute sums each token's slots back,
weighted by the router: out[n] = sum_j weight[s] * y[s] over its kept slots s.
Backward of each is the other (with the weights), plus a row dot product for the
router weights' gradient.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from raypar.kernels import loader

SOURCE = "moe_permute.cu"
NULL = np.uint64(0)
ROWS_PER_BLOCK = 4  # R in moe_permute.cu


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of the torch paths: fp32, or the input's when wider."""
    return torch.promote_types(dtype, torch.float32)


def _kernel_reason(x: Tensor) -> str | None:
    reason = loader.unavailable_reason(x, SOURCE)
    if reason is None and loader.dtype_suffix(x.dtype) is None:
        reason = f"{x.dtype} rows are not supported by the permute kernels (fp32, bf16, fp16 are)"
    return reason


def _variant(x: Tensor, *tensors: Tensor) -> str:
    """`<dtype>_v` (16-byte packs) when every row starts on a 16-byte boundary, else `_s`."""
    row_bytes = x.shape[-1] * x.element_size()
    aligned = row_bytes % 16 == 0 and all(t.data_ptr() % 16 == 0 for t in (x, *tensors))
    return f"{loader.dtype_suffix(x.dtype)}_{'v' if aligned else 's'}"


def _block(d: int, width: int) -> int:
    chunks = max(1, d // width)
    return int(min(256, max(32, (chunks + 31) // 32 * 32)))


def gather_rows(x: Tensor, src: Tensor, scale: Tensor | None = None) -> Tensor:
    """y[i] = x[src[i]] (* scale[i]); kernel when it can run, else torch."""
    if _kernel_reason(x) is not None:
        y = x[src]
        return y if scale is None else (y.to(_acc(x.dtype)) * scale.unsqueeze(1)).to(x.dtype)
    x, src = x.contiguous(), src.contiguous()
    m, d = src.numel(), x.shape[1]
    y = torch.empty((m, d), dtype=x.dtype, device=x.device)
    if m and d:
        variant = _variant(x, y)
        width = loader.vector_width(x.dtype) if variant.endswith("_v") else 1
        loader.launch(SOURCE, f"gather_rows_{variant}", -(-m // ROWS_PER_BLOCK), _block(d, width),
                      (x, src, NULL if scale is None else scale.contiguous(), y, np.int64(m), np.int64(d)))
    return y


def combine_rows(y: Tensor, slots: Tensor, weight: Tensor | None, n: int) -> Tensor:
    """out[t] = sum_j weight[s] * y[s] over kept slots s = slots[t, j]; kernel or torch."""
    if _kernel_reason(y) is not None:
        return _combine_reference(y, slots, weight, n)
    y, slots = y.contiguous(), slots.contiguous()
    d, k = y.shape[1], slots.shape[1]
    out = torch.empty((n, d), dtype=y.dtype, device=y.device)
    if n and d:
        variant = _variant(y, out)
        width = loader.vector_width(y.dtype) if variant.endswith("_v") else 1
        loader.launch(SOURCE, f"combine_rows_{variant}", -(-n // ROWS_PER_BLOCK), _block(d, width),
                      (y, slots, NULL if weight is None else weight.contiguous(), out,
                       np.int64(n), np.int32(k), np.int64(d)))
    return out


def _combine_reference(y: Tensor, slots: Tensor, weight: Tensor | None, n: int) -> Tensor:
    kept = slots.flatten() >= 0
    token = torch.arange(n, device=y.device).repeat_interleave(slots.shape[1])[kept]
    rows = y[slots.flatten()[kept]].to(_acc(y.dtype))
    if weight is not None:
        rows = rows * weight[slots.flatten()[kept]].unsqueeze(1)
    return torch.zeros((n, y.shape[1]), dtype=rows.dtype, device=y.device).index_add_(0, token, rows).to(y.dtype)


def row_dot(a: Tensor, src: Tensor, b: Tensor) -> Tensor:
    """out[i] = <a[src[i]], b[i]> in fp32."""
    if _kernel_reason(a) is not None:
        return (a[src].to(_acc(a.dtype)) * b.to(_acc(a.dtype))).sum(dim=1)
    a, src, b = a.contiguous(), src.contiguous(), b.contiguous()
    m, d = src.numel(), a.shape[1]
    out = torch.zeros(m, dtype=torch.float32, device=a.device)
    if m and d:
        loader.launch(SOURCE, f"row_dot_{loader.dtype_suffix(a.dtype)}", min(m, 16384), 256,
                      (a, src, b, out, np.int64(m), np.int64(d)))
    return out


class Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, token: Tensor, slots: Tensor) -> Tensor:
        ctx.save_for_backward(slots)
        ctx.n = x.shape[0]
        return gather_rows(x, token)

    @staticmethod
    def backward(ctx, grad_y: Tensor):
        (slots,) = ctx.saved_tensors
        return combine_rows(grad_y, slots, None, ctx.n), None, None


class Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: Tensor, weight: Tensor, token: Tensor, slots: Tensor) -> Tensor:
        ctx.save_for_backward(y, weight, token)
        return combine_rows(y, slots, weight, slots.shape[0])

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        y, weight, token = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_y = gather_rows(grad_out, token, weight) if ctx.needs_input_grad[0] else None
        grad_w = row_dot(grad_out, token, y) if ctx.needs_input_grad[1] else None
        return grad_y, grad_w, None, None


def permute(x: Tensor, token: Tensor, slots: Tensor) -> Tensor:
    """Rows of x [n, d] in slot order: x[token]. Kernel on CUDA, torch elsewhere.

    The gradient of x reads only the rows `slots` names: rows no slot names (padding) may
    carry any gradient, undefined values included, without reaching x.
    """
    _say_fallback(x)
    return Permute.apply(x, token, slots)


def unpermute(y: Tensor, weight: Tensor, token: Tensor, slots: Tensor) -> Tensor:
    """[n, d]: each token's kept slots of y summed with their fp32 router weights.

    Reads only the rows of y that `slots` names; a row no slot names needs weight 0.
    """
    _say_fallback(y)
    return Unpermute.apply(y, weight, token, slots)


def _say_fallback(x: Tensor) -> None:
    if x.is_cuda and _kernel_reason(x) is not None:  # on CPU the reference is the plan, not a fallback
        loader.say_once("moe_permute", f"MoE permute/unpermute run in torch: {_kernel_reason(x)}")
