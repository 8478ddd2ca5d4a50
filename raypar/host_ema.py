"""An EMA of the fp32 master weights kept in host memory, for runs short of device memory.

After an update's optimizer step the masters are copied into pinned host buffers on a side
stream (the copy engines move them; the next step's kernels keep the SMs), and one thread
of this process folds them in: ema = decay * ema + (1 - decay) * master, with torch's CPU
lerp on its intra-op threads. The next optimizer step waits for the copy on the device
(`fence`), not on the host. The thread runs its work in order, so a copy of the average
asked for after update k (`snapshot`) holds the average through update k and no later one.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class HostEma:
    def __init__(self, masters: list[torch.Tensor]) -> None:
        """Start the average from `masters` as they are now."""
        self._masters = [m.detach() for m in masters]
        self._cuda = bool(masters) and masters[0].is_cuda
        self.ema = [m.to("cpu", torch.float32, copy=True) for m in self._masters]
        # The masters of the last update, read by its fold; the next update reuses them.
        self._staging = [torch.empty(m.shape, dtype=torch.float32, pin_memory=self._cuda) for m in self._masters]
        self._saved: list[torch.Tensor] | None = None  # the last `snapshot`'s copy
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="host-ema")
        self._stream = torch.cuda.Stream(self._masters[0].device) if self._cuda else None
        self._copied: torch.cuda.Event | None = None  # the last update's masters are in staging
        self._fold: Future | None = None

    def update(self, decay: float) -> float:
        """Queue the fold of the masters as they are now (after an optimizer step). Returns
        the seconds spent waiting for the last fold, whose buffers this one reuses: choose
        `checkpoint.ema_every` so that a fold keeps up with the steps between updates."""
        t0 = time.perf_counter()
        if self._fold is not None:
            self._fold.result()
        waited = time.perf_counter() - t0
        copied = None
        if self._cuda:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for buf, m in zip(self._staging, self._masters):
                    buf.copy_(m, non_blocking=True)
            copied = self._copied = torch.cuda.Event()
            copied.record(self._stream)
        else:
            torch._foreach_copy_(self._staging, self._masters)
        self._fold = self._thread.submit(self._fold_in, copied, 1.0 - decay)
        return waited

    def _fold_in(self, copied: torch.cuda.Event | None, weight: float) -> None:
        if copied is not None:
            copied.synchronize()
        torch._foreach_lerp_(self.ema, self._staging, weight)

    def fence(self) -> None:
        """Order the last update's copy before what the current stream runs next (an
        optimizer step that overwrites the masters); the host does not wait."""
        if self._copied is not None:
            torch.cuda.current_stream(self._masters[0].device).wait_event(self._copied)

    def snapshot(self) -> Future:
        """A future of a copy of the average through the last update (a list like `ema`).
        The copy is reused by the next snapshot: read it before asking for another."""
        return self._thread.submit(self._copy_out)

    def _copy_out(self) -> list[torch.Tensor]:
        if self._saved is None:
            self._saved = [torch.empty_like(e) for e in self.ema]
        torch._foreach_copy_(self._saved, self.ema)
        return self._saved

    def settle(self) -> None:
        """Wait until every queued fold and copy is done (before `ema` is written directly)."""
        self._thread.submit(lambda: None).result()
