"""events.jsonl: each worker's measured unit spans per step, one line per (step, worker).

Each span is written as [label, op, start, end] (`raypar.runtime.report.UnitSpan`): the
unit's actions as text, the op of its first action (F, B, SEND_F, ...), wall-clock seconds.

A GPU worker reports a step once the device has passed what the report reads and its
last backward; the units still running then (the norm's all-reduce, the optimizer step)
come with its next report as late events. (A first stage's report is completed before it
gets here: `StageRuntime.report_tail`.) The log holds such a step's line until they
arrive, so every line written is whole; `flush` writes what is held as it is (a run's
last step, or steps before a failure).
"""
from __future__ import annotations

import json
from typing import IO, Iterable

from raypar.topology import Grid


class EventLog:
    def __init__(self, out: IO[str]):
        self.out = out
        self._held: dict[int, dict] = {}  # rank -> the line of its last step, missing its last units

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc) -> None:
        """Write what is held and close the file."""
        self.flush()
        self.out.close()

    def add(self, step: int, reports: Iterable, grid: Grid) -> None:
        """The reports of step `step` (labelled: `events`, `late_events`)."""
        for r in reports:
            held = self._held.pop(r.rank, None)
            if held is not None:
                if r.late_step == held["step"]:
                    held["events"] += [list(s) for s in r.late_events]
                self._write(held)
            c = grid.coord(r.rank)
            line = {"step": step, "rank": r.rank, "dp": c.dp, "pp": c.pp, "ep": c.ep,
                    "events": [list(s) for s in r.events], "call": [r.called, r.reported], "issued": r.issued}
            if r.pending_units:
                self._held[r.rank] = line
            else:
                self._write(line)

    def complete(self, rank: int, step: int, late_events: list) -> None:
        """The late events of `rank`'s held step, fetched after its last report."""
        held = self._held.pop(rank, None)
        if held is not None:
            if held["step"] == step:
                held["events"] += [list(s) for s in late_events]
            self._write(held)

    def flush(self) -> None:
        for rank in sorted(self._held):
            self._write(self._held.pop(rank))
        self.out.flush()

    def _write(self, line: dict) -> None:
        self.out.write(json.dumps(line) + "\n")
