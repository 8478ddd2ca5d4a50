"""Checkpoint directory layout, atomic commit, listing, cleanup and rotation.

Layout: ``<root>/step-000000123/`` holds shard files and, once committed,
``manifest.json``. The manifest is written last and renamed into place, so its
presence is the single commit point: a directory without it is an interrupted save
and is never loaded.

A root is a local folder or a URI that pyarrow.fs opens (``s3://bucket/prefix``...):
every file operation goes through ``storage``. On an object store the manifest is one
object, uploaded last, so listing shows committed checkpoints only; rotation deletes a
checkpoint's manifest before its shards.
"""
from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable
from pathlib import Path

from . import storage
from .manifest import CheckpointError, Manifest, check_relative_path
from .storage import Location

MANIFEST_NAME = "manifest.json"
_STEP_DIR_RE = re.compile(r"^step-(\d{9,})$")


def checkpoint_dir(root: Location, step: int) -> Location:
    if step < 0:
        raise CheckpointError(f"checkpoint step must be >= 0, got {step}")
    return storage.join(root, f"step-{step:09d}")


def is_committed(ckpt_dir: Location) -> bool:
    return storage.is_file(storage.join(ckpt_dir, MANIFEST_NAME))


def resolve_inside(ckpt_dir: Location, file: str) -> Location:
    """The path of ``file`` inside ``ckpt_dir``; refuses names (or symlinks) leading out."""
    check_relative_path(file, str(ckpt_dir))
    if storage.is_uri(ckpt_dir):
        return storage.join(ckpt_dir, file)  # no symlinks on a store
    ckpt_dir = storage.local(ckpt_dir)
    path = ckpt_dir / file
    base = ckpt_dir.resolve()
    if not path.resolve().is_relative_to(base):
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: manifest names a path outside the checkpoint directory: "
            f"{file!r} (resolves to {path.resolve()})"
        )
    return path


# For writers that take a file name (parquet, text); `storage.write` takes a stream and URIs.
atomic_write = storage.write_local


def read_manifest(ckpt_dir: Location) -> Manifest:
    path = storage.join(ckpt_dir, MANIFEST_NAME)
    if not storage.is_file(path):
        if not storage.is_dir(ckpt_dir):
            raise CheckpointError(f"checkpoint {ckpt_dir}: no such directory")
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: not a committed checkpoint (no {MANIFEST_NAME}; "
            "the save was interrupted or is still running)"
        )
    try:
        text = storage.read_bytes(path).decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt_dir}: cannot read {MANIFEST_NAME}: {e}") from e
    return Manifest.from_json(text, where=str(ckpt_dir))


def commit(ckpt_dir: Location, manifest: Manifest) -> None:
    """Check that every piece is on disk as the manifest says, then publish the manifest."""
    if is_committed(ckpt_dir):
        # Shard files of a committed checkpoint must never change under a reader.
        raise CheckpointError(f"checkpoint {ckpt_dir}: already committed")
    manifest.validate(str(ckpt_dir))
    text = manifest.to_json()
    _check_pieces_on_disk(ckpt_dir, manifest)
    storage.write(storage.join(ckpt_dir, MANIFEST_NAME), lambda f: f.write(text.encode("utf-8")))


def list_committed(root: Location) -> list[tuple[int, Location]]:
    """Committed checkpoints under ``root`` as (step, dir), oldest first."""
    return sorted((step, d) for step, d in _step_dirs(root) if is_committed(d))


def latest(root: Location) -> Location | None:
    committed = list_committed(root)
    return committed[-1][1] if committed else None


def verify(ckpt_dir: Location) -> Manifest:
    """The manifest of a committed checkpoint whose manifest parses and whose every shard
    file holds its pieces' keys and shapes at its announced length; raises CheckpointError
    naming what is wrong. Reads the manifest and the shard headers, not the tensors: their
    checksums are checked as they load."""
    manifest = read_manifest(ckpt_dir)  # parses and validates the tiling
    _check_pieces_on_disk(ckpt_dir, manifest)
    return manifest


def newest_verified(root: Location) -> tuple[Location | None, list[tuple[Location, str]]]:
    """The newest committed checkpoint under ``root`` that `verify` accepts (None: none
    does), and the newer ones it passed over with the reason."""
    passed: list[tuple[Location, str]] = []
    for _, d in reversed(list_committed(root)):
        try:
            verify(d)
        except CheckpointError as e:
            passed.append((d, str(e)))
            continue
        return d, passed
    return None, passed


def resolve(root: Location, spec: str | int) -> Location:
    """Turn "latest", a step number, or a path (absolute, or relative to cwd or root; or a
    URI) into a committed checkpoint directory."""
    spec_text = str(spec).strip()
    if spec_text == "latest":
        found = latest(root)
        if found is None:
            raise CheckpointError(f"no committed checkpoint under {root}")
        return found
    if spec_text.isdigit():
        candidates = [checkpoint_dir(root, int(spec_text))]
    elif storage.is_uri(spec_text):
        candidates = [spec_text]
    else:
        given = Path(spec_text).expanduser()
        candidates = [given] if given.is_absolute() else [given, storage.join(root, spec_text)]
    for c in candidates:
        if storage.is_dir(c):
            if not is_committed(c):
                raise CheckpointError(
                    f"checkpoint {c}: not a committed checkpoint (no {MANIFEST_NAME})"
                )
            return c
    steps = [s for s, _ in list_committed(root)]
    raise CheckpointError(
        f"no checkpoint {spec_text!r} (looked for {', '.join(str(c) for c in candidates)}); "
        f"committed steps under {root}: {steps if steps else 'none'}"
    )


def set_aside(ckpt_dir: Location) -> Location:
    """Rename a checkpoint that does not verify or load to ``<dir>.corrupt`` (``.corrupt-N``
    if taken), where listing, resuming and rotation no longer see it and nothing is deleted.
    Returns the new path."""
    base, name = storage.parent(ckpt_dir), storage.name(ckpt_dir)
    target = storage.join(base, f"{name}.corrupt")
    n = 1
    while storage.is_dir(target):
        target = storage.join(base, f"{name}.corrupt-{n}")
        n += 1
    storage.move_dir(ckpt_dir, target)
    return target


def cleanup_uncommitted(root: Location, keep: Iterable[Location] = frozenset()) -> list[Location]:
    """Delete step directories that never got a manifest, except those in ``keep``
    (saves in progress). Returns the removed directories."""
    removed = []
    for _, d in sorted(_step_dirs(root), key=lambda x: x[0]):
        if not is_committed(d) and not any(storage.same(d, k) for k in keep):
            storage.delete_dir(d)
            removed.append(d)
    return removed


def rotate(root: Location, keep_last: int, protect: Iterable[Location] = frozenset()) -> list[Location]:
    """Delete committed checkpoints older than the newest ``keep_last``; never one in
    ``protect`` (e.g. the one training resumed from). Returns the removed directories."""
    if keep_last < 1:
        raise CheckpointError(f"rotate needs keep_last >= 1, got {keep_last}")
    committed = list_committed(root)
    removed = []
    for _, d in committed[: max(0, len(committed) - keep_last)]:
        if any(storage.same(d, p) for p in protect):
            continue
        # Uncommit first: a crash mid-delete then leaves an uncommitted directory that
        # cleanup_uncommitted removes, never a "committed" checkpoint with missing shards.
        storage.delete_file(storage.join(d, MANIFEST_NAME))
        if not storage.is_uri(d):
            storage.fsync_dir(storage.local(d))
        storage.delete_dir(d)
        removed.append(d)
    return removed


def remove_file(path: Location) -> None:
    storage.delete_file(path)


def list_files(directory: Location) -> list[str]:
    return sorted(name for name, is_dir in storage.list_dir(directory) if not is_dir)


def _step_dirs(root: Location) -> list[tuple[int, Location]]:
    out = []
    for name, is_dir in storage.list_dir(root):
        m = _STEP_DIR_RE.match(name)
        if m and is_dir:
            out.append((int(m.group(1)), storage.join(root, name)))
    return out


def _check_pieces_on_disk(ckpt_dir: Location, manifest: Manifest) -> None:
    """Every piece's key must be in its file's header with the right shape, and each file
    must be as long as its header says (catches a shard that was cut short)."""
    wanted: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {}
    for entry in manifest.tensors.values():
        for p in entry.pieces:
            wanted.setdefault(p.file, []).append((entry.name, p.key, p.shape))
    for file, pieces in wanted.items():
        path = resolve_inside(ckpt_dir, file)
        if not storage.is_file(path):
            raise CheckpointError(
                f"checkpoint {ckpt_dir}: shard file {file} is missing "
                f"(needed by tensor {pieces[0][0]})"
            )
        header = _safetensors_header(path, ckpt_dir)
        for name, key, shape in pieces:
            info = header.get(key)
            if info is None:
                raise CheckpointError(
                    f"checkpoint {ckpt_dir}: shard file {file} lacks key {key!r} (tensor {name})"
                )
            if tuple(info.get("shape", ())) != shape:
                raise CheckpointError(
                    f"checkpoint {ckpt_dir}: shard file {file} holds key {key!r} with shape "
                    f"{tuple(info.get('shape', ()))}, manifest says {shape} (tensor {name})"
                )


def _safetensors_header(path: Location, ckpt_dir: Location) -> dict:
    """Parse a safetensors header (u64 little-endian length, then JSON) and check the
    file is long enough for the data it announces. Reads only the header."""
    size, file = storage.size(path), storage.name(path)
    head = storage.read_bytes(path, 0, 8) if size >= 8 else b""
    if len(head) < 8:
        raise CheckpointError(f"checkpoint {ckpt_dir}: shard file {file} is truncated")
    (n,) = struct.unpack("<Q", head)
    if 8 + n > size:
        raise CheckpointError(f"checkpoint {ckpt_dir}: shard file {file} is truncated")
    try:
        header = json.loads(storage.read_bytes(path, 8, n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: shard file {file} has an unreadable header: {e}"
        ) from e
    try:
        header.pop("__metadata__", None)
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: shard file {file} has a malformed header: {e!r}"
        ) from e
    if 8 + n + end != size:
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: shard file {file} is {size} bytes, its header "
            f"announces {8 + n + end} (truncated or overwritten)"
        )
    return header
