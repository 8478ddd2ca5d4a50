"""Writing one worker's pieces to a shard file.

Each worker calls ``write_shard`` for the pieces it owns and sends the returned entries to
the coordinator, which calls ``manifest.merge_entries`` on all of them and then ``store.commit``.

A shard is written in the safetensors format straight from the tensors' memory (pinned
host snapshots, on a worker): the header, then each tensor's bytes in large writes,
while other threads compute the checksums of the same memory. No serialised copy of the
shard is built first, and both the writes and CRC32 release the interpreter lock, so a
save persists at the storage's speed.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import torch

from . import storage, store
from .manifest import (
    CheckpointError,
    SAFETENSORS_DTYPES,
    PieceEntry,
    PieceResult,
    check_relative_path,
    dtype_name,
    tensor_checksum,
)
from .storage import Location

PieceSpec = tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]

_WRITE_CHUNK = 64 << 20  # one write call's bytes (Linux writes at most ~2 GiB per call)
CHECKSUM_THREADS = 4


def piece_key(name: str, offsets: Sequence[int]) -> str:
    """Key of a piece inside its shard file; the offsets let two pieces of one tensor
    share a file."""
    return f"{name}@{'_'.join(str(o) for o in offsets)}"


def write_shard(ckpt_dir: Location, file: str, pieces: list[PieceSpec]) -> list[PieceResult]:
    """Write (global name, local tensor, offsets, global shape) pieces into one safetensors
    file ``ckpt_dir/file`` (a local folder or a URI), atomically and durably. Returns (name,
    dtype name, PieceEntry) per piece for ``merge_entries``."""
    check_relative_path(file, str(ckpt_dir))
    if store.is_committed(ckpt_dir):
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: already committed; refusing to overwrite {file}"
        )
    tensors: dict[str, torch.Tensor] = {}
    entries: list[tuple[str, tuple[int, ...], torch.Tensor]] = []
    for name, tensor, offsets, global_shape in pieces:
        offsets, global_shape = tuple(int(o) for o in offsets), tuple(int(g) for g in global_shape)
        local = tensor.detach().cpu().contiguous()
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
        if dtype_name(local.dtype) not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"piece of {name!r} for {file}: dtype {local.dtype} cannot be saved "
                                  f"(one of {', '.join(SAFETENSORS_DTYPES)} can)")
        tensors[key] = local
        entries.append((name, offsets, local))
    header = _header(tensors, {"format": "pt", "producer": "raypar.checkpoint"})
    with ThreadPoolExecutor(CHECKSUM_THREADS, thread_name_prefix="checksum") as pool:
        # The file holds exactly these bytes (little-endian, contiguous), so their CRC is the file's.
        checksums = [pool.submit(tensor_checksum, local) for _, _, local in entries]
        storage.write(storage.join(ckpt_dir, file), lambda f: _write_safetensors(f, header, tensors.values()))
        return [(name, dtype_name(local.dtype),
                 PieceEntry(file=file, key=piece_key(name, offsets), offsets=offsets, shape=tuple(local.shape),
                            checksum=crc.result()))
                for (name, offsets, local), crc in zip(entries, checksums)]


def _header(tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """A safetensors header for `tensors` laid out back to back in this order, padded with
    spaces so the data starts on an 8-byte boundary (as safetensors pads it)."""
    doc: dict = {"__metadata__": metadata}
    offset = 0
    for key, t in tensors.items():
        size = t.numel() * t.element_size()
        doc[key] = {"dtype": SAFETENSORS_DTYPES[dtype_name(t.dtype)], "shape": list(t.shape),
                    "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(doc, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)


def _write_safetensors(f: BinaryIO, header: bytes, tensors: Iterable[torch.Tensor]) -> None:
    f.write(struct.pack("<Q", len(header)) + header)
    for t in tensors:
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        for start in range(0, len(raw), _WRITE_CHUNK):
            chunk = raw[start:start + _WRITE_CHUNK]
            while chunk:
                chunk = chunk[f.write(chunk):]
