"""prepare_data: text and Parquet text -> token Parquet that TokenDataset reads."""
from __future__ import annotations

import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypar.data import DataError, TokenDataset, prepare_data
from raypar.data.prepare import BYTE_EOS, BYTE_VOCAB_SIZE

DOCS = ["hello world", "héllo\nagain", "a third, longer document of text " * 3]


def _byte_stream(docs: list[str]) -> list[int]:
    out: list[int] = []
    for d in docs:
        out += list(d.encode("utf-8")) + [BYTE_EOS]
    return out


def _rows(stream: list[int], seq_len: int) -> np.ndarray:
    n = len(stream) // (seq_len + 1)
    return np.asarray(stream[: n * (seq_len + 1)]).reshape(n, seq_len + 1)


def _dataset_rows(path: pathlib.Path, seq_len: int) -> tuple[TokenDataset, np.ndarray]:
    ds = TokenDataset(path, seq_len)
    inputs, labels = ds.get(range(len(ds)))
    rows = np.concatenate([inputs.numpy(), labels.numpy()[:, -1:]], axis=1)
    return ds, rows


def test_bytes_from_txt_files(tmp_path: pathlib.Path) -> None:
    files = []
    for i, doc in enumerate(DOCS):
        files.append(tmp_path / f"doc{i}.txt")
        files[-1].write_text(doc, encoding="utf-8")
    calls: list[tuple[int, int]] = []
    out = prepare_data(files, tmp_path / "out" / "train.parquet", seq_len=7,
                       progress=lambda done, total: calls.append((done, total)))
    ds, rows = _dataset_rows(out, 7)
    assert ds.vocab_size == BYTE_VOCAB_SIZE
    np.testing.assert_array_equal(rows, _rows(_byte_stream(DOCS), 7))
    assert calls == [(1, 3), (2, 3), (3, 3)]
    meta = pq.ParquetFile(out).schema_arrow.metadata
    assert meta[b"raypar.vocab_size"] == b"257" and meta[b"raypar.seq_len"] == b"7"
    assert [p.name for p in out.parent.iterdir()] == ["train.parquet"]  # no temp file left


def test_bytes_from_parquet_and_directory(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    table = pa.table({"id": [1, 2, 3, 4], "body": [DOCS[0], None, DOCS[1], DOCS[2]]})
    pq.write_table(table, src / "a.parquet")
    (src / "b.txt").write_text("tail doc", encoding="utf-8")
    out = prepare_data([src], tmp_path / "t.parquet", seq_len=5, text_column="body", add_eos=False)
    _, rows = _dataset_rows(out, 5)
    stream = [b for d in [*DOCS, "tail doc"] for b in d.encode("utf-8")]  # null row skipped, no EOS
    np.testing.assert_array_equal(rows, _rows(stream, 5))


def test_hf_tokenizer_trained_locally(tmp_path: pathlib.Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(DOCS * 4, trainer=trainer)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))

    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(DOCS), encoding="utf-8")
    out = prepare_data([text, text], tmp_path / "t.parquet", seq_len=4, tokenizer=str(tok_dir))
    ds, rows = _dataset_rows(out, 4)
    ids = tok.encode(" ".join(DOCS), add_special_tokens=False).ids
    eos = tok.token_to_id("</s>")
    np.testing.assert_array_equal(rows, _rows(ids + [eos] + ids + [eos], 4))
    assert ds.vocab_size == tok.get_vocab_size()

    # tokenizer_config.json names the EOS; a file path works as well as its directory.
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<unk>"}))
    out = prepare_data([text, text], tmp_path / "t2.parquet", seq_len=4, tokenizer=str(tok_dir / "tokenizer.json"))
    _, rows = _dataset_rows(out, 4)
    unk = tok.token_to_id("<unk>")
    np.testing.assert_array_equal(rows, _rows(ids + [unk] + ids + [unk], 4))


def test_errors(tmp_path: pathlib.Path) -> None:
    txt = tmp_path / "a.txt"
    txt.write_text("short", encoding="utf-8")
    out = tmp_path / "o.parquet"
    with pytest.raises(DataError, match="input not found"):
        prepare_data([tmp_path / "nope.txt"], out, seq_len=4)
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(DataError, match="unknown extension '.csv'"):
        prepare_data([tmp_path / "a.csv"], out, seq_len=4)
    pq.write_table(pa.table({"content": ["x"], "id": [1]}), tmp_path / "p.parquet")
    with pytest.raises(DataError, match=r"no text column 'text'; its columns are \['content', 'id'\]"):
        prepare_data([tmp_path / "p.parquet"], out, seq_len=4)
    with pytest.raises(DataError, match=r"found 6 tokens .* seq_len \+ 1 = 11"):
        prepare_data([txt], out, seq_len=10)
    (tmp_path / "tokdir").mkdir()
    with pytest.raises(DataError, match="no tokenizer.json"):
        prepare_data([txt], out, seq_len=2, tokenizer=str(tmp_path / "tokdir"))
    with pytest.raises(DataError, match="neither 'bytes' nor an existing path"):
        prepare_data([txt], out, seq_len=2, tokenizer="gpt2")
    assert not out.exists()
