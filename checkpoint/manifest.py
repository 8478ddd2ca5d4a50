"""The checkpoint manifest: what tensors a checkpoint holds and where each piece lives.

The manifest is the commit record of a checkpoint (see ``store.commit``), so everything
that must be true for a load to succeed is checked here, once, when it is parsed:
paths stay inside the checkpoint directory, pieces lie inside their tensor, and the
pieces of a tensor tile it exactly. Readers can then trust the table.
"""
from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass, field
from pathlib import PurePosixPath, PureWindowsPath
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


from .storage import redact

FORMAT_VERSION = 1

_CHECKSUM_RE = re.compile(r"^crc32:[0-9a-f]{8}$")


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, corrupt, or does not hold what was asked for.
    Credentials of a storage URI in the message are replaced by ***."""

    def __init__(self, message: str = "") -> None:
        super().__init__(redact(str(message)))


@dataclass(frozen=True)
class PieceEntry:
    """One saved hyper-rectangle of a global tensor."""

    file: str  # relative to the checkpoint directory
    key: str  # key inside that safetensors file
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    checksum: str  # "crc32:xxxxxxxx" of the piece's contiguous little-endian bytes

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# What `write_shard` returns per piece: (tensor name, dtype name, where it was written).
PieceResult = tuple[str, str, PieceEntry]


@dataclass
class TensorEntry:
    """A global tensor and the pieces that together hold all of its elements."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    pieces: list[PieceEntry]

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)


@dataclass
class Manifest:
    format_version: int = FORMAT_VERSION
    step: int = 0
    consumed_samples: int = 0
    topology: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    tensors: dict[str, TensorEntry] = field(default_factory=dict)

    def to_json(self) -> str:
        doc = {
            "format_version": self.format_version,
            "step": self.step,
            "consumed_samples": self.consumed_samples,
            "topology": self.topology,
            "config": self.config,
            "extra": self.extra,
            # Sorted so two saves of the same state produce the same manifest bytes.
            "tensors": {name: _tensor_to_doc(self.tensors[name]) for name in sorted(self.tensors)},
        }
        try:
            return json.dumps(doc, indent=1) + "\n"
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"manifest for step {self.step} is not JSON-serialisable: {e}") from e

    @classmethod
    def from_json(cls, text: str, where: str) -> "Manifest":
        """Parse and validate; ``where`` (the checkpoint dir) only feeds error messages."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"checkpoint {where}: manifest.json is not valid JSON: {e}") from e
        if not isinstance(doc, dict):
            raise CheckpointError(f"checkpoint {where}: manifest.json must hold a JSON object")
        version = doc.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"checkpoint {where}: unsupported manifest format_version {version!r} "
                f"(this raypar reads version {FORMAT_VERSION})"
            )
        try:
            manifest = cls(
                format_version=version,
                step=_int(doc["step"], "step"),
                consumed_samples=_int(doc["consumed_samples"], "consumed_samples"),
                topology=_dict(doc.get("topology", {}), "topology"),
                config=_dict(doc.get("config", {}), "config"),
                extra=_dict(doc.get("extra", {}), "extra"),
                tensors={
                    name: _tensor_from_doc(name, t)
                    for name, t in _dict(doc["tensors"], "tensors").items()
                },
            )
        except KeyError as e:
            raise CheckpointError(f"checkpoint {where}: manifest.json lacks field {e}") from e
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint {where}: malformed manifest.json: {e}") from e
        manifest.validate(where)
        return manifest

    def validate(self, where: str) -> None:
        """Raise CheckpointError unless every tensor is exactly tiled by in-bounds pieces."""
        for name, entry in self.tensors.items():
            if entry.name != name:
                raise CheckpointError(
                    f"checkpoint {where}: manifest lists tensor {entry.name!r} under key {name!r}"
                )
            check_tensor_entry(entry, where)


def check_relative_path(file: str, where: str) -> None:
    """Reject names that could make a load read outside the checkpoint directory.

    This is the lexical half; ``store.resolve_inside`` also follows symlinks.
    """
    posix, windows = PurePosixPath(file), PureWindowsPath(file)
    if (
        not file
        or posix.is_absolute()
        or windows.is_absolute()
        or windows.drive
        or ".." in posix.parts
        or ".." in windows.parts
        or file in (".",)
    ):
        raise CheckpointError(
            f"checkpoint {where}: manifest names a path outside the checkpoint directory: {file!r}"
        )


def check_tensor_entry(entry: TensorEntry, where: str) -> None:
    ctx = f"checkpoint {where}: tensor {entry.name!r}"
    if entry.dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"{ctx}: unknown dtype {entry.dtype!r}")
    if any(d < 0 for d in entry.shape):
        raise CheckpointError(f"{ctx}: negative dimension in shape {entry.shape}")
    if not entry.pieces:
        raise CheckpointError(f"{ctx}: has no pieces")
    ndim = len(entry.shape)
    for p in entry.pieces:
        check_relative_path(p.file, where)
        if not _CHECKSUM_RE.match(p.checksum):
            raise CheckpointError(f"{ctx}: piece in {p.file} has malformed checksum {p.checksum!r}")
        if len(p.offsets) != ndim or len(p.shape) != ndim:
            raise CheckpointError(
                f"{ctx}: piece in {p.file} at offsets {p.offsets} with shape {p.shape} "
                f"does not have the tensor's {ndim} dimensions"
            )
        if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(p.offsets, p.shape, entry.shape)):
            raise CheckpointError(
                f"{ctx}: piece in {p.file} at offsets {p.offsets} with shape {p.shape} "
                f"lies outside the global shape {entry.shape}"
            )
    # Disjoint in-bounds pieces whose sizes add up to the tensor's size tile it exactly.
    pieces = entry.pieces
    for i in range(len(pieces)):
        for j in range(i + 1, len(pieces)):
            if boxes_overlap(pieces[i].offsets, pieces[i].shape, pieces[j].offsets, pieces[j].shape):
                a, b = pieces[i], pieces[j]
                raise CheckpointError(
                    f"{ctx}: pieces overlap: {a.file} (offsets {a.offsets}, shape {a.shape}) and "
                    f"{b.file} (offsets {b.offsets}, shape {b.shape}); exactly one writer must "
                    "save each element"
                )
    covered = sum(p.numel for p in pieces)
    total = math.prod(entry.shape)
    if covered != total:
        raise CheckpointError(
            f"{ctx}: pieces cover {covered} of {total} elements of shape {entry.shape} "
            "(a piece is missing)"
        )


def boxes_overlap(
    off_a: tuple[int, ...], shape_a: tuple[int, ...], off_b: tuple[int, ...], shape_b: tuple[int, ...]
) -> bool:
    """True when two hyper-rectangles share at least one element."""
    if math.prod(shape_a) == 0 or math.prod(shape_b) == 0:
        return False
    return all(
        max(oa, ob) < min(oa + sa, ob + sb)
        for oa, sa, ob, sb in zip(off_a, shape_a, off_b, shape_b)
    )


# safetensors' names of the dtypes a checkpoint may hold, by torch's (`dtype_name`). Names,
# not torch dtypes: the writer actor that commits checkpoints runs without torch.
SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r}")
    return dtype


def tensor_checksum(tensor: torch.Tensor) -> str:
    """CRC32 of a CPU tensor's raw bytes, as stored in a safetensors file.

    safetensors stores little-endian data; on a little-endian host (every platform
    raypar runs on) that is the in-memory layout, so no copy is needed.
    """
    import torch

    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"crc32:{zlib.crc32(raw) & 0xFFFFFFFF:08x}"


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


def _tensor_to_doc(entry: TensorEntry) -> dict[str, Any]:
    return {
        "dtype": entry.dtype,
        "shape": list(entry.shape),
        "pieces": [
            {
                "file": p.file,
                "key": p.key,
                "offsets": list(p.offsets),
                "shape": list(p.shape),
                "checksum": p.checksum,
            }
            for p in entry.pieces
        ],
    }


def _tensor_from_doc(name: str, doc: Any) -> TensorEntry:
    doc = _dict(doc, f"tensors[{name!r}]")
    pieces = doc["pieces"]
    if not isinstance(pieces, list):
        raise TypeError(f"tensors[{name!r}].pieces must be a list")
    return TensorEntry(
        name=name,
        dtype=_str(doc["dtype"], "dtype"),
        shape=_ints(doc["shape"], "shape"),
        pieces=[
            PieceEntry(
                file=_str(p["file"], "file"),
                key=_str(p["key"], "key"),
                offsets=_ints(p["offsets"], "offsets"),
                shape=_ints(p["shape"], "shape"),
                checksum=_str(p["checksum"], "checksum"),
            )
            for p in (_dict(p, f"tensors[{name!r}].pieces[]") for p in pieces)
        ],
    )


def _int(value: Any, what: str) -> int:
    # bool is an int subclass; a `true` step is a malformed manifest, not step 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got {value!r}")
    return value


def _ints(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TypeError(f"{what} must be a list of integers, got {value!r}")
    return tuple(_int(v, what) for v in value)


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a string, got {value!r}")
    return value


def _dict(value: Any, what: str) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be an object, got {type(value).__name__}")
    return value
