"""CUDA kernels (CuPy) for the hot path, each with a torch reference.

Every op picks the kernel when its tensors are on a GPU, CuPy works and kernels are on
(`runtime.kernels`), and runs its torch reference otherwise, saying so once per process
when a GPU run falls back. CPU runs use the references by design.
"""
from __future__ import annotations

from raypar.kernels.residual_dropout import dropout_add, dropout_add_reference, keep_mask, sample_seeds, site_salt
from raypar.kernels.grad_accumulate import accumulate_
from raypar.kernels.loader import set_enabled, unavailable_reason
from raypar.kernels.moe_permute import permute, unpermute
from raypar.kernels.multi_tensor import copy_, ema_update_
from raypar.kernels.rope import rope, rope_reference
from raypar.kernels.swiglu import swiglu, swiglu_pair, swiglu_pair_reference, swiglu_reference

KERNELS = {"moe_permute": "moe_permute.cu", "moe_layout": "moe_layout.cu", "dropout_add": "dropout_add.cu",
           "multi_tensor": "multi_tensor.cu", "swiglu": "swiglu.cu", "grad_accumulate": "grad_accumulate.cu",
           "rope": "rope.cu"}


def load_all() -> dict[str, str]:
    """Compile every kernel module now (a worker's start-up); returns kernel -> 'active' or why not."""
    import torch

    probe = torch.empty(0, device="cuda") if torch.cuda.is_available() else None
    status = {}
    for name, source in KERNELS.items():
        reason = unavailable_reason(probe, source)
        status[name] = "active" if reason is None else f"torch reference ({reason})"
    return status


__all__ = ["accumulate_", "copy_", "dropout_add", "dropout_add_reference", "ema_update_", "keep_mask", "load_all",
           "permute", "rope", "rope_reference", "sample_seeds", "set_enabled", "site_salt", "swiglu", "swiglu_pair",
           "swiglu_pair_reference", "swiglu_reference", "unavailable_reason", "unpermute"]
