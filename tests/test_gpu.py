"""GPU checks, run on the GPU machine: the NCCL path matches the reference; bf16 trains."""
import math

import pytest
import torch

from raypar.data import SampleOrder
from raypar.reference import ReferenceTrainer
from raypar.driver.trainer import Trainer

from helpers import (SwitchAt, assert_same_checkpoints, run_config, start_group_on, step_both, synthetic_data,
                     tiny_config)

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
        for step, (schedule, m) in enumerate([("fthenb", 4), ("1f1b", 4), ("zb-h1", 8), ("zb-h2", 4), ("1f1b", 8)]):
            loss, grads, ref_loss, ref_grads, reports = step_both(group, ref, dataset, order, step, schedule, m,
                                                                  device="cuda")
            assert loss == pytest.approx(ref_loss, rel=1e-4)
            for name, g in ref_grads.items():
                torch.testing.assert_close(grads[name], g.cpu(), rtol=1e-4, atol=1e-5)
            assert all(r.peak_device_bytes > 0 for r in reports)
    finally:
        group.shutdown()


# Three heads, an MLP of 45 and a vocabulary of 63: every part splits the model dimension;
# dropout on sequence slices runs the kernel from where each slice starts.
FALLBACKS = {"vocab_size": 63, "dim": 24, "n_heads": 3, "ffn_dim": 45, "dropout": 0.1}


# MoE layers whole on both tp workers, on the gathered sequence.
MOE = {"n_layers": 2, "n_experts": 4, "moe_top_k": 2, "moe_every": 2, "moe_aux_loss_coef": 0.01}


@pytest.mark.parametrize("sequence_parallel, model", [(False, {}), (True, {}), (True, FALLBACKS), (True, MOE)],
                         ids=["tp2", "tp2-sequence-parallel", "tp2-model-dim-sequence-parallel-dropout",
                              "tp2-moe-sequence-parallel"])
def test_nccl_tensor_parallel_matches_reference(ray_session, tmp_path, sequence_parallel, model):
    """tp=2 over NCCL: the split layers' all-reduces (or gathers and reduce-scatters), the
    vocabulary-parallel loss and the gathered gradients equal the single GPU's."""
    _need_gpus(2)
    # pp=1: the two GPUs are one cell (the tiny config's default is pp=2).
    _matches_on_nccl(tmp_path, {"pp": 1, "tp": 2, "sequence_parallel": sequence_parallel}, [("1f1b", 4), ("zb-h1", 4)],
                     model)


def test_nccl_tensor_parallel_with_the_sharded_optimizer_matches_reference(ray_session, tmp_path):
    """dp=2 x tp=2 over NCCL with the optimizer sharded over dp on each tp rank's slices, MoE
    layers under sequence parallelism: the same losses and gradients as one GPU."""
    _need_gpus(4)
    _matches_on_nccl(tmp_path, {"dp": 2, "pp": 1, "tp": 2, "sequence_parallel": True, "shard_optimizer": True,
                                "grad_bucket_mb": 0.01},
                     [("1f1b", 4), ("zb-h1", 4)], MOE)


def _matches_on_nccl(tmp_path, parallel: dict, plan: list[tuple[str, int]], model: dict | None = None) -> None:
    """Each (schedule, micro-batches) step of `plan` on a CUDA worker group of the tiny model
    (with `model`'s changes) with `parallel` and on the single-GPU reference: the same loss and gradients."""
    cfg = tiny_config(tmp_path, parallel=parallel, model=model or {},
                      runtime={"device": "cuda", "collective_timeout_s": 30.0})
    dataset = synthetic_data(tmp_path, cfg)
    order = SampleOrder(len(dataset), seed=0)
    ref = ReferenceTrainer(cfg, device="cuda")
    group = start_group_on(cfg, dataset, "cuda")
    try:
        for step, (schedule, m) in enumerate(plan):
            loss, grads, ref_loss, ref_grads, _ = step_both(group, ref, dataset, order, step, schedule, m,
                                                            device="cuda")
            assert loss == pytest.approx(ref_loss, rel=1e-4), f"step {step} ({schedule})"
            for name, g in ref_grads.items():
                torch.testing.assert_close(grads[name], g.cpu(), rtol=1e-4, atol=1e-5)
    finally:
        group.shutdown()


@pytest.mark.parametrize("schedules", [["interleaved-1f1b"], ["zb-v", "zb-v-half"]], ids=["loop", "v"])
def test_nccl_chunked_pipeline_matches_reference(ray_session, tmp_path, schedules):
    """Two chunks per stage over NCCL: a loop sends activations back from the last stage to
    the first, a V turns in memory; each direction of travel is a communicator of its own."""
    _need_gpus(2)
    _matches_on_nccl(tmp_path, {"pp": 2, "schedule": schedules[0]}, [(s, m) for m in (4, 8) for s in schedules])


def test_nccl_sharded_optimizer_matches_reference(ray_session, tmp_path):
    """dp=2 with the optimizer sharded: reduce-scatters queued from the autograd thread
    inside backward (repeated programs), all-gathers in place; weights equal the reference's."""
    _need_gpus(2)
    cfg = tiny_config(tmp_path, parallel={"dp": 2, "pp": 1, "shard_optimizer": True, "grad_bucket_mb": 0.02},
                      train={"global_batch_size": 16}, runtime={"device": "cuda", "collective_timeout_s": 30.0})
    dataset = synthetic_data(tmp_path, cfg)
    order = SampleOrder(len(dataset), seed=0)
    ref = ReferenceTrainer(cfg, device="cuda")
    group = start_group_on(cfg, dataset, "cuda")
    try:
        plan = [("1f1b", 4), ("1f1b", 4), ("zb-h1", 2), ("zb-h1", 2), ("1f1b", 4)]
        for step, (schedule, m) in enumerate(plan):
            loss, grads, ref_loss, ref_grads, reports = step_both(group, ref, dataset, order, step, schedule, m,
                                                                  device="cuda")
            assert loss == pytest.approx(ref_loss, rel=1e-4)
            for name, g in ref_grads.items():
                torch.testing.assert_close(grads[name], g.cpu(), rtol=1e-4, atol=1e-5)
            if step > 0 and plan[step - 1] == plan[step]:
                assert all(r.buckets_early > 0 for r in reports), [(r.buckets, r.buckets_early) for r in reports]
        got, want = group.parameters(), ref.parameters()
        for name, w in want.items():
            # Five AdamW updates of ~lr = 1e-2 each: where a gradient is ~0, fp32 rounding in
            # it moves the update (1.9e-5 seen); 1e-4 is 1% of one update.
            torch.testing.assert_close(got[name], w.cpu(), rtol=1e-4, atol=1e-4)
    finally:
        group.shutdown()


def test_bf16_training_on_gpus_reduces_loss(ray_session, tmp_path):
    _need_gpus(2)
    cfg = tiny_config(tmp_path, model={"dtype": "bfloat16"}, parallel={"pp": 2}, train={"steps": 20, "lr": 3e-3},
                      runtime={"device": "cuda"})
    summary = Trainer(cfg).fit()
    first, last = summary.records[0].loss, summary.records[-1].loss
    assert last < first - 0.2, (first, last)


def test_gpu_events_keep_every_unit_of_every_step(ray_session, tmp_path):
    """A GPU worker reports a step before its optimizer's kernels end, so the next step is
    issued meanwhile; the units it had not timed come with the next report (or, for the
    last step, at the run's end). events.jsonl must still hold every unit of every step,
    each line's spans in program order on the device, and steps one after another."""
    _need_gpus(2)
    import json
    from collections import defaultdict

    from raypar.runtime.report import program_units
    from raypar.schedule import build_programs

    steps = 5
    cfg = tiny_config(tmp_path, model={"dtype": "bfloat16", "dim": 256, "n_layers": 8},
                      parallel={"pp": 2, "schedule": "1f1b", "microbatches": 4}, train={"steps": steps},
                      runtime={"device": "cuda"})
    summary = Trainer(cfg).fit()
    run_dir = tmp_path / "run"
    by_rank: dict[int, dict[int, dict]] = defaultdict(dict)
    for line in (run_dir / "events.jsonl").read_text().splitlines():
        record = json.loads(line)
        assert record["step"] not in by_rank[record["rank"]], "one line per step and worker"
        by_rank[record["rank"]][record["step"]] = record
    programs = build_programs("1f1b", 2, 4)
    assert sorted(by_rank) == [0, 1]
    for rank, records in by_rank.items():
        assert sorted(records) == list(range(steps))
        previous_end = None
        for step in range(steps):
            events = records[step]["events"]
            assert [(e[0], e[1]) for e in events] == [(u.label, u.op) for u in program_units(programs[rank])], (rank, step)
            times = [t for _, _, b, e in events for t in (b, e)]
            assert times == sorted(times), (rank, step, events)
            if previous_end is not None:  # one stream: a step starts after the last one's optimizer
                assert times[0] >= previous_end - 1e-3, (rank, step, times[0], previous_end)
            previous_end = times[-1]
    # The first stage reports before its device ends the step; the rest of its report (the
    # norm, its last units) completes it: the measured bubble is the one its events give.
    for record in summary.records:
        step_events = [by_rank[rank][record.step]["events"] for rank in (0, 1)]
        busy = sum(e - b for events in step_events for _, op, b, e in events if op in ("F", "B"))
        window = (max(e for events in step_events for _, op, b, e in events if op == "B")
                  - min(events[0][2] for events in step_events))
        assert record.bubble_measured == pytest.approx(max(0.0, 1 - busy / (2 * window)), abs=1e-6), record.step
        assert record.grad_norm > 0 and math.isfinite(record.grad_norm), record.step


def test_moving_to_another_cut_over_nccl_keeps_every_loss_and_weight(ray_session, tmp_path):
    """pp=2 on two GPUs switches from 1F1B to ZB-V and then to interleaved 1F1B: the layers that
    change worker travel point to point over NCCL (parallel.move_through=devices), and the
    losses and the final checkpoint (weights, masters, moments) are the fixed 1F1B run's."""
    _need_gpus(2)
    from raypar.data import write_synthetic_corpus

    write_synthetic_corpus(tmp_path / "data.parquet", 256, 8, 64, seed=1)

    def run(name: str, callbacks=()):
        cfg = run_config(tmp_path, name, (1, 2, 1), 9, model={"dropout": 0.1},
                         parallel={"microbatches": 4}, runtime={"device": "cuda", "collective_timeout_s": 30.0},
                         checkpoint={"every": 9})
        return Trainer(cfg, callbacks=list(callbacks), log=lambda m: None).fit()

    fixed = run("fixed")
    moved = run("moved", [SwitchAt({2: ("zb-v",), 5: ("interleaved-1f1b", 2)})])
    assert [(m["through"], m["step"]) for m in moved.moves] == [("devices", 4), ("devices", 7)]
    assert all(0 < m["sent_bytes"] < m["bytes"] for m in moved.moves), moved.moves
    assert [r.loss for r in moved.records] == pytest.approx([r.loss for r in fixed.records], rel=1e-5)
    assert_same_checkpoints(tmp_path / "fixed" / "ckpt", tmp_path / "moved" / "ckpt", 9)


def test_experts_move_between_graphed_workers_over_nccl(ray_session, tmp_path):
    """bf16 MoE at ep=2 with CUDA graphs (their all-to-alls captured) and
    parallel.rebalance_experts_every=2: the stages are rebuilt with experts on other
    workers, which first drops the graphs (destroying the process groups under a graph that
    captured a collective hangs), and the losses and the final checkpoint, by the experts'
    own names, are the run's that never moves them, within bf16's run-to-run differences."""
    _need_gpus(2)
    from raypar.data import write_synthetic_corpus

    write_synthetic_corpus(tmp_path / "data.parquet", 256, 8, 64, seed=1)

    def run(name: str, every: int):
        # A peaky router at a small learning rate: routing uneven and holding still, so moves pass
        # the look's second test (tests/test_expert_placement.py).
        cfg = run_config(tmp_path, name, (1, 1, 2), 6,
                         model={"n_layers": 2, "n_experts": 8, "moe_top_k": 2, "moe_ffn_dim": 64, "dtype": "bfloat16",
                                "init_std": 0.5},
                         parallel={"microbatches": 4, "rebalance_experts_every": every},
                         train={"global_batch_size": 16, "lr": 1e-4, "min_lr": 1e-5}, checkpoint={"every": 6},
                         runtime={"device": "cuda", "collective_timeout_s": 30.0, "step_timeout_s": 60.0})
        return Trainer(cfg, log=lambda m: None).fit()

    fixed, moved = run("fixed", 0), run("moved", 2)
    assert moved.cuda_graphs_share > 0 and moved.expert_moves, (moved.cuda_graphs_share, moved.expert_moves)
    assert all(m["through"] == "devices" and 0 < m["sent_bytes"] < m["bytes"] for m in moved.expert_moves)
    assert [r.loss for r in moved.records] == pytest.approx([r.loss for r in fixed.records], rel=1e-2)
    assert_same_checkpoints(tmp_path / "fixed" / "ckpt", tmp_path / "moved" / "ckpt", 6, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("parallel", [{"pp": 1}, {"pp": 2}, {"dp": 2, "pp": 1, "shard_optimizer": True}],
                         ids=["one", "pp2", "dp2-sharded"])
def test_gpu_checkpoints_resume_exactly(ray_session, tmp_path, parallel):
    """Snapshots on GPU mark the step and copy beside the next one (side stream, pinned
    buffers, the optimizer waiting for them): what they save must be the state after the
    step they name, so a resumed run repeats the uninterrupted one bit for bit (with the
    optimizer sharded too: each rank saves its share, the load slices it back). The load
    stages its copies through pinned buffers (`HostCopies`), converting bf16 on the device."""
    _need_gpus(parallel.get("dp", 1) * parallel["pp"])
    from raypar.checkpoint import CheckpointReader, checkpoint_dir, latest

    def cfg(name: str, resume: str | None = None):
        return tiny_config(tmp_path / name, model={"dtype": "bfloat16"}, parallel=parallel,
                           train={"steps": 8, "lr": 3e-3},
                           data={"path": str(tmp_path / "data.parquet")},
                           runtime={"device": "cuda"},
                           checkpoint={"every": 2, "dir": str(tmp_path / name / "ckpt"), "keep_last": 4,
                                       "resume": resume})

    synthetic_data(tmp_path, cfg("full"))
    full = Trainer(cfg("full")).fit()
    assert [(c["step"], c["error"]) for c in full.checkpoints] == [(s, None) for s in (2, 4, 6, 8)]
    resumed = Trainer(cfg("resumed", resume=str(checkpoint_dir(tmp_path / "full" / "ckpt", 4)))).fit()
    assert [r.step for r in resumed.records] == [4, 5, 6, 7]
    assert [r.loss for r in resumed.records] == [r.loss for r in full.records[4:]]
    with CheckpointReader(latest(tmp_path / "full" / "ckpt")) as a, \
            CheckpointReader(latest(tmp_path / "resumed" / "ckpt")) as b:
        names = [n for n in a.names() if not n.startswith("rng.")]
        assert any(n.startswith("master.") for n in names) and any(n.startswith("optim.") for n in names)
        for name in names:
            assert torch.equal(a.read(name), b.read(name)), name


def test_gpu_ema_in_host_memory_equals_the_ema_on_the_device(ray_session, tmp_path):
    """The host EMA copies the masters on a side stream beside the next step, which waits
    for the copy before its optimizer writes them: its average must equal the device's."""
    _need_gpus(2)
    from raypar.checkpoint import CheckpointReader, latest

    def fit(name: str, on_host: bool) -> dict[str, torch.Tensor]:
        cfg = tiny_config(tmp_path / name, model={"dtype": "bfloat16"}, parallel={"pp": 2},
                          train={"steps": 6, "lr": 3e-3}, data={"path": str(tmp_path / "data.parquet")},
                          runtime={"device": "cuda"},
                          checkpoint={"every": 6, "dir": str(tmp_path / name / "ckpt"), "ema_decay": 0.8,
                                      "ema_on_host": on_host})
        if on_host is False:
            synthetic_data(tmp_path, cfg)
        Trainer(cfg).fit()
        with CheckpointReader(latest(tmp_path / name / "ckpt")) as r:
            return {n: r.read(n) for n in r.names() if n.startswith("ema.")}

    device, host = fit("device", False), fit("host", True)
    assert device and sorted(device) == sorted(host)
    for name in device:
        torch.testing.assert_close(host[name], device[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_killed_gpu_worker_recovers_keeping_the_survivor(ray_session, tmp_path):
    """A stage worker killed mid-run on NCCL: the survivor cancels its step, aborts its
    communicators and is kept; a new worker takes the freed GPU; the states in memory (side
    stream copies into pinned buffers, replicas through the object store) restore it, and
    the run ends where the uninterrupted one does, step by step (GPU resumes are exact)."""
    _need_gpus(2)
    from raypar.data import write_synthetic_corpus

    from helpers import KillWorker, last_loss_per_step

    write_synthetic_corpus(tmp_path / "data.parquet", 256, 8, 64, seed=1)

    def cfg(name: str):
        return run_config(tmp_path, name, (1, 2, 1), 8, {"dtype": "bfloat16"}, checkpoint={"every": 2},
                          elastic={"enabled": True, "resource_timeout_s": 60.0},
                          runtime={"device": "cuda", "collective_timeout_s": 60.0})

    reference = Trainer(cfg("reference")).fit()
    summary = Trainer(cfg("killed"), callbacks=[KillWorker(3, 1)]).fit()
    assert len(summary.recoveries) == 1
    event = summary.recoveries[0]
    print(f"\nGPU recovery: detected in {event['detection_s']:.2f}s, survivors' teardown {event['salvage_s']:.2f}s, "
          f"recovered in {event['recovery_s']:.2f}s")
    # The states kept in memory (elastic.memory_every=1; the lost rank's from the survivor's
    # replica, which may lag one step): at most one step redone.
    assert event["workers_kept"] == 1 and event["workers_started"] == 1
    assert event["source"] == "memory" and event["resumed_step"] in (3, 4), event
    got, want = last_loss_per_step(summary), last_loss_per_step(reference)
    assert [got[s] for s in range(8)] == [want[s] for s in range(8)]
    assert summary.consumed_samples == reference.consumed_samples


def test_staged_host_copies_equal_plain_ones_on_the_gpu():
    """`HostCopies` on CUDA: pinned buffers, one stream per stager, dtypes converted on the
    device; a destination on the host is copied at once."""
    from raypar.runtime.host_copies import host_copies

    g = torch.Generator().manual_seed(0)
    src = [torch.randn(3000, 1000, generator=g), torch.randn(7, generator=g), torch.randn(1, generator=g),
           torch.randn(2049, 513, generator=g)]
    dst = [torch.empty(3000, 1000, device="cuda"), torch.empty(7, dtype=torch.bfloat16, device="cuda"),
           torch.empty((), device="cuda"), torch.empty(2049, 513, dtype=torch.bfloat16, device="cuda")]
    host = torch.empty(7)
    with host_copies(torch.device("cuda"), chunk_bytes=1 << 20) as copies:
        for d, s in zip(dst, src):
            copies.copy(d, s)
        copies.copy(host, src[1])
    assert copies.staged_bytes == sum(s.nbytes for s in src)  # "cuda" matches the tensors' "cuda:0"
    for d, s in zip(dst, src):
        assert torch.equal(d.cpu(), s.reshape(d.shape).to(d.dtype))
    assert torch.equal(host, src[1])
