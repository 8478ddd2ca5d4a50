"""The controller's states and the transitions between them, as a table.

PLANNING picks a grid for what the cluster has, STARTING places the workers and loads a
checkpoint, RUNNING steps. A lost worker or node, or a hung collective, moves to
RECOVERING; GROWING restarts on a larger grid at a checkpoint when resources have come back.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable


class State(str, enum.Enum):
    PLANNING = "PLANNING"  # choosing a grid for the resources the cluster has
    STARTING = "STARTING"  # placing workers, wiring process groups, loading a checkpoint
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"  # a worker or node was lost: tearing down, then planning again
    GROWING = "GROWING"  # resources came back: restarting on a larger grid at a checkpoint
    FINISHED = "FINISHED"
    FAILED = "FAILED"


TRANSITIONS = {
    State.PLANNING: {State.STARTING, State.FAILED},
    State.STARTING: {State.RUNNING, State.RECOVERING, State.FAILED},
    State.RUNNING: {State.RECOVERING, State.GROWING, State.FINISHED, State.FAILED},
    State.RECOVERING: {State.PLANNING, State.FAILED},
    State.GROWING: {State.PLANNING, State.FAILED},
    State.FINISHED: set(),
    State.FAILED: set(),
}


@dataclass
class StateMachine:
    state: State = State.PLANNING
    history: list[tuple[float, State, str]] = field(default_factory=list)
    on_change: Callable[[State, str], None] | None = None  # logging and metrics

    def to(self, new: State, why: str = "") -> None:
        if new not in TRANSITIONS[self.state]:
            raise RuntimeError(f"controller cannot go from {self.state.value} to {new.value}")
        self.state = new
        self.history.append((time.time(), new, why))
        if self.on_change is not None:
            self.on_change(new, why)
