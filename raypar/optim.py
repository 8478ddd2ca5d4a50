"""Optimizer pieces shared by stage workers and the single-process reference.

AdamW over fp32 master weights, the learning-rate schedule, and global-norm clipping
whose norm may be summed over several workers before it is applied. The norm may stay on
the device: clipping is folded into the fused AdamW kernel as its gradient scale, so a
step never waits for the host to read the norm.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import nn

from raypar.adamw import FusedAdamW
from raypar.config import TrainConfig
from raypar.host_ema import HostEma
from raypar.kernels import accumulate_, ema_update_
from raypar.model import main_grad
from raypar.model.experts import named_slices
from raypar.model.tensor_parallel import tp_slices


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at the last step (0-based step)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def is_expert_param(name: str) -> bool:
    """Expert weights are sharded over ep and replicated over dp only."""
    return ".experts." in name


def decays(name: str, p: torch.Tensor) -> bool:
    # Matrices decay; norm gains do not (the usual AdamW recipe for transformers).
    return p.ndim >= 2


class MasterOptimizer:
    """AdamW on fp32 master weights for a module whose parameters may be bf16.

    fp32 modules are optimised in place. For bf16 modules every parameter gets an fp32
    gradient that backward accumulates into (micro-batch gradients summed in fp32, not
    bf16) and an fp32 master copy that AdamW updates and casts back after each step. With
    `fuse_grad_accumulation`, linear layers add their weight gradients into those fp32
    gradients in the GEMM itself (`raypar.model.main_grad`); the rest go through a hook.
    """

    def __init__(self, module: nn.Module, cfg: TrainConfig, fuse_grad_accumulation: bool = True):
        self.cfg = cfg
        self.named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        # What checkpoints call each parameter's pieces (stacked experts: one per expert).
        self.slices = named_slices(module)
        # The parameters this worker holds a tensor-parallel slice of: (slice, global shape).
        self.tp_slices = tp_slices(module)
        self.mixed = any(p.dtype != torch.float32 for _, p in self.named_params)
        if self.mixed:
            self.master = [p.detach().float().clone() for _, p in self.named_params]
            for (_, p), m in zip(self.named_params, self.master):
                m.grad = torch.zeros_like(m)
                p.register_post_accumulate_grad_hook(self._accumulate_into(m))
                if fuse_grad_accumulation:
                    main_grad.attach(p, m.grad)
        else:
            self.master = [p for _, p in self.named_params]
        decay = [m for (n, p), m in zip(self.named_params, self.master) if decays(n, p)]
        no_decay = [m for (n, p), m in zip(self.named_params, self.master) if not decays(n, p)]
        self.optimizer = FusedAdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
        self._init_state()
        # An exponential moving average of the fp32 masters (`enable_ema`), on their device
        # or in host memory (then `_host_ema` folds it).
        self.ema: list[torch.Tensor] | None = None
        self._host_ema: HostEma | None = None

    def enable_ema(self, on_host: bool = False) -> None:
        """Start an EMA of the weights from their values now: fp32, beside the masters, or
        in host memory (`HostEma`)."""
        if on_host:
            self._host_ema = HostEma(self.master)
            self.ema = self._host_ema.ema
        else:
            self.ema = [m.detach().float().clone() for m in self.master]

    def update_ema(self, decay: float) -> float:
        """ema = decay * ema + (1 - decay) * master: one multi-tensor launch on the device, or
        queued for the host. Returns the seconds the caller waited (host: the last fold)."""
        if self._host_ema is not None:
            return self._host_ema.update(decay)
        ema_update_(self.ema, [m.detach() for m in self.master], decay)
        return 0.0

    def ema_for_snapshot(self) -> Callable[[], list[torch.Tensor]]:
        """The EMA as it stands now, for a snapshot whose copies are issued later: call the
        result then. On the device the live tensors (the next update comes after the next
        optimizer step, which waits for the snapshot's copies); on host a copy made in order
        with the folds."""
        if self._host_ema is None:
            return lambda: self.ema
        return self._host_ema.snapshot().result

    def settle_ema(self) -> None:
        """Finish the host EMA's queued work, before a load writes the EMA directly."""
        if self._host_ema is not None:
            self._host_ema.settle()

    def _init_state(self) -> None:
        """AdamW's state as its first step would make it (zero moments, step 0), made now.

        Made lazily, the moments would take the blocks the first step's activations left in
        the caching allocator, and the second step would allocate new ones in the middle of
        its forwards (cudaMalloc on the host's path to the next kernel). Made first, they
        also count in the memory a worker holds from the start.
        """
        for group in self.optimizer.param_groups:
            for m in group["params"]:
                self.optimizer.init_state(m)

    @staticmethod
    def _accumulate_into(master: torch.Tensor):
        def hook(p: torch.Tensor) -> None:
            if p.grad is None:  # a backward that left this weight's gradient for later (split_backward)
                return
            accumulate_(master.grad, p.grad)
            p.grad = None

        return hook

    def state_bytes(self) -> int:
        """Bytes of the optimizer's state on this worker: fp32 masters (of bf16 weights) and
        AdamW's two moments."""
        per = 3 if self.mixed else 2
        return sum(per * 4 * m.numel() for m in self.master)

    def grads(self) -> list[torch.Tensor]:
        """The accumulated fp32 gradients, one per parameter (zeros where none arrived)."""
        out = []
        for m in self.master:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
            out.append(m.grad)
        return out

    def named_grads(self) -> dict[str, torch.Tensor]:
        """Gradients under checkpoint names (views of the fp32 gradients)."""
        return {key: g[index] for (n, _), g in zip(self.named_params, self.grads()) for key, index in self.slices[n]}

    def split_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(dense, expert) gradients, for their different reduction groups."""
        dense, expert = [], []
        for (name, _), g in zip(self.named_params, self.grads()):
            (expert if is_expert_param(name) else dense).append(g)
        return dense, expert

    def local_sq_norm(self, grads: list[torch.Tensor] | None = None) -> torch.Tensor:
        grads = self.grads() if grads is None else grads
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self.master[0].device if self.master else "cpu")
        # One multi-tensor kernel for every gradient's norm, as clip_grad_norm_ does; fp32 sums.
        return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()

    def load_(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Overwrite parameters (and their fp32 masters) by checkpoint name; returns the names set."""
        done = []
        self.settle_ema()
        with torch.no_grad():
            for i, ((name, p), m) in enumerate(zip(self.named_params, self.master)):
                keys = [(key, index) for key, index in self.slices[name] if key in tensors]
                for key, index in keys:
                    m[index].copy_(tensors[key])
                    if self.ema is not None:
                        self.ema[i][index].copy_(m[index])  # new weights restart the average
                    done.append(key)
                if keys and m is not p:
                    p.copy_(m)
        return done

    def step(self, step: int, total_norm: torch.Tensor | float) -> float:
        """Clip by the global norm, update with the step's learning rate, zero the grads.

        `total_norm` may be a device tensor: nothing here reads it on the host.
        """
        if self.cfg.grad_clip > 0 and self.master:
            device = self.master[0].device
            norm = torch.as_tensor(total_norm, dtype=torch.float32, device=device)
            # The fused kernel divides each gradient by this: 1 unless the norm is over the limit.
            self.optimizer.grad_scale = torch.clamp((norm + 1e-6) / self.cfg.grad_clip, min=1.0)
        lr = lr_at(self.cfg, step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.grads()  # parameters that got no gradient step on zeros, as they always have
        if self._host_ema is not None:
            self._host_ema.fence()  # the masters' copy for the host EMA reads them first
        self.optimizer.step()
        self.optimizer.grad_scale = None
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_([p for _, p in self.named_params], self.master)
        self.zero_grad()
        return lr

    def zero_grad(self) -> None:
        grads = [m.grad for m in self.master if m.grad is not None]
        if grads:
            torch._foreach_zero_(grads)
        if self.mixed:
            for _, p in self.named_params:
                p.grad = None


def global_norm(sq_norms: Iterable[torch.Tensor]) -> float:
    return float(torch.stack(list(sq_norms)).sum().sqrt())
