"""The dashboards against a real Prometheus, set up the way dashboards/README.md tells users to.

A Prometheus server (the `prometheus` binary of Debian's package; .ci/run installs it)
runs on 127.0.0.1 with dashboards/prometheus.yml, its ports and paths rewritten for this
test. A Ray cluster with its dashboard writes the service-discovery file that the config's
`ray` job reads. One tiny MoE run on that cluster exports through both backends, each under
its own run name (tests/metrics_run.py): `runtime.metrics=ray`, scraped from the node's
metrics agent found through the service-discovery file, and `runtime.metrics=standalone`,
scraped from the driver's own endpoint. The run checkpoints and loses a worker, so every
panel has something to show. Then every PromQL expression of every dashboard is evaluated
as Grafana would (a range query over the run, its variables filled in) once per backend,
and must return samples carrying the labels its panel shows.

Skipped without a prometheus binary unless RAYPAR_REQUIRE_PROMETHEUS is set (as .ci/run does).
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from raypar.metrics.catalog import CATALOG

from dashboard_queries import BOARDS, Query, all_queries, broken_dashboard, load
from prometheus_harness import (Evaluation, Process, Prometheus, RayHead, dashboard_problems, find_prometheus,
                                free_port, live_problems, prometheus_config, stop_all, tail, wait_until)

pytestmark = pytest.mark.prometheus

ROOT = Path(__file__).resolve().parent.parent
RAY_RUN, STANDALONE_RUN = "tiny-ray", "tiny-standalone"
RUNS = (RAY_RUN, STANDALONE_RUN)
SCRAPE_INTERVAL_S = 1.0  # Ray's agent gets the driver's metrics once a second at best
STEPS = 12
KILL_AT_STEP = 4  # elastic recovery after step 4: restarts, detection and recovery times
# The run's grid and model (configs/tiny-moe.yaml with dp=1): what the labels must cover.
EXPECTED_LABEL_VALUES = {
    "stage": {"0", "1"},
    "dp_rank": {"0"},
    "ep_rank": {"0", "1"},
    "layer": {"1", "3"},  # model.moe_every=2 of 4 layers
    "expert": {"0", "1", "2", "3"},
    "kind": {"measured", "simulated"},
    "outcome": {"committed"},
    "source": {"memory"},
    "state": {"RUNNING", "RECOVERING", "FINISHED"},
}
RUN_OVERRIDES = [
    "parallel.dp=1", f"train.steps={STEPS}", "train.warmup_steps=1", "data.synthetic_samples=256",
    "model.moe_bias_update_rate=0.01",  # the expert biases' series
    "checkpoint.every=2", "elastic.enabled=true", "elastic.resource_timeout_s=30",
    "runtime.device=cpu", "runtime.cpus_per_worker=0.25", "runtime.log_every=1",
]
STEP_PAUSE_S = 0.35  # tiny CPU steps take ~0.1 s: spread the steps (and saves) over several scrapes
TRAINING_TIMEOUT_S = 180.0


@dataclass
class LiveRuns:
    prom: Prometheus
    evaluation: Evaluation  # the finished run's time range, as Grafana would query it


def prometheus_binary() -> str:
    binary = find_prometheus()
    if binary is None:
        why = "no prometheus binary on PATH or at /usr/bin/prometheus (apt-get install prometheus)"
        if os.environ.get("RAYPAR_REQUIRE_PROMETHEUS"):
            pytest.fail(f"RAYPAR_REQUIRE_PROMETHEUS is set, but there is {why}")
        pytest.skip(why)
    return binary


def start_training(head: RayHead, workdir: Path, standalone_port: int) -> Process:
    """The driver; it holds the finished run (exporters open) until the fixture stops it: the
    --hold file is never created."""
    args = [sys.executable, str(ROOT / "tests" / "metrics_run.py"), "--config", "configs/tiny-moe.yaml",
            "--backend", f"ray={RAY_RUN}", "--backend", f"standalone={STANDALONE_RUN}:{standalone_port}",
            "--kill-at", str(KILL_AT_STEP), "--step-pause", str(STEP_PAUSE_S), "--hold", str(workdir / "release"),
            *RUN_OVERRIDES, f"runtime.run_dir={workdir / 'run'}"]
    return Process.start("training driver", args, workdir / "driver.log",
                         env={**head.env, "RAY_ADDRESS": head.address}, cwd=ROOT)


def wait_for_training(driver: Process) -> None:
    def trained() -> tuple[bool, str]:
        driver.assert_running()
        lines = tail(driver.log, 300).strip().splitlines()
        return "TRAINED" in tail(driver.log, 20000), lines[-1] if lines else "no output"

    wait_until("the tiny run to finish its steps", trained, TRAINING_TIMEOUT_S, poll_s=0.5, log=driver.log)


def wait_for_final_scrapes(prom: Prometheus, log: Path) -> None:
    """Until Prometheus holds each run's FINISHED state, the last value any backend exports."""
    def finished() -> tuple[bool, str]:
        found = prom.query('max by (run) ({__name__=~"(ray_)?raypar_controller_state", state="FINISHED"})')
        done = {s["metric"].get("run") for s in found if float(s["value"][1]) == 1}
        targets = [(t["labels"].get("job"), t["scrapeUrl"], t["health"]) for t in prom.targets()]
        return set(RUNS) <= done, f"runs finished: {sorted(done, key=str)}; targets: {targets}"

    wait_until("Prometheus to scrape the FINISHED state of both runs", finished, 60.0, log=log)


@pytest.fixture(scope="module")
def live() -> LiveRuns:
    """Prometheus, a Ray cluster and one finished run exported through both backends, all
    scraped; stopped when the module's tests are done, also after a failure."""
    binary = prometheus_binary()
    with contextlib.ExitStack() as stack:
        # A short path: Ray's unix socket paths, under its temp dir, must stay within ~100 bytes.
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(
            prefix="rp-prom-", dir="/tmp" if os.path.isdir("/tmp") else None, ignore_cleanup_errors=True)))
        ray_temp = workdir / "ray"
        standalone_port = free_port()
        # Every process started below, stopped together (one grace period for all of them).
        started: list[Process] = []
        stack.callback(stop_all, started)
        prom = Prometheus.start(binary, prometheus_config(f"127.0.0.1:{standalone_port}", ray_temp,
                                                          SCRAPE_INTERVAL_S), workdir)
        started.append(prom.process)
        head = RayHead.start(ray_temp, num_cpus=4, report_interval_ms=int(SCRAPE_INTERVAL_S * 1000),
                             log=workdir / "ray-head.log")
        started.append(head.process)
        prom.wait_ready()
        head.wait_for_service_discovery()
        start = time.time()
        driver = start_training(head, workdir, standalone_port)
        started.append(driver)
        wait_for_training(driver)
        trained = time.time()
        wait_for_final_scrapes(prom, driver.log)
        print(f"\nprometheus test: training {trained - start:.1f}s after the cluster was up, "
              f"last scrapes {time.time() - trained:.1f}s after training")
        evaluation = Evaluation(start=start, end=time.time(), step_s=SCRAPE_INTERVAL_S,
                                scrape_interval_s=SCRAPE_INTERVAL_S, expected_values=EXPECTED_LABEL_VALUES)
        yield LiveRuns(prom, evaluation)


@pytest.mark.slow
def test_both_backends_are_scraped_through_the_shipped_config(live):
    """The ray backend's series come from the `ray` job (targets from Ray's service-discovery
    file) with Ray's prefix, the standalone backend's from `raypar-standalone` without it."""
    found = live.prom.query('count by (job, __name__, run) ({__name__=~"(ray_)?raypar_steps_total"})')
    seen = {(s["metric"]["run"], s["metric"]["job"], s["metric"]["__name__"]) for s in found}
    assert (RAY_RUN, "ray", "ray_raypar_steps_total") in seen, seen
    assert (STANDALONE_RUN, "raypar-standalone", "raypar_steps_total") in seen, seen
    discovered = {t["scrapeUrl"] for t in live.prom.targets() if t["labels"].get("job") == "ray"}
    assert discovered and all(url.startswith("http://127.0.0.1:") for url in discovered), discovered


@pytest.mark.parametrize("path", BOARDS, ids=lambda p: p.name)
def test_every_dashboard_query_returns_samples_with_its_panel_labels(live, path):
    problems = dashboard_problems(live.prom, load(path), path.name, RUNS, live.evaluation)
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


def test_scraped_types_match_the_catalog(live):
    """Each catalog metric reaches Prometheus with its catalog type under both names, so
    rate() reads counters and histogram_quantile() reads histograms."""
    metadata = live.prom.api("metadata")
    wrong = []
    for spec in CATALOG:
        for prefix in ("", "ray_"):
            name = prefix + spec.name
            # OpenMetrics names a counter's family without _total.
            entries = metadata.get(name) or metadata.get(name.removesuffix("_total")) or []
            types = {e["type"] for e in entries}
            if types != {spec.kind}:
                wrong.append(f"{name}: {sorted(types) or 'not scraped'}, catalog: {spec.kind}")
    assert not wrong, "\n".join(wrong)


def test_a_dashboard_query_on_a_missing_metric_fails_the_check(live):
    """The check is not vacuous: fed a dashboard whose 'Loss' panel names a metric that does
    not exist, it fails against the catalog and in Prometheus (once per backend's run), each
    time naming the dashboard, the panel and the query, and reports nothing else."""
    board, broken = broken_dashboard()
    problems = dashboard_problems(live.prom, board, "broken.json", RUNS, live.evaluation)
    assert len(problems) == 3, "\n".join(problems)
    assert all(p.startswith(str(broken)) for p in problems), "\n".join(problems)
    assert "['raypar_no_such_metric'] not in raypar.metrics.catalog" in problems[0]
    assert all("no samples" in p for p in problems[1:]), "\n".join(problems)


def test_a_panel_label_the_series_lack_fails_the_check(live):
    """A legend printing {{stage}} on a metric without a stage label is caught too."""
    loss = next(q for q in all_queries() if q.where == "panel 'Loss' target A")
    wrong = Query(loss.board, loss.where, loss.expr, legend="{{run}} stage {{stage}}")
    problems = live_problems(live.prom, wrong, STANDALONE_RUN, live.evaluation)
    assert problems and all("lacks ['stage']" in p for p in problems), problems
