"""Timestamps for a step's actions without synchronising the device mid-step.

On GPU each mark is a CUDA event; they are turned into wall-clock seconds once, after
the step, from one synchronised anchor. On CPU a mark is the wall clock itself.
"""
from __future__ import annotations

import time

import torch

from raypar import host_wait


class StepClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._anchor_time = 0.0
        self._anchor_event = None

    def start(self) -> None:
        if self.cuda:
            host_wait.synchronize(torch.device("cuda"), "step start")
            self._anchor_event = torch.cuda.Event(enable_timing=True)
            self._anchor_event.record()
        self._anchor_time = time.time()

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.time()

    def finish(self) -> None:
        if self.cuda:
            host_wait.synchronize(torch.device("cuda"), "step end")

    def seconds(self, mark) -> float:
        """Wall-clock time of a mark (valid after finish())."""
        if self.cuda:
            return self._anchor_time + self._anchor_event.elapsed_time(mark) / 1000.0
        return mark
