"""Export a checkpoint's model weights in the Hugging Face safetensors layout.

Output: ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` files when
``max_shard_bytes`` splits it, plus ``model.safetensors.index.json`` in either case
(``{"metadata": {"total_size": bytes}, "weight_map": {name: file}}``).

By default only model weights are exported: every tensor except those whose name starts
with one of ``DEFAULT_EXCLUDED_PREFIXES`` (optimizer moments, fp32 master copies, RNG
states, EMA weights and data-loader state). Pass ``include`` to choose differently.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from . import store
from .manifest import CheckpointError
from .reader import CheckpointReader

DEFAULT_EXCLUDED_PREFIXES = ("optim.", "master.", "rng.", "ema.", "data.")
INDEX_NAME = "model.safetensors.index.json"
_SINGLE_NAME = "model.safetensors"
_SHARD_NAME_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def is_model_weight(name: str) -> bool:
    return not name.startswith(DEFAULT_EXCLUDED_PREFIXES)


def export_hf(
    ckpt_dir: Path | str,
    out_dir: Path | str,
    include: Callable[[str], bool] | None = None,
    rename: Callable[[str], str] | None = None,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write the selected tensors of ``ckpt_dir`` to ``out_dir``; returns ``out_dir``.

    ``rename`` maps checkpoint names to exported names. ``dtype`` casts floating-point
    tensors only (integer buffers keep their type). Tensors are read one output file at
    a time, so memory stays bounded by ``max_shard_bytes`` (or one tensor, if larger).
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    out_dir = Path(out_dir)
    include = include or is_model_weight
    rename = rename or (lambda n: n)
    with CheckpointReader(ckpt_dir) as reader:
        selected = _select(reader, include, rename, dtype)
        groups = _group(selected, max_shard_bytes)
        files = (
            [_SINGLE_NAME]
            if len(groups) == 1
            else [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
        )
        weight_map: dict[str, str] = {}
        total = 0
        for file, group in zip(files, groups):
            tensors = {}
            for src, dst, out_dtype, nbytes in group:
                t = reader.read(src)
                tensors[dst] = t if t.dtype == out_dtype else t.to(out_dtype)
                weight_map[dst] = file
                total += nbytes
            store.atomic_write(
                out_dir / file, lambda tmp, t=tensors: save_file(t, str(tmp), metadata={"format": "pt"})
            )
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    text = json.dumps(index, indent=2) + "\n"
    # The index goes last: it is what points a loader at the new files.
    store.atomic_write(out_dir / INDEX_NAME, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    _remove_stale(out_dir, set(files))
    return out_dir


def _select(
    reader: CheckpointReader,
    include: Callable[[str], bool],
    rename: Callable[[str], str],
    dtype: torch.dtype | None,
) -> list[tuple[str, str, torch.dtype, int]]:
    """(checkpoint name, exported name, exported dtype, bytes) of every exported tensor."""
    chosen = []
    sources: dict[str, str] = {}
    for name in reader.names():
        if not include(name):
            continue
        dst = rename(name)
        if dst in sources:
            raise CheckpointError(
                f"export: tensors {sources[dst]!r} and {name!r} both rename to {dst!r}"
            )
        sources[dst] = name
        entry = reader.entry(name)
        out_dtype = entry.torch_dtype
        if dtype is not None and out_dtype.is_floating_point:
            out_dtype = dtype
        chosen.append((name, dst, out_dtype, math.prod(entry.shape) * out_dtype.itemsize))
    if not chosen:
        raise CheckpointError(f"export: no tensor of checkpoint {reader.ckpt_dir} was selected")
    return chosen


def _group(
    selected: list[tuple[str, str, torch.dtype, int]], max_shard_bytes: int | None
) -> list[list[tuple[str, str, torch.dtype, int]]]:
    """Greedy split in name order; a tensor larger than the limit gets a file of its own."""
    if max_shard_bytes is None:
        return [selected]
    groups: list[list] = [[]]
    size = 0
    for item in selected:
        if groups[-1] and size + item[3] > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item[3]
    return groups


def _remove_stale(out_dir: Path, written: set[str]) -> None:
    # A leftover model.safetensors beside a new sharded index (or old shards of a
    # different count) would make loaders pick up stale weights.
    for name in store.list_files(out_dir):
        if name not in written and (name == _SINGLE_NAME or _SHARD_NAME_RE.match(name)):
            store.remove_file(out_dir / name)
