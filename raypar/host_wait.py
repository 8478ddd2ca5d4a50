"""Host waits on the GPU that a recovery can cancel.

When a worker is lost, the survivors' steps are worthless: the recovery goes back to the
last checkpoint. The driver's `abort` cancels them here and aborts their NCCL
communicators. Every wait of a step on the GPU polls a CUDA event instead of blocking in
the driver, and the step checks between its units, so a cancelled step stops issuing
work and raises `StepCancelled` at once, instead of running to its end on what the
aborted communicators left, or sitting in a blocking wait on a lost peer. One stage runs
per worker process, so the cancel flag is the process's.
"""
from __future__ import annotations

import threading
import time

import torch

_cancelled = threading.Event()
_reason = ""
# Busy polls before sleeping: short waits (a norm, a split size) return at once; long
# ones (a host far ahead of its GPU) stop spinning the CPU the other workers share.
_SPIN = 200
_SLEEP_S = 50e-6


class StepCancelled(RuntimeError):
    """A step's wait on the GPU was cancelled: the driver is recovering from a failure."""


def cancel(reason: str) -> None:
    """Make every wait here raise `StepCancelled`, now and until `clear`."""
    global _reason
    _reason = reason
    _cancelled.set()


def clear() -> None:
    _cancelled.clear()


def check(what: str) -> None:
    if _cancelled.is_set():
        raise StepCancelled(f"{what}: cancelled ({_reason})")


def wait_for(event: "torch.cuda.Event", what: str) -> bool:
    """Return once the GPU has passed `event`, and whether the host had to wait for it;
    raise `StepCancelled` if cancelled first."""
    if event.query():
        return False
    spins = 0
    while True:
        check(what)
        if spins < _SPIN:
            spins += 1
            time.sleep(0)
        else:
            time.sleep(_SLEEP_S)
        if event.query():
            return True


def synchronize(device: torch.device, what: str) -> None:
    """`torch.cuda.synchronize` for the current stream's work, cancellable."""
    if device.type != "cuda":
        check(what)
        return
    event = torch.cuda.Event()
    event.record()
    wait_for(event, what)


def to_host(t: torch.Tensor, what: str) -> torch.Tensor:
    """`t.cpu()`, waiting for `t` through `wait_for` rather than inside the copy."""
    if t.device.type == "cuda":
        synchronize(t.device, what)
    return t.cpu()


class HostCopy:
    """`t.cpu()` started now and read later with `result`, so the host may queue more GPU
    work before it waits for the values."""

    def __init__(self, t: torch.Tensor) -> None:
        self.event = None
        if t.device.type == "cuda":
            self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self.host.copy_(t, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = t

    def result(self, what: str) -> torch.Tensor:
        if self.event is not None:
            wait_for(self.event, what)
        else:
            check(what)
        return self.host
