"""CUDA graphs of a stage's micro-batch (runtime.cuda_graphs) on the GPU machine: replayed
steps equal the single-process reference or the same run eagerly (loss, every gradient,
weights), on one stage and on pipeline stages (tp and ep inside), MoE counters keep counting
across replays, and programs a graph cannot hold run eagerly."""
import pytest
import torch

from raypar.data import SampleOrder
from raypar.reference import ReferenceTrainer

from helpers import assert_same, start_group_on, step_both, synthetic_data, tiny_config
from test_moe import ADAM_EPS, MOE
from tolerances import Tolerances

pytestmark = pytest.mark.gpu


def _need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")


def _run(cfg, tmp_path, plan, check_step):
    dataset = synthetic_data(tmp_path, cfg)
    order = SampleOrder(len(dataset), seed=cfg.train.seed)
    ref = ReferenceTrainer(cfg, device="cuda")
    group = start_group_on(cfg, dataset, "cuda")
    try:
        tol = Tolerances(ref)
        for step, (schedule, m) in enumerate(plan):
            loss, grads, ref_loss, ref_grads, reports = step_both(group, ref, dataset, order, step, schedule, m,
                                                                  device="cuda", tol=tol)
            where = f"step {step} ({schedule}, {m} micro-batches)"
            assert abs(loss - ref_loss) <= tol.loss, f"{where}: loss {loss} vs {ref_loss}"
            assert_same(grads, ref_grads, tol.grads, where)
            tol.check_weights(group.parameters(), ref.parameters(), where)
            check_step(step, schedule, m, reports)
    finally:
        group.shutdown()


def _steps(cfg, tmp_path, plan):
    """Run `plan` on a worker group: each step's loss and gradients, the reports, the weights."""
    from raypar.data import split_batch
    from raypar.driver.stats import step_loss
    from raypar.schedule import build_programs

    dataset = synthetic_data(tmp_path, cfg)
    order = SampleOrder(len(dataset), seed=cfg.train.seed)
    group = start_group_on(cfg, dataset, "cuda")
    grid, gbs, out = group.grid, cfg.train.global_batch_size, []
    try:
        for step, (schedule, m) in enumerate(plan):
            batch = order.indices(step * gbs, gbs)
            programs = build_programs(schedule, grid.pp, m)
            if group.programs != programs:
                group.set_programs(programs)
            reports = group.run_step(step, [split_batch(batch, grid.data_parallel_size, grid.data_rank(c))
                                            for c in grid.coords()], capture_grads=True)
            grads = {n: g for r in reports for n, g in r.grads.items()}
            out.append((step_loss(reports), grads, reports))
        return out, group.parameters()
    finally:
        group.shutdown()


def _moe_config(tmp_path, dtype, top_k, graphs=True, overlap=True, **model):
    return tiny_config(tmp_path, model={**MOE, "moe_top_k": top_k, "moe_ffn_dim": 64, "dropout": 0.1, "dtype": dtype,
                                        **model},
                       parallel={"dp": 1, "pp": 1, "ep": 2, "microbatches": 4},
                       train={"global_batch_size": 16, "eps": ADAM_EPS},
                       runtime={"device": "cuda", "collective_timeout_s": 30.0, "cuda_graphs": graphs,
                                "moe_microbatch_overlap": overlap})


@pytest.mark.parametrize("top_k", [1, 2])
def test_graphed_bf16_moe_at_ep2_equals_eager(ray_session, tmp_path, top_k):
    """pp=1 x ep=2 in bf16 (grouped GEMMs), padded all-to-alls inside the graphs, dropout on:
    1F1B steps replay (the second count recaptures) and give the eager run's losses,
    gradients and weights; fthenb keeps every micro-batch live and replays a graph set for
    each. The MoE counters count every replay."""
    _need_gpus(2)
    plan = [("1f1b", 4), ("1f1b", 4), ("fthenb", 4), ("1f1b", 2), ("1f1b", 2)]
    graphed, graphed_weights = _steps(_moe_config(tmp_path / "graphs", "bfloat16", top_k), tmp_path / "graphs", plan)
    eager, eager_weights = _steps(_moe_config(tmp_path / "eager", "bfloat16", top_k, graphs=False),
                                  tmp_path / "eager", plan)
    tokens_per_rank = 16 // 2 * 8 * top_k  # samples per rank x seq_len x choices (dropless)
    for step, ((schedule, m), (loss, grads, reports), (eager_loss, eager_grads, eager_reports)) in enumerate(
            zip(plan, graphed, eager)):
        where = f"step {step} ({schedule}, {m})"
        assert [r.graphed_microbatches for r in reports] == [m] * 2, where
        assert [r.graphed_microbatches for r in eager_reports] == [0, 0], where
        assert loss == pytest.approx(eager_loss, rel=1e-3), where
        for name, g in eager_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=2e-2, atol=1e-4, msg=lambda m_: f"{where} {name}: {m_}")
        for r, e in zip(reports, eager_reports):
            assert {k: sum(v) for k, v in r.expert_tokens.items()} == {"0": tokens_per_rank, "1": tokens_per_rank}
            assert r.alltoall_bytes == e.alltoall_bytes > 0, where
    for name, w in eager_weights.items():
        torch.testing.assert_close(graphed_weights[name], w, rtol=2e-2, atol=1e-3)


def test_graphed_moe_routes_with_the_biases_the_workers_move(ray_session, tmp_path):
    """model.moe_bias_update_rate on graphed bf16 MoE at ep=2: the replayed graphs route with
    the biases the workers move in place after each step (counts summed over NCCL), as the
    eager run does; the same steps without biases give other losses."""
    _need_gpus(2)
    plan = [("1f1b", 4)] * 5
    graphed, graphed_weights = _steps(_moe_config(tmp_path / "graphs", "bfloat16", 2, moe_bias_update_rate=0.05),
                                      tmp_path / "graphs", plan)
    eager, eager_weights = _steps(_moe_config(tmp_path / "eager", "bfloat16", 2, graphs=False,
                                              moe_bias_update_rate=0.05), tmp_path / "eager", plan)
    plain, _ = _steps(_moe_config(tmp_path / "plain", "bfloat16", 2, graphs=False), tmp_path / "plain", plan)
    assert [loss for loss, _, _ in graphed] == pytest.approx([loss for loss, _, _ in eager], rel=1e-3)
    assert [loss for loss, _, _ in plain] != pytest.approx([loss for loss, _, _ in eager], rel=1e-3)
    for name, w in eager_weights.items():
        torch.testing.assert_close(graphed_weights[name], w, rtol=2e-2, atol=1e-3)


def _tp_config(tmp_path, overlap=True, sequence=False):
    return tiny_config(tmp_path, model={"dropout": 0.1, "dtype": "bfloat16"},
                       parallel={"dp": 1, "pp": 1, "tp": 2, "microbatches": 4, "sequence_parallel": sequence},
                       train={"global_batch_size": 16, "eps": ADAM_EPS},
                       runtime={"device": "cuda", "collective_timeout_s": 30.0, "tp_microbatch_overlap": overlap})


OVERLAPPED = {
    "moe-ep2": lambda path, overlap: _moe_config(path, "bfloat16", 2, overlap=overlap),
    "tp2": lambda path, overlap: _tp_config(path, overlap),
    "tp2-sequence-parallel": lambda path, overlap: _tp_config(path, overlap, sequence=True),
}


@pytest.mark.parametrize("run", list(OVERLAPPED))
def test_overlapped_microbatches_equal_one_after_another(ray_session, tmp_path, run):
    """runtime.moe_microbatch_overlap at ep=2, runtime.tp_microbatch_overlap at tp=2 (with and
    without sequence parallelism): each graphed forward replays on the device beside the
    previous micro-batch's backward (it starts before that backward ends), and losses,
    gradients, MoE counters and weights equal the same graphs run one after another."""
    _need_gpus(2)
    make = OVERLAPPED[run]
    plan = [("1f1b", 4), ("1f1b", 4), ("1f1b", 2), ("1f1b", 2), ("1f1b", 4)]  # a new count captures anew
    on, on_weights = _steps(make(tmp_path / "on", True), tmp_path / "on", plan)
    off, off_weights = _steps(make(tmp_path / "off", False), tmp_path / "off", plan)
    for step, ((_, m), (loss, grads, reports), (off_loss, off_grads, off_reports)) in enumerate(zip(plan, on, off)):
        where = f"step {step} ({m} micro-batches)"
        assert [r.graphed_microbatches for r in reports] == [m, m], where
        assert [r.overlapped_microbatches for r in reports] == [m, m], where
        assert [r.overlapped_microbatches for r in off_reports] == [0, 0], where
        captured = step == 0 or plan[step - 1][1] != m
        for r, o in zip(reports, off_reports):
            # Units F0 B0 F1 B1 ...: times hold (start, end) of each, on the device's clock.
            start = lambda unit, t=r.times: t[2 * unit]  # noqa: E731
            end = lambda unit, t=r.times: t[2 * unit + 1]  # noqa: E731
            beside = [start(2 * (i + 1)) < end(2 * i + 1) for i in range(m - 1)]
            # Not in a step that captured: a graph's first replay also uploads it (host time).
            assert captured or any(beside), f"{where}: no forward started before the previous backward ended"
            # Routing may differ where bf16 sums ran in another order; every token is routed.
            assert ({k: sum(v) for k, v in r.expert_tokens.items()} == {k: sum(v) for k, v in o.expert_tokens.items()}
                    and r.alltoall_bytes == o.alltoall_bytes and (r.alltoall_bytes > 0) == run.startswith("moe")), where
        assert loss == pytest.approx(off_loss, rel=1e-3), where
        for name, g in off_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=2e-2, atol=1e-4, msg=lambda m_: f"{where} {name}: {m_}")
    for name, w in off_weights.items():
        torch.testing.assert_close(on_weights[name], w, rtol=2e-2, atol=1e-3)


def test_graphed_moe_with_experts_placed_otherwise_equals_the_default(ray_session, tmp_path):
    """parallel.expert_placement at ep=2 (experts 3 and 1 on worker 0 at layer 0, ...):
    graphed, overlapped micro-batches send each row to its expert's worker by the slot table
    on the device, and losses, gradients (by the experts' own names), counters and weights
    equal the default placement's."""
    _need_gpus(2)
    plan = [("1f1b", 4), ("1f1b", 4), ("1f1b", 2)]
    placed_cfg = _moe_config(tmp_path / "placed", "bfloat16", 2)
    placed_cfg.parallel.expert_placement = [[3, 1, 0, 2], [2, 0, 3, 1]]
    placed, placed_weights = _steps(placed_cfg, tmp_path / "placed", plan)
    default, default_weights = _steps(_moe_config(tmp_path / "default", "bfloat16", 2), tmp_path / "default", plan)
    for step, ((loss, grads, reports), (d_loss, d_grads, d_reports)) in enumerate(zip(placed, default)):
        assert [r.graphed_microbatches for r in reports] == [r.graphed_microbatches for r in d_reports]
        assert sum(r.overlapped_microbatches for r in reports) > 0
        assert loss == pytest.approx(d_loss, rel=1e-3), step
        assert sorted(grads) == sorted(d_grads)
        for name, g in d_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=2e-2, atol=1e-4, msg=lambda m_: f"step {step} {name}: {m_}")
        total = lambda rs: {k: [sum(c) for c in zip(*(r.expert_tokens[k] for r in rs))]  # noqa: E731
                            for k in rs[0].expert_tokens}
        assert total(reports) == total(d_reports), step
    for name, w in default_weights.items():
        torch.testing.assert_close(placed_weights[name], w, rtol=2e-2, atol=1e-3)


def test_fp32_moe_on_gpu_runs_eagerly_and_matches_reference(ray_session, tmp_path):
    """An fp32 model on a GPU has ops a graph cannot capture (the experts' loop reads the
    group sizes on the host): capture fails on every rank alike, and the run goes on
    eagerly, equal to the reference."""
    _need_gpus(2)

    def check(step, schedule, m, reports):
        assert [r.graphed_microbatches for r in reports] == [0, 0], step

    _run(_moe_config(tmp_path, "float32", 2), tmp_path, [("1f1b", 4), ("1f1b", 4)], check)


def test_graphed_bf16_dense_dp2_sharded_equals_eager(ray_session, tmp_path):
    """dp=2 with the sharded optimizer in bf16: the step's last micro-batch runs eagerly so
    its backward queues the reduce-scatters as buckets fill (none is captured); the others
    replay. Losses, gradients and weights equal the eager run's."""
    _need_gpus(2)

    def cfg(name, graphs):
        return tiny_config(tmp_path / name, model={"dropout": 0.1, "dtype": "bfloat16"},
                           parallel={"dp": 2, "pp": 1, "shard_optimizer": True, "grad_bucket_mb": 0.02},
                           train={"global_batch_size": 16},
                           runtime={"device": "cuda", "collective_timeout_s": 30.0, "cuda_graphs": graphs})

    plan = [("1f1b", 4), ("1f1b", 4), ("1f1b", 4), ("1f1b", 2)]
    graphed, graphed_weights = _steps(cfg("graphs", True), tmp_path / "graphs", plan)
    eager, eager_weights = _steps(cfg("eager", False), tmp_path / "eager", plan)
    for step, ((_, m), (loss, grads, reports), (eager_loss, eager_grads, _)) in enumerate(zip(plan, graphed, eager)):
        assert [r.graphed_microbatches for r in reports] == [m - 1] * 2, step
        if step in (1, 2):  # the program learnt its counts the step before
            assert all(r.buckets_early > 0 for r in reports), [(r.buckets, r.buckets_early) for r in reports]
        assert loss == pytest.approx(eager_loss, rel=1e-3), step
        for name, g in eager_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=2e-2, atol=1e-4, msg=lambda m_: f"step {step} {name}: {m_}")
    for name, w in eager_weights.items():
        torch.testing.assert_close(graphed_weights[name], w, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("gpus, parallel, model", [
    (1, {"pp": 1}, {}),
    (2, {"pp": 2}, {}),
    (4, {"pp": 2, "tp": 2}, {}),
    (4, {"pp": 2, "ep": 2}, {**MOE, "moe_top_k": 2, "moe_ffn_dim": 64}),
], ids=["pp1", "pp2", "pp2-tp2", "pp2-ep2-moe"])
def test_graphed_pipeline_stages_equal_eager(ray_session, tmp_path, gpus, parallel, model):
    """Pipeline stages in bf16 with dropout: each stage replays a graph set per micro-batch it
    holds live (1F1B: pp - stage; fthenb: all), starting from the received activation and,
    but on the last stage, from the received output gradient. Losses, gradients and weights
    equal the same run eagerly, and every micro-batch replays."""
    _need_gpus(gpus)
    plan = [("1f1b", 4), ("1f1b", 4), ("fthenb", 4), ("1f1b", 2), ("1f1b", 4)]

    def cfg(name, graphs):
        return tiny_config(tmp_path / name, model={**model, "dropout": 0.1, "dtype": "bfloat16"},
                           parallel={"dp": 1, "microbatches": 4, **parallel}, train={"global_batch_size": 16},
                           runtime={"device": "cuda", "collective_timeout_s": 30.0, "cuda_graphs": graphs})

    graphed, graphed_weights = _steps(cfg("graphs", True), tmp_path / "graphs", plan)
    eager, eager_weights = _steps(cfg("eager", False), tmp_path / "eager", plan)
    for step, ((schedule, m), (loss, grads, reports), (eager_loss, eager_grads, eager_reports)) in enumerate(
            zip(plan, graphed, eager)):
        where = f"step {step} ({schedule}, {m})"
        assert [r.graphed_microbatches for r in reports] == [m] * gpus, where
        assert [r.graphed_microbatches for r in eager_reports] == [0] * gpus, where
        assert loss == pytest.approx(eager_loss, rel=1e-3), where
        for name, g in eager_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=2e-2, atol=1e-4, msg=lambda m_: f"{where} {name}: {m_}")
    for name, w in eager_weights.items():
        torch.testing.assert_close(graphed_weights[name], w, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-h1", "zb-h2", "zb-v"])
def test_graphed_chunked_and_split_stages_equal_eager(ray_session, tmp_path, schedule):
    """Interleaved 1F1B (two chunks a stage) and the zero-bubble schedules (backward split
    into I and W; ZB-V also two chunks) at pp=2, bf16 with dropout: each chunk replays a
    graph set per micro-batch it holds live until its backward ends (B, or W); a chunk's
    output handed to the next chunk on the same stage and that input's gradient handed back
    are the graphs' copies; W replays what its I left. Losses, gradients and weights equal
    the same run eagerly."""
    _need_gpus(2)
    plan = [(schedule, 4), (schedule, 4), (schedule, 2), (schedule, 4)]

    def cfg(name, graphs):
        return tiny_config(tmp_path / name, model={"dropout": 0.1, "dtype": "bfloat16"},
                           parallel={"dp": 1, "pp": 2, "schedule": schedule, "microbatches": 4},
                           train={"global_batch_size": 16},
                           runtime={"device": "cuda", "collective_timeout_s": 30.0, "cuda_graphs": graphs})

    graphed, graphed_weights = _steps(cfg("graphs", True), tmp_path / "graphs", plan)
    eager, eager_weights = _steps(cfg("eager", False), tmp_path / "eager", plan)
    for step, ((_, m), (loss, grads, reports), (eager_loss, eager_grads, _)) in enumerate(zip(plan, graphed, eager)):
        where = f"step {step} ({m} micro-batches)"
        assert [r.graphed_microbatches for r in reports] == [m] * 2, where
        assert loss == pytest.approx(eager_loss, rel=1e-3), where
        for name, g in eager_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=2e-2, atol=1e-4, msg=lambda m_: f"{where} {name}: {m_}")
    for name, w in eager_weights.items():
        torch.testing.assert_close(graphed_weights[name], w, rtol=2e-2, atol=1e-3)
