"""Copies of a worker's state into host memory that overlap with the next step.

A snapshot is taken in two halves. At the end of a step the step's thread only marks the
point to copy (a CUDA event) and keeps the RNG states (`begin`); the copies are issued by
whichever thread needs them first (`issue`): usually the shard write, which runs on its
own thread beside the next step, else the next optimizer step, which must not write the
state before it is copied (its stream waits for the copies on the device: `fence`). On GPU the copies run on a side stream into
pinned buffers that are reused across saves; on CPU they are plain copies.

Pinning host memory is slow (seconds for the gigabytes of a 1B model's state), so the
buffers can be reserved ahead, on a background thread, from the state's expected layout
(`reserve`); a snapshot that comes before they are ready waits for them. Buffers a process
already holds (an earlier stage's, a standby's) are reused where a shape and dtype match.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Callable

import torch

Layout = dict[str, tuple[torch.Size, torch.dtype]]


class StateSnapshot:
    def __init__(self, buffers: dict[str, torch.Tensor] | None = None,
                 allocate: Callable[[Layout], dict[str, torch.Tensor] | None] | None = None) -> None:
        """`buffers`: host buffers of an earlier snapshot of this process (`release`), reused
        where a name, shape and dtype match. `allocate`: makes a whole layout's buffers at
        once (in shared memory: `SharedCopies`); None from it, or no `allocate`, means each
        buffer on its own."""
        # By name; kept across saves, whatever they hold.
        self._buffers: dict[str, torch.Tensor] = dict(buffers or {})
        self._allocate = allocate
        self._names: list[str] = []  # what the last snapshot holds
        self._reserving: threading.Thread | None = None
        self._lock = threading.Lock()  # one thread issues a snapshot's copies
        self._collect: Callable[[], dict[str, torch.Tensor]] | None = None  # set between begin and issue
        self._taken: dict[str, torch.Tensor] = {}  # host-side state kept at begin (RNG)
        self._after = None  # CUDA event: the end of the step being copied
        self._event = None  # CUDA event: the copies are done
        # The tensors being copied, held until the copies are done: a transient one (the peer
        # check) would otherwise go back to the caching allocator and be reused by the next
        # step's stream while the side stream still reads it.
        self._sources: dict[str, torch.Tensor] = {}
        self._stream = None
        self.step: int | None = None

    def adopt(self, buffers: dict[str, torch.Tensor]) -> None:
        """Take host buffers allocated ahead (`pinned_buffers`): `reserve` uses them for
        names of their shape and dtype instead of allocating."""
        self._buffers.update(buffers)

    def reserve(self, layout: Layout, pin: bool = True) -> None:
        """Allocate (pinned) buffers for `layout` on a background thread; returns at once."""
        if not layout:
            return
        if self._allocate is not None and not all(self._fits(n, *spec) for n, spec in layout.items()):
            def allocate_all() -> None:
                # The whole layout in one place, or (no room there) each buffer on its own.
                whole = self._allocate(layout)
                self._buffers = whole if whole is not None else {
                    name: torch.empty(shape, dtype=dtype, pin_memory=pin) for name, (shape, dtype) in layout.items()}

            self._buffers = {}
            self._reserving = threading.Thread(target=allocate_all, name="snapshot-reserve", daemon=True)
            self._reserving.start()
            return

        # Buffers handed over (`release`, `pinned_buffers`) that fit no name of this layout
        # take the place of another name of their shape and dtype; the rest are dropped.
        held, self._buffers = self._buffers, {}
        spares: dict[tuple[torch.Size, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for name, buf in held.items():
            if layout.get(name) == (buf.shape, buf.dtype):
                self._buffers[name] = buf
            else:
                spares[buf.shape, buf.dtype].append(buf)

        def allocate() -> None:
            for name, (shape, dtype) in layout.items():
                if not self._fits(name, shape, dtype):
                    fitting = spares.get((shape, dtype))
                    self._buffers[name] = fitting.pop() if fitting else torch.empty(shape, dtype=dtype, pin_memory=pin)

        self._reserving = threading.Thread(target=allocate, name="snapshot-reserve", daemon=True)
        self._reserving.start()

    def reserving(self) -> bool:
        """Whether `reserve`'s buffers are still being allocated."""
        return self._reserving is not None and self._reserving.is_alive()

    def wait_reserved(self) -> None:
        """Until `reserve`'s buffers are allocated."""
        if self._reserving is not None:
            self._reserving.join()

    def _fits(self, name: str, shape, dtype) -> bool:
        buf = self._buffers.get(name)
        return buf is not None and buf.shape == shape and buf.dtype == dtype

    def begin(self, step: int, collect: Callable[[], dict[str, torch.Tensor]], taken: dict[str, torch.Tensor],
              cuda: bool) -> None:
        """Mark the state as it is now (end of step `step`) for copying.

        `collect` returns the live tensors to copy, called when the copies are issued: the
        caller must not change them before `wait` returns. `taken` is host state already
        copied (RNG states), kept as it is.
        """
        with self._lock:
            self.step = step
            self._collect = collect
            self._taken = dict(taken)
            self._after = None
            if cuda:
                self._after = torch.cuda.Event()
                self._after.record()

    def issue(self) -> None:
        """Start the copies of the state `begin` marked (once; any thread)."""
        with self._lock:
            collect, self._collect = self._collect, None
            if collect is None:
                return
            if self._reserving is not None:
                self._reserving.join()
                self._reserving = None
            tensors = collect()
            for name, t in tensors.items():
                if not self._fits(name, t.shape, t.dtype):
                    self._buffers[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            for name, t in self._taken.items():
                self._buffers[name] = t
            self._names = [*tensors, *self._taken]
            if self._after is not None:
                if self._stream is None:
                    self._stream = torch.cuda.Stream()
                self._stream.wait_event(self._after)
                with torch.cuda.stream(self._stream):
                    # One cudaMemcpyAsync per tensor: the copy engines move the bytes, so the
                    # next step's kernels keep every SM (a copy kernel would share them).
                    for name, t in tensors.items():
                        self._buffers[name].copy_(t, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
                self._sources = tensors
            else:
                for name, t in tensors.items():
                    self._buffers[name].copy_(t)
                self._event = None

    def release(self) -> dict[str, torch.Tensor]:
        """Hand the host buffers over to the next snapshot of this process, once no copy or
        reservation is using them: a worker kept after a failure would pin them again."""
        if self._reserving is not None:
            self._reserving.join()
        with self._lock:
            if self._event is not None:
                self._event.synchronize()
            buffers, self._buffers, self._names, self._sources = self._buffers, {}, [], {}
        return buffers

    def fence(self) -> float:
        """Order the copies before what the current stream runs next (an optimizer step that
        overwrites the copied tensors), issuing them if no thread has, without the host
        waiting for them; returns the seconds spent."""
        t0 = time.perf_counter()
        self.issue()
        event = self._event
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        return time.perf_counter() - t0

    def wait(self) -> float:
        """Block until the copies are done (issuing them if no one has); returns the seconds spent."""
        t0 = time.perf_counter()
        self.issue()
        event = self._event
        if event is not None:
            event.synchronize()  # may run on the export thread and the step thread at once
            with self._lock:
                if self._event is event:
                    self._sources = {}
        return time.perf_counter() - t0

    def held_bytes(self) -> int:
        """Host memory its buffers hold now (allocated by `reserve`, whatever they hold)."""
        return sum(t.nbytes for t in self._buffers.values())

    def host_tensors(self) -> dict[str, torch.Tensor]:
        self.wait()
        return {name: self._buffers[name] for name in self._names}


def pinned_buffers(shapes: list[tuple[torch.Size, torch.dtype]], pin: bool = True) -> dict[str, torch.Tensor]:
    """Host buffers of these shapes, for a `StateSnapshot` whose names are not known yet: its
    `reserve` gives each a name of its shape and dtype (a standby pins them while it waits)."""
    return {f"spare.{i}": torch.empty(shape, dtype=dtype, pin_memory=pin) for i, (shape, dtype) in enumerate(shapes)}
