"""Tests for raypar.checkpoint: sharded save, atomic commit, resharding load, HF export."""
from __future__ import annotations

import json
import os
import pathlib
import struct

import pytest
import torch
from safetensors.torch import load_file

from raypar.checkpoint import (
    CheckpointError,
    CheckpointReader,
    Manifest,
    checkpoint_dir,
    cleanup_uncommitted,
    commit,
    export_hf,
    latest,
    list_committed,
    merge_entries,
    plan_reads,
    resolve,
    rotate,
    write_shard,
)

Piece = tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]


def _save(ckpt: pathlib.Path, shards: dict[str, list[Piece]], step: int = 1) -> Manifest:
    """Write each file's pieces as one "worker" would, merge, commit."""
    results, shapes = [], {}
    for file, pieces in shards.items():
        results.append(write_shard(ckpt, file, pieces))
        shapes.update({name: g for name, _, _, g in pieces})
    manifest = Manifest(step=step, consumed_samples=step * 8, topology={"dp": 1, "pp": 2},
                        config={"lr": 0.1}, extra={"sched": {"last_epoch": step}},
                        tensors=merge_entries(results, shapes))
    commit(ckpt, manifest)
    return manifest


def _whole(name: str, t: torch.Tensor) -> Piece:
    return (name, t, (0,) * t.ndim, tuple(t.shape))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _data_offset(path: pathlib.Path, key: str) -> int:
    """Absolute file offset of ``key``'s first data byte, from the safetensors header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n + header[key]["data_offsets"][0]


# --- round trip -------------------------------------------------------------------


def test_round_trip_dtypes_bit_exact(tmp_path: pathlib.Path) -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(5, 3, generator=g) * 10
    tensors = {
        "layers.0.w.f32": base,
        "layers.0.w.bf16": base.to(torch.bfloat16),
        "layers.0.w.f16": base.to(torch.float16),
        "layers.0.w.f8e4m3": base.to(torch.float8_e4m3fn),
        "layers.0.w.f8e5m2": base.to(torch.float8_e5m2),
        "data.i64": torch.randint(-(2**40), 2**40, (7,), generator=g),
        "rng.rank0.cpu": torch.randint(0, 256, (11,), dtype=torch.uint8, generator=g),
        "scalar": torch.tensor(2.5),
    }
    ckpt = checkpoint_dir(tmp_path, 3)
    _save(ckpt, {"shard-00000.safetensors": [_whole(n, t) for n, t in tensors.items()]}, step=3)
    with CheckpointReader(ckpt) as r:
        assert r.names() == sorted(tensors)
        assert r.manifest.step == 3 and r.manifest.consumed_samples == 24
        assert r.manifest.extra == {"sched": {"last_epoch": 3}}
        for name, t in tensors.items():
            got = r.read(name)
            assert got.dtype == t.dtype and got.shape == t.shape
            assert torch.equal(_bits(got), _bits(t)), name


def test_manifest_json_round_trip(tmp_path: pathlib.Path) -> None:
    ckpt = checkpoint_dir(tmp_path, 1)
    m = _save(ckpt, {"s.safetensors": [_whole("a", torch.ones(2, 2))]})
    again = Manifest.from_json(m.to_json(), where=str(ckpt))
    assert again == m


# --- resharding -------------------------------------------------------------------


@pytest.fixture
def resharded(tmp_path: pathlib.Path):
    a = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    b = torch.arange(24, dtype=torch.int64).reshape(4, 6) * 7
    ckpt = checkpoint_dir(tmp_path, 10)
    _save(ckpt, {
        # Two "workers" hold row halves of a; b's three column pieces are spread out,
        # two of them sharing a file.
        "shard-00000.safetensors": [("a", a[0:3], (0, 0), (6, 8)), ("b", b[:, 0:2], (0, 0), (4, 6))],
        "shard-00001.safetensors": [("a", a[3:6], (3, 0), (6, 8)), ("b", b[:, 2:4], (0, 2), (4, 6)),
                                    ("b", b[:, 4:6], (0, 4), (4, 6))],
    }, step=10)
    return ckpt, a, b


def test_read_whole_and_resharded(resharded) -> None:
    ckpt, a, b = resharded
    with CheckpointReader(ckpt) as r:
        assert torch.equal(r.read("a"), a)
        assert torch.equal(r.read("b"), b)
        for start in (0, 2, 4):  # a 3-way row split
            assert torch.equal(r.read("a", (start, 0), (2, 8)), a[start:start + 2])
        assert torch.equal(r.read("a", (2, 3), (3, 4)), a[2:5, 3:7])
        assert torch.equal(r.read("b", (1, 1), (2, 4)), b[1:3, 1:5])
        out = torch.zeros(2, 3, dtype=torch.int64)
        assert r.read("b", (2, 3), (2, 3), out=out) is out
        assert torch.equal(out, b[2:4, 3:6])


def test_plan_reads_touches_only_intersecting_pieces(resharded) -> None:
    ckpt, _, _ = resharded
    with CheckpointReader(ckpt) as r:
        a, b = r.manifest.tensors["a"], r.manifest.tensors["b"]
    ops = plan_reads(a, (0, 0), (2, 8))
    assert [op.piece.offsets for op in ops] == [(0, 0)]
    ops = plan_reads(a, (2, 3), (3, 4))
    assert [op.piece.offsets for op in ops] == [(0, 0), (3, 0)]
    assert ops[0].src == (slice(2, 3), slice(3, 7)) and ops[0].dst == (slice(0, 1), slice(0, 4))
    assert ops[1].src == (slice(0, 2), slice(3, 7)) and ops[1].dst == (slice(1, 3), slice(0, 4))
    ops = plan_reads(b, (0, 2), (4, 2))
    assert [op.piece.offsets for op in ops] == [(0, 2)]
    assert [op.piece.offsets for op in plan_reads(b, (0, 1), (4, 4))] == [(0, 0), (0, 2), (0, 4)]
    assert plan_reads(a, (0, 0), (0, 8)) == []


def test_read_request_errors(resharded) -> None:
    ckpt, _, _ = resharded
    with CheckpointReader(ckpt) as r:
        with pytest.raises(CheckpointError, match="no tensor named 'aa'.*close names: a"):
            r.read("aa")
        with pytest.raises(CheckpointError, match="outside tensor a"):
            r.read("a", (5, 0), (2, 8))
        with pytest.raises(CheckpointError, match="outside tensor a"):
            r.read("a", (0,), (8,))


# --- store ------------------------------------------------------------------------


def _commit_tiny(root: pathlib.Path, step: int) -> pathlib.Path:
    ckpt = checkpoint_dir(root, step)
    _save(ckpt, {"s.safetensors": [_whole("w", torch.full((2,), float(step)))]}, step=step)
    return ckpt


def test_commit_list_latest_resolve(tmp_path: pathlib.Path) -> None:
    assert list_committed(tmp_path) == [] and latest(tmp_path) is None
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        resolve(tmp_path, "latest")
    c5, c20 = _commit_tiny(tmp_path, 5), _commit_tiny(tmp_path, 20)
    partial = checkpoint_dir(tmp_path, 30)
    write_shard(partial, "s.safetensors", [_whole("w", torch.zeros(2))])  # never committed
    assert c5.name == "step-000000005"
    assert list_committed(str(tmp_path)) == [(5, c5), (20, c20)]
    assert latest(tmp_path) == c20
    assert resolve(tmp_path, "latest") == c20
    assert resolve(tmp_path, "5") == c5
    assert resolve(tmp_path, str(c5)) == c5
    assert resolve(tmp_path, "step-000000020") == c20
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        resolve(tmp_path, "30")
    with pytest.raises(CheckpointError, match="committed steps under .*\\[5, 20\\]"):
        resolve(tmp_path, "7")
    with pytest.raises(CheckpointError, match="not a committed checkpoint"):
        CheckpointReader(partial)
    with pytest.raises(CheckpointError, match="already committed"):
        write_shard(c5, "s.safetensors", [_whole("w", torch.zeros(2))])


def test_cleanup_uncommitted(tmp_path: pathlib.Path) -> None:
    c1 = _commit_tiny(tmp_path, 1)
    stale, in_progress = checkpoint_dir(tmp_path, 2), checkpoint_dir(tmp_path, 3)
    for d in (stale, in_progress):
        write_shard(d, "s.safetensors", [_whole("w", torch.zeros(2))])
    (tmp_path / "not-a-step").mkdir()
    assert cleanup_uncommitted(tmp_path, keep={in_progress}) == [stale]
    assert not stale.exists() and in_progress.exists() and c1.exists()
    assert (tmp_path / "not-a-step").exists()
    assert cleanup_uncommitted(tmp_path) == [in_progress]


def test_rotate(tmp_path: pathlib.Path) -> None:
    dirs = [_commit_tiny(tmp_path, s) for s in (1, 2, 3, 4, 5)]
    with pytest.raises(CheckpointError, match="keep_last >= 1"):
        rotate(tmp_path, 0)
    assert rotate(tmp_path, 3, protect={dirs[0]}) == [dirs[1]]
    assert [d for _, d in list_committed(tmp_path)] == [dirs[0], dirs[2], dirs[3], dirs[4]]
    assert rotate(tmp_path, 2) == [dirs[0], dirs[2]]
    assert [d for _, d in list_committed(tmp_path)] == dirs[3:]
    assert rotate(tmp_path, 1) == [dirs[3]]
    assert list_committed(tmp_path) == [(5, dirs[4])]
    assert not dirs[0].exists()


# --- integrity --------------------------------------------------------------------


def test_flipped_byte_names_file_and_tensor(resharded) -> None:
    ckpt, a, _ = resharded
    path = ckpt / "shard-00001.safetensors"
    raw = bytearray(path.read_bytes())
    raw[_data_offset(path, "a@3_0") + 5] ^= 0x01
    path.write_bytes(bytes(raw))
    with CheckpointReader(ckpt) as r:
        assert torch.equal(r.read("a", (0, 0), (3, 8)), a[:3])  # untouched piece still reads
        with pytest.raises(CheckpointError, match=r"checksum mismatch in shard-00001\.safetensors "
                                                  r"for tensor a \(piece at offsets \(3, 0\)\): "
                                                  r"the file is corrupt"):
            r.read("a", (4, 0), (1, 8))
    with CheckpointReader(ckpt, verify=False) as r:
        r.read("a")  # without verification the flip goes unnoticed


def test_truncated_and_missing_files(resharded) -> None:
    ckpt, _, _ = resharded
    path = ckpt / "shard-00001.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with CheckpointReader(ckpt) as r:
        with pytest.raises(CheckpointError, match=r"shard-00001\.safetensors is unreadable or truncated"):
            r.read("a")
    path.unlink()
    with CheckpointReader(ckpt) as r:
        with pytest.raises(CheckpointError, match=r"shard file shard-00001\.safetensors is missing"):
            r.read("b")


def test_commit_checks_files(tmp_path: pathlib.Path) -> None:
    ckpt = checkpoint_dir(tmp_path, 1)
    results = write_shard(ckpt, "s.safetensors", [_whole("w", torch.zeros(4))])
    manifest = Manifest(step=1, tensors=merge_entries(results, {"w": (4,)}))
    path = ckpt / "s.safetensors"
    good = path.read_bytes()
    path.write_bytes(good[:-3])
    with pytest.raises(CheckpointError, match="truncated"):
        commit(ckpt, manifest)
    path.unlink()
    with pytest.raises(CheckpointError, match=r"shard file s\.safetensors is missing"):
        commit(ckpt, manifest)
    path.write_bytes(good)
    commit(ckpt, manifest)
    assert not (ckpt / "manifest.json.tmp").exists()
    with pytest.raises(CheckpointError, match="already committed"):
        commit(ckpt, manifest)


def test_dtype_mismatch(tmp_path: pathlib.Path) -> None:
    ckpt = _commit_tiny(tmp_path, 1)
    doc = json.loads((ckpt / "manifest.json").read_text())
    doc["tensors"]["w"]["dtype"] = "float16"
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    with CheckpointReader(ckpt) as r, pytest.raises(CheckpointError, match="stored as torch.float32"):
        r.read("w")


@pytest.mark.parametrize("bad", ["../evil.safetensors", "/etc/evil.safetensors", "a/../../x"])
def test_manifest_path_outside_dir(tmp_path: pathlib.Path, bad: str) -> None:
    ckpt = _commit_tiny(tmp_path, 1)
    doc = json.loads((ckpt / "manifest.json").read_text())
    doc["tensors"]["w"]["pieces"][0]["file"] = bad
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match="manifest names a path outside the checkpoint directory"):
        CheckpointReader(ckpt)


def test_manifest_symlink_outside_dir(tmp_path: pathlib.Path) -> None:
    ckpt = _commit_tiny(tmp_path, 1)
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(ckpt / "s.safetensors", outside)
    os.symlink(outside, ckpt / "s.safetensors")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        CheckpointReader(ckpt)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format_version=99), "unsupported manifest format_version 99"),
        (lambda d: d["tensors"]["w"]["pieces"][0].update(offsets=[1]), "outside the global shape"),
        (lambda d: d["tensors"]["w"].update(shape=[3]), "cover 2 of 3 elements"),
        (lambda d: d["tensors"]["w"]["pieces"].append(dict(d["tensors"]["w"]["pieces"][0])),
         "pieces overlap"),
        (lambda d: d.pop("step"), "lacks field 'step'"),
    ],
)
def test_manifest_validation(tmp_path: pathlib.Path, edit, message: str) -> None:
    ckpt = _commit_tiny(tmp_path, 1)
    doc = json.loads((ckpt / "manifest.json").read_text())
    edit(doc)
    (ckpt / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=message) as info:
        CheckpointReader(ckpt)
    assert str(ckpt) in str(info.value)


def test_malformed_manifest_json(tmp_path: pathlib.Path) -> None:
    ckpt = _commit_tiny(tmp_path, 1)
    (ckpt / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        CheckpointReader(ckpt)


def test_overlapping_writers_rejected(tmp_path: pathlib.Path) -> None:
    ckpt = checkpoint_dir(tmp_path, 1)
    t = torch.arange(12.0).reshape(4, 3)
    r0 = write_shard(ckpt, "shard-00000.safetensors", [("w", t[0:3], (0, 0), (4, 3))])
    r1 = write_shard(ckpt, "shard-00001.safetensors", [("w", t[2:4], (2, 0), (4, 3))])
    with pytest.raises(CheckpointError, match="pieces overlap.*shard-00000.*shard-00001"):
        merge_entries([r0, r1], {"w": (4, 3)})
    r2 = write_shard(ckpt, "shard-00002.safetensors", [("w", t[3:4], (3, 0), (4, 3))])
    with pytest.raises(CheckpointError, match="cover 9 of 12"):
        merge_entries([r0], {"w": (4, 3)})
    assert [p.offsets for p in merge_entries(r0 + r2, {"w": (4, 3)})["w"].pieces] == [(0, 0), (3, 0)]


def test_tied_weights_in_one_shard(tmp_path: pathlib.Path) -> None:
    ckpt = checkpoint_dir(tmp_path, 1)
    w = torch.randn(4, 2)
    _save(ckpt, {"s.safetensors": [_whole("embed.weight", w), _whole("head.weight", w)]})
    with CheckpointReader(ckpt) as r:
        assert torch.equal(r.read("head.weight"), w) and torch.equal(r.read("embed.weight"), w)


# --- export -----------------------------------------------------------------------


@pytest.fixture
def training_ckpt(tmp_path: pathlib.Path):
    g = torch.Generator().manual_seed(1)
    weights = {
        "embed.weight": torch.randn(8, 4, generator=g),
        "layers.0.mlp.w1.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "layers.1.mlp.w1.weight": torch.randn(6, 4, generator=g).to(torch.bfloat16),
        "norm.steps": torch.tensor([3, 4], dtype=torch.int64),
    }
    state = {
        "optim.exp_avg.embed.weight": torch.zeros(8, 4),
        "master.embed.weight": torch.zeros(8, 4),
        "rng.rank0.cpu": torch.zeros(16, dtype=torch.uint8),
        "ema.embed.weight": torch.zeros(8, 4),
        "data.order": torch.zeros(3, dtype=torch.int64),
    }
    e = weights["embed.weight"]
    ckpt = checkpoint_dir(tmp_path / "ckpts", 7)
    _save(ckpt, {
        "shard-00000.safetensors": [("embed.weight", e[:4], (0, 0), (8, 4))]
        + [_whole(n, t) for n, t in state.items()],
        "shard-00001.safetensors": [("embed.weight", e[4:], (4, 0), (8, 4))]
        + [_whole(n, t) for n, t in weights.items() if n != "embed.weight"],
    }, step=7)
    return ckpt, weights


def test_export_hf_single_file(training_ckpt, tmp_path: pathlib.Path) -> None:
    ckpt, weights = training_ckpt
    out = export_hf(ckpt, tmp_path / "hf")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {n: "model.safetensors" for n in sorted(weights)}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    loaded = load_file(out / "model.safetensors")
    assert sorted(loaded) == sorted(weights)
    for n, t in weights.items():
        assert loaded[n].dtype == t.dtype and torch.equal(_bits(loaded[n]), _bits(t))
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_export_hf_sharded_renamed_cast(training_ckpt, tmp_path: pathlib.Path) -> None:
    ckpt, weights = training_ckpt
    out = tmp_path / "hf"
    export_hf(ckpt, out)  # a stale single file that the sharded export must replace
    export_hf(ckpt, out, rename=lambda n: "model." + n, max_shard_bytes=64, dtype=torch.float32)
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(index["weight_map"]) == sorted("model." + n for n in weights)
    total, seen = 0, {}
    for f in files:
        for name, t in load_file(out / f).items():
            assert index["weight_map"][name] == f
            seen[name] = t
            total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    for n, t in weights.items():
        got = seen["model." + n]
        # Floats are cast to the export dtype; integer buffers are left alone.
        assert got.dtype == (torch.float32 if t.is_floating_point() else t.dtype)
        assert torch.equal(got, t.to(got.dtype))


def test_export_hf_include_and_collisions(training_ckpt, tmp_path: pathlib.Path) -> None:
    ckpt, _ = training_ckpt
    out = export_hf(ckpt, tmp_path / "hf", include=lambda n: n.startswith("optim."))
    assert list(load_file(out / "model.safetensors")) == ["optim.exp_avg.embed.weight"]
    with pytest.raises(CheckpointError, match="both rename to 'x'"):
        export_hf(ckpt, tmp_path / "hf2", rename=lambda n: "x")
    with pytest.raises(CheckpointError, match="no tensor"):
        export_hf(ckpt, tmp_path / "hf3", include=lambda n: False)


def test_a_writer_killed_while_persisting_leaves_no_shard_and_nothing_listed(tmp_path: pathlib.Path) -> None:
    """SIGKILL halfway through a shard's bytes: at most a stray .tmp in an uncommitted
    directory, which cleanup removes; the checkpoint before it still loads."""
    import subprocess
    import sys
    import textwrap

    root = tmp_path / "ckpt"
    _save(checkpoint_dir(root, 1), {"s.safetensors": [_whole("w", torch.arange(6.0))]})
    script = textwrap.dedent(f"""
        import os, signal, torch
        import raypar.checkpoint.writer as writer
        from raypar.checkpoint import checkpoint_dir, write_shard

        def die_halfway(f, header, tensors):
            f.write(b"x" * (1 << 20))
            os.kill(os.getpid(), signal.SIGKILL)

        writer._write_safetensors = die_halfway
        write_shard(checkpoint_dir({str(root)!r}, 2), "shard-00000.safetensors",
                    [("w", torch.zeros(1 << 20), (0,), (1 << 20,))])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    partial = checkpoint_dir(root, 2)
    assert not (partial / "shard-00000.safetensors").exists()
    assert [s for s, _ in list_committed(root)] == [1]
    assert cleanup_uncommitted(root) == [partial]
    with CheckpointReader(checkpoint_dir(root, 1)) as r:
        assert torch.equal(r.read("w"), torch.arange(6.0))


def test_the_writer_actor_commits_a_checkpoint_without_torch(tmp_path):
    """The writer actor (one per node, started with every run) merges the workers' results
    and commits without importing torch, most of its start-up: the first save waited ~0.8 s
    for it on the CPU test machine."""
    import pickle
    import subprocess
    import sys

    from raypar.checkpoint import CheckpointReader, checkpoint_dir, write_shard

    weights = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    results = write_shard(checkpoint_dir(tmp_path, 1), "shard-00000.safetensors", [("w", weights, (0, 0), (2, 3))])
    (tmp_path / "written.pkl").write_bytes(pickle.dumps({"results": results, "shapes": {"w": (2, 3)}}))
    script = (
        "import pickle, sys\n"
        "import raypar.actors.checkpoint_writer\n"
        "from raypar.checkpoint import Manifest, checkpoint_dir, commit, merge_entries, rotate\n"
        "root = sys.argv[1]\n"
        "written = pickle.loads(open(root + '/written.pkl', 'rb').read())\n"
        "tensors = merge_entries([written['results']], written['shapes'])\n"
        "commit(checkpoint_dir(root, 1), Manifest(step=1, tensors=tensors))\n"
        "rotate(root, 2)\n"
        "assert 'torch' not in sys.modules, 'the writer imported torch'\n")
    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, cwd=root,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0, done.stderr[-2000:]
    with CheckpointReader(checkpoint_dir(tmp_path, 1)) as reader:
        assert torch.equal(reader.read("w"), weights)
