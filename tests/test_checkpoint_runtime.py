"""Checkpoints during training: exact resume, resume on other grids, failures mid-save."""
import pytest
import ray
import torch

from raypar.checkpoint import CheckpointReader, checkpoint_dir, latest, list_committed, read_manifest
from raypar.driver.trainer import Trainer

from helpers import run_config

# With routing biases that move each step (model.moe_bias_update_rate): a resumed run routes
# as the uninterrupted one only with the biases its checkpoint names.
MOE = {"n_layers": 4, "n_experts": 4, "moe_top_k": 2, "moe_aux_loss_coef": 0.01, "moe_bias_update_rate": 0.02}


def config(tmp_path, name, grid=(1, 2, 1), steps=10, every=5, model=None, **checkpoint):
    return run_config(tmp_path, name, grid, steps, model, checkpoint={"every": every, **checkpoint})


@pytest.fixture
def data(tmp_path):
    from raypar.data import write_synthetic_corpus

    write_synthetic_corpus(tmp_path / "data.parquet", 256, 8, 64, seed=1)


def weights(path):
    with CheckpointReader(path) as r:
        return {n: r.read(n) for n in r.names() if not n.startswith("rng.")}


def test_resume_equals_an_uninterrupted_run(ray_session, tmp_path, data):
    full = Trainer(config(tmp_path, "full")).fit()
    saved_at_5 = checkpoint_dir(tmp_path / "full" / "ckpt", 5)
    resumed = Trainer(config(tmp_path, "resumed", resume=str(saved_at_5))).fit()
    assert resumed.start_step == 5 and [r.step for r in resumed.records] == [5, 6, 7, 8, 9]
    assert [r.loss for r in resumed.records] == [r.loss for r in full.records[5:]]
    assert resumed.consumed_samples == full.consumed_samples
    a, b = weights(latest(tmp_path / "full" / "ckpt")), weights(latest(tmp_path / "resumed" / "ckpt"))
    assert a.keys() == b.keys() and any(n.startswith("optim.") for n in a)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def moe_source(ray_session, tmp_path_factory):
    """An MoE run on dp=1 x pp=2 x ep=2 with checkpoints at steps 3 and 6 (one for every target)."""
    from raypar.data import write_synthetic_corpus

    tmp_path = tmp_path_factory.mktemp("moe-source")
    write_synthetic_corpus(tmp_path / "data.parquet", 256, 8, 64, seed=1)
    return tmp_path, Trainer(config(tmp_path, "source", grid=(1, 2, 2), steps=6, every=3, model=MOE)).fit()


@pytest.mark.parametrize("target", [(1, 1, 1), (1, 4, 1)], ids=lambda g: "x".join(map(str, g)))
def test_checkpoint_from_one_grid_resumes_on_another(ray_session, tmp_path, data, target, moe_source):
    source_dir, source = moe_source
    saved = checkpoint_dir(source_dir / "source" / "ckpt", 3)
    biases = read_manifest(saved).extra["expert_biases"]
    assert sorted(biases, key=int) == ["0", "1", "2", "3"] and any(any(v) for v in biases.values())
    assert source.records[2].expert_biases == biases  # what the metrics showed after step 2
    moved = Trainer(config(tmp_path, "target", grid=target, steps=6, every=3, model=MOE, resume=str(saved))).fit()
    assert [r.loss for r in moved.records] == pytest.approx([r.loss for r in source.records[3:]], rel=1e-5)
    a, b = weights(latest(source_dir / "source" / "ckpt")), weights(latest(tmp_path / "target" / "ckpt"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_checkpoint_resumes_across_schedules_and_chunkings(ray_session, tmp_path, data):
    """The format names layers, not chunks: a ZB-V run's checkpoint (two chunks per stage in a
    V, the head on stage 0) goes on as interleaved 1F1B (chunks in a loop) and as one stage."""
    zb_v = {"schedule": "zb-v"}
    source = Trainer(run_config(tmp_path, "source", (1, 2, 1), 6, checkpoint={"every": 3}, parallel=zb_v)).fit()
    saved = checkpoint_dir(tmp_path / "source" / "ckpt", 3)
    expected = weights(latest(tmp_path / "source" / "ckpt"))
    for name, grid, parallel in (("interleaved", (1, 2, 1), {"schedule": "interleaved-1f1b"}),
                                 ("one-stage", (1, 1, 1), {"schedule": "1f1b"})):
        moved = Trainer(run_config(tmp_path, name, grid, 6, checkpoint={"every": 3, "resume": str(saved)},
                                   parallel=parallel)).fit()
        assert [r.loss for r in moved.records] == pytest.approx([r.loss for r in source.records[3:]], rel=1e-5), name
        got = weights(latest(tmp_path / name / "ckpt"))
        assert got.keys() == expected.keys()
        for key in expected:
            torch.testing.assert_close(got[key], expected[key], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {key}: {m}")


@pytest.mark.parametrize("on_host", [False, True], ids=["device", "host"])
def test_ema_of_the_weights_is_saved_and_exported(ray_session, tmp_path, data, on_host):
    """The workers' EMA of their masters equals the single-process reference's, kept beside
    the masters or folded in host memory."""
    from safetensors.torch import load_file

    from raypar.data import SampleOrder, TokenDataset
    from raypar.hf import export_checkpoint_to_hf
    from raypar.reference import ReferenceTrainer

    decay = 0.5
    cfg = config(tmp_path, "ema", steps=4, every=4, ema_decay=decay, ema_every=1, ema_on_host=on_host)
    Trainer(cfg).fit()
    # The same four steps in one process, with the EMA folded in after each.
    dataset = TokenDataset(cfg.data.path, cfg.data.seq_len)
    order = SampleOrder(len(dataset), cfg.train.seed)
    ref = ReferenceTrainer(cfg)
    ema = ref.parameters()  # the average starts from the initial weights
    for step in range(4):
        ref.step(step, *dataset.get(order.indices(step * 8, 8)))
        w = ref.parameters()
        ema = {n: decay * ema[n] + (1 - decay) * w[n] for n in w}
    saved = latest(tmp_path / "ema" / "ckpt")
    with CheckpointReader(saved) as r:
        assert sorted(n[4:] for n in r.names() if n.startswith("ema.")) == sorted(ema)
        for name, want in ema.items():
            torch.testing.assert_close(r.read(f"ema.{name}"), want, rtol=1e-5, atol=1e-5)
    export_checkpoint_to_hf(saved, tmp_path / "hf-ema", ema=True)
    exported = load_file(str(tmp_path / "hf-ema" / "model.safetensors"))
    torch.testing.assert_close(exported["model.embed_tokens.weight"], ema["embed.weight"], rtol=1e-5, atol=1e-5)


def _shard_with_data(ckpt):
    """A shard file of checkpoint `ckpt` and the offset of its first tensor's first byte."""
    import json
    import struct

    shard = sorted(ckpt.glob("*.safetensors"), key=lambda p: p.stat().st_size)[-1]
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = {k: v for k, v in json.loads(raw[8:8 + n]).items() if k != "__metadata__"}
    return shard, 8 + n + min(v["data_offsets"][0] for v in header.values())


def test_resume_latest_passes_over_a_corrupt_newest_checkpoint(ray_session, tmp_path, data):
    from raypar.checkpoint import CheckpointError

    full = Trainer(config(tmp_path, "run")).fit()
    root = tmp_path / "run" / "ckpt"
    assert [s for s, _ in list_committed(root)] == [5, 10]

    # A flipped byte: the files look whole, the load's checksum catches it; step 5 is next.
    shard, at = _shard_with_data(checkpoint_dir(root, 10))
    raw = bytearray(shard.read_bytes())
    raw[at] ^= 0xFF
    shard.write_bytes(bytes(raw))
    resumed = Trainer(config(tmp_path, "run", resume="latest")).fit()
    assert resumed.start_step == 5
    assert [r.loss for r in resumed.records] == [r.loss for r in full.records[5:]]
    assert (root / "step-000000010.corrupt").is_dir()  # set aside, not deleted
    assert [s for s, _ in list_committed(root)] == [5, 10]  # and step 10 saved again

    # A shard cut short: strict resuming fails and names it, and moves nothing.
    shard, _ = _shard_with_data(checkpoint_dir(root, 10))
    shard.write_bytes(shard.read_bytes()[:-16])
    with pytest.raises(CheckpointError, match=r"newest checkpoint does not verify: .*step-000000010.*truncated"):
        Trainer(config(tmp_path, "run", resume="latest", resume_strict=True)).fit()
    assert [s for s, _ in list_committed(root)] == [5, 10]


def test_ema_resumed_on_the_same_or_another_grid_equals_an_uninterrupted_runs(ray_session, tmp_path, data):
    ema = {"ema_decay": 0.7, "ema_every": 2}
    Trainer(config(tmp_path, "full", steps=6, every=3, **ema)).fit()
    saved = checkpoint_dir(tmp_path / "full" / "ckpt", 3)
    with CheckpointReader(latest(tmp_path / "full" / "ckpt")) as a:
        names = [n for n in a.names() if n.startswith("ema.")]
        want = {n: a.read(n) for n in names}
    assert names
    # On the same grid into host memory (`ema_on_host`), on another on the device.
    for target, on_host in [((1, 2, 1), True), ((2, 1, 1), False)]:
        name = "resumed-" + "x".join(map(str, target)) + ("-host" if on_host else "")
        Trainer(config(tmp_path, name, grid=target, steps=6, every=3, resume=str(saved), ema_on_host=on_host,
                       **ema)).fit()
        with CheckpointReader(latest(tmp_path / name / "ckpt")) as b:
            assert names == [n for n in b.names() if n.startswith("ema.")]
            for n in names:
                torch.testing.assert_close(b.read(n), want[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{target} {n}: {m}")


def test_the_final_save_waits_for_the_one_still_writing_even_with_when_busy_skip(ray_session, tmp_path):
    import time

    from raypar.driver.saver import Saver

    @ray.remote
    def slow_commit():
        time.sleep(1.0)
        return {"path": "p", "bytes": 1, "write_s": 0.5, "copy_wait_s": 0.0, "commit_s": 0.0}

    saver = Saver(config(tmp_path, "run", every=1, when_busy="skip"), tmp_path, log=lambda m: None)
    saver._pending = (1, slow_commit.remote(), time.perf_counter())  # a save still writing
    assert saver.ready_for() == (False, 0.0) and saver.skipped == 1
    go, waited = saver.ready_for(final=True)
    assert go and waited > 0.5 and [r.error for r in saver.results] == [None]


def test_a_save_whose_writers_did_not_start_fails_alone_and_the_next_starts_them_again(tmp_path):
    """The writers start without the driver waiting (their start was on a recovery's path);
    the first save waits for them. Writers that do not start fail that save alone: training
    goes on, and the next save replaces them."""
    from raypar.checkpoint import CheckpointError
    from raypar.driver.saver import Saver
    from raypar.topology import Grid

    class Writers:  # the part of WorkerCheckpoints a save's start calls
        def __init__(self):
            self.calls: list[str] = []

        def start_writers(self, root):
            self.calls.append("start")

        def wait_writers(self, timeout):
            self.calls.append("wait")
            if self.calls.count("wait") == 1:
                raise CheckpointError(f"the checkpoint writers did not start within checkpoint.timeout_s={timeout:g}s")
            return 0.0

        def reset_writers(self):
            self.calls.append("reset")

        def clean_before(self, root, keep):
            self.calls.append("clean")

        def save(self, root, step, meta):
            self.calls.append("save")
            return "the commit's ref"

    logs: list[str] = []
    cfg = config(tmp_path, "run", every=2)
    saver, writers = Saver(cfg, tmp_path, log=logs.append), Writers()
    saver.start(writers)
    saver.begin(2, 16, cfg, Grid(1, 2, 1))
    assert writers.calls == ["start", "wait"] and saver._pending is None
    (failed,) = saver.results
    assert failed.step == 2 and "did not start within checkpoint.timeout_s" in failed.error
    assert "not saving step 2" in logs[-1] and "stays valid" in logs[-1]
    saver.begin(4, 32, cfg, Grid(1, 2, 1))
    assert writers.calls[2:] == ["reset", "wait", "clean", "save"] and saver._pending[0] == 4
