"""Checkpoint directory layout, atomic commit, listing, cleanup and rotation.

Layout: ``<root>/step-000000123/`` holds shard files and, once committed,
``manifest.json``. The manifest is written last and renamed into place, so its
presence is the single commit point: a directory without it is an interrupted save
and is never loaded.

Every filesystem call of the package lives in this module so that remote storage
(pyarrow.fs) can later replace the local implementation in one place.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

from .manifest import CheckpointError, Manifest, check_relative_path

MANIFEST_NAME = "manifest.json"
_STEP_DIR_RE = re.compile(r"^step-(\d{9,})$")


def checkpoint_dir(root: Path | str, step: int) -> Path:
    if step < 0:
        raise CheckpointError(f"checkpoint step must be >= 0, got {step}")
    return Path(root) / f"step-{step:09d}"


def is_committed(ckpt_dir: Path | str) -> bool:
    return (Path(ckpt_dir) / MANIFEST_NAME).is_file()


def resolve_inside(ckpt_dir: Path | str, file: str) -> Path:
    """The path of ``file`` inside ``ckpt_dir``; refuses names (or symlinks) leading out."""
    ckpt_dir = Path(ckpt_dir)
    check_relative_path(file, str(ckpt_dir))
    path = ckpt_dir / file
    base = ckpt_dir.resolve()
    if not path.resolve().is_relative_to(base):
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: manifest names a path outside the checkpoint directory: "
            f"{file!r} (resolves to {path.resolve()})"
        )
    return path


def atomic_write(path: Path | str, fill: Callable[[Path], None]) -> None:
    """Have ``fill`` write a temporary sibling of ``path``, make it durable, rename it over.

    Readers therefore see either the old file or the complete new one, and after a
    crash at worst a stray ``*.tmp`` in an uncommitted directory.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        fill(tmp)
        _fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def read_manifest(ckpt_dir: Path | str) -> Manifest:
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint {ckpt_dir}: no such directory")
    path = ckpt_dir / MANIFEST_NAME
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: not a committed checkpoint (no {MANIFEST_NAME}; "
            "the save was interrupted or is still running)"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt_dir}: cannot read {MANIFEST_NAME}: {e}") from e
    return Manifest.from_json(text, where=str(ckpt_dir))


def commit(ckpt_dir: Path | str, manifest: Manifest) -> None:
    """Check that every piece is on disk as the manifest says, then publish the manifest."""
    ckpt_dir = Path(ckpt_dir)
    if is_committed(ckpt_dir):
        # Shard files of a committed checkpoint must never change under a reader.
        raise CheckpointError(f"checkpoint {ckpt_dir}: already committed")
    manifest.validate(str(ckpt_dir))
    text = manifest.to_json()
    _check_pieces_on_disk(ckpt_dir, manifest)
    atomic_write(ckpt_dir / MANIFEST_NAME, lambda tmp: _write_text_durably(tmp, text))


def list_committed(root: Path | str) -> list[tuple[int, Path]]:
    """Committed checkpoints under ``root`` as (step, dir), oldest first."""
    return sorted((step, d) for step, d in _step_dirs(root) if is_committed(d))


def latest(root: Path | str) -> Path | None:
    committed = list_committed(root)
    return committed[-1][1] if committed else None


def verify(ckpt_dir: Path | str) -> Manifest:
    """The manifest of a committed checkpoint whose manifest parses and whose every shard
    file holds its pieces' keys and shapes at its announced length; raises CheckpointError
    naming what is wrong. Reads the manifest and the shard headers, not the tensors: their
    checksums are checked as they load."""
    ckpt_dir = Path(ckpt_dir)
    manifest = read_manifest(ckpt_dir)  # parses and validates the tiling
    _check_pieces_on_disk(ckpt_dir, manifest)
    return manifest


def newest_verified(root: Path | str) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest committed checkpoint under ``root`` that `verify` accepts (None: none
    does), and the newer ones it passed over with the reason."""
    passed: list[tuple[Path, str]] = []
    for _, d in reversed(list_committed(root)):
        try:
            verify(d)
        except CheckpointError as e:
            passed.append((d, str(e)))
            continue
        return d, passed
    return None, passed


def resolve(root: Path | str, spec: str | int) -> Path:
    """Turn "latest", a step number, or a path (absolute, or relative to cwd or root) into a
    committed checkpoint directory."""
    root = Path(root)
    spec_text = str(spec).strip()
    if spec_text == "latest":
        found = latest(root)
        if found is None:
            raise CheckpointError(f"no committed checkpoint under {root}")
        return found
    if spec_text.isdigit():
        candidates = [checkpoint_dir(root, int(spec_text))]
    else:
        given = Path(spec_text).expanduser()
        candidates = [given] if given.is_absolute() else [given, root / given]
    for c in candidates:
        if c.is_dir():
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


def set_aside(ckpt_dir: Path | str) -> Path:
    """Rename a checkpoint that does not verify or load to ``<dir>.corrupt`` (``.corrupt-N``
    if taken), where listing, resuming and rotation no longer see it and nothing is deleted.
    Returns the new path."""
    ckpt_dir = Path(ckpt_dir)
    target = ckpt_dir.with_name(ckpt_dir.name + ".corrupt")
    n = 1
    while target.exists():
        target = ckpt_dir.with_name(f"{ckpt_dir.name}.corrupt-{n}")
        n += 1
    os.replace(ckpt_dir, target)
    _fsync_dir(ckpt_dir.parent)
    return target


def cleanup_uncommitted(root: Path | str, keep: Iterable[Path | str] = frozenset()) -> list[Path]:
    """Delete step directories that never got a manifest, except those in ``keep``
    (saves in progress). Returns the removed directories."""
    kept = {Path(k).resolve() for k in keep}
    removed = []
    for _, d in sorted(_step_dirs(root)):
        if not is_committed(d) and d.resolve() not in kept:
            shutil.rmtree(d)
            removed.append(d)
    return removed


def rotate(root: Path | str, keep_last: int, protect: Iterable[Path | str] = frozenset()) -> list[Path]:
    """Delete committed checkpoints older than the newest ``keep_last``; never one in
    ``protect`` (e.g. the one training resumed from). Returns the removed directories."""
    if keep_last < 1:
        raise CheckpointError(f"rotate needs keep_last >= 1, got {keep_last}")
    protected = {Path(p).resolve() for p in protect}
    committed = list_committed(root)
    removed = []
    for _, d in committed[: max(0, len(committed) - keep_last)]:
        if d.resolve() in protected:
            continue
        # Uncommit first: a crash mid-delete then leaves an uncommitted directory that
        # cleanup_uncommitted removes, never a "committed" checkpoint with missing shards.
        (d / MANIFEST_NAME).unlink()
        _fsync_dir(d)
        shutil.rmtree(d)
        removed.append(d)
    return removed


def remove_file(path: Path | str) -> None:
    Path(path).unlink(missing_ok=True)


def list_files(directory: Path | str) -> list[str]:
    directory = Path(directory)
    return sorted(p.name for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []


def _step_dirs(root: Path | str) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = _STEP_DIR_RE.match(d.name)
        if m and d.is_dir():
            out.append((int(m.group(1)), d))
    return out


def _check_pieces_on_disk(ckpt_dir: Path, manifest: Manifest) -> None:
    """Every piece's key must be in its file's header with the right shape, and each file
    must be as long as its header says (catches a shard that was cut short)."""
    wanted: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {}
    for entry in manifest.tensors.values():
        for p in entry.pieces:
            wanted.setdefault(p.file, []).append((entry.name, p.key, p.shape))
    for file, pieces in wanted.items():
        path = resolve_inside(ckpt_dir, file)
        if not path.is_file():
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


def _safetensors_header(path: Path, ckpt_dir: Path) -> dict:
    """Parse a safetensors header (u64 little-endian length, then JSON) and check the
    file is long enough for the data it announces. Reads only the header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"checkpoint {ckpt_dir}: shard file {path.name} is truncated")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"checkpoint {ckpt_dir}: shard file {path.name} is truncated")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"checkpoint {ckpt_dir}: shard file {path.name} has an unreadable header: {e}"
            ) from e
    try:
        header.pop("__metadata__", None)
        end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as e:
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: shard file {path.name} has a malformed header: {e!r}"
        ) from e
    if 8 + n + end != size:
        raise CheckpointError(
            f"checkpoint {ckpt_dir}: shard file {path.name} is {size} bytes, its header "
            f"announces {8 + n + end} (truncated or overwritten)"
        )
    return header


def _write_text_durably(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # Makes a rename durable; some platforms cannot open directories, which only
    # weakens durability there, so it is not an error.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
