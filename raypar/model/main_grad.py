"""Linear layers' weight gradients added straight into fp32 main gradients.

Under mixed precision every bf16 weight has an fp32 gradient (its main gradient) in which
the micro-batches' gradients add up. Through autograd, a linear layer's weight gradient is a
bf16 GEMM output that a hook then adds into the main gradient: per micro-batch the bf16
gradient is written, read back, and the fp32 one read and written by a kernel of its own
(1 x H200, 1B model: 19.7 ms of a 379 ms step; at tp=2 13.4 ms of 226, BENCHMARKS.md).
A weight with its main gradient attached (`attach`) has its `Linear` run the weight GEMM
with the main gradient as the accumulator instead (cuBLAS: bf16 inputs, fp32 output,
beta = 1): no bf16 gradient and no kernel after it, and each product is added in fp32
rather than rounded to bf16 first. Where that GEMM is not available (CPU, other dtypes)
the layer computes the gradient in the weight's dtype and adds it, as the hook did.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from raypar.kernels import accumulate_
from raypar.kernels.loader import say_once

__all__ = ["attach", "attached", "add_linear_weight_grad", "fused_on"]

# On the parameter: (main gradient, whether the GEMM can add into it, what to call once one is added).
_ATTR = "_raypar_main_grad"


def attach(param: Tensor, main: Tensor, arrived: Callable[[], None] | None = None) -> None:
    """Let `param`'s linear layer add its weight gradients into `main` (fp32, param's shape)
    and call `arrived()` after each, as a post-accumulate-grad hook would run."""
    if main.dtype != torch.float32 or main.shape != param.shape:
        raise ValueError(f"a main gradient must be fp32 of the weight's shape {tuple(param.shape)}; "
                         f"got {main.dtype} {tuple(main.shape)}")
    # Decided now, once: a probe inside a CUDA graph's capture would break it, and backward
    # runs this per layer and micro-batch.
    fused = main.is_cuda and fused_on(main.device)
    setattr(param, _ATTR, (main, fused, arrived))


def attached(param: Tensor) -> bool:
    return hasattr(param, _ATTR)


def add_linear_weight_grad(param: Tensor, x: Tensor, grad_out: Tensor) -> None:
    """main += grad_out^T x over every leading dimension: `param`'s weight gradient for a
    linear layer y = x param^T, added into its attached main gradient."""
    main, fused, arrived = getattr(param, _ATTR)
    g = grad_out.reshape(-1, grad_out.shape[-1]).t()
    a = x.reshape(-1, x.shape[-1])
    if fused and g.dtype in (torch.bfloat16, torch.float16) and g.dtype == a.dtype:
        torch.addmm(main, g, a, out_dtype=torch.float32, out=main)
    else:
        accumulate_(main, g @ a)
    if arrived is not None:
        arrived()


@functools.lru_cache(maxsize=None)
def fused_on(device: torch.device) -> bool:
    """Whether this torch adds a 16-bit GEMM into an fp32 tensor in place on `device`, and
    gets it right (checked once against an fp32 product)."""
    try:
        # A generator of its own: the default one's state is part of a run's checkpointed RNG.
        gen = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(64, 32, device=device, generator=gen).to(torch.bfloat16)
        b = torch.randn(32, 48, device=device, generator=gen).to(torch.bfloat16)
        c = torch.randn(64, 48, device=device, generator=gen)
        want = c + a.float() @ b.float()
        torch.addmm(c, a, b, out_dtype=torch.float32, out=c)
        ok = torch.allclose(c, want, rtol=1e-4, atol=1e-4)
        reason = "" if ok else "its result differs from an fp32 product"
    except (RuntimeError, NotImplementedError, TypeError) as e:
        ok, reason = False, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    if not ok:
        say_once(f"main_grad/{device}", f"weight gradients go through bf16 and a separate add on {device}: "
                                        f"torch.addmm into fp32 is not usable ({reason})")
    return ok
