"""Adding a weight's gradient into its fp32 master gradient, once per micro-batch.

`accumulate_(main, grad)` is `main += grad` for an fp32 `main` and a gradient in the
weight's dtype: on CUDA one vectorised kernel (grad_accumulate.cu); torch adds a 16-bit
tensor into an fp32 one elementwise without vector loads.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from raypar.kernels import loader

SOURCE = "grad_accumulate.cu"
THREADS = 256
MAX_BLOCKS = 4096  # blocks stride over the elements beyond this


def accumulate_(main: Tensor, grad: Tensor) -> None:
    """main += grad (same shape; main fp32)."""
    if main.shape != grad.shape:
        raise ValueError(f"accumulate_: gradient {tuple(grad.shape)} does not match {tuple(main.shape)}")
    reason = loader.unavailable_reason(grad, SOURCE)
    if reason is None and (main.dtype != torch.float32 or loader.dtype_suffix(grad.dtype) is None):
        reason = f"main {main.dtype} must be fp32 and the gradient fp32, bf16 or fp16 (got {grad.dtype})"
    if reason is None and not (main.is_cuda and main.is_contiguous() and grad.is_contiguous()):
        reason = "main and gradient must be contiguous CUDA tensors"
    if reason is not None:
        if grad.is_cuda:
            loader.say_once(f"accumulate/{grad.dtype}", f"gradient accumulation runs in torch: {reason}")
        main.add_(grad)
        return
    n = grad.numel()
    if not n:
        return
    width = loader.vector_width(grad.dtype)
    vector = main.data_ptr() % 16 == 0 and grad.data_ptr() % 16 == 0
    blocks = min(-(-(n // width if vector else n) // THREADS), MAX_BLOCKS)
    suffix = f"{loader.dtype_suffix(grad.dtype)}_{'v' if vector else 's'}"
    loader.launch(SOURCE, f"accumulate_{suffix}", max(blocks, 1), THREADS, (main, grad, np.int64(n)))
