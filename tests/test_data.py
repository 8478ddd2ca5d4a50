"""Tests for raypar.data: Parquet token datasets, sample order, synthetic corpora."""
from __future__ import annotations

import math
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from raypar.data import DataError, SampleOrder, TokenDataset, split_batch, write_synthetic_corpus
from raypar.data.synthetic import generate_markov_tokens

SEQ = 16
VOCAB = 64


def _write_rows(path: pathlib.Path, rows, typ=None, metadata=None, name: str = "tokens") -> pathlib.Path:
    arr = pa.array(rows, type=typ)
    table = pa.table({name: arr})
    if metadata:
        table = table.replace_schema_metadata(metadata)
    pq.write_table(table, path)
    return path


@pytest.fixture
def corpus(tmp_path: pathlib.Path) -> pathlib.Path:
    return write_synthetic_corpus(tmp_path / "sub" / "train.parquet", 200, SEQ, VOCAB, seed=3)


# --- TokenDataset -----------------------------------------------------------------


def test_round_trip(corpus: pathlib.Path) -> None:
    ds = TokenDataset(corpus, SEQ)
    assert len(ds) == 200
    assert ds.seq_len == SEQ
    assert ds.vocab_size == VOCAB
    inputs, labels = ds.get([0, 7, 199, 7])
    assert inputs.shape == labels.shape == (4, SEQ)
    assert inputs.dtype == labels.dtype == torch.int64
    assert inputs.is_contiguous() and labels.is_contiguous()
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    assert torch.equal(inputs[1], inputs[3])

    raw = pq.read_table(corpus).column("tokens").to_pylist()
    assert inputs[2].tolist() == raw[199][:-1]
    assert labels[2].tolist() == raw[199][1:]

    empty_in, empty_lab = ds.get([])
    assert empty_in.shape == (0, SEQ) and empty_lab.shape == (0, SEQ)


def test_metadata_and_atomic_write(corpus: pathlib.Path) -> None:
    meta = pq.read_schema(corpus).metadata
    assert meta[b"raypar.vocab_size"] == str(VOCAB).encode()
    assert meta[b"raypar.seq_len"] == str(SEQ).encode()
    assert b"raypar.generator" in meta and meta[b"raypar.seed"] == b"3"
    assert pq.read_schema(corpus).field("tokens").type == pa.list_(pa.int32())
    # No temp file survives next to the result.
    assert [p.name for p in corpus.parent.iterdir()] == ["train.parquet"]


def test_synthetic_deterministic(tmp_path: pathlib.Path) -> None:
    a = write_synthetic_corpus(tmp_path / "a.parquet", 50, SEQ, VOCAB, seed=1)
    b = write_synthetic_corpus(tmp_path / "b.parquet", 50, SEQ, VOCAB, seed=1)
    c = write_synthetic_corpus(tmp_path / "c.parquet", 50, SEQ, VOCAB, seed=2)
    ta, tb, tc = (pq.read_table(p).column("tokens") for p in (a, b, c))
    assert ta.equals(tb)
    assert not ta.equals(tc)


def test_directory_of_files_sorted_by_name(tmp_path: pathlib.Path) -> None:
    d = tmp_path / "shards"
    d.mkdir()
    width = SEQ + 1
    # Written out of name order to check the reader sorts.
    _write_rows(d / "b.parquet", [[2] * width] * 3)
    _write_rows(d / "a.parquet", [[1] * width] * 2)
    _write_rows(d / "c.parquet", [[3] * width] * 1, typ=pa.large_list(pa.int64()))
    (d / "notes.txt").write_text("ignored")
    (d / ".c.parquet.x.tmp").write_bytes(b"garbage")
    (d / "_SUCCESS.parquet").write_bytes(b"garbage")
    ds = TokenDataset(d, SEQ)
    assert len(ds) == 6
    inputs, _ = ds.get(range(6))
    assert inputs[:, 0].tolist() == [1, 1, 2, 2, 2, 3]
    assert ds.vocab_size is None  # none declared: ids are checked as blocks are read


@pytest.mark.parametrize(
    "typ",
    [
        pa.list_(pa.int32()),
        pa.list_(pa.int64()),
        pa.large_list(pa.int32()),
        pa.list_(pa.int32(), SEQ + 1),  # fixed_size_list
        pa.list_(pa.uint16()),
    ],
)
def test_accepted_column_types(tmp_path: pathlib.Path, typ: pa.DataType) -> None:
    rows = [list(range(i, i + SEQ + 1)) for i in range(4)]
    ds = TokenDataset(_write_rows(tmp_path / "t.parquet", rows, typ=typ), SEQ)
    inputs, labels = ds.get([3])
    assert inputs[0].tolist() == rows[3][:-1]
    assert labels[0].tolist() == rows[3][1:]


def test_multiple_row_groups(tmp_path: pathlib.Path) -> None:
    rows = [[i] * (SEQ + 1) for i in range(10)]
    path = tmp_path / "rg.parquet"
    pq.write_table(pa.table({"tokens": rows}), path, row_group_size=3)
    ds = TokenDataset(path, SEQ)
    assert ds.get(range(10))[0][:, 0].tolist() == list(range(10))


def test_missing_path(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "nope.parquet"
    with pytest.raises(DataError) as e:
        TokenDataset(missing, SEQ)
    msg = str(e.value)
    assert f"data file not found: {missing}" in msg
    assert "raypar prepare-data --synthetic OUT" in msg
    assert "leave data.path unset" in msg


def test_empty_directory(tmp_path: pathlib.Path) -> None:
    with pytest.raises(DataError, match=r"no \*\.parquet files"):
        TokenDataset(tmp_path, SEQ)


def test_no_tokens_column(tmp_path: pathlib.Path) -> None:
    path = _write_rows(tmp_path / "t.parquet", [[1, 2]], name="ids")
    with pytest.raises(DataError) as e:
        TokenDataset(path, SEQ)
    assert "no `tokens` column" in str(e.value)
    assert "['ids']" in str(e.value)


def test_wrong_column_type(tmp_path: pathlib.Path) -> None:
    path = _write_rows(tmp_path / "t.parquet", [[1.0] * (SEQ + 1)])
    with pytest.raises(DataError, match="list of integers"):
        TokenDataset(path, SEQ)


def test_wrong_seq_len(corpus: pathlib.Path) -> None:
    # Declared in the file: refused at open, before any block is read.
    with pytest.raises(DataError) as e:
        TokenDataset(corpus, SEQ + 4)
    msg = str(e.value)
    assert f"written with seq_len={SEQ} but data.seq_len is {SEQ + 4}" in msg
    assert f"--seq-len {SEQ + 4}" in msg


def test_wrong_row_length_undeclared(tmp_path: pathlib.Path) -> None:
    ds = TokenDataset(_write_rows(tmp_path / "t.parquet", [[0] * (SEQ + 1)] * 2), SEQ + 4)
    with pytest.raises(DataError) as e:
        ds.get([1])
    msg = str(e.value)
    assert f"expected seq_len + 1 = {SEQ + 5}" in msg
    assert f"has {SEQ + 1} tokens" in msg
    assert "data.seq_len must match the file" in msg


def test_ragged_rows(tmp_path: pathlib.Path) -> None:
    rows = [[0] * (SEQ + 1), [0] * (SEQ + 1), [0] * SEQ]
    ds = TokenDataset(_write_rows(tmp_path / "t.parquet", rows), SEQ)
    with pytest.raises(DataError, match=rf"row 2 has {SEQ} tokens but expected seq_len \+ 1 = {SEQ + 1}"):
        ds.get([0])


def test_wrong_fixed_size(tmp_path: pathlib.Path) -> None:
    path = _write_rows(tmp_path / "t.parquet", [[0] * SEQ], typ=pa.list_(pa.int32(), SEQ))
    with pytest.raises(DataError, match=rf"expected seq_len \+ 1 = {SEQ + 1}"):
        TokenDataset(path, SEQ).get([0])


def test_empty_dataset(tmp_path: pathlib.Path) -> None:
    path = _write_rows(tmp_path / "t.parquet", [], typ=pa.list_(pa.int32()))
    with pytest.raises(DataError, match="holds no samples"):
        TokenDataset(path, SEQ)


def test_not_parquet(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "t.parquet"
    path.write_text("this is not parquet at all")
    with pytest.raises(DataError) as e:
        TokenDataset(path, SEQ)
    assert str(path) in str(e.value)
    assert "not a readable Parquet file" in str(e.value)


def test_negative_tokens(tmp_path: pathlib.Path) -> None:
    rows = [[1] * (SEQ + 1), [1] * SEQ + [-5]]
    with pytest.raises(DataError, match="row 1 holds negative token id -5"):
        TokenDataset(_write_rows(tmp_path / "t.parquet", rows), SEQ).get([0])


def test_null_row(tmp_path: pathlib.Path) -> None:
    rows = [[1] * (SEQ + 1), None]
    with pytest.raises(DataError, match="row 1 .* is null"):
        TokenDataset(_write_rows(tmp_path / "t.parquet", rows), SEQ).get([0])


def test_declared_vocab_too_small(tmp_path: pathlib.Path) -> None:
    rows = [[9] * (SEQ + 1)]
    path = _write_rows(tmp_path / "t.parquet", rows, metadata={b"raypar.vocab_size": b"8"})
    ds = TokenDataset(path, SEQ)
    assert ds.vocab_size == 8
    with pytest.raises(DataError, match="declares vocab_size 8 but row 0 holds token id 9"):
        ds.get([0])


def test_index_out_of_range(corpus: pathlib.Path) -> None:
    ds = TokenDataset(corpus, SEQ)
    with pytest.raises(DataError, match="sample index 200 out of range for dataset of 200"):
        ds.get([0, 200])
    with pytest.raises(DataError, match="sample index -1 out of range"):
        ds.get([-1])


def test_check_vocab(tmp_path: pathlib.Path) -> None:
    rows = [[300] + [1] * SEQ]
    ds = TokenDataset(_write_rows(tmp_path / "t.parquet", rows), SEQ)
    ds.check_vocab(301)
    ds.get([0])
    fresh = TokenDataset(_write_rows(tmp_path / "t.parquet", rows), SEQ)
    fresh.check_vocab(256)  # nothing declared: the read refuses, naming the row
    with pytest.raises(DataError, match="row 0 holds token id 300 but model.vocab_size is 256"):
        fresh.get([0])


# --- SampleOrder ------------------------------------------------------------------


def test_order_deterministic_and_seeded() -> None:
    a = SampleOrder(100, seed=7).indices(0, 300)
    b = SampleOrder(100, seed=7).indices(0, 300)
    c = SampleOrder(100, seed=8).indices(0, 300)
    assert a == b
    assert a != c
    assert all(isinstance(i, int) for i in a)


def test_each_epoch_is_a_permutation() -> None:
    n = 37
    order = SampleOrder(n, seed=0)
    stream = order.indices(0, 4 * n)
    epochs = [stream[e * n : (e + 1) * n] for e in range(4)]
    for ep in epochs:
        assert sorted(ep) == list(range(n))
    assert len({tuple(ep) for ep in epochs}) == 4  # reshuffled every epoch
    assert epochs[0] != list(range(n))


def test_indices_is_pure_slicing() -> None:
    n = 23
    full = SampleOrder(n, seed=5).indices(0, 10 * n)
    order = SampleOrder(n, seed=5)
    # Arbitrary, backwards and epoch-crossing call pattern on one shared object.
    for start, count in [(200, 17), (3, 5), (20, 10), (0, 0), (45, 70), (22, 1), (150, 80)]:
        assert order.indices(start, count) == full[start : start + count]
    # Readers that each fetch their own chunks agree with a single reader.
    stitched: list[int] = []
    readers = [SampleOrder(n, seed=5) for _ in range(3)]
    for step, pos in enumerate(range(0, 10 * n, 10)):
        stitched += readers[step % 3].indices(pos, 10)
    assert stitched == full


def test_epoch_of_and_crossing() -> None:
    order = SampleOrder(10, seed=1)
    assert [order.epoch_of(p) for p in (0, 9, 10, 25)] == [0, 0, 1, 2]
    cross = order.indices(8, 4)
    assert cross[:2] == order.indices(8, 2)
    assert cross[2:] == order.indices(10, 2)


def test_no_shuffle() -> None:
    assert SampleOrder(4, seed=9, shuffle=False).indices(2, 7) == [2, 3, 0, 1, 2, 3, 0]


def test_order_rejects_bad_args() -> None:
    with pytest.raises(ValueError):
        SampleOrder(0, seed=0)
    with pytest.raises(ValueError):
        SampleOrder(5, seed=0).indices(-1, 2)


def test_split_batch() -> None:
    batch = list(range(12))
    assert split_batch(batch, 3, 0) == [0, 1, 2, 3]
    assert split_batch(batch, 3, 2) == [8, 9, 10, 11]
    assert sum((split_batch(batch, 4, p) for p in range(4)), []) == batch
    assert split_batch(batch, 1, 0) == batch
    with pytest.raises(ValueError, match="does not split into 5 equal parts"):
        split_batch(batch, 5, 0)
    with pytest.raises(ValueError):
        split_batch(batch, 3, 3)


# --- learnability -----------------------------------------------------------------


def test_corpus_is_learnable() -> None:
    vocab = 256
    tokens = generate_markov_tokens(2000, 129, vocab, seed=0).astype(np.int64)
    prev, nxt = tokens[:, :-1].ravel(), tokens[:, 1:].ravel()
    joint = np.bincount(prev * vocab + nxt, minlength=vocab * vocab).reshape(vocab, vocab).astype(float)
    p_joint = joint / joint.sum()
    p_prev = p_joint.sum(axis=1, keepdims=True)
    mask = p_joint > 0
    cond_entropy = -(p_joint[mask] * np.log((p_joint / p_prev)[mask])).sum()
    assert cond_entropy < 0.4 * math.log(vocab)
    # Not trivial either: several successors per token carry real mass.
    assert cond_entropy > 0.5
    # Unigram stays spread over the vocabulary, so a model cannot just predict one token.
    assert np.count_nonzero(np.bincount(nxt, minlength=vocab)) > 0.9 * vocab


def test_failed_write_leaves_no_file(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import raypar.data.synthetic as synthetic

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(synthetic.pq, "write_table", boom)
    with pytest.raises(OSError, match="disk full"):
        write_synthetic_corpus(tmp_path / "out.parquet", 10, SEQ, VOCAB)
    assert list(tmp_path.iterdir()) == []
