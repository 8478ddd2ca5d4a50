"""Fused dropout + residual add with a counter-based mask.

out = residual + dropout(x, p). The keep mask is a hash of (the sample's seed, the
element's index within the sample, a salt per dropout site), the same function here in
torch and in dropout_add.cu; one 32-bit hash serves two elements (16-bit uniforms). So backward and activation recompute regenerate the mask
instead of storing it, and a sample's mask does not depend on which micro-batch, replica
or pipeline split carries it: dropout keeps every grid equal to the reference.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from raypar.kernels import loader

SOURCE = "dropout_add.cu"
M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1


def _mul32(x: Tensor, c: int) -> Tensor:
    # (x * c) mod 2^32 for x < 2^32 without int64 overflow: split x into 16-bit halves.
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & M32


def mix32(x: Tensor) -> Tensor:
    """The kernel's 32-bit integer hash, on int64 tensors holding values below 2^32."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    x &= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def site_salt(layer: int, site: int) -> int:
    """Salt of one dropout site (site 0: after attention, 1: after the MLP) of a layer."""
    return _mix32_int(layer * 2 + site + 0x9E3779B9)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def sample_seeds(seed: int, step: int, sample_ids: list[int], device: torch.device | str = "cpu") -> Tensor:
    """One dropout seed per sample of a step (int64, below 2^63), whatever the grid."""
    base = _splitmix64(_splitmix64(seed) ^ step)
    return torch.tensor([_splitmix64(base ^ int(i)) >> 1 for i in sample_ids], dtype=torch.int64, device=device)


def threshold_and_scale(p: float) -> tuple[int, float]:
    """The 16-bit drop threshold for p, and the scale that keeps the expectation exact."""
    threshold = min(int(p * 65536), 65535)
    return threshold, 65536.0 / (65536 - threshold)


def keep_mask(seeds: Tensor, per_sample: int, salt: int, p: float, first: int = 0) -> Tensor:
    """Boolean keep mask [len(seeds), per_sample] (the torch twin of the kernel's) of each
    sample's elements first .. first + per_sample - 1.

    Per sample a key mix(mix(seed_lo ^ salt) + seed_hi); element e keeps when a 16-bit
    half of mix((e >> 1) ^ key) (the low one for even e) reaches the threshold.
    """
    threshold, _ = threshold_and_scale(p)
    seeds = seeds.to(torch.int64).unsqueeze(1)
    key = mix32((mix32((seeds & M32) ^ salt) + ((seeds >> 32) & M32)) & M32)
    e = torch.arange(first, first + per_sample, dtype=torch.int64, device=seeds.device).unsqueeze(0)
    h = mix32((e >> 1) ^ key)
    return torch.where((e & 1).bool(), h >> 16, h & 0xFFFF) >= threshold


def dropout_add_reference(x: Tensor, residual: Tensor, seeds: Tensor, p: float, salt: int, first: int = 0) -> Tensor:
    """Unfused torch: residual + x * mask / (1 - p), in fp32 where x is 16-bit."""
    if x.numel() == 0:
        return residual + x
    mask = keep_mask(seeds.to(x.device), x[0].numel(), salt, p, first).reshape(x.shape)
    compute = torch.promote_types(x.dtype, torch.float32)
    return (residual.to(compute) + x.to(compute) * mask * threshold_and_scale(p)[1]).to(x.dtype)


def _kernel_reason(x: Tensor, first: int) -> str | None:
    reason = loader.unavailable_reason(x, SOURCE)
    if reason is None and loader.dtype_suffix(x.dtype) is None:
        reason = f"{x.dtype} would lose precision in the fp32 kernel"
    if reason is None and x.shape[0] and first + x[0].numel() >= 2**32:
        reason = "samples of 2^32 elements or more overflow the mask's element counter"
    if reason is None and x.shape[0] > 65535:
        reason = f"{x.shape[0]} samples in one call, the kernel takes up to 65535"
    return reason


def _launch(name: str, args: tuple, samples: int, per_sample: int, dtype: torch.dtype, aligned: bool) -> None:
    # Grid: y = sample, x = packs of the sample (a few per thread: the hash is arithmetic).
    # `aligned` includes an even first element: a pack's hashes serve element pairs.
    width = loader.vector_width(dtype)
    vector = aligned and per_sample % width == 0
    chunks = per_sample // width if vector else per_sample
    block = 256
    grid_x = int(max(1, min((chunks + block - 1) // block, max(1, 2048 // samples))))
    suffix = f"{loader.dtype_suffix(dtype)}_{'v' if vector else 's'}"
    loader.launch(SOURCE, f"{name}_{suffix}", (grid_x, samples), block, args)


class DropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, residual: Tensor, seeds: Tensor, p: float, salt: int, first: int) -> Tensor:
        x, residual, seeds = x.contiguous(), residual.contiguous(), seeds.contiguous()
        out = torch.empty_like(x)
        samples, per_sample = x.shape[0], x[0].numel() if x.shape[0] else 1
        threshold, scale = threshold_and_scale(p)
        ctx.save_for_backward(seeds)
        ctx.consts = (samples, per_sample, first, salt, threshold, scale)
        if x.numel():
            aligned = first % 2 == 0 and all(t.data_ptr() % 16 == 0 for t in (x, residual, out))
            _launch("dropout_add", (x, residual, seeds, out, np.int64(per_sample), np.int64(first), np.uint32(salt),
                                    np.uint32(threshold), np.float32(scale)), samples, per_sample, x.dtype, aligned)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (seeds,) = ctx.saved_tensors
        samples, per_sample, first, salt, threshold, scale = ctx.consts
        grad = grad.contiguous()
        grad_x = torch.empty_like(grad)
        if grad.numel():
            aligned = first % 2 == 0 and grad.data_ptr() % 16 == 0 and grad_x.data_ptr() % 16 == 0
            _launch("dropout_grad", (grad, seeds, grad_x, np.int64(per_sample), np.int64(first), np.uint32(salt),
                                     np.uint32(threshold), np.float32(scale)), samples, per_sample, grad.dtype, aligned)
        return grad_x, grad, None, None, None, None


def dropout_add(x: Tensor, residual: Tensor, seeds: Tensor, p: float, salt: int, first: int = 0) -> Tensor:
    """residual + dropout(x, p) with per-sample seeds [x.shape[0]]; fused kernel on CUDA.
    `first`: where each row of x starts within its whole sample (a slice of the sequence
    takes its part of the whole sample's mask)."""
    if x.shape != residual.shape:
        raise ValueError(f"dropout_add: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    if seeds.shape != (x.shape[0],):
        raise ValueError(f"dropout_add: need one seed per sample ({x.shape[0]}), got seeds of shape {tuple(seeds.shape)}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_add: p={p} must be in [0, 1)")
    if p == 0.0:
        return residual + x
    reason = _kernel_reason(x, first)
    if reason is not None:
        if x.is_cuda:
            loader.say_once(f"dropout_add/{x.dtype}", f"dropout + residual add runs unfused in torch: {reason}")
        return dropout_add_reference(x, residual, seeds, p, salt, first)
    return DropoutAdd.apply(x, residual, seeds.to(device=x.device, dtype=torch.int64), p, salt, first)
