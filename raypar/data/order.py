"""Deterministic global sample order.

The order is a pure function of (num_samples, seed, shuffle, position): resuming
from a checkpoint only needs ``consumed_samples``, and any number of readers
(data-parallel replicas, restarted actors, a different world size after an
elastic resize) agree on which sample sits at each stream position.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["SampleOrder", "split_batch"]


class SampleOrder:
    """Deterministic global sample order.

    Epoch ``e`` is a permutation of ``range(N)`` drawn from ``(seed, e)``. Position
    ``k`` of the stream (``k = consumed_samples``) is sample ``perm_{k // N}[k % N]``.
    With ``shuffle=False`` the order is ``0..N-1`` repeated.
    """

    def __init__(self, num_samples: int, seed: int, shuffle: bool = True):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if seed < 0:
            # numpy's SeedSequence rejects negative entropy; fail at construction.
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        # (epoch, permutation) held as one tuple so a concurrent reader (threaded
        # actor) never sees an epoch paired with another epoch's permutation.
        self._cache: tuple[int, np.ndarray] | None = None

    def epoch_of(self, position: int) -> int:
        if position < 0:
            raise ValueError(f"stream position must be >= 0, got {position}")
        return position // self.num_samples

    def _perm(self, epoch: int) -> np.ndarray:
        cache = self._cache
        if cache is not None and cache[0] == epoch:
            return cache[1]
        # Seeding from [seed, epoch] makes each epoch independent of which epochs
        # were computed before, which keeps the order pure.
        perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        self._cache = (epoch, perm)
        return perm

    def indices(self, start: int, count: int) -> list[int]:
        """Sample ids at stream positions ``[start, start + count)``; may cross epochs."""
        if start < 0 or count < 0:
            raise ValueError(f"start and count must be >= 0, got start={start} count={count}")
        n = self.num_samples
        out: list[int] = []
        pos, end = start, start + count
        while pos < end:
            epoch, offset = divmod(pos, n)
            take = min(n - offset, end - pos)
            if self.shuffle:
                out.extend(self._perm(epoch)[offset : offset + take].tolist())
            else:
                out.extend(range(offset, offset + take))
            pos += take
        return out


def split_batch(indices: Sequence[int], parts: int, part: int) -> list[int]:
    """Return the ``part``-th of ``parts`` contiguous equal slices of ``indices``.

    Used to hand data-parallel replicas and micro-batches their share of a batch.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if not 0 <= part < parts:
        raise ValueError(f"part must be in [0, {parts}), got {part}")
    if len(indices) % parts:
        raise ValueError(
            f"batch of {len(indices)} samples does not split into {parts} equal parts; "
            f"make the batch size a multiple of {parts}"
        )
    size = len(indices) // parts
    return list(indices[part * size : (part + 1) * size])
