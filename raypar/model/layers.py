"""Model layers shared by the dense transformer and the mixture-of-experts MLP.

The norm, the rotary embedding and the SwiGLU feed-forward block live here, below both
`transformer` (which uses all of them) and `moe` (whose experts are the dense MLP), so
that `transformer` can import `moe` and neither module imports the other in a loop.
Attribute names here (`weight`, `w1`, `w2`, `w3`) are part of the global parameter names
that checkpoints and the Hugging Face export rely on.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raypar.kernels import rope, rope_reference, swiglu_pair
from raypar.model.split_backward import Linear

__all__ = ["RMSNorm", "FeedForward", "rope_tables", "apply_rope"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        # Normalises in fp32 for bf16 inputs (too little mantissa for a stable mean of
        # squares) and multiplies by the weight before casting back; one fused kernel on GPU.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


# ---------------------------------------------------------------------------------------
# Rotary position embedding (Hugging Face / Llama "rotate_half" convention)


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """cos and signed sin tables of shape [max_seq_len, head_dim], in fp32.

    rotate_half pairs element i with i + hd/2 and negates the second half's partner; the
    sign is folded into the sin table (its first half is -sin), so `apply_rope` rotates
    with one roll instead of a split, a negation and a concatenation, with the same values.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    pos = torch.arange(max_seq_len, device=device, dtype=torch.int64).float()
    freqs = torch.outer(pos, inv_freq)
    sin = freqs.sin()
    return torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-sin, sin), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [..., head_dim] by `rope_tables`' cos / signed sin, shaped to broadcast over
    it: [t, head_dim] for x [b, heads, t, head_dim], [t, 1, head_dim] for x [b, t, heads,
    head_dim] (in x's dtype: `Transformer` casts them once, not per layer).

    The attention's layout, x [b, t, heads, head_dim], goes through `kernels.rope`: one fused
    kernel each way on GPU; other layouts, and CPU runs, take the formula
    (`kernels.rope_reference`), value for value."""
    if x.dim() == 4 and cos.dim() == 3 and cos.shape[0] == x.shape[1] and cos.shape[1] == 1:
        return rope(x, cos, sin)
    return rope_reference(x, cos, sin)


# ---------------------------------------------------------------------------------------
# Feed-forward


class FeedForward(nn.Module):
    """SwiGLU MLP: w2(silu(w1 x) * w3 x); the activation is `kernels.swiglu_pair`, one fused
    kernel each way on GPU and `F.silu(gate) * up` on CPU."""

    def __init__(self, dim: int, hidden_dim: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.w1 = Linear(dim, hidden_dim, bias=False, dtype=dtype)  # gate
        self.w3 = Linear(dim, hidden_dim, bias=False, dtype=dtype)  # up
        self.w2 = Linear(hidden_dim, dim, bias=False, dtype=dtype)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(swiglu_pair(self.w1(x), self.w3(x)))
