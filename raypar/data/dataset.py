"""Fixed-length token samples read from Parquet into one in-memory array.

The whole corpus is held as a single contiguous int32 numpy array so that a
batch is one fancy-index away; the training corpora this runtime targets fit
comfortably in host memory, and avoiding per-batch Parquet reads keeps the
data path off the critical path of the pipeline.
"""
from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

__all__ = ["DataError", "TokenDataset", "TOKENS_COLUMN", "META_VOCAB_SIZE", "META_SEQ_LEN"]

TOKENS_COLUMN = "tokens"
META_VOCAB_SIZE = b"raypar.vocab_size"
META_SEQ_LEN = b"raypar.seq_len"

_INT32_MAX = np.iinfo(np.int32).max


class DataError(ValueError):
    """The training data is missing, malformed or inconsistent with the config."""


def _resolve_files(path: pathlib.Path) -> list[pathlib.Path]:
    if not path.exists():
        raise DataError(
            f"data file not found: {path}. Set data.path to a Parquet token file "
            "(write one with `raypar prepare-data --synthetic OUT`), or leave data.path "
            "unset to generate a synthetic corpus in the run directory."
        )
    if path.is_file():
        return [path]
    # Hidden and underscore-prefixed names are writer scratch (our own atomic-write
    # temp files, Spark's _SUCCESS/_metadata); reading them would double-count rows.
    files = sorted(
        p for p in path.glob("*.parquet") if p.is_file() and not p.name.startswith((".", "_"))
    )
    if not files:
        raise DataError(
            f"no *.parquet files in data directory {path}. Point data.path at a Parquet "
            "token file or a directory of them."
        )
    return files


def _open(file: pathlib.Path) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(file)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(
            f"{file} is not a readable Parquet file ({exc}). data.path must point to a "
            "Parquet file with a `tokens` column (see `raypar prepare-data`)."
        ) from exc


def _declared_int(meta: dict[bytes, bytes] | None, key: bytes, file: pathlib.Path) -> int | None:
    if not meta or key not in meta:
        return None
    raw = meta[key]
    try:
        return int(raw)
    except ValueError:
        raise DataError(
            f"{file}: schema metadata {key.decode()}={raw!r} is not an integer"
        ) from None


def _check_schema(file: pathlib.Path, pf: pq.ParquetFile) -> None:
    schema = pf.schema_arrow
    if TOKENS_COLUMN not in schema.names:
        raise DataError(
            f"{file} has no `{TOKENS_COLUMN}` column (columns found: {schema.names}). "
            f"Token files need a `{TOKENS_COLUMN}` column holding one list of ints per sample."
        )
    typ = schema.field(TOKENS_COLUMN).type
    is_list = (
        pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ)
    )
    if not is_list or not pa.types.is_integer(typ.value_type):
        raise DataError(
            f"{file}: column `{TOKENS_COLUMN}` has type {typ}; expected a list of integers "
            "(list<int32>, list<int64>, large_list or fixed_size_list)."
        )


def _row_length_error(
    file: pathlib.Path, row: int, found: int, seq_len: int, declared: int | None
) -> DataError:
    hint = f" (the file was written with seq_len={declared})" if declared is not None else ""
    return DataError(
        f"{file}: row {row} has {found} tokens but expected seq_len + 1 = {seq_len + 1}"
        f"{hint}; data.seq_len must match the file."
    )


def _chunk_to_numpy(
    chunk: pa.Array, file: pathlib.Path, first_row: int, seq_len: int, declared_seq: int | None
) -> np.ndarray:
    """Validate one Arrow chunk and return it as an int32 [rows, seq_len + 1] array."""
    width = seq_len + 1
    if chunk.null_count:
        row = first_row + int(np.flatnonzero(chunk.is_null().to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{file}: row {row} of `{TOKENS_COLUMN}` is null")
    if pa.types.is_fixed_size_list(chunk.type):
        if chunk.type.list_size != width:
            raise _row_length_error(file, first_row, chunk.type.list_size, seq_len, declared_seq)
    else:
        lengths = pc.list_value_length(chunk).to_numpy()
        bad = np.flatnonzero(lengths != width)
        if bad.size:
            i = int(bad[0])
            raise _row_length_error(file, first_row + i, int(lengths[i]), seq_len, declared_seq)
    # list_flatten honours slice offsets, unlike `.values`.
    values = pc.list_flatten(chunk)
    if values.null_count:
        raise DataError(f"{file}: `{TOKENS_COLUMN}` holds null token ids near row {first_row}")
    flat = values.to_numpy()
    if flat.size:
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0:
            row = first_row + int(np.flatnonzero(flat < 0)[0]) // width
            raise DataError(f"{file}: row {row} holds negative token id {lo}; token ids must be >= 0")
        if hi > _INT32_MAX:
            raise DataError(f"{file}: token id {hi} does not fit in int32")
    return flat.astype(np.int32, copy=False).reshape(-1, width)


class TokenDataset:
    """Fixed-length token samples stored in Parquet.

    Column ``tokens``, one row per sample, each a list of ``seq_len + 1`` ints;
    inputs are ``tokens[:-1]`` and labels ``tokens[1:]``. ``path`` may be a single
    Parquet file or a directory whose ``*.parquet`` files are concatenated in name
    order.
    """

    vocab_size: int
    seq_len: int

    def __init__(self, path: str | os.PathLike, seq_len: int):
        if seq_len < 1:
            raise DataError(f"data.seq_len must be >= 1, got {seq_len}")
        self.path = pathlib.Path(path)
        self.seq_len = int(seq_len)
        files = _resolve_files(self.path)

        # Validate every schema before reading any data, so a bad file late in a
        # directory fails in milliseconds rather than after loading the rest.
        opened: list[tuple[pathlib.Path, pq.ParquetFile]] = []
        for f in files:
            pf = _open(f)
            _check_schema(f, pf)
            opened.append((f, pf))

        total = sum(pf.metadata.num_rows for _, pf in opened)
        if total == 0:
            raise DataError(
                f"data at {self.path} holds no samples; write a corpus with "
                "`raypar prepare-data --synthetic OUT` or point data.path at a non-empty file."
            )

        # Preallocating from the footer row counts keeps peak memory at one copy
        # of the corpus instead of per-file arrays plus their concatenation.
        tokens = np.empty((total, self.seq_len + 1), dtype=np.int32)
        declared_vocab: list[int] = []
        any_undeclared = False
        row = 0
        for f, pf in opened:
            meta = pf.schema_arrow.metadata
            file_vocab = _declared_int(meta, META_VOCAB_SIZE, f)
            file_seq = _declared_int(meta, META_SEQ_LEN, f)
            file_start = row
            try:
                column = pf.read(columns=[TOKENS_COLUMN]).column(TOKENS_COLUMN)
            except (pa.ArrowException, OSError) as exc:
                raise DataError(f"failed to read Parquet file {f}: {exc}") from exc
            for chunk in column.chunks:
                arr = _chunk_to_numpy(chunk, f, row, self.seq_len, file_seq)
                tokens[row : row + len(arr)] = arr
                row += len(arr)
            if file_vocab is None:
                any_undeclared = True
            else:
                file_max = int(tokens[file_start:row].max()) if row > file_start else -1
                if file_max >= file_vocab:
                    raise DataError(
                        f"{f}: declares vocab_size {file_vocab} but holds token id {file_max}"
                    )
                declared_vocab.append(file_vocab)
        if row != total:  # footer and data disagree: the file is corrupt
            raise DataError(f"data at {self.path}: footer promised {total} rows, read {row}")

        self._tokens = tokens
        self._max_token = int(tokens.max())
        inferred = [self._max_token + 1] if any_undeclared else []
        self.vocab_size = max(declared_vocab + inferred)

    def __len__(self) -> int:
        return self._tokens.shape[0]

    @property
    def max_token(self) -> int:
        """Largest token id present in the data."""
        return self._max_token

    def check_vocab(self, vocab_size: int) -> None:
        """Raise DataError if the data holds token ids the model cannot embed."""
        if self._max_token >= vocab_size:
            raise DataError(
                f"data holds token id {self._max_token} but model.vocab_size is {vocab_size}; "
                f"set model.vocab_size to at least {self._max_token + 1} or use matching data."
            )

    def get(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(inputs, labels)``, int64 tensors of shape ``[len(indices), seq_len]``."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size:
            bad = idx[(idx < 0) | (idx >= n)]
            # Negative indices are rejected rather than wrapped: they only arise from
            # bugs in the order/offset arithmetic, which wrapping would hide.
            if bad.size:
                raise DataError(
                    f"sample index {int(bad[0])} out of range for dataset of {n} samples "
                    f"(valid: 0..{n - 1})"
                )
        rows = self._tokens[idx]
        inputs = torch.from_numpy(np.ascontiguousarray(rows[:, :-1], dtype=np.int64))
        labels = torch.from_numpy(np.ascontiguousarray(rows[:, 1:], dtype=np.int64))
        return inputs, labels

    def __repr__(self) -> str:
        return (
            f"TokenDataset(path={str(self.path)!r}, samples={len(self)}, "
            f"seq_len={self.seq_len}, vocab_size={self.vocab_size})"
        )
