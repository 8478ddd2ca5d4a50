"""Writing one worker's pieces to a shard file, and assembling the manifest's tensor table.

Each worker calls ``write_shard`` for the pieces it owns and sends the returned entries to
the coordinator, which calls ``merge_entries`` on all of them and then ``store.commit``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import store
from .manifest import (
    CheckpointError,
    PieceEntry,
    TensorEntry,
    check_relative_path,
    check_tensor_entry,
    dtype_name,
    tensor_checksum,
)

PieceSpec = tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]
PieceResult = tuple[str, str, PieceEntry]


def piece_key(name: str, offsets: Sequence[int]) -> str:
    """Key of a piece inside its shard file; the offsets let two pieces of one tensor
    share a file."""
    return f"{name}@{'_'.join(str(o) for o in offsets)}"


def write_shard(ckpt_dir: Path | str, file: str, pieces: list[PieceSpec]) -> list[PieceResult]:
    """Write (global name, local tensor, offsets, global shape) pieces into one safetensors
    file ``ckpt_dir/file``, atomically and durably. Returns (name, dtype name, PieceEntry)
    per piece for ``merge_entries``."""
    ckpt_dir = Path(ckpt_dir)
    check_relative_path(file, str(ckpt_dir))
    if store.is_committed(ckpt_dir):
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: already committed; refusing to overwrite {file}"
        )
    tensors: dict[str, torch.Tensor] = {}
    results: list[PieceResult] = []
    spans: list[tuple[int, int]] = []
    for name, tensor, offsets, global_shape in pieces:
        offsets, global_shape = tuple(int(o) for o in offsets), tuple(int(g) for g in global_shape)
        local = _to_cpu_contiguous(tensor, spans)
        shape = tuple(local.shape)
        if len(offsets) != local.ndim or len(global_shape) != local.ndim:
            raise CheckpointError(
                f"piece of {name!r} for {file}: offsets {offsets} and global shape {global_shape} "
                f"do not match the local tensor's {local.ndim} dimensions"
            )
        if any(o < 0 or o + s > g for o, s, g in zip(offsets, shape, global_shape)):
            raise CheckpointError(
                f"piece of {name!r} for {file}: offsets {offsets} with shape {shape} lie outside "
                f"the global shape {global_shape}"
            )
        key = piece_key(name, offsets)
        if key in tensors:
            raise CheckpointError(f"piece of {name!r} at offsets {offsets} given twice for {file}")
        tensors[key] = local
        results.append(
            (
                name,
                dtype_name(local.dtype),
                PieceEntry(
                    file=file,
                    key=key,
                    offsets=offsets,
                    shape=shape,
                    # safetensors writes exactly these bytes (little-endian, contiguous).
                    checksum=tensor_checksum(local),
                ),
            )
        )
    metadata = {"format": "pt", "producer": "raypar.checkpoint"}
    store.atomic_write(ckpt_dir / file, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return results


def merge_entries(
    results: Iterable[PieceResult | Iterable[PieceResult]],
    shapes: Mapping[str, Sequence[int]],
) -> dict[str, TensorEntry]:
    """Assemble the manifest's tensor table from every writer's ``write_shard`` results.

    ``results`` may be flat (name, dtype, PieceEntry) triples or one list of them per
    worker. ``shapes`` gives each tensor's global shape. Raises CheckpointError when two
    writers saved overlapping elements, dtypes disagree, or a tensor is not fully covered.
    """
    by_name: dict[str, list[PieceEntry]] = {}
    dtypes: dict[str, str] = {}
    for name, dtype, piece in _flatten(results):
        if dtypes.setdefault(name, dtype) != dtype:
            raise CheckpointError(
                f"tensor {name!r}: writers disagree on dtype ({dtypes[name]} vs {dtype} in {piece.file})"
            )
        by_name.setdefault(name, []).append(piece)
    unknown = sorted(set(by_name) - set(shapes))
    if unknown:
        raise CheckpointError(f"no global shape given for tensors {unknown[:5]}")
    unwritten = sorted(set(shapes) - set(by_name))
    if unwritten:
        raise CheckpointError(f"no writer saved tensors {unwritten[:5]}")
    table: dict[str, TensorEntry] = {}
    for name in sorted(by_name):
        entry = TensorEntry(
            name=name,
            dtype=dtypes[name],
            shape=tuple(int(d) for d in shapes[name]),
            pieces=sorted(by_name[name], key=lambda p: (p.offsets, p.file)),
        )
        check_tensor_entry(entry, where="being saved")
        table[name] = entry
    return table


def _flatten(results: Iterable) -> Iterable[PieceResult]:
    for item in results:
        if isinstance(item, tuple) and len(item) == 3 and isinstance(item[2], PieceEntry):
            yield item
        else:
            yield from item


def _to_cpu_contiguous(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    # safetensors refuses two entries backed by overlapping memory (e.g. tied weights
    # written under both names); copying the later one sidesteps that. Disjoint views of
    # one buffer are fine and are not copied.
    if t.numel() > 0:
        start = t.data_ptr()
        span = (start, start + t.numel() * t.element_size())
        if any(a < span[1] and span[0] < b for a, b in spans):
            t = t.clone()
            start = t.data_ptr()
            span = (start, start + t.numel() * t.element_size())
        spans.append(span)
    return t
