"""Hooks into a run: subclass Callback and pass instances to `Trainer(cfg, callbacks=[...])`.

Every hook runs in the driver, between steps; a slow hook slows training.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from raypar.driver.records import Recovery, RunSummary, StepRecord
    from raypar.driver.saver import SaveResult
    from raypar.driver.trainer import Trainer


class Callback:
    def on_train_start(self, trainer: "Trainer") -> None:
        """Workers are up (and a checkpoint is loaded when resuming)."""

    def on_step_end(self, trainer: "Trainer", record: "StepRecord") -> None:
        """A step finished; `record` holds its loss, timings and memory."""

    def on_checkpoint(self, trainer: "Trainer", result: "SaveResult") -> None:
        """A save committed (or failed: `result.error` says why)."""

    def on_state_change(self, trainer: "Trainer", state: str) -> None:
        """The controller entered `state` (PLANNING, STARTING, RUNNING, RECOVERING, ...)."""

    def on_recovery(self, trainer: "Trainer", recovery: "Recovery") -> None:
        """The run recovered from a failure: what failed, the new grid, the times."""

    def on_train_end(self, trainer: "Trainer", summary: "RunSummary") -> None:
        """The run finished; `summary` is the RunSummary."""


class StepFunction(Callback):
    """Adapts a plain `fn(record)` to a Callback's on_step_end."""

    def __init__(self, fn: Callable[["StepRecord"], None]):
        self.fn = fn

    def on_step_end(self, trainer: "Trainer", record: "StepRecord") -> None:
        self.fn(record)


def as_callbacks(items) -> list[Callback]:
    return [c if isinstance(c, Callback) else StepFunction(c) for c in items or ()]
