"""Token rows into a corpus: one Parquet file, or a folder of shards of bounded size and a
manifest written last.

Rows arrive in order and are cut into row groups of bounded bytes (a streaming reader reads
one per sample it needs) and the row groups into shards, so a corpus of any size is written
in the memory of one row group. Every file is written under a `.tmp` name (which readers
skip) and renamed once complete; `manifest.json` (`raypar.data.manifest`), written last and
atomically, lists the shards with their sample counts and checksums: a folder with one is
complete.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raypar.checkpoint.store import atomic_write
from raypar.data.manifest import MANIFEST_NAME, CorpusManifest, ShardEntry
from raypar.data.shards import TOKENS_COLUMN, DataError

__all__ = ["DEFAULT_ROW_GROUP_BYTES", "DEFAULT_SHARD_BYTES", "RowSink", "ShardFile", "check_output", "open_sink",
           "rows_fitting", "write_manifest"]

DEFAULT_SHARD_BYTES = 256 * 2**20
# A random sample reads its whole row group: small ones keep a read cheap.
DEFAULT_ROW_GROUP_BYTES = 2**20
_TOKEN_BYTES = 4  # int32
_SHARD_NAME = "part-{:05d}.parquet"


def rows_fitting(budget_bytes: int, seq_len: int) -> int:
    """Rows of seq_len + 1 int32 tokens within `budget_bytes` of token data; at least one."""
    return max(1, budget_bytes // ((seq_len + 1) * _TOKEN_BYTES))


def _rows_table(rows: np.ndarray, schema: pa.Schema) -> pa.Table:
    n, width = rows.shape
    values = pa.array(rows.reshape(-1), type=pa.int32())
    if pa.types.is_large_list(schema.field(TOKENS_COLUMN).type):
        column = pa.LargeListArray.from_arrays(pa.array(np.arange(0, n * width + 1, width, dtype=np.int64)), values)
    else:
        column = pa.ListArray.from_arrays(pa.array(np.arange(0, n * width + 1, width, dtype=np.int32)), values)
    return pa.Table.from_arrays([column], schema=schema)


class ShardFile:
    """One Parquet file written under a `.tmp` name (which readers skip) and renamed when complete."""

    def __init__(self, path: pathlib.Path, schema: pa.Schema) -> None:
        self.path = path
        self.rows = 0
        self._schema = schema
        self._tmp = path.with_name(path.name + ".tmp")
        # zstd level 1: token ids shrink to about half (less disk, less to fetch from
        # an object store) and decode far faster than storage delivers, so a 1 MiB row
        # group stays a cheap random read. Dictionary encoding saves nothing on top of
        # zstd for ids and costs write time.
        self._writer = pq.ParquetWriter(self._tmp, schema, compression="zstd", compression_level=1,
                                        use_dictionary=False)

    def write_group(self, rows: np.ndarray) -> None:
        self._writer.write_table(_rows_table(rows, self._schema), row_group_size=len(rows))
        self.rows += len(rows)

    def finish(self, footer: dict[bytes, bytes] | None = None) -> ShardEntry:
        if footer:
            self._writer.add_key_value_metadata(footer)
        self._writer.close()
        digest = hashlib.sha256()
        with self._tmp.open("rb") as f:
            while chunk := f.read(4 * 2**20):
                digest.update(chunk)
            os.fsync(f.fileno())  # durable before the rename publishes it
        size = self._tmp.stat().st_size
        os.replace(self._tmp, self.path)
        return ShardEntry(path=self.path.name, samples=self.rows, bytes=size, sha256=digest.hexdigest())

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self._tmp.unlink(missing_ok=True)


class RowSink:
    """Cuts incoming rows into row groups and the row groups into shards (files)."""

    def __init__(self, shard_path: Callable[[int], pathlib.Path], schema: pa.Schema, group_rows: int,
                 shard_rows: int | None) -> None:
        self._shard_path = shard_path
        self._schema = schema
        self._group_rows = group_rows
        self._shard_rows = shard_rows  # None: one file, however large
        self._pending: list[np.ndarray] = []
        self._pending_rows = 0
        self._file: ShardFile | None = None
        self.shards: list[ShardEntry] = []
        self.rows = 0  # accepted, whether written yet or pending
        self.max_token = -1

    def _next_group(self) -> int:
        if self._shard_rows is None:
            return self._group_rows
        return min(self._group_rows, self._shard_rows - (self._file.rows if self._file else 0))

    def add(self, rows: np.ndarray) -> None:
        self.rows += len(rows)
        self.max_token = max(self.max_token, int(rows.max(initial=-1)))
        self._pending.append(rows)
        self._pending_rows += len(rows)
        if self._pending_rows < self._next_group():
            return
        block = np.concatenate(self._pending)
        start = 0
        while len(block) - start >= (take := self._next_group()):
            self._write(block[start:start + take])
            start += take
        # A copy: a view would keep the whole block alive until the next add.
        self._pending = [block[start:].copy()]
        self._pending_rows = len(block) - start

    def _write(self, rows: np.ndarray) -> None:
        if self._file is None:
            self._file = ShardFile(self._shard_path(len(self.shards)), self._schema)
        self._file.write_group(rows)
        if self._shard_rows is not None and self._file.rows >= self._shard_rows:
            self.shards.append(self._file.finish())
            self._file = None

    def close(self, footer: dict[bytes, bytes] | None = None) -> list[ShardEntry]:
        if self._pending_rows:
            self._write(np.concatenate(self._pending))
            self._pending, self._pending_rows = [], 0
        if self._file is not None:
            self.shards.append(self._file.finish(footer))
            self._file = None
        return self.shards

    def abort(self) -> None:
        """Removes what this sink wrote: a partial corpus must not be mistaken for a whole one."""
        if self._file is not None:
            self._file.abort()
            self._file = None
        for entry in self.shards:
            (self._shard_path(0).parent / entry.path).unlink(missing_ok=True)


def check_output(target: pathlib.Path, folder: bool, overwrite: bool) -> None:
    if not folder:
        if target.is_dir():
            raise DataError(f"output {target} is a directory; give a file path such as {target}/train.parquet, "
                            f"or a folder path not ending in .parquet for shards")
        return
    if target.exists() and not target.is_dir():
        raise DataError(f"output {target} is a file; give a folder for shards + {MANIFEST_NAME}, or a path ending "
                        f"in .parquet for a single file")
    if not target.is_dir() or overwrite:
        return
    taken = sorted(p.name for p in target.iterdir() if p.name == MANIFEST_NAME or p.suffix == ".parquet")
    if taken:
        raise DataError(f"output folder {target} already holds a corpus ({', '.join(taken[:3])}"
                        f"{', ...' if len(taken) > 3 else ''}); pass overwrite=True (--overwrite) to replace it, "
                        f"or give another folder")


def _clear_folder(target: pathlib.Path) -> None:
    # The manifest goes first: without it the folder no longer claims to be complete.
    (target / MANIFEST_NAME).unlink(missing_ok=True)
    for old in sorted(target.glob("part-*.parquet")) + sorted(target.glob("part-*.parquet.tmp")):
        old.unlink()


def open_sink(target: pathlib.Path, folder: bool, overwrite: bool, schema: pa.Schema, seq_len: int,
               shard_bytes: int, row_group_bytes: int) -> RowSink:
    """Makes room for the output (an overwrite clears the old corpus here) and a sink writing into it."""
    group_rows = rows_fitting(row_group_bytes, seq_len)
    if not folder:
        target.parent.mkdir(parents=True, exist_ok=True)
        return RowSink(lambda _: target, schema, group_rows, None)
    target.mkdir(parents=True, exist_ok=True)
    if overwrite:
        _clear_folder(target)
    shard_rows = rows_fitting(shard_bytes, seq_len)
    return RowSink(lambda i: target / _SHARD_NAME.format(i), schema, min(group_rows, shard_rows), shard_rows)


def write_manifest(folder: pathlib.Path, manifest: CorpusManifest) -> None:
    """Commit a folder's corpus. atomic_write syncs the folder after its rename, which makes the
    shards' renames durable too."""
    atomic_write(folder / MANIFEST_NAME, lambda tmp: tmp.write_text(manifest.to_json(), encoding="utf-8"))
