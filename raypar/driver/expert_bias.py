"""The MoE layers' routing biases as the driver keeps them (`model.moe_bias_update_rate`).

The workers move their biases on the device after each step (`StageRuntime._move_expert_biases`).
The driver does the same arithmetic (`raypar.model.moe.update_expert_bias`, exact in float64)
on the rows each step's record counts over every replica (`StepRecord.expert_tokens`), so it
knows the biases before every step it may go back to: a checkpoint's manifest names them
(`extra.expert_biases`), and after a restore, from storage or from memory, onto any grid,
or a move of the workers, they are sent to the workers before the first step runs.
"""
from __future__ import annotations

from typing import Callable

import torch

from raypar.config import ModelConfig
from raypar.driver.records import StepRecord
from raypar.expert_placement import moe_layer_ids
from raypar.model.moe import update_expert_bias

MANIFEST_KEY = "expert_biases"


class ExpertBiases:
    def __init__(self, cfg: ModelConfig, log: Callable[[str], None]) -> None:
        self.rate = cfg.moe_bias_update_rate
        self.layers = [str(layer) for layer in moe_layer_ids(cfg)] if cfg.n_experts else []
        self.n_experts = cfg.n_experts
        self.log = log
        # Steps done -> the biases [layer, expert] the next step routes with.
        self._before: dict[int, torch.Tensor] = {0: self._zeros()}

    @property
    def enabled(self) -> bool:
        return self.rate > 0 and bool(self.layers)

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(len(self.layers), self.n_experts, dtype=torch.float64)

    def start(self, steps_done: int, saved: dict | None) -> None:
        """The run goes on after `steps_done` steps, with `saved` (a checkpoint's
        `extra.expert_biases`) or, without, the biases this driver kept for that step."""
        if not self.enabled:
            return
        if saved is not None:
            self._before = {steps_done: self._from_saved(saved)}
        elif steps_done in self._before:
            self._before = {s: b for s, b in self._before.items() if s <= steps_done}
        else:
            if steps_done > 0:
                self.log(f"raypar: the state of step {steps_done} names no expert biases (saved before "
                         f"model.moe_bias_update_rate was set): they start at zero")
            self._before = {steps_done: self._zeros()}

    def _from_saved(self, saved: dict) -> torch.Tensor:
        if sorted(saved, key=int) != self.layers or any(len(v) != self.n_experts for v in saved.values()):
            raise ValueError(f"the checkpoint's expert biases are for layers {sorted(saved, key=int)} with "
                             f"{sorted({len(v) for v in saved.values()})} experts; this model has MoE layers "
                             f"{self.layers} with {self.n_experts}")
        return torch.tensor([saved[layer] for layer in self.layers], dtype=torch.float64)

    def observe(self, record: StepRecord) -> None:
        """After step `record.step`: the biases of the step after it."""
        if not self.enabled:
            return
        counts = torch.tensor([record.expert_tokens.get(layer, [0] * self.n_experts) for layer in self.layers],
                              dtype=torch.int64)
        biases = self._before[record.step].clone()
        update_expert_bias(biases, counts, self.rate)
        self._before[record.step + 1] = biases

    def forget_before(self, steps_done: int) -> None:
        """No restore will go back further than `steps_done` steps."""
        self._before = {s: b for s, b in self._before.items() if s >= steps_done}

    def at(self, steps_done: int) -> dict[str, list[float]]:
        """The biases, by layer id, of the step after `steps_done` steps."""
        if steps_done not in self._before:
            raise KeyError(f"the driver kept no expert biases for step {steps_done} (kept: {sorted(self._before)})")
        return {layer: row.tolist() for layer, row in zip(self.layers, self._before[steps_done])}

    def saved(self, steps_done: int) -> dict:
        """What a checkpoint of the state after `steps_done` steps says of them."""
        return {MANIFEST_KEY: self.at(steps_done)} if self.enabled else {}
