"""Fixed-length token samples streamed from a corpus of any size.

A corpus is a Parquet file, a folder of them (with the `manifest.json` that
`prepare-data` writes, or without), or a Hugging Face `datasets` folder of Arrow
files, on a local disk or in any store `pyarrow.fs` opens (``s3://bucket/prefix``).
Opening one reads the manifest or the files' footers: an index from sample id to
file and block (a Parquet row group), never the tokens. A batch reads the blocks
its samples sit in; the blocks read last stay in a window of bounded size
(`data.window_mb`), so no process holds more of the corpus than that.
"""
from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from raypar.checkpoint import storage
from raypar.data.manifest import MANIFEST_NAME, CorpusManifest
from raypar.data.shards import (META_SEQ_LEN, META_TOKENIZER_FINGERPRINT, META_VOCAB_SIZE, TOKENS_COLUMN, DataError,
                                Shard, open_shard)

__all__ = ["DataError", "TokenDataset", "TOKENS_COLUMN", "META_VOCAB_SIZE", "META_SEQ_LEN",
           "META_TOKENIZER_FINGERPRINT", "DEFAULT_WINDOW_BYTES"]

DEFAULT_WINDOW_BYTES = 256 * 2**20
# Open file handles kept at once: a corpus of thousands of shards must not exhaust them.
_OPEN_SHARDS = 64


def _is_data_file(name: str, suffix: str) -> bool:
    # Hidden and underscore-prefixed names are writer scratch (our own atomic-write
    # temp files, Spark's _SUCCESS/_metadata); reading them would double-count rows.
    return name.endswith(suffix) and not name.startswith((".", "_"))


def _hf_data_files(path: storage.Location) -> list[str] | None:
    """The Arrow files of a Hugging Face `datasets` folder, in its own order (state.json)."""
    import json

    state = storage.join(path, "state.json")
    if not storage.is_file(state):
        return None
    try:
        files = [f["filename"] for f in json.loads(storage.read_bytes(state))["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{storage.redact(str(state))} is not a `datasets` state file ({exc})") from None
    return files


def _resolve(path: storage.Location, seq_len: int) -> tuple[list[Shard], CorpusManifest | None]:
    shown = storage.redact(str(path))
    if storage.is_file(path):
        return [open_shard(path, seq_len)], None
    if not storage.is_dir(path):
        raise DataError(
            f"data file not found: {shown}. Set data.path to a Parquet token file or folder "
            "(write one with `raypar prepare-data --synthetic OUT`), or leave data.path "
            "unset to generate a synthetic corpus in the run directory."
        )
    manifest_path = storage.join(path, MANIFEST_NAME)
    if storage.is_file(manifest_path):
        manifest = CorpusManifest.from_json(storage.read_bytes(manifest_path).decode(), storage.redact(str(manifest_path)))
        return [open_shard(storage.join(path, s.path), seq_len, s.samples) for s in manifest.shards], manifest
    hf = _hf_data_files(path)
    if hf is not None:
        return [open_shard(storage.join(path, f), seq_len) for f in hf], None
    names = sorted(n for n, is_dir in storage.list_dir(path) if not is_dir)
    for suffix in (".parquet", ".arrow"):
        files = [n for n in names if _is_data_file(n, suffix)]
        if files:
            return [open_shard(storage.join(path, n), seq_len) for n in files], None
    raise DataError(f"no *.parquet files in data directory {shown}. Point data.path at a Parquet "
                    "token file or a directory of them.")


class _Window:
    """The blocks read last, up to a number of bytes; the oldest go first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._blocks: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self.bytes = 0
        self.peak_bytes = 0
        self.reads = 0  # blocks read from the files

    def get(self, key: tuple[int, int]) -> np.ndarray | None:
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
        return block

    def put(self, key: tuple[int, int], block: np.ndarray) -> bool:
        """Keep `block`; False when it alone is larger than the window (used for one batch only)."""
        self.reads += 1
        if block.nbytes > self.max_bytes:
            return False
        self._blocks[key] = block
        self.bytes += block.nbytes
        while self.bytes > self.max_bytes:
            _, old = self._blocks.popitem(last=False)
            self.bytes -= old.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return True


class TokenDataset:
    """Fixed-length token samples, column ``tokens`` (or ``input_ids``): one row per sample,
    each a list of ``seq_len + 1`` ints; inputs are ``tokens[:-1]`` and labels ``tokens[1:]``.
    Sample ids run over the files in order (a folder's files in name order, or its
    manifest's). Safe to call from several threads (the step and its prefetch)."""

    def __init__(self, path: storage.Location, seq_len: int, window_bytes: int = DEFAULT_WINDOW_BYTES) -> None:
        if seq_len < 1:
            raise DataError(f"data.seq_len must be >= 1, got {seq_len}")
        if window_bytes < 1:
            raise DataError(f"data.window_mb must be > 0, got {window_bytes / 2**20}")
        self.path = path if storage.is_uri(path) else Path(storage.local(path))
        self.seq_len = int(seq_len)
        self.shards, self.manifest = _resolve(self.path, self.seq_len)
        counts = np.array([s.samples for s in self.shards], dtype=np.int64)
        for shard in self.shards:  # counted; reopened when read, a bounded number at a time
            shard.close()
        if counts.sum() == 0:
            raise DataError(f"data at {self.shown} holds no samples; write a corpus with "
                            "`raypar prepare-data --synthetic OUT` or point data.path at a non-empty file.")
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self._check_declared_seq_len()
        self._window = _Window(window_bytes)
        self._open: OrderedDict[int, None] = OrderedDict()
        self._vocab_limit: int | None = None
        self._warned = False
        self._lock = threading.Lock()

    @property
    def shown(self) -> str:
        return storage.redact(str(self.path))

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary the corpus declares (its manifest, or the largest its files declare);
        None when it declares none."""
        if self.manifest is not None:
            return self.manifest.vocab_size
        declared = [s.declared_vocab for s in self.shards if s.is_open and s.declared_vocab is not None]
        return max(declared) if declared else None

    @property
    def tokenizer_fingerprint(self) -> str | None:
        if self.manifest is not None:
            return self.manifest.tokenizer_fingerprint
        return self.shards[0].fingerprint if self.shards[0].is_open else None

    @property
    def window(self) -> _Window:
        return self._window

    def _check_declared_seq_len(self) -> None:
        if self.manifest is not None:
            declared = self.manifest.seq_len
        else:
            declared = next((s.declared_seq_len for s in self.shards if s.is_open and s.declared_seq_len is not None),
                            None)
        if declared is not None and declared != self.seq_len:
            raise DataError(f"the corpus at {self.shown} was written with seq_len={declared} but data.seq_len is "
                            f"{self.seq_len}; data.seq_len must match the corpus (or write it again with "
                            f"`raypar prepare-data --seq-len {self.seq_len}`)")

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids the model cannot embed: now where the corpus says which ids it holds,
        else as each block is read."""
        self._vocab_limit = int(vocab_size)
        top = self.manifest.max_token if self.manifest is not None else None
        if top is not None and top >= vocab_size:
            raise DataError(f"data holds token id {top} but model.vocab_size is {vocab_size}; set "
                            f"model.vocab_size to at least {top + 1} or use matching data.")

    def check_tokenizer(self, fingerprint: str) -> None:
        """Refuse a corpus made with another tokenizer than `fingerprint` (see `tokenizer_fingerprint`)."""
        found = self.tokenizer_fingerprint
        if found != fingerprint:
            made = f"was made with tokenizer {found}" if found else "records no tokenizer"
            raise DataError(f"the corpus at {self.shown} {made}, but data.tokenizer is {fingerprint}; "
                            "write the corpus again with that tokenizer, or set data.tokenizer to the one it used")

    def get(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(inputs, labels)``, int64 tensors of shape ``[len(indices), seq_len]``."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size:
            bad = idx[(idx < 0) | (idx >= n)]
            # Negative ids are rejected rather than wrapped: they only arise from bugs in
            # the order/offset arithmetic, which wrapping would hide.
            if bad.size:
                raise DataError(f"sample index {int(bad[0])} out of range for dataset of {n} samples "
                                f"(valid: 0..{n - 1})")
        rows = np.empty((idx.size, self.seq_len + 1), dtype=np.int64)
        with self._lock:
            self._gather(idx, rows)
        inputs = torch.from_numpy(np.ascontiguousarray(rows[:, :-1]))
        labels = torch.from_numpy(np.ascontiguousarray(rows[:, 1:]))
        return inputs, labels

    def _gather(self, idx: np.ndarray, out: np.ndarray) -> None:
        shard_of = np.searchsorted(self._starts, idx, side="right") - 1
        for s in np.unique(shard_of):
            shard = self.shards[int(s)]
            where = np.flatnonzero(shard_of == s)
            rows = idx[where] - self._starts[s]
            self._touch(int(s))
            blocks = shard.block_of(rows)
            for b in np.unique(blocks):
                block = self._block(int(s), int(b))
                take = blocks == b
                out[where[take]] = block[rows[take] - shard.block_start(int(b))]

    def _block(self, s: int, b: int) -> np.ndarray:
        block = self._window.get((s, b))
        if block is None:
            shard = self.shards[s]
            block = shard.read_block(b)
            if self._vocab_limit is not None and block.size and int(block.max()) >= self._vocab_limit:
                row = shard.block_start(b) + int(np.flatnonzero((block >= self._vocab_limit).any(axis=1))[0])
                raise DataError(f"{shard.name}: row {row} holds token id {int(block.max())} but model.vocab_size "
                                f"is {self._vocab_limit}; set model.vocab_size to at least {int(block.max()) + 1} "
                                "or use matching data.")
            if not self._window.put((s, b), block) and not self._warned:
                self._warned = True
                warnings.warn(f"{shard.name}: block {b} holds {block.nbytes / 2**20:.1f} MiB of tokens, more than "
                              f"data.window_mb={self._window.max_bytes / 2**20:g}: every batch that needs it reads it "
                              "again. Raise data.window_mb, or write the corpus with `raypar prepare-data` "
                              "(row groups of 1 MiB)", stacklevel=2)
        return block

    def _touch(self, s: int) -> None:
        self._open[s] = None
        self._open.move_to_end(s)
        while len(self._open) > _OPEN_SHARDS:
            old, _ = self._open.popitem(last=False)
            self.shards[old].close()

    def __repr__(self) -> str:
        return (f"TokenDataset(path={self.shown!r}, samples={len(self)}, shards={len(self.shards)}, "
                f"seq_len={self.seq_len}, vocab_size={self.vocab_size})")

