"""Copies of host tensors into GPU tensors at the speed of the bus, for loads.

A copy from pageable host memory (a checkpoint's bytes, a copy in shared memory, an
object-store buffer) goes through the CUDA driver's own small staging buffer, one at a
time: 2-5 GB/s on an H200 host. Here a few threads each copy chunks into a pinned buffer
of their own and from it onto the GPU on a stream of their own, so the host-side copy
of one chunk overlaps the bus transfer of another: 3x on one H200 host (BENCHMARKS.md).
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
import queue
import threading

import torch

CHUNK_BYTES = 16 << 20
THREADS = 4
_DONE = object()


class HostCopies:
    """`copy(dst, src)` = `dst.copy_(src.reshape(dst.shape))`, done by the time `wait()`
    returns (which raises what a copy raised). Chunks are staged when `staged` (the default
    for a CUDA `device`): `src` on the host, `dst` contiguous on `device`; any other pair
    is copied at once, in the caller's thread. A staged copy converts dtypes on the device.
    At most `2 x threads` chunks wait, so the caller's reads stay that far ahead of the bus."""

    def __init__(self, device: torch.device, threads: int = THREADS, chunk_bytes: int = CHUNK_BYTES,
                 staged: bool | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # A tensor's device has its index: "cuda" alone would match none.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.staged = self.device.type == "cuda" if staged is None else staged
        self._pinned = self.device.type == "cuda"  # staging buffers in pinned memory, one stream per stager
        self.chunk_bytes = chunk_bytes
        self.staged_bytes = 0  # of the copies so far, those that went through the stagers
        self._errors: list[BaseException] = []
        self._threads: list[threading.Thread] = []
        if not self.staged:
            return
        if self.device.type == "cuda":
            # Earlier work of the caller's stream on the destinations comes first.
            torch.cuda.current_stream(self.device).synchronize()
        self._chunks: queue.Queue = queue.Queue(maxsize=2 * threads)
        self._threads = [threading.Thread(target=self._stage, name=f"host-copy-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.numel() != src.numel():
            raise ValueError(f"copying {src.numel()} elements into {dst.numel()} ({tuple(src.shape)} into "
                             f"{tuple(dst.shape)})")
        if self._errors:
            raise self._errors[0]
        if not (self.staged and dst.device == self.device and src.device.type == "cpu"
                and dst.is_contiguous() and src.is_contiguous()):
            with torch.no_grad():
                dst.copy_(src.reshape(dst.shape))
            return
        self.staged_bytes += src.nbytes
        flat_dst, flat_src = dst.view(-1), src.view(-1)
        step = max(1, self.chunk_bytes // src.element_size())
        for start in range(0, src.numel(), step):
            # Blocks while the stagers are behind: the reads wait for the bus, not the memory.
            self._chunks.put((flat_dst[start:start + step], flat_src[start:start + step]))

    def wait(self) -> None:
        """Every copy done; raises the first error a copy raised."""
        for _ in self._threads:
            self._chunks.put(_DONE)
        for t in self._threads:
            t.join()
        self._threads = []
        if self._errors:
            raise self._errors[0]

    def _stage(self) -> None:
        buffer = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=self._pinned)
        stream = torch.cuda.Stream(self.device) if self._pinned else None
        on_device: dict[torch.dtype, torch.Tensor] = {}  # a chunk of another dtype, converted there
        while (item := self._chunks.get()) is not _DONE:
            if self._errors:
                continue  # drain: the caller raises at its next copy or wait
            try:
                with torch.no_grad(), torch.cuda.stream(stream) if stream is not None else nullcontext():
                    self._copy_chunk(*item, buffer, on_device)
                if stream is not None:
                    stream.synchronize()  # the buffer is reused by the next chunk
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._errors.append(e)

    def _copy_chunk(self, dst: torch.Tensor, src: torch.Tensor, buffer: torch.Tensor,
                    on_device: dict[torch.dtype, torch.Tensor]) -> None:
        held = buffer[:src.numel() * src.element_size()].view(src.dtype)
        held.copy_(src)
        if dst.dtype == src.dtype:
            dst.copy_(held, non_blocking=self._pinned)
            return
        if src.dtype not in on_device:
            on_device[src.dtype] = torch.empty(self.chunk_bytes // src.element_size(), dtype=src.dtype,
                                               device=self.device)
        landed = on_device[src.dtype][:src.numel()]
        landed.copy_(held, non_blocking=self._pinned)
        dst.copy_(landed)


@contextmanager
def host_copies(device: torch.device, **kwargs) -> Iterator[HostCopies]:
    """A `HostCopies` whose copies are done (or whose error raised) when the block ends; on
    an error in the block the stagers are stopped and that error raised."""
    copies = HostCopies(device, **kwargs)
    try:
        yield copies
    except BaseException:
        try:
            copies.wait()
        except BaseException:  # noqa: BLE001 - the block's own error is the one to raise
            pass
        raise
    copies.wait()
