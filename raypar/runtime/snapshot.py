"""Copies of a worker's state into host memory that overlap with the next step.

On GPU the copies run on a side stream into pinned buffers (reused across saves) after
the optimizer step; the next optimizer step must wait for them, nothing else does. On
CPU the copy is a plain clone.
"""
from __future__ import annotations

import time

import torch

from raypar.kernels import copy_


class StateSnapshot:
    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._event = None
        self._stream = None
        self.step: int | None = None
        self.copy_s = 0.0

    def start(self, step: int, tensors: dict[str, torch.Tensor]) -> float:
        """Begin copying; returns the seconds the caller was held up issuing the copies."""
        t0 = time.perf_counter()
        self.step = step
        cuda = any(t.is_cuda for t in tensors.values())
        if cuda and self._stream is None:
            self._stream = torch.cuda.Stream()
        fresh: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            buf = self._buffers.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            fresh[name] = buf
        self._buffers = fresh
        if cuda:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                # One launch for the device tensors (the kernel), one copy for each other
                # (host-side state such as RNG states, non-contiguous views).
                on_device = [n for n, t in tensors.items() if t.is_cuda and t.is_contiguous()]
                copy_([tensors[n] for n in on_device], [self._buffers[n] for n in on_device])
                for name in tensors.keys() - set(on_device):
                    self._buffers[name].copy_(tensors[name], non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)
        else:
            for name, t in tensors.items():
                self._buffers[name].copy_(t)
            self._event = None
        return time.perf_counter() - t0

    def wait(self) -> float:
        """Block until the copies are done; returns the seconds spent waiting."""
        t0 = time.perf_counter()
        if self._event is not None:
            self._event.synchronize()  # may run on the export thread and the step thread at once
        return time.perf_counter() - t0

    def host_tensors(self) -> dict[str, torch.Tensor]:
        self.wait()
        return dict(self._buffers)
