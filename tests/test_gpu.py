"""GPU checks, run on the GPU machine: the NCCL path matches the reference; bf16 trains."""
import pytest
import torch

from raypar.data import SampleOrder
from raypar.reference import ReferenceTrainer
from raypar.trainer import Trainer

from helpers import start_group_on, step_both, synthetic_data, tiny_config

pytestmark = pytest.mark.gpu


def _need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")


def test_nccl_pipeline_matches_reference(ray_session, tmp_path):
    _need_gpus(2)
    cfg = tiny_config(tmp_path, parallel={"pp": 2}, runtime={"device": "cuda", "collective_timeout_s": 30.0})
    dataset = synthetic_data(tmp_path, cfg)
    order = SampleOrder(len(dataset), seed=0)
    ref = ReferenceTrainer(cfg, device="cuda")
    group = start_group_on(cfg, dataset, "cuda")
    try:
        for step, (schedule, m) in enumerate([("fthenb", 4), ("1f1b", 4), ("1f1b", 8)]):
            loss, grads, ref_loss, ref_grads, reports = step_both(group, ref, dataset, order, step, schedule, m,
                                                                  device="cuda")
            assert loss == pytest.approx(ref_loss, rel=1e-4)
            for name, g in ref_grads.items():
                torch.testing.assert_close(grads[name], g.cpu(), rtol=1e-4, atol=1e-5)
            assert all(r.peak_device_bytes > 0 for r in reports)
    finally:
        group.shutdown()


def test_bf16_training_on_gpus_reduces_loss(ray_session, tmp_path):
    _need_gpus(2)
    cfg = tiny_config(tmp_path, model={"dtype": "bfloat16"}, parallel={"pp": 2}, train={"steps": 20, "lr": 3e-3},
                      runtime={"device": "cuda"})
    summary = Trainer(cfg).fit()
    first, last = summary.records[0].loss, summary.records[-1].loss
    assert last < first - 0.2, (first, last)


def test_gpu_checkpoints_resume_exactly(ray_session, tmp_path):
    """Snapshots on GPU mark the step and copy beside the next one (side stream, pinned
    buffers, the optimizer waiting for them): what they save must be the state after the
    step they name, so a resumed run repeats the uninterrupted one bit for bit."""
    _need_gpus(2)
    from raypar.checkpoint import CheckpointReader, checkpoint_dir, latest

    def cfg(name: str, resume: str | None = None):
        return tiny_config(tmp_path / name, model={"dtype": "bfloat16"}, parallel={"pp": 2},
                           train={"steps": 8, "lr": 3e-3},
                           data={"path": str(tmp_path / "data.parquet")},
                           runtime={"device": "cuda"},
                           checkpoint={"every": 2, "dir": str(tmp_path / name / "ckpt"), "keep_last": 4,
                                       "resume": resume})

    synthetic_data(tmp_path, cfg("full"))
    full = Trainer(cfg("full")).fit()
    resumed = Trainer(cfg("resumed", resume=str(checkpoint_dir(tmp_path / "full" / "ckpt", 4)))).fit()
    assert [r.step for r in resumed.records] == [4, 5, 6, 7]
    assert [r.loss for r in resumed.records] == [r.loss for r in full.records[4:]]
    with CheckpointReader(latest(tmp_path / "full" / "ckpt")) as a, \
            CheckpointReader(latest(tmp_path / "resumed" / "ckpt")) as b:
        names = [n for n in a.names() if not n.startswith("rng.")]
        assert any(n.startswith("master.") for n in names) and any(n.startswith("optim.") for n in names)
        for name in names:
            assert torch.equal(a.read(name), b.read(name)), name
