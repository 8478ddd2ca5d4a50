"""Checkpoints on an S3-protocol object store: moto's server, started here on the loopback
address, through pyarrow.fs. Training saves, lists, rotates and resumes (on another grid)
there; a process killed mid-upload leaves nothing listed."""
import subprocess
import sys
import textwrap
import time

import pytest

from raypar.checkpoint import checkpoint_dir, list_committed, storage
from raypar.driver.trainer import Trainer

from conftest import s3_query
from helpers import run_config


@pytest.fixture
def gate(moto_port):
    """An S3Gate in front of the server; `gate.root(prefix)` is a URI through it."""
    from s3_gate import S3Gate

    gate = S3Gate(moto_port)
    gate.root = lambda prefix: f"s3://testing:testing@raypar/{prefix}?{s3_query(gate.port)}"
    yield gate
    gate.close()


@pytest.fixture
def data(tmp_path):
    from raypar.data import write_synthetic_corpus

    write_synthetic_corpus(tmp_path / "data.parquet", 256, 8, 64, seed=1)


def test_training_saves_lists_rotates_and_resumes_on_another_grid_through_s3(ray_session, tmp_path, data, s3_root):
    root = s3_root("train")
    full = Trainer(run_config(tmp_path, "full", (1, 2, 1), 6, checkpoint={"every": 2, "keep_last": 2, "dir": root})).fit()
    assert [c["error"] for c in full.checkpoints] == [None] * 3
    # The URI's credentials stay out of what the run writes and says.
    assert all("testing:testing" not in c["path"] and "***@raypar" in c["path"] for c in full.checkpoints)
    assert [s for s, _ in list_committed(root)] == [4, 6]  # step 2 rotated away
    assert not storage.list_dir(checkpoint_dir(root, 2))  # its shards too, not only its manifest
    # The pp=2 checkpoint loads onto pp=1: each worker reads its pieces by ranged reads.
    resumed = Trainer(run_config(tmp_path, "resumed", (1, 1, 1), 6,
                                 checkpoint={"every": 0, "dir": root, "resume": str(checkpoint_dir(root, 4))})).fit()
    assert resumed.start_step == 4
    assert [r.loss for r in resumed.records] == pytest.approx([r.loss for r in full.records[4:]], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("phase, victim", [("persisting", "stage worker"), ("committing", "writer")])
def test_a_process_killed_at_each_phase_of_a_save_loses_only_that_save(ray_session, tmp_path, data, gate, s3_root,
                                                                        phase, victim):
    """The save of step 4 is held at a known phase (a stage worker's shard upload, or the
    writer's manifest upload) while a stage worker or the writer is killed by Ray. The run
    goes on (elastic: re-planned, reloaded from the newest committed checkpoint), the save
    is lost, and everything listed loads. (The writer has no part in persisting; a stage
    worker killed while the writer commits leaves whole shards, and the commit lands; a kill
    while the device copies cannot be held here: on CPU the copy is one memcpy.)"""
    import threading

    import ray

    from raypar.checkpoint import CheckpointReader

    prefix = f"{phase}-{victim.replace(' ', '-')}"
    root, direct = gate.root(prefix), s3_root(prefix)
    # States in memory off: the recovery reloads the checkpoint, through the gate.
    trainer = Trainer(run_config(tmp_path, "run", (1, 2, 1), 6, checkpoint={"every": 2, "keep_last": 5, "dir": root},
                                 elastic={"enabled": True, "resource_timeout_s": 10.0, "memory_every": 0}))
    held = {"persisting": r"step-000000004/shard-00001", "committing": r"step-000000004/manifest\.json"}[phase]
    gate.hold(held)
    errors = []

    def kill_when_held() -> None:
        try:
            assert gate.arrived.wait(120), f"no request matched {held}"
            if victim == "writer":
                for w in list(trainer.group.checkpoints.writers.values()):
                    ray.kill(w)
            else:
                ray.kill(trainer.group.workers[1])
            time.sleep(1.0)  # the held request's sender is gone before it goes on
        except BaseException as e:  # noqa: BLE001 - re-raised by the test below
            errors.append(e)
        finally:
            gate.release()

    killer = threading.Thread(target=kill_when_held, daemon=True)
    killer.start()
    summary = trainer.fit()
    killer.join(30)
    assert not errors, errors
    assert gate.held and summary.controller_states[-1] == "FINISHED"
    saves = [(c["step"], c["error"] is None) for c in summary.checkpoints]
    committed = [s for s, _ in list_committed(root)]
    if victim == "writer":
        assert (4, False) in saves and 4 not in committed, (saves, committed)
        assert committed == [2, 6] and not summary.recoveries
    else:
        assert len(summary.recoveries) == 1 and committed[-1] == 6, (summary.recoveries, committed)
        assert saves[:2] == [(2, True), (4, False)], saves  # its shard never landed
        assert summary.recoveries[0]["resumed_step"] == 2
    # Nothing but committed checkpoints is left under the root (a failed save's partial
    # pieces go at the next save), and every one of them loads.
    listed = sorted(name for name, _ in storage.list_dir(root))
    assert listed == [f"step-{s:09d}" for s in committed], listed
    for _, path in list_committed(direct):  # read past the gate, whose every request is slow
        with CheckpointReader(path) as r:  # reads check every piece's checksum
            assert all(r.read(n).numel() >= 0 for n in r.names())


def test_a_process_killed_mid_upload_leaves_nothing_listed(tmp_path, s3_root):
    root = s3_root("killed")
    # The writer dies by SIGKILL halfway through its shard's bytes: the multipart upload never completes.
    script = textwrap.dedent(f"""
        import os, signal, torch
        import raypar.checkpoint.writer as writer
        from raypar.checkpoint import checkpoint_dir, write_shard

        def die_halfway(f, header, tensors):
            f.write(b"x" * (8 << 20))  # past the first part of the upload
            os.kill(os.getpid(), signal.SIGKILL)

        writer._write_safetensors = die_halfway
        write_shard(checkpoint_dir({root!r}, 7), "shard-00000.safetensors",
                    [("w", torch.zeros(4 << 20), (0,), (4 << 20,))])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert list_committed(root) == []
    assert not storage.is_file(storage.join(checkpoint_dir(root, 7), "shard-00000.safetensors"))


def test_a_shard_write_that_raises_leaves_no_object(s3_root, monkeypatch):
    import torch

    import raypar.checkpoint.writer as writer
    from raypar.checkpoint import write_shard

    root = s3_root("raised")

    def fail_halfway(f, header, tensors):
        f.write(b"x" * 1024)
        raise OSError("disk went away")

    monkeypatch.setattr(writer, "_write_safetensors", fail_halfway)
    with pytest.raises(OSError, match="disk went away"):
        write_shard(checkpoint_dir(root, 3), "shard-00000.safetensors", [("w", torch.zeros(8), (0,), (8,))])
    assert not storage.is_file(storage.join(checkpoint_dir(root, 3), "shard-00000.safetensors"))
    assert list_committed(root) == []


def test_errors_name_a_storage_uri_without_its_credentials(s3_root):
    from raypar.checkpoint import CheckpointError, resolve

    with pytest.raises(CheckpointError) as e:
        resolve(s3_root("empty"), "latest")
    assert "no committed checkpoint under s3://***@raypar/empty" in str(e.value)
    assert "testing:testing" not in str(e.value)
