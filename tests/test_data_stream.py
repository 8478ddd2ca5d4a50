"""Corpora streamed a block at a time: a process keeps at most its window (measured), an
S3-protocol store (moto's server on the loopback address) gives the local file's batches
and trains to the same losses, prefetch hands over the next batch, manifests and
Hugging Face `datasets` folders are read, and bad corpora are refused with clear errors."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch

from raypar.data import DataError, TokenDataset
from raypar.data.manifest import MANIFEST_NAME, CorpusManifest, ShardEntry
from raypar.data.prefetch import Prefetcher
from raypar.driver.callbacks import Callback
from raypar.driver.trainer import Trainer

from helpers import ROOT, run_config

VOCAB = 50_000


def numbered_rows(first: int, count: int, seq_len: int, vocab: int = VOCAB) -> np.ndarray:
    """Rows whose every token says which sample it belongs to: row i is (7 i + j) mod vocab."""
    ids = np.arange(first, first + count, dtype=np.int64)[:, None]
    return ((ids * 7 + np.arange(seq_len + 1)) % vocab).astype(np.int32)


def write_numbered(path: Path, samples: int, seq_len: int, rows_per_group: int, vocab: int = VOCAB) -> Path:
    """A corpus of `samples` numbered rows in row groups of `rows_per_group`, written a group
    at a time (the test process never holds it whole either)."""
    width = seq_len + 1
    meta = {b"raypar.vocab_size": str(vocab).encode(), b"raypar.seq_len": str(seq_len).encode()}
    schema = pa.schema([("tokens", pa.list_(pa.int32()))], metadata=meta)
    with pq.ParquetWriter(path, schema, compression="none") as writer:
        for first in range(0, samples, rows_per_group):
            rows = numbered_rows(first, min(rows_per_group, samples - first), seq_len, vocab)
            offsets = pa.array(np.arange(0, rows.size + 1, width, dtype=np.int32))
            column = pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))
            writer.write_table(pa.Table.from_arrays([column], schema=schema))
    return path


def test_reading_through_a_corpus_keeps_memory_within_the_window(tmp_path):
    # 128 MiB of tokens in 256 KiB row groups; a 8 MiB window. A process reading 4,096 random
    # samples (most row groups) must grow by the window and a batch, not by the corpus.
    seq_len, samples = 1023, 32_768
    path = write_numbered(tmp_path / "big.parquet", samples, seq_len, rows_per_group=64)
    script = textwrap.dedent(f"""
        import json, numpy as np
        from raypar.data import TokenDataset

        def rss(key):
            for line in open("/proc/self/status"):
                if line.startswith(key):
                    return int(line.split()[1]) * 1024

        ds = TokenDataset({str(path)!r}, {seq_len}, window_bytes=8 << 20)
        ds.get([0])
        base = rss("VmRSS")
        rng = np.random.default_rng(0)
        for _ in range(64):
            ids = rng.integers(0, len(ds), 64)
            x, y = ds.get(ids.tolist())
            want = (ids[:, None] * 7 + np.arange({seq_len} + 1)) % {VOCAB}
            assert (x.numpy() == want[:, :-1]).all() and (y.numpy() == want[:, 1:]).all()
        print(json.dumps(dict(grown=rss("VmHWM") - base, window_peak=ds.window.peak_bytes, reads=ds.window.reads)))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    corpus = samples * (seq_len + 1) * 4
    assert seen["window_peak"] <= 8 << 20
    assert seen["reads"] * (64 * (seq_len + 1) * 4) > corpus  # it read more than the whole corpus's size
    # The window, a batch, and what Arrow's allocator (mimalloc) keeps of freed blocks: 17 MiB
    # with the system allocator, 31-40 with mimalloc; the whole corpus would be 128.
    assert seen["grown"] < 56 << 20, f"grew {seen['grown'] / 2**20:.0f} MiB reading a {corpus >> 20} MiB corpus"


class WorkerMemory(Callback):
    """Each worker's peak resident memory (read while the workers run: they end with the run)
    and the corpus bytes the workers report keeping."""

    def __init__(self) -> None:
        self.peak = 0
        self.window: list[int] = []

    def on_step_end(self, trainer, record) -> None:
        self.window.append(max(record.data_window_bytes))
        self.peak = max(self.peak, *(_status(i["pid"], "VmHWM") for i in trainer.group.info))


def _status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def test_training_on_a_corpus_larger_than_the_window_keeps_workers_within_it(ray_session, tmp_path):
    # The same run on 512 samples and on 48 MiB of tokens (~66 KiB row groups, a 1 MiB window,
    # every step reading blocks it has not kept): the workers' peak memory must not grow by
    # the corpus. A reader that loads the corpus would add 48 MiB to both data workers.
    peaks = {}
    for name, samples in (("small", 512), ("large", 393_216)):
        (tmp_path / name).mkdir()
        write_numbered(tmp_path / name / "data.parquet", samples, 31, rows_per_group=512, vocab=64)
        memory = WorkerMemory()
        cfg = run_config(tmp_path / name, "run", (1, 2, 1), 8, model={"max_seq_len": 32},
                         data={"seq_len": 31, "window_mb": 1.0}, train={"global_batch_size": 64})
        assert Trainer(cfg, callbacks=[memory]).fit().steps == 8
        assert 0 < max(memory.window) <= 1 << 20
        peaks[name] = memory.peak
    grown = peaks["large"] - peaks["small"]
    assert grown < 20 << 20, f"the workers' peak grew by {grown / 2**20:.0f} MiB on a 48 MiB corpus"


def _upload(local: Path, uri_dir: str, name: str) -> str:
    fs, inner = pafs.FileSystem.from_uri(uri_dir)
    with fs.open_output_stream(f"{inner}/{name}") as out:
        out.write(local.read_bytes())
    return uri_dir


def test_an_s3_corpus_gives_the_local_batches_and_trains_the_same(ray_session, tmp_path, s3_root):
    local = tmp_path / "data"
    local.mkdir()
    write_numbered(local / "a.parquet", 300, 8, rows_per_group=32, vocab=64)
    write_numbered(local / "b.parquet", 212, 8, rows_per_group=50, vocab=64)
    remote = s3_root("corpus")
    for name in ("a.parquet", "b.parquet"):
        _upload(local / name, remote, name)

    here, there = TokenDataset(local, 8, window_bytes=4096), TokenDataset(remote, 8, window_bytes=4096)
    assert len(there) == len(here) == 512 and "testing:testing" not in repr(there)
    ids = np.random.default_rng(0).integers(0, 512, 96).tolist()
    for got, want in zip(there.get(ids), here.get(ids)):
        assert torch.equal(got, want)

    runs = {}
    for name, path in (("local", str(local)), ("s3", remote)):
        cfg = run_config(tmp_path, name, (1, 2, 1), 4, data={"path": path, "window_mb": 0.01})
        runs[name] = [r.loss for r in Trainer(cfg).fit().records]
    assert runs["s3"] == runs["local"]


def test_prefetch_hands_over_the_next_batch_and_its_errors():
    calls = []

    def read(ids):
        calls.append((threading.current_thread().name, list(ids)))
        if -1 in ids:
            raise DataError("no such sample")
        time.sleep(0.2)
        t = torch.tensor(list(ids))
        return t, t + 1

    prefetch = Prefetcher(read, pin=False)
    prefetch.start([1, 2])
    time.sleep(0.4)  # the step runs meanwhile
    (x, y), waited = prefetch.take([1, 2])
    assert x.tolist() == [1, 2] and y.tolist() == [2, 3] and waited < 0.1
    assert calls[-1][0].startswith("raypar-prefetch")

    prefetch.start([3])
    (x, _), waited = prefetch.take([4])  # another batch than the one prefetched: read now
    assert x.tolist() == [4] and waited >= 0.2
    assert [thread for thread, ids in calls if ids == [4]] == [threading.current_thread().name]

    prefetch.start([-1])
    with pytest.raises(DataError, match="no such sample"):
        prefetch.take([-1])
    prefetch.close()


def test_a_manifest_gives_the_shards_and_the_checks(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    shards = []
    for i, count in enumerate((40, 24)):
        path = write_numbered(folder / f"part-{i:05d}.parquet", count, 8, rows_per_group=16, vocab=64)
        shards.append(ShardEntry(path.name, count, path.stat().st_size, "0" * 64))
    (folder / "stray.parquet").write_bytes(b"not listed, not read")
    manifest = CorpusManifest(seq_len=8, vocab_size=64, tokenizer="bytes", tokenizer_fingerprint="bytes", eos_id=-1,
                              documents=64, samples=64, tokens=64 * 9, max_token=63, shards=shards)
    (folder / MANIFEST_NAME).write_text(manifest.to_json())

    ds = TokenDataset(folder, 8)
    assert len(ds) == 64 and ds.vocab_size == 64
    assert not any(s.is_open for s in ds.shards)  # the manifest's counts: no footer read yet
    x, _ = ds.get([45])
    assert x[0].tolist() == numbered_rows(5, 1, 8, 64)[0, :-1].tolist()  # sample 5 of the second shard

    ds.check_tokenizer("bytes")
    with pytest.raises(DataError, match="was made with tokenizer bytes, but data.tokenizer is sha256:ab"):
        ds.check_tokenizer("sha256:ab")
    with pytest.raises(DataError, match="data holds token id 63 but model.vocab_size is 32"):
        ds.check_vocab(32)
    with pytest.raises(DataError, match="written with seq_len=8 but data.seq_len is 16"):
        TokenDataset(folder, 16)

    damaged = json.loads(manifest.to_json())
    damaged["samples"] = 65
    (folder / MANIFEST_NAME).write_text(json.dumps(damaged))
    with pytest.raises(DataError, match="the shards hold 64 samples but the manifest says 65"):
        TokenDataset(folder, 8)


def test_a_datasets_folder_is_read_in_its_own_order(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    names = ["data-00001-of-00002.arrow", "data-00000-of-00002.arrow"]  # state.json's order, not the names'
    for k, name in enumerate(names):
        rows = numbered_rows(100 * k, 10, 8, 64)
        column = pa.ListArray.from_arrays(pa.array(np.arange(0, rows.size + 1, 9, dtype=np.int32)),
                                          pa.array(rows.reshape(-1)))
        table = pa.table({"input_ids": column, "attention_mask": column})
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            for batch in table.to_batches(max_chunksize=4):
                writer.write_batch(batch)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (folder / "dataset_info.json").write_text("{}")

    ds = TokenDataset(folder, 8)
    assert len(ds) == 20
    x, y = ds.get([0, 9, 10, 19])
    firsts = [0, 9, 100, 109]
    assert x[:, 0].tolist() == [(7 * i) % 64 for i in firsts]
    assert y[:, -1].tolist() == [(7 * i + 8) % 64 for i in firsts]


def test_a_wrong_corpus_stops_the_run_before_it_starts(ray_session, tmp_path):
    write_numbered(tmp_path / "data.parquet", 64, 8, rows_per_group=16, vocab=64)
    with pytest.raises(DataError, match="records no tokenizer, but data.tokenizer is bytes"):
        Trainer(run_config(tmp_path, "tok", (1, 2, 1), 2, data={"tokenizer": "bytes"})).fit()
    with pytest.raises(DataError, match="written with seq_len=8 but data.seq_len is 12"):
        Trainer(run_config(tmp_path, "seq", (1, 2, 1), 2, data={"seq_len": 12})).fit()


def test_a_token_past_the_vocabulary_fails_the_step_naming_the_row(ray_session, tmp_path):
    # Nothing declared: the first read of the bad row refuses it, and the run ends with that error.
    rows = numbered_rows(0, 64, 8, 64)
    rows[37, 3] = 70
    offsets = pa.array(np.arange(0, rows.size + 1, 9, dtype=np.int32))
    pq.write_table(pa.table({"tokens": pa.ListArray.from_arrays(offsets, pa.array(rows.reshape(-1)))}),
                   tmp_path / "data.parquet", row_group_size=8)
    cfg = run_config(tmp_path, "vocab", (1, 2, 1), 9, data={"shuffle": False})
    with pytest.raises(DataError, match="row 37 holds token id 70 but model.vocab_size is 64"):
        Trainer(cfg).fit()


def test_a_block_larger_than_the_window_is_read_for_its_batch_and_warned_about(tmp_path):
    path = write_numbered(tmp_path / "one-group.parquet", 256, 8, rows_per_group=256, vocab=64)  # 9 KiB
    ds = TokenDataset(path, 8, window_bytes=4096)
    with pytest.warns(UserWarning, match="more than data.window_mb=0.00390625: every batch that needs it reads it again"):
        first = ds.get([3, 200])
    second = ds.get([3, 200])  # read again, no second warning
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert ds.window.bytes == 0 and ds.window.reads == 2


def test_resume_mid_epoch_on_another_grid_reads_what_an_uninterrupted_run_reads(ray_session, tmp_path):
    from raypar.checkpoint import checkpoint_dir

    # 40 samples in blocks of 8, a window of about one block, 8 samples a step: epochs end at
    # steps 5 and 10; the resume starts at step 3, 24 samples into the first epoch.
    write_numbered(tmp_path / "data.parquet", 40, 8, rows_per_group=8, vocab=64)
    data = {"window_mb": 0.0005}
    full = Trainer(run_config(tmp_path, "full", (1, 2, 1), 8, checkpoint={"every": 3, "keep_last": 5}, data=data)).fit()
    saved = str(checkpoint_dir(tmp_path / "full" / "ckpt", 3))
    moved = Trainer(run_config(tmp_path, "moved", (2, 2, 1), 8, checkpoint={"every": 3, "resume": saved},
                               data=data)).fit()
    assert moved.start_step == 3 and moved.consumed_samples == full.consumed_samples == 64
    assert [r.loss for r in moved.records] == pytest.approx([r.loss for r in full.records[3:]], rel=1e-5)


def test_the_benchmark_table_compares_each_launch_with_the_small_corpus():
    from bench.data_stream import table

    def row(kind, tps, wait_ms, share, r=0):
        return {"kind": kind, "tokens_per_s": tps, "step_ms": 250.0, "data_wait_ms": wait_ms,
                "data_wait_max_ms": wait_ms * 2, "data_wait_share": share, "window_bytes": 256 << 20, "run_s": 30.0,
                "round": r}

    corpus = {"samples": 1000, "bytes": 3 << 30, "files": 12}
    text = table(corpus, [row("small", 100.0, 0.01, 0.0001), row("stream", 101.0, 0.01, 0.0001),
                          row("stream", 99.0, 0.02, 0.0002, r=1), row("stream-no-prefetch", 80.0, 90.0, 0.3),
                          row("in-memory", 100.0, 0.0, 0.0)])
    lines = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert "| 101 / 99 | 1.000 | 250 | 0.01 / 0.04 | 0.020% | 256 |" in lines["| stream"]
    assert "| 0.800 |" in lines["| stream-no-prefetch"] and "| 30.000% |" in lines["| stream-no-prefetch"]
    assert "(not recorded)" in lines["| in-memory"]
