"""Loading with resharding: read any hyper-rectangle of a saved tensor, whatever pieces it
was saved as.

A read is planned first (``plan_reads``: which saved pieces intersect the request, and
which slice of each lands where) and then executed by reading only those slices through
safetensors' lazy ``get_slice``, so a worker loading its shard of a large tensor does not
materialise the other workers' pieces. On remote storage (a URI) each piece is one ranged
read of its bytes.
"""
from __future__ import annotations

import difflib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from . import storage, store
from .pieces import read_flat_from_boxes
from .manifest import (SAFETENSORS_DTYPES, CheckpointError, Manifest, PieceEntry, TensorEntry, dtype_from_name,
                       tensor_checksum)
from .storage import Location


@dataclass(frozen=True)
class ReadOp:
    """Copy ``piece[src]`` into ``target[dst]``."""

    piece: PieceEntry
    src: tuple[slice, ...]  # within the piece
    dst: tuple[slice, ...]  # within the requested rectangle


def plan_reads(entry: TensorEntry, offsets: tuple[int, ...], shape: tuple[int, ...]) -> list[ReadOp]:
    """The reads that assemble ``entry[offsets : offsets + shape]``; only pieces that share
    at least one element with the request appear."""
    if math.prod(shape) == 0:
        return []
    ops = []
    for p in entry.pieces:
        lo = [max(o, po) for o, po in zip(offsets, p.offsets)]
        hi = [min(o + s, po + ps) for o, s, po, ps in zip(offsets, shape, p.offsets, p.shape)]
        if any(l >= h for l, h in zip(lo, hi)):
            continue
        ops.append(
            ReadOp(
                piece=p,
                src=tuple(slice(l - po, h - po) for l, h, po in zip(lo, hi, p.offsets)),
                dst=tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, offsets)),
            )
        )
    return ops


class CheckpointReader:
    """Reads tensors of one committed checkpoint. Use as a context manager, or call
    ``close()``, to release the memory-mapped shard files."""

    def __init__(self, ckpt_dir: Location, verify: bool = True):
        self.ckpt_dir = ckpt_dir if storage.is_uri(ckpt_dir) else Path(ckpt_dir)
        self.verify = verify
        self.manifest: Manifest = store.read_manifest(self.ckpt_dir)
        # Lexical checks ran while parsing; this one also follows symlinks.
        self._paths = {
            p.file: store.resolve_inside(self.ckpt_dir, p.file)
            for e in self.manifest.tensors.values()
            for p in e.pieces
        }
        self._handles: dict[str, Any] = {}
        self._verified: set[tuple[str, str]] = set()

    def names(self) -> list[str]:
        return sorted(self.manifest.tensors)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.manifest.tensors[name]
        except KeyError:
            close = difflib.get_close_matches(name, self.manifest.tensors, n=5, cutoff=0.6)
            hint = f"; close names: {', '.join(close)}" if close else ""
            raise CheckpointError(
                f"checkpoint {self.ckpt_dir}: no tensor named {name!r} "
                f"({len(self.manifest.tensors)} tensors saved){hint}"
            ) from None

    def read(
        self,
        name: str,
        offsets: tuple[int, ...] | None = None,
        shape: tuple[int, ...] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The rectangle ``name[offsets : offsets + shape]`` (the whole tensor by default),
        written into ``out`` when given (which may live on any device)."""
        entry = self.entry(name)
        offsets = tuple(offsets) if offsets is not None else (0,) * len(entry.shape)
        if shape is None:
            shape = tuple(g - o for g, o in zip(entry.shape, offsets))
        shape = tuple(shape)
        self._check_request(entry, offsets, shape)
        dtype = entry.torch_dtype
        if out is not None:
            if tuple(out.shape) != shape or out.dtype != dtype:
                raise CheckpointError(
                    f"checkpoint {self.ckpt_dir}: out for {name} is {out.dtype} {tuple(out.shape)}, "
                    f"the request is {dtype} {shape}"
                )
            target = out
        else:
            target = torch.empty(shape, dtype=dtype)
        for op in plan_reads(entry, offsets, shape):
            target[op.dst] = self._read_piece_slice(entry, op)
        return target

    def read_flat(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of `name` in row-major order (a sharded optimizer's share)."""
        return read_flat_from_boxes(self.read, self.entry(name).shape, name, start, stop)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_request(self, entry: TensorEntry, offsets: tuple[int, ...], shape: tuple[int, ...]) -> None:
        if (
            len(offsets) != len(entry.shape)
            or len(shape) != len(entry.shape)
            or any(o < 0 or s < 0 or o + s > g for o, s, g in zip(offsets, shape, entry.shape))
        ):
            raise CheckpointError(
                f"checkpoint {self.ckpt_dir}: request offsets {offsets} shape {shape} lies outside "
                f"tensor {entry.name} of shape {entry.shape}"
            )

    def _read_piece_slice(self, entry: TensorEntry, op: ReadOp) -> torch.Tensor:
        piece = op.piece
        where = f"{piece.file} for tensor {entry.name} (piece at offsets {piece.offsets})"
        handle = self._open(piece.file, entry.name)
        try:
            lazy = handle.get_slice(piece.key)
            stored_shape = tuple(lazy.get_shape())
        except Exception as e:  # safetensors raises its own untyped errors
            raise CheckpointError(
                f"checkpoint {self.ckpt_dir}: cannot read key {piece.key!r} in {where}: {e}"
            ) from e
        if stored_shape != piece.shape:
            raise CheckpointError(
                f"checkpoint {self.ckpt_dir}: {where} holds shape {stored_shape}, "
                f"manifest says {piece.shape}"
            )
        whole = self.verify and (piece.file, piece.key) not in self._verified
        try:
            # A 0-d tensor cannot be sliced; verification needs every byte anyway.
            data = handle.get_tensor(piece.key) if whole or not piece.shape else lazy[op.src]
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {self.ckpt_dir}: cannot read {where}: {e}"
            ) from e
        if data.dtype != entry.torch_dtype:
            raise CheckpointError(
                f"checkpoint {self.ckpt_dir}: {where} is stored as {data.dtype}, "
                f"manifest says {entry.dtype}"
            )
        if whole:
            if tensor_checksum(data) != piece.checksum:
                raise CheckpointError(
                    f"checkpoint {self.ckpt_dir}: checksum mismatch in {where}: the file is corrupt"
                )
            self._verified.add((piece.file, piece.key))
            data = data[op.src]
        return data

    def _open(self, file: str, tensor: str) -> Any:
        handle = self._handles.get(file)
        if handle is not None:
            return handle
        path = self._paths[file]
        if not storage.is_file(path):
            raise CheckpointError(
                f"checkpoint {self.ckpt_dir}: shard file {file} is missing (needed by tensor {tensor})"
            )
        try:
            handle = _RemoteShard(path) if storage.is_uri(path) else safe_open(str(path), framework="pt")
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {self.ckpt_dir}: shard file {file} is unreadable or truncated "
                f"(needed by tensor {tensor}): {e}"
            ) from e
        self._handles[file] = handle
        return handle


_DTYPES = {code: dtype_from_name(name) for name, code in SAFETENSORS_DTYPES.items()}


class _RemoteShard:
    """safetensors' `safe_open` handle for a file on remote storage: the header read once,
    each tensor one ranged read."""

    def __init__(self, path: str):
        self.path = path
        (n,) = struct.unpack("<Q", storage.read_bytes(path, 0, 8))
        self.header = json.loads(storage.read_bytes(path, 8, n))
        self.header.pop("__metadata__", None)
        self.data_start = 8 + n

    def get_tensor(self, key: str) -> torch.Tensor:
        info = self.header[key]
        begin, end = info["data_offsets"]
        raw = bytearray(storage.read_bytes(self.path, self.data_start + begin, end - begin))
        dtype = _DTYPES[info["dtype"]]
        flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        return flat.reshape(info["shape"])

    def get_slice(self, key: str) -> "_RemoteSlice":
        if key not in self.header:
            raise KeyError(key)
        return _RemoteSlice(self, key)


class _RemoteSlice:
    def __init__(self, shard: _RemoteShard, key: str):
        self.shard, self.key = shard, key

    def get_shape(self) -> list[int]:
        return list(self.shard.header[self.key]["shape"])

    def __getitem__(self, index) -> torch.Tensor:
        return self.shard.get_tensor(self.key)[index]
