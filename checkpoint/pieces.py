"""Flat pieces of named tensors: a run of elements in row-major order.

A sharded optimizer splits its state evenly over ranks regardless of tensor boundaries, so
a rank holds, of each tensor, one run of consecutive elements (a flat range). Checkpoints
store hyper-rectangles; a flat range is a few of them (`flat_range_boxes`), so it is saved
as ordinary pieces and any grid, sharded or not, loads it. In memory a flat piece is one
1-D tensor under `piece_name(name, start)`; `FlatPieces` reads any range of a tensor back
from whole tensors and such pieces.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from .manifest import CheckpointError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)
_SEP = "@"


def piece_name(name: str, start: int) -> str:
    """The in-memory name of the flat piece of `name` that begins at element `start`."""
    return f"{name}{_SEP}{start}"


def split_piece_name(key: str) -> tuple[str, int | None]:
    """(tensor name, start) of a `piece_name`; (key, None) for a whole tensor's name."""
    name, sep, start = key.rpartition(_SEP)
    return (name, int(start)) if sep else (key, None)


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The hyper-rectangles, in row-major order, that hold elements [start, stop) of a tensor
    of `shape`; each is contiguous in that order. At most 2 * ndim - 1 of them."""
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"flat range [{start}, {stop}) lies outside a tensor of {numel} elements {tuple(shape)}")
    if start == stop:
        return []
    if not shape:
        return [((), ())]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    inner = tuple(shape[1:])
    if start % row == 0 and stop % row == 0 or not inner:
        return [((first,) + (0,) * len(inner), (last - first + 1,) + inner)]
    if first == last:
        return [((first,) + o, (1,) + s) for o, s in flat_range_boxes(inner, start - first * row, stop - first * row)]
    boxes: list[Box] = []
    head_end = (first + 1) * row
    if start % row:
        boxes += [((first,) + o, (1,) + s) for o, s in flat_range_boxes(inner, start - first * row, row)]
        start = head_end
    whole_rows = stop // row - start // row
    if whole_rows:
        boxes.append(((start // row,) + (0,) * len(inner), (whole_rows,) + inner))
    if stop % row:
        boxes += [((last,) + o, (1,) + s) for o, s in flat_range_boxes(inner, 0, stop - last * row)]
    return boxes


class FlatPieces:
    """Ranges of named tensors read from whole tensors and flat pieces held in memory
    (`piece_name` keys, e.g. several ranks' shares of one optimizer state)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._whole: dict[str, torch.Tensor] = {}
        self._pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for key, t in tensors.items():
            name, start = split_piece_name(key)
            if start is None:
                self._whole[name] = t
            else:
                self._pieces.setdefault(name, []).append((start, t.reshape(-1)))
        for pieces in self._pieces.values():
            pieces.sort(key=lambda p: p[0])

    @property
    def names(self) -> set[str]:
        return set(self._whole) | set(self._pieces)

    def read(self, name: str) -> torch.Tensor:
        """A whole tensor (a flat one when it is held in pieces: the caller shapes it)."""
        if name in self._whole:
            return self._whole[name]
        pieces = self._pieces.get(name)
        if not pieces:
            raise KeyError(name)
        return self.read_flat(name, 0, pieces[-1][0] + pieces[-1][1].numel())

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of `name` in row-major order, as a new 1-D tensor."""
        if name in self._whole:
            return self._whole[name].reshape(-1)[start:stop].clone()
        pieces = self._pieces.get(name)
        if pieces is None:
            raise KeyError(name)
        out = torch.empty(stop - start, dtype=pieces[0][1].dtype)
        filled = 0
        for at, piece in pieces:
            lo, hi = max(start, at), min(stop, at + piece.numel())
            if lo < hi:
                out[lo - start:hi - start] = piece[lo - at:hi - at]
                filled += hi - lo
        if filled != stop - start:
            raise CheckpointError(f"{name}: the pieces in memory hold {filled} of elements [{start}, {stop})")
        return out


def read_flat_from_boxes(read_box, shape: tuple[int, ...], name: str, start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of `name` (of `shape`) through `read_box(name, offsets, shape)`."""
    parts: Iterable[torch.Tensor] = (read_box(name, o, s).reshape(-1) for o, s in flat_range_boxes(shape, start, stop))
    parts = list(parts)
    if not parts:
        return torch.empty(0)
    return parts[0] if len(parts) == 1 else torch.cat(parts)
