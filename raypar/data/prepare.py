"""Text to token Parquet: tokenize documents, join them with EOS, cut fixed-length rows.

Inputs are `.txt` files (each file is one document, so prose keeps its line breaks
inside a document) and `.parquet` files (each non-null value of the text column is one
document). A directory stands for its `.txt` and `.parquet` files in name order.

Documents are tokenized, each followed by EOS, concatenated in input order and cut into
rows of seq_len + 1 tokens; the tail that does not fill a row is dropped. The output is
the format `TokenDataset` reads (column `tokens`, list<int32>, schema metadata
raypar.vocab_size and raypar.seq_len).
"""
from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raypar.checkpoint.store import atomic_write

from raypar.data.dataset import META_SEQ_LEN, META_VOCAB_SIZE, TOKENS_COLUMN, DataError

__all__ = ["prepare_data", "ByteTokenizer", "BYTE_EOS", "BYTE_VOCAB_SIZE"]

BYTE_EOS = 256
BYTE_VOCAB_SIZE = 257
_EXTENSIONS = (".txt", ".parquet")
# Tried in order when tokenizer_config.json does not name the EOS token.
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")


class _Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, texts: list[str]) -> list[np.ndarray]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, EOS = 256: no files, no vocabulary to ship."""

    name = "bytes"
    vocab_size = BYTE_VOCAB_SIZE
    eos_id: int | None = BYTE_EOS

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int32) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class _HFTokenizer:
    """A local Hugging Face `tokenizer.json`, through the `tokenizers` library (no network)."""

    def __init__(self, path: pathlib.Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"tokenizer {path} needs the `tokenizers` package: pip install tokenizers") from None
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise DataError(
                f"tokenizer directory {path} has no tokenizer.json (files there: "
                f"{sorted(p.name for p in path.iterdir())[:10]}); give a directory saved by a Hugging Face "
                f"tokenizer, or tokenizer='bytes'"
            )
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises untyped errors for malformed files
            raise DataError(f"{file} is not a loadable tokenizer.json: {e}") from e
        self.name = str(file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(file.parent)

    def _find_eos(self, directory: pathlib.Path) -> int | None:
        config = directory / "tokenizer_config.json"
        if config.is_file():
            try:
                eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataError(f"{config} is not valid JSON: {e}") from e
            if isinstance(eos, dict):  # AddedToken serialised as a dict
                eos = eos.get("content")
            if isinstance(eos, str) and self._tok.token_to_id(eos) is not None:
                return self._tok.token_to_id(eos)
        for token in _EOS_CANDIDATES:
            found = self._tok.token_to_id(token)
            if found is not None:
                return found
        return None

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        # No post-processor specials (BOS etc.): documents are separated by EOS only.
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]


def _load_tokenizer(spec: str | os.PathLike) -> _Tokenizer:
    if str(spec) == "bytes":
        return ByteTokenizer()
    path = pathlib.Path(spec).expanduser()
    if not path.exists():
        raise DataError(
            f"tokenizer {str(spec)!r} is neither 'bytes' nor an existing path; give a local directory or file "
            f"with a Hugging Face tokenizer.json (nothing is downloaded)"
        )
    return _HFTokenizer(path)


# ---------------------------------------------------------------------------------------
# Inputs


def _input_files(inputs: Sequence[str | os.PathLike]) -> list[pathlib.Path]:
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]  # a lone path is an easy slip; a str would iterate by character
    if not inputs:
        raise DataError("prepare_data: no input files given")
    files: list[pathlib.Path] = []
    for item in inputs:
        path = pathlib.Path(item)
        if not path.exists():
            raise DataError(f"input not found: {path}")
        if path.is_dir():
            found = sorted(p for p in path.iterdir()
                           if p.is_file() and p.suffix.lower() in _EXTENSIONS and not p.name.startswith((".", "_")))
            if not found:
                raise DataError(f"input directory {path} holds no {' or '.join(_EXTENSIONS)} files")
            files.extend(found)
        elif path.suffix.lower() not in _EXTENSIONS:
            raise DataError(
                f"input {path}: unknown extension {path.suffix or '(none)'!r}; use .txt (one document per file) "
                f"or .parquet (one document per row of the text column)"
            )
        else:
            files.append(path)
    return files


def _parquet_file(path: pathlib.Path, text_column: str) -> pq.ParquetFile:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable Parquet file: {e}") from e
    names = pf.schema_arrow.names
    if text_column not in names:
        raise DataError(f"{path} has no text column {text_column!r}; its columns are {names}. "
                        f"Pass text_column= to choose one")
    typ = pf.schema_arrow.field(text_column).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        raise DataError(f"{path}: column {text_column!r} has type {typ}; it must hold strings")
    return pf


def _documents(files: list[pathlib.Path], text_column: str) -> tuple[int, Iterator[list[str | None]]]:
    """Total documents and batches of document texts, in input order."""
    opened = {f: _parquet_file(f, text_column) for f in files if f.suffix.lower() == ".parquet"}
    total = sum(1 for f in files if f not in opened) + sum(pf.metadata.num_rows for pf in opened.values())

    def batches() -> Iterator[list[str]]:
        for f in files:
            pf = opened.get(f)
            if pf is None:
                try:
                    yield [f.read_text(encoding="utf-8")]
                except UnicodeDecodeError as e:
                    raise DataError(f"{f} is not UTF-8 text: {e}") from e
                continue
            for batch in pf.iter_batches(columns=[text_column], batch_size=1024):
                # Nulls stay in the batch (counted as done) but are skipped: a missing
                # document is not an empty one and gets no EOS.
                yield batch.column(0).to_pylist()

    return total, batches()


# ---------------------------------------------------------------------------------------
# Output


def _write_atomically(target: pathlib.Path, table: pa.Table) -> None:
    # The temp file's .tmp suffix keeps directory readers (*.parquet) off it, even orphaned.
    atomic_write(target, lambda tmp: pq.write_table(table, tmp))


def _rows_table(stream: np.ndarray, width: int, metadata: dict[bytes, bytes]) -> pa.Table:
    rows = len(stream) // width
    n = rows * width
    values = pa.array(stream[:n], type=pa.int32())
    # list<int32> is the documented format; only beyond 2**31 tokens do the offsets
    # need 64 bits, which TokenDataset accepts as large_list.
    if n <= np.iinfo(np.int32).max:
        column = pa.ListArray.from_arrays(pa.array(np.arange(0, n + 1, width, dtype=np.int32)), values)
    else:
        column = pa.LargeListArray.from_arrays(pa.array(np.arange(0, n + 1, width, dtype=np.int64)), values)
    return pa.Table.from_arrays([column], names=[TOKENS_COLUMN]).replace_schema_metadata(metadata)


def prepare_data(
    inputs: Sequence[str | pathlib.Path],
    out: str | pathlib.Path,
    seq_len: int,
    tokenizer: str = "bytes",
    text_column: str = "text",
    add_eos: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> pathlib.Path:
    """Tokenize text files into a token Parquet file for `TokenDataset(out, seq_len)`.

    `inputs`: `.txt` files (one document each), `.parquet` files (one document per
    non-null value of `text_column`) or directories of them. `tokenizer`: "bytes" (UTF-8
    bytes, EOS 256, vocab 257) or a local path to a Hugging Face tokenizer.json or its
    directory (EOS from tokenizer_config.json's eos_token, else a usual name such as
    </s> or <|endoftext|>). `progress(done, total)` is called as documents finish.
    Every row holds seq_len + 1 tokens; tokens after the last full row are dropped.
    Writes atomically and returns `out`. Raises DataError for unusable input.
    """
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    target = pathlib.Path(out)
    if target.is_dir():
        raise DataError(f"output {target} is a directory; give a file path such as {target}/train.parquet")
    files = _input_files(inputs)
    tok = _load_tokenizer(tokenizer)
    if add_eos and tok.eos_id is None:
        raise DataError(
            f"tokenizer {tok.name} has no EOS token (no eos_token in tokenizer_config.json and none of "
            f"{', '.join(_EOS_CANDIDATES)}); add one, or pass add_eos=False"
        )
    total, batches = _documents(files, text_column)
    eos = np.asarray([tok.eos_id], dtype=np.int32) if add_eos else np.empty(0, dtype=np.int32)

    parts: list[np.ndarray] = []
    done = 0
    for texts in batches:
        present = [t for t in texts if t is not None]
        for ids in tok.encode(present):
            parts.append(ids)
            parts.append(eos)
        done += len(texts)
        if progress is not None:
            progress(done, total)
    stream = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)

    width = seq_len + 1
    if len(stream) < width:
        raise DataError(
            f"found {len(stream)} tokens in {done} documents of {len(files)} input files, but one row needs "
            f"seq_len + 1 = {width} tokens; add text or lower seq_len"
        )
    if stream.size and int(stream.max()) >= tok.vocab_size:  # a tokenizer bug, not user error
        raise DataError(f"tokenizer {tok.name} produced id {int(stream.max())} >= its vocab size {tok.vocab_size}")
    metadata = {
        META_VOCAB_SIZE: str(tok.vocab_size).encode(),
        META_SEQ_LEN: str(seq_len).encode(),
        b"raypar.tokenizer": tok.name.encode(),
        b"raypar.eos_id": str(tok.eos_id if add_eos else -1).encode(),
        b"raypar.documents": str(done).encode(),
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(target, _rows_table(stream, width, metadata))
    return target
