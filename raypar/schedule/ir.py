"""Schedule IR: the per-stage action lists that stage actors execute and the simulator checks.

A *program* is one stage's list of actions for one training step. Programs are plain data so
that the same lists can be generated, lowered, simulated, logged and shipped to Ray actors.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Iterable, Sequence


class ScheduleError(ValueError):
    """A schedule or program that cannot run correctly (bad input, deadlock, broken ordering)."""


class Op(str, enum.Enum):
    F = "F"  # forward of one micro-batch on this stage
    B = "B"  # backward of one micro-batch (input grad + weight grad)
    I = "I"  # noqa: E741 - input gradient only: the part of B the previous stage waits for
    W = "W"  # weight gradient of a micro-batch whose I has run (zero-bubble schedules)
    SEND_F = "SEND_F"  # send forward activation of mb to next stage
    RECV_F = "RECV_F"  # receive forward activation of mb from previous stage
    SEND_B = "SEND_B"  # send input-gradient of mb to previous stage
    RECV_B = "RECV_B"  # receive output-gradient of mb from next stage
    RELEASE_OUT = "RELEASE_OUT"  # free data of mb's stage output (its autograd node is kept)
    RELEASE_IN = "RELEASE_IN"  # drop mb's received input (and its grad) once backward no longer needs it
    REDUCE_GRAD = "REDUCE_GRAD"  # gradient all-reduce / global grad-norm (once per step, after all B)
    STEP = "STEP"  # optimizer step (once per step, last)

    def __str__(self) -> str:
        return self.value

    @property
    def is_compute(self) -> bool:
        """A forward or a backward (whole or part): the units a pipeline's bubble is measured against."""
        return self in _COMPUTE_OPS

    @property
    def is_backward(self) -> bool:
        return self in _BACKWARD_OPS


_COMM_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})
_SEND_OPS = frozenset({Op.SEND_F, Op.SEND_B})
_COMPUTE_OPS = frozenset({Op.F, Op.B, Op.I, Op.W})
_BACKWARD_OPS = frozenset({Op.B, Op.I, Op.W})
_RELEASE_OPS = frozenset({Op.RELEASE_OUT, Op.RELEASE_IN})
_STEP_OPS = frozenset({Op.REDUCE_GRAD, Op.STEP})  # the once-per-step ops, which carry no mb


@dataclass(frozen=True)
class Action:
    op: Op
    mb: int | None = None  # micro-batch index (None for REDUCE_GRAD/STEP)
    peer: int | None = None  # the other stage for SEND_*/RECV_* actions
    chunk: int = 0  # the model chunk (raypar.schedule.layout) it runs on; always 0 with one chunk per stage

    def __post_init__(self) -> None:
        # Accept plain strings ("F") so programs can come back from logs or configs.
        try:
            object.__setattr__(self, "op", Op(self.op))
        except ValueError:
            valid = ", ".join(o.value for o in Op)
            raise ScheduleError(f"unknown op {self.op!r}; valid ops: {valid}") from None
        if self.op in _STEP_OPS:
            if self.mb is not None:
                raise ScheduleError(
                    f"{self.op.value} is once per step and takes no micro-batch (got mb={self.mb})"
                )
        elif not isinstance(self.mb, int) or isinstance(self.mb, bool) or self.mb < 0:
            raise ScheduleError(f"{self.op.value} needs a micro-batch index >= 0 (got mb={self.mb!r})")
        if self.is_comm:
            if not isinstance(self.peer, int) or isinstance(self.peer, bool):
                raise ScheduleError(
                    f"{self.op.value}{self.mb} needs the peer stage (got peer={self.peer!r})"
                )
        elif self.peer is not None:
            raise ScheduleError(f"{self.op.value} is not a communication action and takes no peer")
        if not isinstance(self.chunk, int) or isinstance(self.chunk, bool) or self.chunk < 0:
            raise ScheduleError(f"{self.op.value} needs a chunk index >= 0 (got chunk={self.chunk!r})")
        if self.op in _STEP_OPS and self.chunk:
            raise ScheduleError(f"{self.op.value} is once per step for the whole stage and takes no chunk")

    @property
    def is_comm(self) -> bool:
        return self.op in _COMM_OPS

    @property
    def is_send(self) -> bool:
        return self.op in _SEND_OPS

    @property
    def is_compute(self) -> bool:
        return self.op.is_compute

    @property
    def is_release(self) -> bool:
        return self.op in _RELEASE_OPS

    @property
    def key(self) -> tuple[int, int]:
        """(chunk, micro-batch): what the runtime keeps a micro-batch's tensors under."""
        return self.chunk, self.mb

    def __str__(self) -> str:
        if self.op in _STEP_OPS:
            return self.op.value
        chunk = f"c{self.chunk}" if self.chunk else ""
        if self.is_comm:
            arrow = "->" if self.is_send else "<-"
            return f"{self.op.value}{self.mb}{chunk}{arrow}{self.peer}"
        return f"{self.op.value}{self.mb}{chunk}"


def format_program(program: Iterable[Action]) -> str:
    """One line, actions joined by spaces (the inverse of `parse_program`)."""
    return " ".join(str(a) for a in program)


_ACTION_RE = re.compile(
    r"(?P<op>RELEASE_OUT|RELEASE_IN|REDUCE_GRAD|STEP|SEND_F|SEND_B|RECV_F|RECV_B|F|B|I|W)"
    r"(?P<mb>\d+)?(?:c(?P<chunk>\d+))?(?:(?P<arrow>->|<-)(?P<peer>\d+))?"
)


def parse_program(text: str) -> list[Action]:
    """Parse the `format_program` form back, e.g. "RECV_F0<-0 F0 SEND_F0->2 B0 STEP" (chunk 1's
    forward of micro-batch 3 is "F3c1")."""
    program = []
    for token in text.split():
        m = _ACTION_RE.fullmatch(token)
        if m is None:
            raise ScheduleError(f"cannot parse action {token!r}")
        op = Op(m["op"])
        if m["arrow"] is not None and m["arrow"] != ("->" if op in _SEND_OPS else "<-"):
            raise ScheduleError(f"cannot parse action {token!r}: sends use '->', receives use '<-'")
        mb = int(m["mb"]) if m["mb"] is not None else None
        peer = int(m["peer"]) if m["peer"] is not None else None
        program.append(Action(op, mb, peer, int(m["chunk"]) if m["chunk"] is not None else 0))
    return program


def comm_groups(program: Sequence[Action]) -> list[tuple[Action, ...]]:
    """Split a program into execution units.

    A maximal run of consecutive communication actions is one unit: the runtime posts it as a
    single batched isend/irecv call, and the simulator treats it as one rendezvous. Every other
    action is a unit of its own. Runtime and simulator share this function so they batch alike.
    """
    groups: list[tuple[Action, ...]] = []
    run: list[Action] = []
    for action in program:
        if action.is_comm:
            run.append(action)
            continue
        if run:
            groups.append(tuple(run))
            run = []
        groups.append((action,))
    if run:
        groups.append(tuple(run))
    return groups


def check_sizes(n_stages: int, n_microbatches: int) -> None:
    """Stage and micro-batch counts a schedule generator takes: integers >= 1."""
    for name, value in (("n_stages", n_stages), ("n_microbatches", n_microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{name} must be an integer >= 1, got {value!r}")
