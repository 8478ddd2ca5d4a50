"""What a stage reports about one step, and how the driver completes and labels it.

A worker's report carries numbers only: the flat start/end times of its program's units.
The driver, which sent the program, turns them into `UnitSpan`s (`label_spans`). Each span
carries its unit's op, so nothing downstream parses a label to learn what a unit was.

Two things can arrive after a report:
- its *tail*: a first stage may report before its device has finished the step
  (`StepReport.complete` is False); `ReportTail` brings the rest (`complete_report`);
- its *late units*: the last units of a step (the norm's all-reduce, the optimizer) that the
  device had not finished when the report was made come with the worker's next report
  (`late_step`, `late_times`), or from `late_units` at the end of a run.

This module imports no executor, so the driver reads reports without building a stage.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from raypar.schedule import Action, Op, comm_groups


class UnitSpan(NamedTuple):
    """One program unit as it ran: its actions as text, what kind of unit it is, its span."""

    label: str  # e.g. "F3" or "SEND_F3->1 RECV_B0<-1" (the unit's actions, as in events.jsonl)
    op: Op  # the op of the unit's first action
    start: float  # wall-clock seconds
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Unit:
    """A program unit as the driver knows it before it runs: label and op."""

    label: str
    op: Op


def program_units(program: Sequence[Action]) -> list[Unit]:
    """The units of `program` (`comm_groups`), in order."""
    return [Unit(" ".join(str(a) for a in unit), unit[0].op) for unit in comm_groups(program)]


def spans(units: Sequence[Unit], times: Sequence[float]) -> list[UnitSpan]:
    """Spans of the first len(times) / 2 units, from flat [start0, end0, start1, ...] times."""
    return [UnitSpan(u.label, u.op, b, e) for u, b, e in zip(units, times[0::2], times[1::2])]


def late_spans(units: Sequence[Unit], times: Sequence[float]) -> list[UnitSpan]:
    """Spans of the program's last len(times) / 2 units (a step's late units)."""
    return spans(units[len(units) - len(times) // 2:], times)


def compute_seconds(times: Sequence[float], units: Sequence[Unit]) -> float:
    """Seconds in forwards and backwards, from flat unit times and the units they time."""
    return sum(s.seconds for s in spans(units, times) if s.op.is_compute)


@dataclass
class StepReport:
    rank: int
    stage: int
    step: int
    losses: list[float]  # per micro-batch, last stage only
    # Start and end (wall-clock seconds) of each unit of the program (`comm_groups`), in order,
    # flat: [start0, end0, start1, end1, ...]. The driver knows the program and labels them.
    # On GPU the report is made once the device has passed what it reads: units it has not
    # finished yet (`pending_units`, the last ones) come in the next report's `late_times`,
    # or, for a report that is not `complete`, in its `ReportTail`.
    times: list[float]
    compute_s: float  # time in F and B
    start: float  # program start (wall clock)
    end_of_backward: float  # end of the last B (wall clock)
    wall_s: float  # whole run_step (on GPU its optimizer issued, not necessarily finished)
    called: float  # wall clock when the worker began this step (before its batch was loaded)
    reported: float  # wall clock when this report was made (the device past the step's last read)
    peak_activation_bytes: int
    peak_device_bytes: int
    peak_live_microbatches: int  # micro-batches whose forward ran and whose backward has not
    released_outputs: int
    expert_tokens: dict[str, list[int]]  # per MoE layer: this rank's token assignments per expert
    tokens_dropped: int  # assignments over capacity, summed over MoE layers
    alltoall_bytes: int  # sent to other ranks of the ep group, forward and backward
    alltoall_s: float  # host time in all-to-all exchanges
    grad_norm: float | None  # first stage only: one norm over the whole model, which that stage is last to finish
    lr: float
    checkpoint_stall_s: float  # time this step waited on a checkpoint snapshot
    data_wait_s: float = 0.0  # time the host waited to read its batch (0 when prefetched in time)
    data_window_bytes: int = 0  # bytes of the corpus this worker keeps (its window of read blocks)
    optimizer_bytes: int = 0  # fp32 masters and AdamW moments this worker holds (its share when sharded)
    # Sharded optimizer: gradient buckets reduced over replicas, and how many of them were
    # queued from inside backward (parallel.overlap_grad_reduce) rather than after it.
    buckets: int = 0
    buckets_early: int = 0
    microbatches: int = 0  # forwards in this worker's program
    graphed_microbatches: int = 0  # of them, those whose forward and backward replayed CUDA graphs
    # Of those, the ones replayed beside another micro-batch's (runtime.*_microbatch_overlap).
    overlapped_microbatches: int = 0
    # Still making a copy of its state in memory (elastic.memory_every) from before this
    # step when it reported: a copy asked for now would likely be skipped, so the driver asks
    # for none until every worker can take one (copies of the same steps on every worker).
    memory_busy: bool = False
    # Still sending a copy to its peer: the driver asks for no replica until every worker can
    # send one (replicas of the same steps on every worker: a lost node's ranks come back at
    # the step of their replicas, which the other ranks then hold too).
    replica_busy: bool = False
    # False: a first stage reported without waiting for its device (`StageRuntime.report_tail`
    # brings the rest); until `complete_report`, it lacks its pending units, end_of_backward
    # and every value read from the device.
    complete: bool = True
    pending_units: int = 0  # units at the program's end whose times this report lacks
    late_step: int | None = None  # the step `late_times` belong to (the last one this worker ran)
    late_times: list[float] = field(default_factory=list)  # that step's pending units, as `times`
    issued: list[float] = field(default_factory=list)  # wall clock when the host began issuing each unit
    grads: dict[str, torch.Tensor] | None = field(default=None, repr=False)
    # Filled in on the driver from `times` and `late_times` (see `label_spans`).
    events: list[UnitSpan] | None = field(default=None, repr=False)
    late_events: list[UnitSpan] | None = field(default=None, repr=False)


@dataclass
class ReportTail:
    """What a report that is not `complete` lacked, once the device has passed its step."""
    step: int
    times: list[float]  # the report's pending units, as `StepReport.times`
    compute_s: float  # in those units
    end_of_backward: float | None
    losses: list[float]
    grad_norm: float | None
    expert_tokens: dict[str, list[int]]
    tokens_dropped: int


def complete_report(report: StepReport, tail: ReportTail) -> StepReport:
    """`report` with what its tail brings: the same report the stage makes when it waits."""
    if tail.step != report.step:
        raise ValueError(f"rank {report.rank}: the tail of step {tail.step} cannot complete step {report.step}'s report")
    report.times = report.times + tail.times
    report.start = report.times[0] if report.times else report.start
    report.compute_s += tail.compute_s
    if tail.end_of_backward is not None:
        report.end_of_backward = tail.end_of_backward
    report.losses, report.grad_norm = tail.losses, tail.grad_norm
    report.expert_tokens, report.tokens_dropped = tail.expert_tokens, tail.tokens_dropped
    report.pending_units, report.complete = 0, True
    return report


def label_spans(report: StepReport, units: Sequence[Unit]) -> StepReport:
    """Give `report` its spans from its times and its program's units, and the late spans of
    the step before (that step's last units)."""
    report.events = spans(units, report.times)
    report.late_events = late_spans(units, report.late_times)
    return report
