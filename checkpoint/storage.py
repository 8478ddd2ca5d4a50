"""Where checkpoints live: a local folder, or any URI that pyarrow.fs opens.

A location is a local path (``str`` or ``Path``) or a URI such as ``s3://bucket/prefix``
(``gs://``, ``hdfs://``, ``abfs://``: whatever ``pyarrow.fs.FileSystem.from_uri`` takes;
query parameters such as ``?endpoint_override=host:port&scheme=http`` and credentials
(``s3://key:secret@bucket/...``; usually they come from the environment instead) stay on
the URI and carry over to every path under it). Local files are written under a temporary name,
fsync'd and renamed; on an object store an object appears whole when its upload
completes, so a process killed mid-upload leaves nothing, and the manifest, written
last, stays the only commit point. Object stores have no directories: a "directory" is a
prefix, and moving one moves each object under it.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit, urlunsplit

Location = str | Path


_CREDENTIALS = re.compile(r"(\w+://)[^/@\s]+@")


def redact(text: str) -> str:
    """`text` with the credentials of any URI in it (scheme://key:secret@...) replaced by ***."""
    return _CREDENTIALS.sub(r"\1***@", text)


def is_uri(path: Location) -> bool:
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def local(path: Location) -> Path:
    return Path(path[len("file://"):] if isinstance(path, str) and path.startswith("file://") else path)


def join(path: Location, *parts: str) -> Location:
    """`path`/`part`/...: a Path for local paths, a URI (query kept at the end) for URIs."""
    if not is_uri(path):
        return local(path).joinpath(*parts)
    u = urlsplit(path)
    return urlunsplit(u._replace(path="/".join([u.path.rstrip("/"), *parts])))


def name(path: Location) -> str:
    return urlsplit(path).path.rstrip("/").rsplit("/", 1)[-1] if is_uri(path) else local(path).name


def parent(path: Location) -> Location:
    if not is_uri(path):
        return local(path).parent
    u = urlsplit(path)
    return urlunsplit(u._replace(path=u.path.rstrip("/").rsplit("/", 1)[0]))


def same(a: Location, b: Location) -> bool:
    """Whether two locations name the same place (local paths resolved)."""
    if is_uri(a) or is_uri(b):
        return str(a).rstrip("/") == str(b).rstrip("/")
    return local(a).resolve() == local(b).resolve()


@functools.lru_cache(maxsize=64)
def _filesystem(key: str):
    import pyarrow.fs as pafs

    fs, _ = pafs.FileSystem.from_uri(key)
    return fs


def _remote(path: str):
    """(pyarrow filesystem, the path in it) of a URI; one filesystem per scheme, host and query."""
    u = urlsplit(path)
    fs = _filesystem(urlunsplit((u.scheme, u.netloc, "/", u.query, "")))
    host = u.netloc.rsplit("@", 1)[-1]  # credentials may sit in the URI (s3://key:secret@bucket/...)
    inner = u.path if u.scheme in ("hdfs", "viewfs") else f"{host}{u.path}"
    return fs, inner.rstrip("/")


def _info(path: str):
    fs, inner = _remote(path)
    return fs.get_file_info(inner)


def is_file(path: Location) -> bool:
    if not is_uri(path):
        return local(path).is_file()
    import pyarrow.fs as pafs

    return _info(path).type == pafs.FileType.File


def is_dir(path: Location) -> bool:
    """A local directory, or a prefix with at least one object under it."""
    if not is_uri(path):
        return local(path).is_dir()
    import pyarrow.fs as pafs

    info = _info(path)
    if info.type == pafs.FileType.Directory:
        return True
    return info.type == pafs.FileType.NotFound and bool(list_dir(path))


def size(path: Location) -> int:
    if not is_uri(path):
        return local(path).stat().st_size
    return _info(path).size


def list_dir(path: Location) -> list[tuple[str, bool]]:
    """(name, is a directory) of each entry directly under `path`; [] when there is none."""
    if not is_uri(path):
        d = local(path)
        return [(p.name, p.is_dir()) for p in d.iterdir()] if d.is_dir() else []
    import pyarrow.fs as pafs

    fs, inner = _remote(path)
    try:
        infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    except (FileNotFoundError, OSError):
        return []
    return [(i.base_name, i.type == pafs.FileType.Directory) for i in infos]


def read_bytes(path: Location, offset: int = 0, length: int | None = None) -> bytes:
    """`length` bytes from `offset` (to the end by default): one ranged read on a store."""
    if not is_uri(path):
        with open(local(path), "rb") as f:
            f.seek(offset)
            return f.read() if length is None else f.read(length)
    fs, inner = _remote(path)
    with fs.open_input_file(inner) as f:
        if length is None:
            length = f.size() - offset
        return f.read_at(length, offset)


def open_input(path: Location, memory_map: bool = False):
    """A pyarrow random-access file for `path`: local files are read with positioned reads
    (or memory-mapped: their pages are then the OS's cache, counted in the process's
    resident memory while mapped), files in a store with ranged requests."""
    import pyarrow as pa

    if not is_uri(path):
        return pa.memory_map(str(local(path)), "r") if memory_map else pa.OSFile(str(local(path)), "r")
    fs, inner = _remote(path)
    return fs.open_input_file(inner)


def write(path: Location, fill: Callable[[BinaryIO], None]) -> None:
    """Have `fill` write the file at `path` so that readers see the whole file or none:
    locally a temporary sibling, fsync'd and renamed over (`write_local`); on a store one
    upload, which a process killed midway never completes (one that raises is deleted)."""
    if is_uri(path):
        fs, inner = _remote(path)
        stream = fs.open_output_stream(inner)
        try:
            fill(stream)
        except BaseException:
            # pyarrow cannot abort an upload: closing completes it, so the partial object
            # goes at once (no manifest names it, and a commit would refuse its length).
            stream.close()
            delete_file(path)
            raise
        stream.close()
        return

    def fill_file(tmp: Path) -> None:
        with open(tmp, "wb", buffering=0) as f:
            fill(f)

    write_local(local(path), fill_file)


def write_local(path: Location, fill: Callable[[Path], None]) -> None:
    """Have `fill` write a temporary sibling of local `path`, make it durable, rename it over.

    Readers therefore see either the old file or the complete new one, and after a crash
    at worst a stray ``*.tmp`` in an uncommitted directory.
    """
    path = local(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        fill(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def delete_file(path: Location) -> None:
    if not is_uri(path):
        local(path).unlink(missing_ok=True)
        return
    fs, inner = _remote(path)
    try:
        fs.delete_file(inner)
    except FileNotFoundError:
        pass


def delete_dir(path: Location) -> None:
    if not is_uri(path):
        shutil.rmtree(local(path))
        return
    fs, inner = _remote(path)
    fs.delete_dir(inner)


def move_dir(src: Location, dst: Location) -> None:
    """Rename a directory; on a store, move each object under the prefix."""
    if not is_uri(src):
        os.replace(local(src), local(dst))
        fsync_dir(local(src).parent)
        return
    import pyarrow.fs as pafs

    fs, a = _remote(src)
    _, b = _remote(dst)
    for info in fs.get_file_info(pafs.FileSelector(a, recursive=True)):
        if info.type == pafs.FileType.File:
            fs.move(info.path, b + info.path[len(a):])
    fs.delete_dir(a)


def fsync_dir(path: Path) -> None:
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
