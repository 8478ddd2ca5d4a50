"""The benchmark harness runs on CPU with tiny sizes, so it cannot rot between GPU runs."""

import pytest

from helpers import run_bench_cpu

SUITES = ["kernels", "moe", "baselines", "checkpoint", "elastic", "pipeline"]
# Rows that cannot run without GPUs and say so; on CPU every other row must have run.
CPU_UNAVAILABLE = {"NCCL p2p send/recv, 256 MiB"}


def _rows(results: dict, suite: str) -> dict[str, dict]:
    return {r["label"]: r for r in results["suites"][suite]["rows"]}


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_every_suite_runs_on_cpu(tmp_path):
    # Baselines launch each row twice (median and spread) and profile one step: one run of
    # the harness covers those options too. Three steps: the device step needs a step after
    # the first with one after it.
    out, results = run_bench_cpu("all", tmp_path, 500, "--repeats", "2", "--profile", "--steps", "3")
    env = results["environment"]
    assert env["card"] == "cpu" and env["torch"] and env["ray"]
    assert list(results["suites"]) == SUITES
    for name, suite in results["suites"].items():
        assert "error" not in suite, f"suite {name} failed:\n{suite.get('traceback')}"
        assert suite["rows"], f"suite {name} has no rows"
        for row in suite["rows"]:
            # Any error on CPU is a harness bug; only GPU-only rows may be missing, and must say why.
            assert "error" not in row, f"{name} / {row['label']}: {row['error']}\n{row.get('traceback')}"
            assert "skipped" not in row, f"{name} / {row['label']}: {row['skipped']}"
            if "unavailable" in row:
                assert row["label"] in CPU_UNAVAILABLE and "not available on CPU" in row["unavailable"], row
            assert "stopped_early" not in row, row

    kernel_rows = results["suites"]["kernels"]["rows"]
    assert kernel_rows[0]["d2d_gbps"] > 0 and kernel_rows[0]["d2h_pinned_gbps"] > 0
    # On CPU the ops run their torch references: those are timed, no kernel is.
    assert len(kernel_rows) == 11 and all(r["eager_ms"] > 0 and "kernel_ms" not in r for r in kernel_rows[1:])

    moe = _rows(results, "moe")
    ep, pp = moe["ep=2, grid (1,1,2)"], moe["pp=2, grid (1,2,1)"]
    assert ep["tokens_per_s"] > 0 and pp["tokens_per_s"] > 0
    assert ep["alltoall_bytes_per_step"] > 0 and ep["alltoall_gbps"] > 0 and 0 < ep["alltoall_share"] < 1
    assert pp["alltoall_bytes_per_step"] == 0 and ep["config"]["parallel"]["ep"] == 2

    base = _rows(results, "baselines")
    single = next(r for r in base.values() if r.get("kind") == "single")
    for schedule, torch_label in (("1f1b", "Schedule1F1B"), ("fthenb", "ScheduleGPipe")):
        ours, theirs = base[f"raypar {schedule}"], base[f"torch.distributed.pipelining {torch_label}"]
        assert ours["vs_torch"] > 0 and theirs["tokens_per_s"] > 0
        # Same data, initialisation and optimizer: the same losses, whoever runs the pipeline.
        assert theirs["final_loss"] == pytest.approx(single["final_loss"], rel=1e-4)
        assert ours["final_loss"] == pytest.approx(single["final_loss"], rel=1e-4)

    ckpt = results["suites"]["checkpoint"]["rows"]
    raypar_save = next(r for r in ckpt if r["label"].startswith("raypar, checkpoint.every"))
    assert raypar_save["bytes"] > 0 and raypar_save["stall_per_step"] >= 0 and raypar_save["vs_disk"] > 0
    assert raypar_save["vs_no_saves"] > 0 and raypar_save["save_stages_s"]["write_s"] > 0
    ema = next(r for r in ckpt if r["label"].startswith("raypar, EMA every step"))
    assert ema["vs_no_saves"] > 0 and ema["config"]["checkpoint"]["ema_every"] == 1
    assert {r["label"] for r in ckpt} >= {"torch.save, synchronous (whole model on the driver)",
                                         "torch.distributed.checkpoint.async_save",
                                         "load, same grid (pp=2 -> pp=2), into the running workers",
                                         "load, resharded (pp=2 -> pp=1)"}
    assert next(r for r in ckpt if r.get("load_pp") == 1)["vs_same_grid"] > 0

    off, on, recovery, borrowed, restart = results["suites"]["elastic"]["rows"]
    assert (off["memory_every"], on["memory_every"]) == (0, 1) and on["vs_no_memory"] > 0
    assert off["memory_copies"] == 0 and 0 < on["memory_copies"] <= on["steps_run"]
    for killed in (recovery, borrowed):
        assert killed["kill_to_step_s"] > 0 and killed["failed_grid"] == killed["recovered_grid"]
        assert killed["source"] == "memory" and killed["steps_lost"] <= 1 and killed["vs_restart"] > 0
        # Where the step before the kill and the first step after went, per stage.
        before, after = killed["step_before_kill"], killed["first_step_after"]
        assert after["step"] == killed["resumed_step"] and before["step"] == killed["killed_after"]
        assert [w["stage"] for w in after["workers"]] == [0, 1] and after["step_ms"] > 0
    assert restart["restart_s"] > 0 and restart["resumed_step"] <= recovery["resumed_step"]
    assert (borrowed["workers_started"], borrowed["workers_from_standby"]) == (0, 1)
    assert borrowed["config"]["elastic"]["standby_gpu"] == "borrow"

    pipeline = _rows(results, "pipeline")
    assert pipeline["1f1b, release"]["reused_from"] == "baselines" and len(pipeline) == 6

    # Every suite's table is printed, after the last log line.
    tail = out.stdout[out.stdout.rindex("# raypar benchmarks"):]
    for name in SUITES:
        assert f"## {name}:" in tail and f"## {name}:" in (tmp_path / "results.md").read_text()
    assert "the first step after (step" in tail
    assert "| ep=2, grid (1,1,2) (4 mb) |" in tail and "| raypar 1f1b (8 mb); median of 2 launches" in tail
    _check_repeated_baselines(out, results)


def _check_repeated_baselines(out, results: dict) -> None:
    """Launches of one config vary (BENCHMARKS.md): with --repeats each row is the median
    launch, with every launch's rate and the spread, and the ratios use those rows."""
    rows = results["suites"]["baselines"]["rows"]
    costs = [r for r in rows if r.get("kind") == "stage_costs"]
    assert len(costs) == 1 and len(costs[0]["gpu_ms"]) == len(costs[0]["host_ms"]) == 2
    # --profile: one more launch of each raypar schedule and of torch, a trace per stage.
    profiles = [r for r in rows if r.get("kind") == "profile"]
    assert len(profiles) == 4 and all("error" not in r for r in profiles), profiles
    assert all(len(r["stages"]) == 2 and all(st["traced_ms"] > 0 for st in r["stages"]) for r in profiles)
    assert "One profiled step" in out.stdout
    rows = [r for r in rows if r.get("kind") not in ("stage_costs", "profile")]
    assert len({r["label"] for r in rows}) == len(rows) == 19
    # torch's multi-chunk schedules: the model in 4 stages, 2 per process; the same losses.
    chunked = [r for r in rows if r.get("chunks") == 2]
    assert sorted(r["label"].split()[1] for r in chunked) == ["ScheduleDualPipeV", "ScheduleInterleaved1F1B",
                                                              "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble"]
    single = next(r for r in rows if r.get("kind") == "single")
    assert all(r["final_loss"] == pytest.approx(single["final_loss"], rel=1e-4) for r in chunked)
    fastest = next(r for r in rows if "vs_torch_best" in r)
    assert fastest["tokens_per_s"] == max(r["tokens_per_s"] for r in rows if r["label"].startswith("raypar "))
    assert "over the fastest torch row" in out.stdout
    # parallel.schedule=auto: chose one of the schedules the other rows ran, and says how it compares.
    auto = next(r for r in rows if r["label"] == "raypar auto")
    every = {"fthenb", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "zb-v-half"}
    assert auto["chosen"] in every and auto["schedule_choices"][0]["measured_step_s"]
    assert auto["best_measured"] in every and auto["vs_best_measured"] > 0 and auto["chosen_tokens_per_s"] > 0
    for schedule, torch_label in (("interleaved-1f1b", "ScheduleInterleaved1F1B"), ("zb-v", "ScheduleZBVZeroBubble")):
        # raypar's schedules of two chunks per stage beside torch's that place chunks alike.
        ours = next(r for r in rows if r["label"] == f"raypar {schedule}")
        theirs = next(r for r in rows if r["label"].startswith(f"torch.distributed.pipelining {torch_label}"))
        assert ours["vs_torch"] == pytest.approx(ours["tokens_per_s"] / theirs["tokens_per_s"])
    for schedule in ("zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "zb-v-half"):  # beside raypar's 1F1B
        zb = next(r for r in rows if r["label"] == f"raypar {schedule}")
        assert zb["config"]["parallel"]["schedule"] == schedule and zb["vs_1f1b"] > 0 and zb["vs_2_devices"] > 0
        assert zb["peak_vs_1f1b"] > 0
        single = next(r for r in rows if r.get("kind") == "single")
        assert zb["final_loss"] == pytest.approx(single["final_loss"], rel=1e-4)  # same model, same steps
    for r in rows:
        assert "error" not in r and "skipped" not in r, r
        launches = 1 if r.get("zero_bubble") or r.get("auto") or r.get("chunks") == 2 else 2  # first launch only
        assert r["launches"] == r["launches_measured"] == launches and len(r["tokens_per_s_launches"]) == launches
        assert min(r["tokens_per_s_launches"]) == r["tokens_per_s"] and r["spread"] >= 0
    ours = next(r for r in rows if r["label"] == "raypar 1f1b")
    theirs = next(r for r in rows if r["label"] == "torch.distributed.pipelining Schedule1F1B")
    assert ours["vs_torch"] == pytest.approx(ours["tokens_per_s"] / theirs["tokens_per_s"])
    assert "median of 2 launches" in out.stdout
    # The pace on the device: every stage's time from one step's first unit to the next's.
    for r in (ours, theirs):
        steps = [b["device_step_ms"] for b in r["breakdown"]]
        assert len(steps) == 2 and all(s > 0 for s in steps) and len(r["device_step_ms_launches"]) == 2
        assert max(steps) == pytest.approx(r["device_step_ms_launches"][0], rel=1e-9)
    # Launch by launch: raypar's over torch's of the same round, and their median.
    assert len(ours["vs_torch_by_launch"]) == len(ours["vs_torch_on_device_by_launch"]) == 2
    assert ours["vs_torch_median_pair"] == pytest.approx(sum(ours["vs_torch_by_launch"]) / 2)
    assert sorted(ours["vs_torch_by_launch"]) == pytest.approx(sorted(
        a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(ours["by_launch"], theirs["by_launch"])))
    assert "by launch" in out.stdout
    assert ours["vs_torch_on_device"] == pytest.approx(max(b["device_step_ms"] for b in theirs["breakdown"])
                                                       / max(b["device_step_ms"] for b in ours["breakdown"]))
    # The same run without the first forward issued ahead, side by side.
    off = next(r for r in rows if r["label"] == "raypar 1f1b, runtime.forward_ahead=false")
    assert off["config"]["runtime"]["forward_ahead"] is False and ours["config"]["runtime"]["forward_ahead"]
    assert off["vs_torch"] == pytest.approx(off["tokens_per_s"] / theirs["tokens_per_s"])
    # Where the step went, per stage, from the run's events: the parts fit inside the
    # stage's own span of the step (its first unit to its last).
    for b in ours["breakdown"]:
        parts = [b[k] for k in ("forward_ms", "backward_ms", "window_idle_ms", "grad_norm_ms", "optimizer_ms")]
        assert all(p >= 0 for p in parts) and 0 < sum(parts) <= b["span_ms"] + 1e-6
        assert b["window_ms"] == pytest.approx(b["forward_ms"] + b["backward_ms"] + b["window_idle_ms"])
        assert b["forward_ms"] > 0 and b["backward_ms"] > 0 and b["compute_vs_alone"] > 0
    assert [b["stage"] for b in ours["breakdown"]] == [0, 1]
    # torch's the same way, from marks around its schedule's step, its stage's forwards and
    # backwards, the norm and the optimizer.
    torch_step_ms = 1000 * theirs["step_time_s"]
    assert [b["stage"] for b in theirs["breakdown"]] == [0, 1]
    for b in theirs["breakdown"]:
        parts = [b[k] for k in ("window_ms", "grad_norm_ms", "optimizer_ms", "between_steps_ms")]
        assert all(p >= 0 for p in parts) and 0 < sum(parts) <= torch_step_ms * 1.05
        assert b["forward_ms"] > 0 and b["backward_ms"] > 0 and b["compute_vs_alone"] > 0
        assert b["window_ms"] == pytest.approx(b["forward_ms"] + b["backward_ms"] + b["window_idle_ms"])
    assert "Where each pipelined step goes" in out.stdout


@pytest.mark.slow
def test_schedules_bench_runs_on_cpu(tmp_path):
    """bench/schedules.py: each kind its own launch; ratios to the one-stage ideal times the
    stages (--pp 4 here), and the layers each (virtual) stage got. (Two kinds: every launch
    starts its own Ray.)"""
    import json
    import subprocess
    import sys

    out = tmp_path / "out"
    subprocess.run([sys.executable, "-m", "bench.schedules", "--out", str(out), "--cpu", "--rounds", "1",
                    "--steps", "3", "--pp", "4", "--kinds", "pp1,interleaved-1f1b-auto", "--work", str(tmp_path / "work")],
                   check=True, capture_output=True, text=True, timeout=240)
    rows = {r["kind"]: r for r in json.loads((out / "schedules.json").read_text())}
    assert set(rows) == {"pp1", "interleaved-1f1b-auto"} and all(r["tokens_per_s"] > 0 for r in rows.values())
    # On CPU the tiny model has 2 layers per stage: 8 here, on 4 stages of 2 chunks each.
    assert rows["pp1"]["layers_per_stage"] == [8] and rows["pp1"]["pp"] == 1
    row = rows["interleaved-1f1b-auto"]
    assert row["pp"] == 4 and len(row["layers_per_stage"]) == 8 and sum(row["layers_per_stage"]) == 8
    # The same model, data and steps in every launch: the same losses, whatever the schedule.
    assert row["final_loss"] == pytest.approx(rows["pp1"]["final_loss"], rel=1e-4)
    table = (out / "schedules.md").read_text()
    ideal = row["tokens_per_s"] / (4 * rows["pp1"]["tokens_per_s"])
    split = " ".join(f"{n:g}" for n in row["layers_per_stage"])  # halves as .5
    assert "| vs ideal (4 x pp1) |" in table
    assert f"| interleaved-1f1b-auto | {split} | {row['tokens_per_s']:,.0f} | {ideal:.3f} |  |" in table
    assert f"Fastest pipelined launch: interleaved-1f1b-auto, {ideal:.3f} of the ideal" in table


def test_rows_that_a_rows_pattern_does_not_select_are_listed_as_skipped(tmp_path):
    """`--rows REGEX`: a row whose label the pattern does not find is not run, and says why."""
    from bench.run import Context

    ctx = Context(work=tmp_path, cpu=True, steps=2, quick=False, rows=r"tp=2\b")
    assert ctx.attempt("tp=1, 1 GPU", lambda: 1 / 0) == [
        {"label": "tp=1, 1 GPU", "skipped": r"not selected by --rows 'tp=2\\b'"}]
    ran = ctx.attempt("tp=2, 2 GPUs", lambda: {"label": "tp=2, 2 GPUs", "tokens_per_s": 1.0})
    assert [(r["label"], r["tokens_per_s"]) for r in ran] == [("tp=2, 2 GPUs", 1.0)]


def test_the_kernels_table_shows_graph_replay_times_and_marks_queued_ones():
    """GPU rows of bench/kernels.py: times replayed from a CUDA graph stand as they are,
    those only queued from Python (not capturable) are marked, the queued pair beside both."""
    from bench.kernels import table

    common = {"bytes": 1, "kernel_gbps": 900.0, "eager_gbps": 300.0, "copy_kind": "d2d", "vs_copy": 0.5,
              "kernel_host_us": 30.0, "eager_host_us": 90.0}
    rows = [{"label": "rope", "timed": "graph replay", "kernel_ms": 0.05, "eager_ms": 0.15, "speedup": 3.0,
             "kernel_queued_ms": 0.2, "eager_queued_ms": 0.25, **common},
            {"label": "copy", "timed": "queued", "graph_failed": "not capturable in a CUDA graph: RuntimeError: x",
             "kernel_ms": 0.4, "eager_ms": 0.8, "speedup": 2.0, "kernel_queued_ms": 0.4, "eager_queued_ms": 0.8,
             **common},
            {"label": "cpu row", "eager_ms": 1.5}]
    lines = table(rows).splitlines()
    assert "| rope | 0.050 | 0.150 | 3.00x | 900 | 50% (d2d) | 0.200 / 0.250 | 30 / 90 |" in lines
    assert "| copy | 0.400 (queued) | 0.800 (queued) | 2.00x | 900 | 50% (d2d) | 0.400 / 0.800 | 30 / 90 |" in lines
    assert "| cpu row | - | 1.500 | - | - | - | - | - |" in lines
    assert all(line.count("|") == lines[0].count("|") for line in lines)
