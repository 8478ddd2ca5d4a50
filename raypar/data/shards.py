"""One file of a token corpus, read a block at a time.

A Parquet shard's blocks are its row groups: one ranged read each, from a local disk or
any store `pyarrow.fs` opens. An Arrow shard (the `*.arrow` files Hugging Face
`datasets` saves, IPC stream or file format) is memory-mapped and its blocks are its
record batches. Every block is checked as it is read (row lengths, nulls, negative ids,
ids past the vocabulary the file declares) and handed out as int32 ``[rows, seq_len + 1]``.
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from raypar.checkpoint import storage

__all__ = ["DataError", "Shard", "open_shard", "TOKENS_COLUMN", "TOKEN_COLUMNS", "META_VOCAB_SIZE", "META_SEQ_LEN",
           "META_TOKENIZER_FINGERPRINT"]

TOKENS_COLUMN = "tokens"
# `input_ids` is what Hugging Face tokenized datasets call the same column.
TOKEN_COLUMNS = (TOKENS_COLUMN, "input_ids")
META_VOCAB_SIZE = b"raypar.vocab_size"
META_SEQ_LEN = b"raypar.seq_len"
META_TOKENIZER_FINGERPRINT = b"raypar.tokenizer_fingerprint"

_INT32_MAX = np.iinfo(np.int32).max


class DataError(ValueError):
    """The training data is missing, malformed or inconsistent with the config."""


def _declared_int(meta: dict[bytes, bytes] | None, key: bytes, where: str) -> int | None:
    if not meta or key not in meta:
        return None
    try:
        return int(meta[key])
    except ValueError:
        raise DataError(f"{where}: schema metadata {key.decode()}={meta[key]!r} is not an integer") from None


def _token_column(where: str, schema: pa.Schema) -> str:
    column = next((c for c in TOKEN_COLUMNS if c in schema.names), None)
    if column is None:
        raise DataError(
            f"{where} has no `{TOKENS_COLUMN}` column (columns found: {schema.names}). Token files need a "
            f"`{TOKENS_COLUMN}` (or `input_ids`) column holding one list of ints per sample."
        )
    typ = schema.field(column).type
    is_list = pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)
    if not is_list or not pa.types.is_integer(typ.value_type):
        raise DataError(
            f"{where}: column `{column}` has type {typ}; expected a list of integers "
            "(list<int32>, list<int64>, large_list or fixed_size_list)."
        )
    return column


class Shard:
    """A token file: its sample count, and its rows a block at a time. Opened on first use;
    `close` lets go of the file handle (and, for a mapped file, the mapping)."""

    def __init__(self, location: storage.Location, seq_len: int, samples: int | None = None) -> None:
        self.location = location
        self.name = storage.redact(str(location))
        self.seq_len = seq_len
        self._samples = samples
        self._starts: np.ndarray | None = None  # first row of each block, and the row count last
        self.declared_vocab: int | None = None
        self.declared_seq_len: int | None = None
        self.fingerprint: str | None = None

    @property
    def samples(self) -> int:
        if self._samples is None:
            self.open()
        return self._samples

    @property
    def is_open(self) -> bool:
        return self._starts is not None

    def open(self) -> None:
        if self.is_open:
            return
        try:
            schema, block_rows = self._open()
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{self.name} is not a readable {self.kind} file ({exc}). data.path must point to "
                            f"token files with a `{TOKENS_COLUMN}` column (see `raypar prepare-data`).") from exc
        self.column = _token_column(self.name, schema)
        meta = schema.metadata
        self.declared_vocab = _declared_int(meta, META_VOCAB_SIZE, self.name)
        self.declared_seq_len = _declared_int(meta, META_SEQ_LEN, self.name)
        if meta and META_TOKENIZER_FINGERPRINT in meta:
            self.fingerprint = meta[META_TOKENIZER_FINGERPRINT].decode()
        starts = np.zeros(len(block_rows) + 1, dtype=np.int64)
        np.cumsum(block_rows, out=starts[1:])
        if self._samples is not None and int(starts[-1]) != self._samples:
            raise DataError(f"{self.name} holds {int(starts[-1])} samples but the corpus manifest says "
                            f"{self._samples}; the corpus changed after it was written, write it again")
        self._samples = int(starts[-1])
        self._starts = starts

    def block_of(self, rows: np.ndarray) -> np.ndarray:
        """The block holding each of `rows` (rows of this shard)."""
        self.open()
        return np.searchsorted(self._starts, rows, side="right") - 1

    def block_start(self, block: int) -> int:
        return int(self._starts[block])

    def read_block(self, block: int) -> np.ndarray:
        """Block `block`'s rows, checked, as int32 ``[rows, seq_len + 1]``."""
        self.open()
        try:
            chunk = self._read(block)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"failed to read block {block} of {self.name}: {exc}") from exc
        rows = _rows_to_numpy(chunk, self.name, self.block_start(block), self.seq_len, self.declared_seq_len)
        if self.declared_vocab is not None and rows.size and int(rows.max()) >= self.declared_vocab:
            row = self.block_start(block) + int(np.flatnonzero((rows >= self.declared_vocab).any(axis=1))[0])
            raise DataError(f"{self.name}: declares vocab_size {self.declared_vocab} but row {row} holds token id "
                            f"{int(rows.max())}")
        return rows

    def close(self) -> None:
        """Let go of the file; the index stays, so the shard reopens on its next read."""


class ParquetShard(Shard):
    kind = "Parquet"

    def __init__(self, location: storage.Location, seq_len: int, samples: int | None = None) -> None:
        super().__init__(location, seq_len, samples)
        self._file: pq.ParquetFile | None = None
        self._source = None

    def _parquet(self) -> pq.ParquetFile:
        if self._file is None:
            self._source = storage.open_input(self.location)
            self._file = pq.ParquetFile(self._source)
        return self._file

    def _open(self) -> tuple[pa.Schema, list[int]]:
        pf = self._parquet()
        meta = pf.metadata
        return pf.schema_arrow, [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]

    def _read(self, block: int) -> pa.Array:
        column = self._parquet().read_row_group(block, columns=[self.column]).column(0)
        return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._source.close()  # ParquetFile does not own a file it was handed
            self._file = self._source = None


class ArrowShard(Shard):
    kind = "Arrow IPC"

    def __init__(self, location: storage.Location, seq_len: int, samples: int | None = None) -> None:
        super().__init__(location, seq_len, samples)
        self._batches: list[pa.RecordBatch] | None = None

    def _load(self) -> list[pa.RecordBatch]:
        if self._batches is None:
            source = storage.open_input(self.location, memory_map=True)
            try:
                reader = pa.ipc.open_file(source)
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
                schema = reader.schema
            except pa.ArrowInvalid:  # `datasets` writes the stream format
                source.seek(0)
                reader = pa.ipc.open_stream(source)
                batches, schema = list(reader), reader.schema
            self._schema = schema
            self._batches = batches  # views of the mapping: nothing is copied until a row is read
        return self._batches

    def _open(self) -> tuple[pa.Schema, list[int]]:
        batches = self._load()
        return self._schema, [b.num_rows for b in batches]

    def _read(self, block: int) -> pa.Array:
        return self._load()[block].column(self.column)

    def close(self) -> None:
        self._batches = None


def open_shard(location: storage.Location, seq_len: int, samples: int | None = None) -> Shard:
    """The shard for a `.parquet` or `.arrow` file (by its name)."""
    if storage.name(location).endswith(".arrow"):
        if storage.is_uri(location):
            raise DataError(f"{storage.redact(str(location))}: Arrow IPC files are read memory-mapped, from a local "
                            "path only; convert the corpus to Parquet (`raypar prepare-data`) to stream it from a store")
        return ArrowShard(location, seq_len, samples)
    return ParquetShard(location, seq_len, samples)


def _row_length_error(where: str, row: int, found: int, seq_len: int, declared: int | None) -> DataError:
    hint = f" (the file was written with seq_len={declared})" if declared is not None else ""
    return DataError(f"{where}: row {row} has {found} tokens but expected seq_len + 1 = {seq_len + 1}{hint}; "
                     "data.seq_len must match the file.")


def _rows_to_numpy(chunk: pa.Array, where: str, first_row: int, seq_len: int, declared_seq: int | None) -> np.ndarray:
    """Check one Arrow list array of rows and return it as int32 ``[rows, seq_len + 1]``."""
    width = seq_len + 1
    if chunk.null_count:
        row = first_row + int(np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{where}: row {row} of `{TOKENS_COLUMN}` is null")
    if pa.types.is_fixed_size_list(chunk.type):
        if chunk.type.list_size != width:
            raise _row_length_error(where, first_row, chunk.type.list_size, seq_len, declared_seq)
    else:
        lengths = pc.list_value_length(chunk).to_numpy()
        bad = np.flatnonzero(lengths != width)
        if bad.size:
            i = int(bad[0])
            raise _row_length_error(where, first_row + i, int(lengths[i]), seq_len, declared_seq)
    # list_flatten honours slice offsets, unlike `.values`.
    values = pc.list_flatten(chunk)
    if values.null_count:
        raise DataError(f"{where}: `{TOKENS_COLUMN}` holds null token ids near row {first_row}")
    flat = values.to_numpy()
    if flat.size:
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0:
            row = first_row + int(np.flatnonzero(flat < 0)[0]) // width
            raise DataError(f"{where}: row {row} holds negative token id {lo}; token ids must be >= 0")
        if hi > _INT32_MAX:
            raise DataError(f"{where}: token id {hi} does not fit in int32")
    return flat.astype(np.int32, copy=False).reshape(-1, width)
