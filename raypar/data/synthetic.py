"""A small learnable synthetic token corpus for smoke tests and benchmarks."""
from __future__ import annotations

import os
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raypar.checkpoint.store import atomic_write

from raypar.data.dataset import META_SEQ_LEN, META_TOKENIZER_FINGERPRINT, META_VOCAB_SIZE, TOKENS_COLUMN

__all__ = ["write_synthetic_corpus", "generate_markov_tokens", "GENERATOR"]

GENERATOR = "sparse-markov-v1"

# Each token has this many candidate successors, with these probabilities. The
# skew gives a bigram conditional entropy of ~1.45 nats (with the noise below) vs.
# log(256) = 5.5 for a uniform stream: a tiny model learns the transition table
# within tens of steps, yet the task is not a deterministic copy.
_SUCCESSOR_PROBS = np.array([0.6, 0.25, 0.1, 0.05])
# Chance that a position is a uniformly random token instead; keeps every
# transition possible so no logit is driven to -inf.
_NOISE = 0.05


def generate_markov_tokens(
    num_samples: int, length: int, vocab_size: int, seed: int = 0, part: int | None = None
) -> np.ndarray:
    """Draw ``num_samples`` sequences of ``length`` tokens as int32 ``[num_samples, length]``.

    Generator (``sparse-markov-v1``): a fixed sparse Markov chain is drawn from
    ``seed``: every token ``v`` gets ``K = min(4, vocab_size)`` successor tokens
    (uniform, repeats allowed) weighted 0.6 / 0.25 / 0.1 / 0.05. Each sequence
    starts at a uniform token; each next token is, with probability 0.95, a
    successor of the current token drawn by those weights, and otherwise a
    uniform random token. The loop runs over positions, vectorised over samples.
    ``part`` draws another batch of samples from the same chain (a corpus written in parts).
    """
    if num_samples < 0 or length < 1 or vocab_size < 2:
        raise ValueError(
            f"need num_samples >= 0, length >= 1, vocab_size >= 2; got "
            f"{num_samples}, {length}, {vocab_size}"
        )
    k = min(len(_SUCCESSOR_PROBS), vocab_size)
    probs = _SUCCESSOR_PROBS[:k] / _SUCCESSOR_PROBS[:k].sum()
    cdf = np.cumsum(probs)
    cdf[-1] = 1.0  # guard against rounding leaving u in (cdf[-1], 1)

    # Separate streams for the chain and the samples: the chain (the "language")
    # depends only on the seed and vocab, not on how many samples are drawn.
    chain_rng = np.random.default_rng([seed, 0])
    sample_rng = np.random.default_rng([seed, 1] if part is None else [seed, 1, part])
    successors = chain_rng.integers(0, vocab_size, size=(vocab_size, k), dtype=np.int32)

    out = np.empty((num_samples, length), dtype=np.int32)
    cur = sample_rng.integers(0, vocab_size, size=num_samples, dtype=np.int32)
    out[:, 0] = cur
    for t in range(1, length):
        choice = np.searchsorted(cdf, sample_rng.random(num_samples), side="right")
        nxt = successors[cur, choice]
        noisy = sample_rng.random(num_samples) < _NOISE
        nxt[noisy] = sample_rng.integers(0, vocab_size, size=int(noisy.sum()), dtype=np.int32)
        out[:, t] = nxt
        cur = nxt
    return out


def _tokens_table(tokens: np.ndarray, metadata: dict[bytes, bytes]) -> pa.Table:
    n, width = tokens.shape
    values = pa.array(tokens.reshape(-1), type=pa.int32())
    total = n * width
    # list<int32> (int32 offsets) is the documented format; only a corpus beyond
    # 2**31 tokens needs 64-bit offsets, which readers accept as large_list.
    if total <= np.iinfo(np.int32).max:
        offsets = pa.array(np.arange(0, total + 1, width, dtype=np.int32))
        column = pa.ListArray.from_arrays(offsets, values)
    else:
        offsets = pa.array(np.arange(0, total + 1, width, dtype=np.int64))
        column = pa.LargeListArray.from_arrays(offsets, values)
    return pa.Table.from_arrays([column], names=[TOKENS_COLUMN]).replace_schema_metadata(metadata)


def write_synthetic_corpus(
    path: str | os.PathLike,
    num_samples: int,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
) -> pathlib.Path:
    """Write a learnable Markov-chain corpus (see ``generate_markov_tokens``) to Parquet:
    one file when ``path`` ends in ``.parquet``, else a folder of shards with a manifest
    (`CorpusWriter`), generated and written a part at a time, so a corpus of any size fits.

    Each row of column ``tokens`` (list<int32>) holds ``seq_len + 1`` tokens. The
    schema metadata records ``raypar.vocab_size``, ``raypar.seq_len``,
    ``raypar.generator`` and ``raypar.seed``. The file is written to a hidden
    temporary file in the same directory, fsynced and renamed into place, so a
    crash never leaves a partial file under ``path``. Same arguments give
    identical token content. Returns the path written.
    """
    if num_samples < 1 or seq_len < 1:
        raise ValueError(f"need num_samples >= 1 and seq_len >= 1, got {num_samples}, {seq_len}")
    target = pathlib.Path(path)
    if target.suffix != ".parquet":
        return _write_folder(target, num_samples, seq_len, vocab_size, seed)
    if target.is_dir():
        raise IsADirectoryError(
            f"{target} is a directory; give a file path such as {target}/train.parquet"
        )
    target.parent.mkdir(parents=True, exist_ok=True)

    tokens = generate_markov_tokens(num_samples, seq_len + 1, vocab_size, seed)
    table = _tokens_table(
        tokens,
        {
            META_VOCAB_SIZE: str(vocab_size).encode(),
            META_SEQ_LEN: str(seq_len).encode(),
            b"raypar.generator": GENERATOR.encode(),
            b"raypar.seed": str(seed).encode(),
        },
    )

    # The temp file's .tmp suffix keeps directory readers (*.parquet) off it, even orphaned.
    # Row groups of about 1 MiB: a streaming reader reads one per sample it needs.
    rows_per_group = max(1, 2**20 // (4 * (seq_len + 1)))
    atomic_write(target, lambda tmp: pq.write_table(table, tmp, row_group_size=rows_per_group))
    return target


_PART_SAMPLES = 16384


def _write_folder(folder: pathlib.Path, num_samples: int, seq_len: int, vocab_size: int, seed: int) -> pathlib.Path:
    from raypar.data.manifest import CorpusManifest
    from raypar.data.writer import DEFAULT_ROW_GROUP_BYTES, DEFAULT_SHARD_BYTES, open_sink, write_manifest

    name = f"synthetic:{GENERATOR}"
    metadata = {META_VOCAB_SIZE: str(vocab_size).encode(), META_SEQ_LEN: str(seq_len).encode(),
                b"raypar.generator": GENERATOR.encode(), b"raypar.seed": str(seed).encode(),
                META_TOKENIZER_FINGERPRINT: name.encode()}
    schema = pa.schema([(TOKENS_COLUMN, pa.list_(pa.int32()))], metadata=metadata)
    sink = open_sink(folder, True, True, schema, seq_len, DEFAULT_SHARD_BYTES, DEFAULT_ROW_GROUP_BYTES)
    try:
        for part, first in enumerate(range(0, num_samples, _PART_SAMPLES)):
            sink.add(generate_markov_tokens(min(_PART_SAMPLES, num_samples - first), seq_len + 1, vocab_size, seed,
                                            part=part))
        manifest = CorpusManifest(seq_len=seq_len, vocab_size=vocab_size, tokenizer=name, tokenizer_fingerprint=name,
                                  eos_id=-1, documents=num_samples, samples=sink.rows,
                                  tokens=sink.rows * (seq_len + 1), max_token=sink.max_token, shards=sink.close())
        write_manifest(folder, manifest)
    except BaseException:
        sink.abort()
        raise
    return folder
