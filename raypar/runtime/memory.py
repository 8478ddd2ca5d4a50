"""Live activation bytes of one stage, measured on CPU and GPU alike.

Counts the storages autograd saves for backward during each micro-batch's forward
(caught with saved-tensor hooks; parameters excluded) plus the tensors the runtime
itself holds for a micro-batch (received inputs, outputs, received gradients, inputs
kept by activation recompute), and, between a split backward's I and its W, what the
waiting weight gradients hold (each layer's input and output gradient). Each storage counts once (keyed by its StorageImpl, which
stays put when the data is freed, unlike its data pointer), at its current size, so an
output whose data was released counts zero from then on.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


class ActivationTracker:
    def __init__(self, params: list[torch.Tensor]):
        # Parameters are updated in place, so their storages stay the same objects.
        self._param_storages = {p.untyped_storage()._cdata for p in params}
        self._saved: dict[int, dict[int, torch.UntypedStorage]] = {}
        self._held: dict[int, dict[int, torch.UntypedStorage]] = {}
        # Bytes a replayed CUDA graph's forward keeps for its backward, per micro-batch: they
        # live in the graph's memory pool, where no hook sees them.
        self._graphed: dict[int, int] = {}
        # What a micro-batch's weight gradients hold from its I to its W.
        self._weights: dict[object, dict[int, torch.UntypedStorage]] = {}
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes()

    @contextmanager
    def recording(self, mb: int) -> Iterator[None]:
        """Attribute what autograd saves inside this block to micro-batch `mb`."""
        saved = self._saved.setdefault(mb, {})
        params = self._param_storages

        # Called for every tensor autograd saves, on the host's path to the next kernel:
        # kept to one storage lookup (an empty storage counts 0 bytes wherever it is kept).
        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in saved and key not in params:
                saved[key] = storage
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def hold(self, mb: int, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr():
            self._held.setdefault(mb, {}).setdefault(storage._cdata, storage)

    def hold_graphed(self, mb: int, nbytes: int) -> None:
        """Micro-batch `mb`'s forward ran as a CUDA graph that keeps `nbytes` for its backward
        (or its I did, keeping `nbytes` for its W)."""
        self._graphed[mb] = nbytes

    def hold_for_weights(self, mb, tensors: list[torch.Tensor]) -> None:
        """After I: the tensors `mb`'s deferred weight gradients keep until its W."""
        table = self._weights.setdefault(mb, {})
        for t in tensors:
            storage = t.untyped_storage()
            if storage._cdata not in self._param_storages:
                table.setdefault(storage._cdata, storage)

    def weights_done(self, mb) -> None:
        """W ran: its inputs are let go (a graphed W's, counted by `hold_graphed` after its I)."""
        self._weights.pop(mb, None)
        self._graphed.pop(mb, None)

    def backward_done(self, mb: int) -> None:
        """Autograd frees what it saved for `mb` once its backward has run."""
        self._saved.pop(mb, None)
        self._graphed.pop(mb, None)

    def drop(self, mb: int) -> None:
        self._held.pop(mb, None)

    def clear(self) -> None:
        self._saved.clear()
        self._held.clear()
        self._graphed.clear()
        self._weights.clear()

    def live_microbatches(self) -> int:
        return len(self._saved.keys() | self._graphed.keys() | self._weights.keys())

    def live_bytes(self) -> int:
        seen: dict[int, torch.UntypedStorage] = {}
        for table in (self._saved, self._held, self._weights):
            for storages in table.values():
                seen.update(storages)
        return sum(s.nbytes() for s in seen.values()) + sum(self._graphed.values())

    def sample(self) -> int:
        live = self.live_bytes()
        self.peak_bytes = max(self.peak_bytes, live)
        return live
