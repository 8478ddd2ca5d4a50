"""Timestamps for a step's actions without synchronising the device.

On GPU each mark is a CUDA event, turned into wall-clock seconds from an anchor: an event
whose wall time is known because the host was waiting for it when it passed. The first
step's start is one (the device is idle then); after that, every wait that had to wait
(`wait`) moves the anchor to that event, so a step never synchronises only to be timed and
the next step can be issued while the last one's optimizer still runs. On CPU a mark is
the wall clock itself.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from raypar import host_wait


@dataclass(frozen=True)
class Mark:
    seq: int  # order of recording: elapsed times are read from the earlier event to the later
    event: "torch.cuda.Event"


class StepClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._seq = 0
        self._anchor: tuple[Mark, float] | None = None  # (mark, its wall-clock time)

    def start(self) -> None:
        if self.cuda and self._anchor is None:
            host_wait.synchronize(torch.device("cuda"), "first step start")
            self._anchor = (self.mark(), time.time())

    def mark(self) -> Mark | float:
        if not self.cuda:
            return time.time()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._seq += 1
        return Mark(self._seq, event)

    def wait(self, mark: Mark | float, what: str) -> None:
        """Return once the device has passed `mark`; when the host had to wait for it, the
        mark passed just now and becomes the anchor."""
        if self.cuda and host_wait.wait_for(mark.event, what):
            self._anchor = (mark, time.time())

    def passed(self, mark: Mark | float) -> bool:
        return not self.cuda or mark.event.query()

    @property
    def anchor(self) -> tuple[Mark, float] | None:
        return self._anchor

    def seconds(self, mark: Mark | float, anchor: tuple[Mark, float] | None = None) -> float:
        """Wall-clock time of a mark the device has passed, from `anchor` (default: the latest)."""
        if not self.cuda:
            return mark
        anchor, t = anchor or self._anchor
        if mark.seq >= anchor.seq:
            return t + anchor.event.elapsed_time(mark.event) / 1000.0
        return t - mark.event.elapsed_time(anchor.event) / 1000.0
