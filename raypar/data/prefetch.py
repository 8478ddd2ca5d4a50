"""The next batch, read on a background thread while the current step runs.

A worker that feeds or scores a pipeline knows its next step's sample ids one step ahead
(the driver sends them with each step). `start` reads that batch on one background thread
and pins it when the worker has a GPU, so the step that needs it finds it ready and copies
it with a non-blocking transfer. `take` hands it over; what the step still waited (a
source slower than training, or no prefetch) comes back with it, for the step's report.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

__all__ = ["Prefetcher"]

Batch = tuple[torch.Tensor, torch.Tensor]


class Prefetcher:
    def __init__(self, read: Callable[[Sequence[int]], Batch], pin: bool) -> None:
        self._read = read
        self._pin = pin
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[tuple[int, ...], Future[Batch]] | None = None

    def _load(self, ids: Sequence[int]) -> Batch:
        x, y = self._read(ids)
        if self._pin:
            # From pageable memory a copy to the device would wait for the queued work.
            x, y = x.pin_memory(), y.pin_memory()
        return x, y

    def start(self, ids: Sequence[int]) -> None:
        """Begin reading `ids` (the next step's batch); a batch not taken yet is dropped."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="raypar-prefetch")
        self._pending = (tuple(ids), self._pool.submit(self._load, list(ids)))

    def take(self, ids: Sequence[int]) -> tuple[Batch, float]:
        """The batch of `ids` and the seconds this call waited for it: the prefetched one when
        it is that batch (its read error, if any, raised here), else read now."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == tuple(ids):
            batch = pending[1].result()
        else:
            batch = self._load(ids)
        return batch, time.perf_counter() - t0

    def close(self) -> None:
        self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
