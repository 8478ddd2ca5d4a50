"""Single-process reference: the whole model, the whole batch, the same optimizer.

Pipelined and resharded runs are checked against it (losses, gradients, weights).
"""
from __future__ import annotations

import torch

from raypar.config import Config
from raypar.kernels import sample_seeds
from raypar.model import build_stage, unstacked
from raypar.model.moe import MoE, update_expert_bias
from raypar.optim import MasterOptimizer


class ReferenceTrainer:
    def __init__(self, cfg: Config, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.model = build_stage(cfg.model, 0, 1, seed=cfg.train.seed, device=torch.device(device))
        self.optimizer = MasterOptimizer(self.model, cfg.train,
                                         fuse_grad_accumulation=cfg.runtime.grad_accumulation_fusion)
        self.moe_layers = [m for m in self.model.modules() if isinstance(m, MoE)]

    def step(self, step: int, tokens: torch.Tensor, labels: torch.Tensor,
             sample_ids: list[int] | None = None) -> tuple[float, dict[str, torch.Tensor]]:
        """One optimizer step on the full batch; returns the loss and the unclipped gradients.

        `sample_ids` (the batch's global sample ids) give the dropout seeds; needed when
        model.dropout > 0.
        """
        seeds = None
        routed = [m.stats.routed.clone() if m.stats.routed is not None else None for m in self.moe_layers]
        if self.cfg.model.dropout > 0:
            if sample_ids is None:
                raise ValueError("model.dropout > 0: pass the batch's sample_ids so the masks match the pipelined run")
            seeds = sample_seeds(self.cfg.train.seed, step, sample_ids, tokens.device)
        loss = self.model(tokens, labels, seeds)
        loss.backward()
        grads = {n: g.detach().float().clone() for n, g in self.optimizer.named_grads().items()}
        norm = float(self.optimizer.local_sq_norm().sqrt())
        self.optimizer.step(step, norm)
        for m, before in zip(self.moe_layers, routed):
            if m.bias_rate > 0:  # the rows of this step: the counters run over the reference's steps
                update_expert_bias(m.expert_bias, m.stats.routed - (before if before is not None else 0), m.bias_rate)
        return float(loss.detach()), grads

    def parameters(self) -> dict[str, torch.Tensor]:
        return {n: t.detach().float().clone() for n, t in unstacked(self.model)}
