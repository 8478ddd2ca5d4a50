"""AdamW as torch's fused multi-tensor kernel, called without torch.optim's wrapper.

`torch.optim.AdamW(fused=True)` runs `torch._fused_adamw_` once per device and dtype; this
runs the same kernel on the same state (the updates are bit-identical, which a test checks).
The wrapper is left out because its first use imports torch's compiler stack (dynamo and
sympy, over a second of CPU per process): every stage worker paid it at start, on the
path of every recovery that starts a process.

The interface is the part of torch.optim's that raypar uses: `param_groups` (each with its
`lr` and `weight_decay`), `state[param]` ("step", "exp_avg", "exp_avg_sq"), `grad_scale`
(every gradient is divided by it inside the kernel: how clipping is applied).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch


class FusedAdamW:
    def __init__(self, groups: Iterable[dict], lr: float, betas: tuple[float, float], eps: float):
        self.param_groups = [{"params": list(g["params"]), "weight_decay": float(g["weight_decay"]), "lr": lr}
                             for g in groups]
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        self.grad_scale: torch.Tensor | None = None

    def init_state(self, param: torch.Tensor, exp_avg: torch.Tensor | None = None,
                   exp_avg_sq: torch.Tensor | None = None) -> None:
        """`param`'s state before its first step: moments zero (or the given tensors, e.g.
        views into a flat buffer) and the step count an fp32 scalar on its device."""
        self.state[param] = {
            "step": torch.zeros((), dtype=torch.float32, device=param.device),
            "exp_avg": torch.zeros_like(param) if exp_avg is None else exp_avg,
            "exp_avg_sq": torch.zeros_like(param) if exp_avg_sq is None else exp_avg_sq,
        }

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        for group in self.param_groups:
            by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
            for p in group["params"]:
                if p.grad is not None:
                    by_kind[(p.device, p.dtype)].append(p)
            for (device, _), params in by_kind.items():
                states = [self.state[p] for p in params]
                steps = [s["step"] for s in states]
                torch._foreach_add_(steps, 1)
                scale = self.grad_scale.to(device, non_blocking=True) if self.grad_scale is not None else None
                torch._fused_adamw_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                                    [s["exp_avg_sq"] for s in states], [], steps, amsgrad=False, lr=group["lr"],
                                    beta1=self.beta1, beta2=self.beta2, weight_decay=group["weight_decay"],
                                    eps=self.eps, maximize=False, grad_scale=scale, found_inf=None)
