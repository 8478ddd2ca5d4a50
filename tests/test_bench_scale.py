"""The scale suite (bench/scale.py, for 4-8 GPUs) runs on CPU with tiny sizes and 4 workers, so it
cannot rot between GPU runs; its GPU sizes are checked without running them."""
import pytest

from helpers import run_bench_cpu


@pytest.fixture(scope="module")
def scale_and_tp(tmp_path_factory):
    """The scale and tp suites in one run of the harness (one Ray start for both)."""
    out_dir = tmp_path_factory.mktemp("scale-and-tp")
    out, results = run_bench_cpu("scale,tp", out_dir, timeout=400)
    return out, results, out_dir


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_scale_suite_runs_on_cpu(scale_and_tp):
    out, results, tmp_path = scale_and_tp
    assert list(results["suites"]) == ["scale", "tp"]
    suite = results["suites"]["scale"]
    assert "error" not in suite, suite.get("traceback")
    for row in suite["rows"]:
        # Any error, skip or early stop on CPU is a harness bug.
        assert not {"error", "skipped", "unavailable", "stopped_early"} & row.keys(), row
    by_kind: dict[str, list[dict]] = {}
    for row in suite["rows"]:
        by_kind.setdefault(row["kind"], []).append(row)

    (ref,) = by_kind["reference"]
    grids = by_kind["grid"]
    assert [r["label"] for r in grids] == ["grid (1,2,2)", "grid (2,1,2)", "grid (1,4,1)"]
    # The 2-GPU reference: same depth and batch per GPU, half the experts (N/2 = 2).
    assert ref["gpus"] == 2 and ref["grid"] == "dp=1 x pp=1 x ep=2" and ref["config"]["model"]["n_experts"] == 4
    for r in [ref, *grids]:
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert r["tokens_per_s_per_gpu"] == pytest.approx(r["tokens_per_s"] / r["gpus"])
        assert r["mfu"] is None  # no bf16 peak for a CPU
        assert len(r["peak_activation_bytes"]) == len(r["params_per_gpu"]) == r["config"]["parallel"]["pp"]
        assert r["flops_per_token"] > 0 and 0 <= r["bubble_measured"] < 1
    for r in grids:
        assert r["gpus"] == 4 and r["config"]["model"]["n_experts"] == 8
        assert r["config"]["model"]["n_layers"] == ref["config"]["model"]["n_layers"]
        assert r["config"]["train"]["global_batch_size"] == 2 * ref["config"]["train"]["global_batch_size"]
        assert r["weak_scaling"] > 0 and r["tokens_per_gpu_ratio"] > 0
    share = {r["label"]: r["alltoall_share"] for r in grids}
    assert share["grid (1,2,2)"] > 0 and share["grid (2,1,2)"] > 0 and share["grid (1,4,1)"] == 0
    # The first grid's row comes from the lost-worker run's steps before its save.
    assert grids[0]["from_run"] and grids[0]["steps_measured"] == [1, 2]

    (ckpt,) = by_kind["checkpoint"]
    assert ckpt["workers"] == 4 and ckpt["bytes"] > 0 and ckpt["write_bytes_per_s"] > 0
    assert ckpt["stall_s"] >= 0 and ckpt["overlap_s"] >= 0 and ckpt["save_duration_s"] > 0
    (lost,) = by_kind["lost worker"]
    # From the checkpoint committed before the kill (step 4), or from the states in memory when
    # the step after it was copied whole before the worker died.
    assert lost["failed_grid"] == "dp=1 x pp=2 x ep=2" and lost["resumed_step"] >= 4 and lost["steps_lost"] <= 1
    if lost["held"]:
        # All workers torn down, the lost one's CPUs held: 3 slots, no dp to shrink, so pp and ep are re-split.
        assert lost["held"] == {"CPU": 6.5} and lost["recovered_grid"] == "dp=1 x pp=3 x ep=1"
    else:
        # The survivors and the lost worker's bundle were kept: the same grid comes back.
        assert lost["not_held"] and lost["recovered_grid"] == lost["failed_grid"]
    assert lost["detection_s"] >= 0 and lost["recovery_s"] > 0
    assert lost["tokens_per_s_before"] > 0 and lost["tokens_per_s_after"] > 0 and len(lost["steps_after"]) >= 3

    md = (tmp_path / "results.md").read_text()
    tail = out.stdout[out.stdout.rindex("# raypar benchmarks"):]
    for text in (md, tail):
        assert "## scale:" in text and "| grid (1,4,1) | 4 |" in text
        assert "| lost worker |" in text and f"dp=1 x pp=2 x ep=2 -> {lost['recovered_grid']}" in text


def test_scale_is_not_part_of_all():
    from bench.run import suite_names

    assert "scale" not in suite_names("all") and "scale" not in suite_names("quick")
    assert suite_names("scale") == ["scale"]


@pytest.mark.parametrize("family", [4, 8])
def test_gpu_sizes(tmp_path, family):
    """The GPU configs validate; a GPU of a grid holds as much on 8 GPUs as on 4, and fits 78 GiB."""
    from bench import scale
    from bench.run import Context

    ctx = Context(work=tmp_path, cpu=False, steps=None, quick=False, suite="scale")
    grids = scale.GRIDS[family]
    per_gpu = {}
    for grid in grids:
        cfg = scale.config(ctx, "gpu", family, grid, label=str(grid))
        p = cfg.parallel
        assert (p.dp, p.pp, p.ep) == grid and cfg.model.dtype == "bfloat16"
        assert cfg.train.global_batch_size == 16 * family and cfg.microbatch_size == 4
        per_gpu[grid] = max(scale.params_per_gpu(cfg))
        # bf16 weights, fp32 masters and gradients, AdamW moments: ~18 bytes a parameter, with room for activations.
        assert per_gpu[grid] * 18 < 50 * 2**30
    ref = scale.config(ctx, "gpu", family, scale.REFERENCE_GRID, experts_div=family // 2, label="reference")
    assert ref.train.global_batch_size == 32 and ref.model.n_experts == 8 // (family // 2)
    assert ref.model.n_layers == cfg.model.n_layers == 8 * family // 4
    loss = scale.config(ctx, "gpu", family, grids[0], label="loss", loss=scale.SAVE_AT["gpu"])
    assert loss.checkpoint.every == scale.SAVE_AT["gpu"] > scale.POST["gpu"] and loss.elastic.enabled
    # The same per-GPU size on 4 and 8 GPUs, grid for grid (up to the embedding or head a stage holds).
    other = scale.GRIDS[12 - family]
    other_cfgs = [scale.config(ctx, "gpu", 12 - family, g, label=str(g)) for g in other]
    for grid, cfg in zip(grids, other_cfgs):
        assert max(scale.params_per_gpu(cfg)) == pytest.approx(per_gpu[grid], rel=0.1)


@pytest.mark.timeout(400)
def test_tensor_parallel_suite_runs_on_cpu_and_only_when_named(scale_and_tp):
    """bench/tensor_parallel.py on CPU: tp=2 against tp=1 with the split layers' efficiency;
    the 4-GPU rows say why they did not run. Not part of `all`."""
    from bench.run import suite_names

    assert "tp" not in suite_names("all") and suite_names("tp") == ["tp"]
    out, results, tmp_path = scale_and_tp
    assert "error" not in results["suites"]["tp"], results["suites"]["tp"].get("traceback")
    rows = {r["label"]: r for r in results["suites"]["tp"]["rows"]}
    assert rows["tp=1, 1 GPU"]["tokens_per_s"] > 0 and rows["tp=2, 2 GPUs"]["config"]["parallel"]["tp"] == 2
    assert rows["tp=2, 2 GPUs"]["tp_efficiency"] == pytest.approx(
        rows["tp=2, 2 GPUs"]["tokens_per_s"] / 2 / rows["tp=1, 1 GPU"]["tokens_per_s"])
    assert "needs 4 GPUs" in rows["tp=2 x pp=2, 4 GPUs"]["unavailable"]
    assert "| tp=2, 2 GPUs | 2 |" in (tmp_path / "results.md").read_text()
