"""prepare_data: text, JSON lines, Parquet and Arrow text -> token Parquet (a file, or shards + manifest)."""
from __future__ import annotations

import hashlib
import json
import pathlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raypar.data import DataError, TokenDataset, prepare_data
from raypar.data.manifest import MANIFEST_NAME, CorpusManifest
from raypar.data.prepare import BYTE_EOS, BYTE_VOCAB_SIZE, tokenizer_fingerprint

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
    calls: list[tuple[int, int | None, int]] = []
    out = prepare_data(files, tmp_path / "out" / "train.parquet", seq_len=7,
                       progress=lambda done, total, tokens: calls.append((done, total, tokens)))
    ds, rows = _dataset_rows(out, 7)
    assert ds.vocab_size == BYTE_VOCAB_SIZE
    np.testing.assert_array_equal(rows, _rows(_byte_stream(DOCS), 7))
    assert calls == [(3, 3, rows.size)]  # three small documents make one batch
    meta = pq.ParquetFile(out).schema_arrow.metadata
    assert meta[b"raypar.vocab_size"] == b"257" and meta[b"raypar.seq_len"] == b"7"
    assert meta[b"raypar.tokenizer_fingerprint"] == b"bytes" and meta[b"raypar.eos_id"] == b"256"
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


def _train_tokenizer(tok_dir: pathlib.Path):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(DOCS * 4, trainer=trainer)
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    return tok


def test_hf_tokenizer_trained_locally(tmp_path: pathlib.Path) -> None:
    tok_dir = tmp_path / "tok"
    tok = _train_tokenizer(tok_dir)

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
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="input directory .*empty holds no .txt, .jsonl"):
        prepare_data([tmp_path / "empty"], out, seq_len=4)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"found 0 tokens in 0 documents"):
        prepare_data([tmp_path / "empty.jsonl"], out, seq_len=4)
    (tmp_path / "tokdir").mkdir()
    with pytest.raises(DataError, match="no tokenizer.json"):
        prepare_data([txt], out, seq_len=2, tokenizer=str(tmp_path / "tokdir"))
    with pytest.raises(DataError, match="neither 'bytes' nor an existing path"):
        prepare_data([txt], out, seq_len=2, tokenizer="gpt2")
    assert not out.exists()


# ---------------------------------------------------------------------------------------
# Corpus scale: folder output, JSON lines and datasets inputs, workers


def _write_jsonl(path: pathlib.Path, docs: list[str | None]) -> pathlib.Path:
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def _stored_rows(files: list[pathlib.Path]) -> np.ndarray:
    return np.asarray([row for f in files for row in pq.read_table(f).column("tokens").to_pylist()])


def _many_docs(n: int) -> list[str]:
    return [f"doc {i}: " + "wörds " * (i % 5) for i in range(n)]


def test_folder_output_packs_documents_into_shards_with_a_manifest(tmp_path: pathlib.Path) -> None:
    docs = _many_docs(60)
    src = _write_jsonl(tmp_path / "docs.jsonl", docs)
    seq_len, shard_rows, group_rows = 15, 10, 4
    width_bytes = (seq_len + 1) * 4
    out = prepare_data([src], tmp_path / "corpus", seq_len=seq_len, shard_bytes=shard_rows * width_bytes,
                       row_group_bytes=group_rows * width_bytes + 3)
    assert out == tmp_path / "corpus"
    manifest = CorpusManifest.from_json((out / MANIFEST_NAME).read_text(), "test")
    shards = sorted(out.glob("*.parquet"))
    assert [s.path for s in manifest.shards] == [f.name for f in shards] == [f"part-{i:05d}.parquet"
                                                                             for i in range(len(shards))]
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME] + [f.name for f in shards]  # no .tmp left

    rows = _stored_rows(shards)  # every document's bytes then EOS, concatenated, cut, tail dropped
    np.testing.assert_array_equal(rows, _rows(_byte_stream(docs), seq_len))
    assert (manifest.samples, manifest.tokens, manifest.documents) == (len(rows), rows.size, len(docs))
    assert (manifest.seq_len, manifest.vocab_size, manifest.eos_id) == (seq_len, BYTE_VOCAB_SIZE, BYTE_EOS)
    assert manifest.max_token == rows.max() and manifest.tokenizer == manifest.tokenizer_fingerprint == "bytes"
    for entry, f in zip(manifest.shards, shards):
        pf = pq.ParquetFile(f)
        assert entry.sha256 == hashlib.sha256(f.read_bytes()).hexdigest() and entry.bytes == f.stat().st_size
        assert entry.samples == pf.metadata.num_rows <= shard_rows
        groups = [pf.metadata.row_group(i).num_rows for i in range(pf.metadata.num_row_groups)]
        assert max(groups) <= group_rows and sum(groups) == entry.samples
        assert str(pf.schema_arrow.field("tokens").type) == "list<element: int32>"
        meta = pf.schema_arrow.metadata
        assert meta[b"raypar.seq_len"] == b"15" and meta[b"raypar.vocab_size"] == b"257"
        assert meta[b"raypar.tokenizer_fingerprint"] == b"bytes" and meta[b"raypar.eos_id"] == b"256"
    assert [e.samples for e in manifest.shards[:-1]] == [shard_rows] * (len(shards) - 1)


def test_two_workers_write_what_one_writes(tmp_path: pathlib.Path) -> None:
    src = _write_jsonl(tmp_path / "docs.jsonl", _many_docs(700))  # three batches: the pool really runs
    outs = [prepare_data([src], tmp_path / f"w{w}", seq_len=31, workers=w, shard_bytes=4096) for w in (1, 2)]
    files = [sorted(o.iterdir()) for o in outs]
    assert [f.name for f in files[0]] == [f.name for f in files[1]] and len(files[0]) > 2
    for a, b in zip(*files):
        assert a.read_bytes() == b.read_bytes(), a.name  # the manifest, sha256s included, too


def test_jsonl_input_and_its_errors(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "first"}\n\n{"text": null}\n{"text": "second", "n": 1}\n', encoding="utf-8")
    calls: list[tuple[int, int | None, int]] = []
    out = prepare_data([src], tmp_path / "a.parquet", seq_len=3,
                       progress=lambda done, total, tokens: calls.append((done, total, tokens)))
    np.testing.assert_array_equal(_stored_rows([out]), _rows(_byte_stream(["first", "second"]), 3))
    assert calls == [(3, None, 12)]  # the null counts as read, the blank line not at all; no total for JSONL

    good = [json.dumps({"text": d}) for d in _many_docs(300)]
    (tmp_path / "bad.jsonl").write_text("\n".join(good + ["{not json"]), encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl, line 301 is not JSON"):
        prepare_data([tmp_path / "bad.jsonl"], tmp_path / "bad", seq_len=3, shard_bytes=64)
    assert not list((tmp_path / "bad").iterdir())  # the shards written before the error are gone
    (tmp_path / "nofield.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"nofield.jsonl, line 2 has no field 'text' \(it has \['body'\]\)"):
        prepare_data([tmp_path / "nofield.jsonl"], tmp_path / "o.parquet", seq_len=1)


def test_datasets_folder_is_read_in_state_json_order(tmp_path: pathlib.Path) -> None:
    folder = tmp_path / "ds"
    folder.mkdir()
    parts = {"data-00000-of-00002.arrow": ["alpha", "beta"], "data-00001-of-00002.arrow": ["gamma", None, "delta"]}
    for name, texts in parts.items():
        table = pa.table({"text": texts, "label": list(range(len(texts)))})
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=2):
                writer.write_batch(batch)
    order = list(reversed(parts))  # not name order, so the test tells them apart
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in order]}))
    (folder / "dataset_info.json").write_text("{}")
    calls: list[tuple[int, int | None, int]] = []
    out = prepare_data([folder], tmp_path / "o.parquet", seq_len=4,
                       progress=lambda done, total, tokens: calls.append((done, total, tokens)))
    expected = [t for n in order for t in parts[n] if t is not None]
    np.testing.assert_array_equal(_stored_rows([out]), _rows(_byte_stream(expected), 4))
    assert calls[-1][:2] == (5, 5)


def test_folder_output_refuses_an_existing_corpus_unless_overwrite(tmp_path: pathlib.Path) -> None:
    src = tmp_path / "a.txt"
    src.write_text("some text to tokenize", encoding="utf-8")
    out = prepare_data([src], tmp_path / "corpus", seq_len=3, shard_bytes=16)
    assert len(list(out.glob("part-*.parquet"))) == 5
    with pytest.raises(DataError, match=r"already holds a corpus .*overwrite=True"):
        prepare_data([src], out, seq_len=3)
    src.write_text("shorter one", encoding="utf-8")
    prepare_data([src], out, seq_len=3, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST_NAME, "part-00000.parquet"]
    np.testing.assert_array_equal(_stored_rows([out / "part-00000.parquet"]), _rows(_byte_stream(["shorter one"]), 3))
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="is a file"):
        prepare_data([src], tmp_path / "file", seq_len=3)


def test_tokenizer_fingerprint(tmp_path: pathlib.Path) -> None:
    assert tokenizer_fingerprint("bytes") == "bytes"
    tok_dir = tmp_path / "tok"
    _train_tokenizer(tok_dir)
    expected = "sha256:" + hashlib.sha256((tok_dir / "tokenizer.json").read_bytes()).hexdigest()
    assert tokenizer_fingerprint(str(tok_dir)) == tokenizer_fingerprint(str(tok_dir / "tokenizer.json")) == expected
    with pytest.raises(DataError, match="no tokenizer.json"):
        tokenizer_fingerprint(str(tmp_path))

    src = tmp_path / "a.txt"
    src.write_text(" ".join(DOCS), encoding="utf-8")
    out = prepare_data([src], tmp_path / "corpus", seq_len=2, tokenizer=str(tok_dir))
    manifest = CorpusManifest.from_json((out / MANIFEST_NAME).read_text(), "test")
    assert manifest.tokenizer_fingerprint == expected and manifest.tokenizer == str(tok_dir / "tokenizer.json")
    meta = pq.ParquetFile(out / "part-00000.parquet").schema_arrow.metadata
    assert meta[b"raypar.tokenizer_fingerprint"] == expected.encode()


def test_cli_writes_a_folder_and_shows_progress(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    from raypar.driver.cli import main

    src = _write_jsonl(tmp_path / "docs.jsonl", _many_docs(40))
    out = tmp_path / "corpus"
    args = ["prepare-data", str(out), "--input", str(src), "--seq-len", "7", "--workers", "1", "--shard-mb", "0.001",
            "--row-group-kb", "0.1"]
    assert main(args) == 0
    err = capsys.readouterr().err
    manifest = CorpusManifest.from_json((out / MANIFEST_NAME).read_text(), "test")
    assert err.endswith("\n") and err.count("\n") == 1 and f"40 documents  {manifest.tokens} tokens" in err
    assert f"  {len(manifest.shards)} shards" in err
    assert main(args) == 2 and "--overwrite" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
