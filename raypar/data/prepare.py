"""Text to token Parquet: tokenize documents, join them with EOS, cut fixed-length rows.

Inputs are `.txt` files (each file is one document, so prose keeps its line breaks
inside a document), JSON lines files (`.jsonl`, `.json`: one document per line, its text
in the text field), `.parquet` files and `.arrow` files (each non-null value of the text
column is one document), and Hugging Face `datasets` folders as `save_to_disk` writes
them (Arrow stream files, read in the order `state.json` lists them). Any other folder
stands for its `.txt`, `.jsonl`, `.json`, `.parquet` and `.arrow` files in name order.

Documents are read in batches in this process and tokenized in a pool of worker
processes, in order, so the output does not depend on the number of workers. Each
document's ids, followed by EOS, are appended to a carry buffer that full rows of
seq_len + 1 tokens are cut from as they come; the tail that does not fill a row is
dropped. Rows stream into Parquet row groups of bounded size, so memory stays bounded
whatever the corpus size.

The output is a folder of shards `part-00000.parquet`, ... plus `manifest.json`
(`CorpusManifest`, written last), or a single `.parquet` file. Every file has column
`tokens` (list<int32>) and the schema metadata `TokenDataset` reads (raypar.vocab_size,
raypar.seq_len, raypar.tokenizer_fingerprint), plus raypar.tokenizer and raypar.eos_id.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
import os
import pathlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raypar.checkpoint.storage import fsync_dir

from raypar.data.dataset import (META_SEQ_LEN, META_TOKENIZER_FINGERPRINT, META_VOCAB_SIZE, TOKENS_COLUMN,
                                 DataError)
from raypar.data.manifest import CorpusManifest
from raypar.data.writer import (DEFAULT_ROW_GROUP_BYTES, DEFAULT_SHARD_BYTES, RowSink, check_output, open_sink,
                                rows_fitting, write_manifest)

__all__ = ["prepare_data", "tokenizer_fingerprint", "rows_fitting", "ByteTokenizer", "BYTE_EOS", "BYTE_VOCAB_SIZE",
           "DEFAULT_SHARD_BYTES", "DEFAULT_ROW_GROUP_BYTES"]

BYTE_EOS = 256
BYTE_VOCAB_SIZE = 257
_INT32_MAX = int(np.iinfo(np.int32).max)

_EXTENSIONS = (".txt", ".jsonl", ".json", ".parquet", ".arrow")
# Tried in order when tokenizer_config.json does not name the EOS token.
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")

# A batch is one pool task: large enough to amortise pickling, small enough that the
# batches in flight (2 per worker) stay a few hundred MB at most.
_BATCH_DOCUMENTS = 256
_BATCH_CHARS = 2 * 2**20

_META_TOKENIZER = b"raypar.tokenizer"
_META_EOS_ID = b"raypar.eos_id"
_META_DOCUMENTS = b"raypar.documents"


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

    def __init__(self, file: pathlib.Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"tokenizer {file} needs the `tokenizers` package: pip install tokenizers") from None
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


def _tokenizer_file(spec: str | os.PathLike) -> pathlib.Path:
    path = pathlib.Path(spec).expanduser()
    if not path.exists():
        raise DataError(
            f"tokenizer {str(spec)!r} is neither 'bytes' nor an existing path; give a local directory or file "
            f"with a Hugging Face tokenizer.json (nothing is downloaded)"
        )
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DataError(
            f"tokenizer directory {path} has no tokenizer.json (files there: "
            f"{sorted(p.name for p in path.iterdir())[:10]}); give a directory saved by a Hugging Face "
            f"tokenizer, or tokenizer='bytes'"
        )
    return file


def _load_tokenizer(spec: str | os.PathLike) -> _Tokenizer:
    if str(spec) == "bytes":
        return ByteTokenizer()
    return _HFTokenizer(_tokenizer_file(spec))


def tokenizer_fingerprint(spec: str | os.PathLike) -> str:
    """What identifies a tokenizer's ids: "bytes", or "sha256:<hex>" of its tokenizer.json.

    `spec` is what `prepare_data` takes: "bytes", a tokenizer.json or its folder.
    """
    if str(spec) == "bytes":
        return "bytes"
    return "sha256:" + _file_sha256(_tokenizer_file(spec))


def _file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(4 * 2**20):
            digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------
# Inputs


@dataclass(frozen=True)
class _Source:
    path: pathlib.Path
    kind: str  # "txt", "jsonl", "parquet" or "arrow"
    documents: int | None  # None: not known without reading it all (JSON lines)


def _kind(path: pathlib.Path) -> str | None:
    suffix = path.suffix.lower()
    if suffix not in _EXTENSIONS:
        return None
    return "jsonl" if suffix == ".json" else suffix[1:]


def _is_input_name(path: pathlib.Path) -> bool:
    # Hidden and underscore names are writer scratch (temp files, Spark's _SUCCESS).
    return path.is_file() and not path.name.startswith((".", "_")) and _kind(path) is not None


def _datasets_files(folder: pathlib.Path) -> list[pathlib.Path] | None:
    """The Arrow files of a `datasets` save_to_disk folder in their row order; None if it is not one."""
    state = folder / "state.json"
    if not state.is_file() and not (folder / "dataset_info.json").is_file():
        return None
    if state.is_file():
        try:
            names = [entry["filename"] for entry in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{state} is not a `datasets` state.json (no _data_files list of filenames: {e})") from None
        files = [folder / name for name in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise DataError(f"{state} lists Arrow files that are missing: {missing[:5]}; the dataset is incomplete")
    else:
        files = sorted(p for p in folder.glob("*.arrow") if _is_input_name(p))
    if not files:
        raise DataError(f"`datasets` folder {folder} holds no .arrow files")
    return files


def _folder_files(folder: pathlib.Path) -> list[pathlib.Path]:
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
        raise DataError(f"input {folder} is a `datasets` DatasetDict; give one split's folder, one of "
                        f"{[str(folder / s) for s in splits]}")
    files = _datasets_files(folder)
    if files is not None:
        return files
    files = sorted(p for p in folder.iterdir() if _is_input_name(p))
    if not files:
        raise DataError(f"input directory {folder} holds no {', '.join(_EXTENSIONS)} files and is not a "
                        f"`datasets` folder (state.json with .arrow files)")
    return files


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
            files.extend(_folder_files(path))
        elif _kind(path) is None:
            raise DataError(
                f"input {path}: unknown extension {path.suffix or '(none)'!r}; use .txt (one document per file), "
                f".jsonl or .json (one JSON object per line), .parquet or .arrow (one document per row of the text "
                f"column), or a `datasets` folder"
            )
        else:
            files.append(path)
    return files


def _check_text_type(path: pathlib.Path, schema: pa.Schema, text_column: str) -> None:
    if text_column not in schema.names:
        raise DataError(f"{path} has no text column {text_column!r}; its columns are {schema.names}. "
                        f"Pass text_column= to choose one")
    typ = schema.field(text_column).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
        raise DataError(f"{path}: column {text_column!r} has type {typ}; it must hold strings")


def _parquet_file(path: pathlib.Path, text_column: str) -> pq.ParquetFile:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path} is not a readable Parquet file: {e}") from e
    _check_text_type(path, pf.schema_arrow, text_column)
    return pf


def _open_arrow(source: pa.MemoryMappedFile, path: pathlib.Path) -> tuple[pa.Schema, Iterator[pa.RecordBatch]]:
    try:
        reader = pa.ipc.open_stream(source)  # what `datasets` writes
        return reader.schema, iter(reader)
    except pa.ArrowInvalid:
        source.seek(0)
    try:
        file_reader = pa.ipc.open_file(source)
    except pa.ArrowInvalid as e:
        raise DataError(f"{path} is not an Arrow IPC stream or file: {e}") from None
    return file_reader.schema, (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))


def _arrow_batches(path: pathlib.Path, text_column: str) -> Iterator[pa.RecordBatch]:
    """Record batches of an Arrow IPC file, memory-mapped: only what is used gets read."""
    with pa.memory_map(str(path)) as source:
        schema, batches = _open_arrow(source, path)
        _check_text_type(path, schema, text_column)
        yield from batches


def _open_source(path: pathlib.Path, text_column: str) -> _Source:
    """Checks what can be checked before reading (columns, types) and counts documents where cheap."""
    kind = _kind(path)
    if kind == "parquet":
        return _Source(path, kind, _parquet_file(path, text_column).metadata.num_rows)
    if kind == "arrow":
        # Mapped: counting touches each batch's header, not its text.
        return _Source(path, kind, sum(b.num_rows for b in _arrow_batches(path, text_column)))
    return _Source(path, kind, 1 if kind == "txt" else None)


def _read_txt(path: pathlib.Path) -> Iterator[str]:
    try:
        yield path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 text: {e}") from e


def _jsonl_text(line: bytes, field: str, path: pathlib.Path, number: int) -> str | None:
    where = f"{path}, line {number}"
    try:
        record = json.loads(line)
    except ValueError as e:
        raise DataError(f"{where} is not JSON ({e}); each line of a JSON lines file holds one object such as "
                        f'{{"{field}": "..."}}') from None
    if not isinstance(record, dict) or field not in record:
        keys = list(record) if isinstance(record, dict) else type(record).__name__
        raise DataError(f"{where} has no field {field!r} (it has {keys}); pass text_column= to choose the text field")
    text = record[field]
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: field {field!r} holds {type(text).__name__}, not text")
    return text


def _read_jsonl(path: pathlib.Path, field: str) -> Iterator[str | None]:
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield _jsonl_text(line, field, path, number)


def _read_parquet(path: pathlib.Path, column: str) -> Iterator[str | None]:
    for batch in _parquet_file(path, column).iter_batches(columns=[column], batch_size=_BATCH_DOCUMENTS):
        yield from batch.column(0).to_pylist()


def _read_arrow(path: pathlib.Path, column: str) -> Iterator[str | None]:
    for batch in _arrow_batches(path, column):
        texts = batch.column(batch.schema.get_field_index(column))
        # Slices keep the Python strings of one slice alive, not a whole (possibly huge) batch.
        for start in range(0, len(texts), _BATCH_DOCUMENTS):
            yield from texts.slice(start, _BATCH_DOCUMENTS).to_pylist()


def _documents(sources: Sequence[_Source], text_column: str) -> Iterator[str | None]:
    """Every document in input order; None for a null value (a missing document, which gets no EOS)."""
    for source in sources:
        if source.kind == "txt":
            yield from _read_txt(source.path)
        elif source.kind == "jsonl":
            yield from _read_jsonl(source.path, text_column)
        elif source.kind == "parquet":
            yield from _read_parquet(source.path, text_column)
        else:
            yield from _read_arrow(source.path, text_column)


def _batches(documents: Iterable[str | None]) -> Iterator[list[str | None]]:
    batch: list[str | None] = []
    chars = 0
    for doc in documents:
        batch.append(doc)
        chars += len(doc) if doc else 0
        if len(batch) >= _BATCH_DOCUMENTS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


# ---------------------------------------------------------------------------------------
# Tokenizing, in this process or a pool


def _encode(tok: _Tokenizer, texts: list[str | None], eos_id: int | None) -> tuple[np.ndarray, int]:
    """A batch's token stream (each document's ids, then EOS) and its count of non-null documents."""
    present = [t for t in texts if t is not None]
    if not present:
        return np.empty(0, dtype=np.int32), 0
    eos = np.asarray([] if eos_id is None else [eos_id], dtype=np.int32)
    parts: list[np.ndarray] = []
    for ids in tok.encode(present):
        parts += (ids, eos)
    return np.concatenate(parts), len(present)


_worker_state: tuple[_Tokenizer, int | None] | None = None


def _init_worker(spec: str, eos_id: int | None) -> None:
    global _worker_state
    # Each worker already has a core; tokenizers' own threads would oversubscribe them.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_state = (_load_tokenizer(spec), eos_id)


def _encode_in_worker(texts: list[str | None]) -> tuple[np.ndarray, int]:
    assert _worker_state is not None, "pool worker started without _init_worker"
    tok, eos_id = _worker_state
    return _encode(tok, texts, eos_id)


def _encoded(batches: Iterator[list[str | None]], tok: _Tokenizer, spec: str, eos_id: int | None,
             workers: int) -> Iterator[tuple[int, np.ndarray, int]]:
    """(documents read, token stream, documents tokenized) per batch, in input order."""
    head = list(itertools.islice(batches, 2))
    if workers == 1 or len(head) < 2:  # a single batch is not worth starting processes for
        for texts in itertools.chain(head, batches):
            yield len(texts), *_encode(tok, texts, eos_id)
        return
    # spawn, not fork: a forked child inherits locks that the caller's other threads may
    # hold; unlike forkserver it leaves no server process behind. An executor rather than
    # multiprocessing.Pool: a worker that dies (OOM killer, failed start) raises
    # BrokenProcessPool here instead of leaving the Pool waiting forever.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                             initargs=(spec, eos_id)) as pool:
        # A bounded window of tasks, not map/imap, which submit the whole input up front
        # and so would pull the corpus into memory whenever tokenizing is the slower
        # side. Taking results oldest first keeps the input order.
        in_flight: deque[tuple[int, Future]] = deque()
        try:
            for texts in itertools.chain(head, batches):
                in_flight.append((len(texts), pool.submit(_encode_in_worker, texts)))
                if len(in_flight) >= 2 * workers:
                    read, future = in_flight.popleft()
                    yield read, *future.result()
            while in_flight:
                read, future = in_flight.popleft()
                yield read, *future.result()
        finally:
            for _, future in in_flight:  # on an error, do not tokenize what nobody will write
                future.cancel()


# ---------------------------------------------------------------------------------------
# Output


def _check_sizes(seq_len: int, workers: int | None, shard_bytes: int, row_group_bytes: int) -> int:
    """The number of workers to use, once the sizes are known to be usable."""
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    if shard_bytes < 1 or row_group_bytes < 1:
        raise DataError(f"shard_bytes and row_group_bytes must be >= 1, got {shard_bytes} and {row_group_bytes}")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise DataError(f"workers must be >= 1, got {workers}")
    return workers


def _file_schema(tok: _Tokenizer, fingerprint: str, seq_len: int, eos_id: int | None, folder: bool,
                 shard_bytes: int) -> pa.Schema:
    # Offsets are per row group written, so list<int32> only runs out when one shard
    # passes 2**31 tokens; a single file, of unknown size, keeps list<int32> regardless.
    large = folder and rows_fitting(shard_bytes, seq_len) * (seq_len + 1) > _INT32_MAX
    metadata = {
        META_VOCAB_SIZE: str(tok.vocab_size).encode(),
        META_SEQ_LEN: str(seq_len).encode(),
        _META_TOKENIZER: tok.name.encode(),
        META_TOKENIZER_FINGERPRINT: fingerprint.encode(),
        _META_EOS_ID: str(-1 if eos_id is None else eos_id).encode(),
    }
    typ = pa.large_list(pa.int32()) if large else pa.list_(pa.int32())
    return pa.schema([pa.field(TOKENS_COLUMN, typ)], metadata=metadata)


# ---------------------------------------------------------------------------------------
# Packing


@dataclass
class _Counts:
    read: int = 0  # documents read, nulls included: what progress counts against the total
    documents: int = 0  # non-null documents tokenized
    tokens: int = 0  # tokenized, EOS included, before the tail is dropped


def _pack(encoded: Iterable[tuple[int, np.ndarray, int]], width: int, vocab_size: int, tokenizer_name: str,
          sink: RowSink, report: Callable[[_Counts], None]) -> _Counts:
    """Appends each batch's stream to a carry buffer and hands the full rows to `sink`."""
    counts = _Counts()
    carry = np.empty(0, dtype=np.int32)
    for read, ids, documents in encoded:
        counts.read += read
        counts.documents += documents
        counts.tokens += len(ids)
        if ids.size and int(ids.max()) >= vocab_size:  # a tokenizer bug, not user error
            raise DataError(f"tokenizer {tokenizer_name} produced id {int(ids.max())} >= its vocab size {vocab_size}")
        carry = np.concatenate([carry, ids])
        full = len(carry) // width * width
        if full:
            sink.add(carry[:full].reshape(-1, width))
            carry = carry[full:].copy()
        report(counts)
    return counts


def prepare_data(
    inputs: Sequence[str | pathlib.Path],
    out: str | pathlib.Path,
    seq_len: int,
    tokenizer: str = "bytes",
    text_column: str = "text",
    add_eos: bool = True,
    progress: Callable[[int, int | None, int], None] | None = None,
    workers: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    row_group_bytes: int = DEFAULT_ROW_GROUP_BYTES,
    overwrite: bool = False,
) -> pathlib.Path:
    """Tokenize text into a token corpus for `TokenDataset(out, seq_len)`; returns `out`.

    `inputs`: `.txt` files (one document each), `.jsonl`/`.json` files (one document per
    line, text in the field `text_column`), `.parquet` and `.arrow` files (one document
    per non-null value of `text_column`), Hugging Face `datasets` folders (save_to_disk)
    and folders of such files. `tokenizer`: "bytes" (UTF-8 bytes, EOS 256, vocab 257) or
    a local path to a Hugging Face tokenizer.json or its directory (EOS from
    tokenizer_config.json's eos_token, else a usual name such as </s> or <|endoftext|>).

    Every row holds seq_len + 1 tokens of the documents' ids, each document followed by
    EOS (unless `add_eos` is False), packed across documents; tokens after the last full
    row are dropped. `out` ending in `.parquet` is written as one file; any other `out`
    is a folder of shards `part-NNNNN.parquet` of at most `shard_bytes` of tokens each,
    plus `manifest.json`, written last. A folder that already holds a corpus is refused
    unless `overwrite`. Row groups hold at most `row_group_bytes` of tokens (at least a
    row): a random sample reads one. Every file is renamed into place once complete.

    `workers` processes tokenize (None: one per CPU core; 1: in this process); the
    output is the same for any number. With more than one, a script calling this needs
    the usual `if __name__ == "__main__":` guard (workers are spawned).
    `progress(documents_read, total_or_None, tokens_written)` is called after each batch;
    the total is None when a JSON lines input makes it unknown.
    Raises DataError for unusable input, naming what is wrong.
    """
    workers = _check_sizes(seq_len, workers, shard_bytes, row_group_bytes)
    target = pathlib.Path(out)
    folder = target.suffix.lower() != ".parquet"
    check_output(target, folder, overwrite)
    files = _input_files(inputs)
    tok = _load_tokenizer(tokenizer)
    if add_eos and tok.eos_id is None:
        raise DataError(
            f"tokenizer {tok.name} has no EOS token (no eos_token in tokenizer_config.json and none of "
            f"{', '.join(_EOS_CANDIDATES)}); add one, or pass add_eos=False"
        )
    sources = [_open_source(f, text_column) for f in files]
    total = None if any(s.documents is None for s in sources) else sum(s.documents for s in sources)
    eos_id = tok.eos_id if add_eos else None
    fingerprint = tokenizer_fingerprint(tokenizer)
    width = seq_len + 1
    sink = open_sink(target, folder, overwrite, _file_schema(tok, fingerprint, seq_len, eos_id, folder, shard_bytes),
                      seq_len, shard_bytes, row_group_bytes)

    def report(counts: _Counts) -> None:
        if progress is not None:
            progress(counts.read, total, sink.rows * width)

    encoded = _encoded(_batches(_documents(sources, text_column)), tok, str(tokenizer), eos_id, workers)
    try:
        counts = _pack(encoded, width, tok.vocab_size, tok.name, sink, report)
        if sink.rows == 0:
            raise DataError(
                f"found {counts.tokens} tokens in {counts.documents} documents of {len(files)} input files, but one "
                f"row needs seq_len + 1 = {width} tokens; add text or lower seq_len"
            )
        if not folder:
            sink.close({_META_DOCUMENTS: str(counts.documents).encode()})
            fsync_dir(target.parent)
            return target
        manifest = CorpusManifest(
            seq_len=seq_len, vocab_size=tok.vocab_size, tokenizer=tok.name, tokenizer_fingerprint=fingerprint,
            eos_id=-1 if eos_id is None else eos_id, documents=counts.documents, samples=sink.rows,
            tokens=sink.rows * width, max_token=sink.max_token, shards=sink.close(),
        )
        write_manifest(target, manifest)
    except BaseException:
        sink.abort()
        raise
    finally:
        encoded.close()  # stops the workers now, not when the traceback lets go of the generator
    return target
