"""A real Prometheus and a Ray cluster with its dashboard, on the loopback address, for
tests/test_prometheus.py; and the check that evaluates dashboard queries in Prometheus.

Every process here starts in a session of its own and `stop()` ends its whole process
group, so nothing outlives the test, and nothing touches another Ray cluster on the
machine (no `ray stop`, which stops every Ray process of the user).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from ports import free_port
from dashboard_queries import (DASHBOARDS, Query, board_queries, board_variables, label_values_query, panel_labels,
                               static_problems, to_promql)

# Where Debian's `prometheus` package puts the binary, in case PATH lacks /usr/bin (cron, CI).
PROMETHEUS_PATHS = ("/usr/bin/prometheus",)
# What dashboards/prometheus.yml points at, rewritten for a test's own ports and Ray temp dir.
TEMPLATE_STANDALONE_TARGET = "127.0.0.1:9464"
TEMPLATE_RAY_TEMP_DIR = "/tmp/ray/"


def find_prometheus() -> str | None:
    """The prometheus binary on PATH, else Debian's; None if neither exists."""
    found = shutil.which("prometheus")
    if found:
        return found
    return next((p for p in PROMETHEUS_PATHS if os.access(p, os.X_OK)), None)


def wait_until(what: str, probe: Callable[[], tuple[bool, str]], timeout_s: float, poll_s: float = 0.25,
               log: Path | None = None) -> None:
    """Poll `probe` (done?, what it saw) until done; fail after `timeout_s` naming what was
    waited for, what was last seen, and the tail of `log` when one is given."""
    deadline = time.monotonic() + timeout_s
    seen = "nothing yet"
    while time.monotonic() < deadline:
        try:
            done, seen = probe()
        except (OSError, ValueError) as e:  # a server not up yet, a file half written
            done, seen = False, f"{type(e).__name__}: {e}"
        if done:
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}; last seen: {seen}"
                         + (f"\n--- {log} (tail) ---\n{tail(log)}" if log else ""))


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError as e:
        return f"(cannot read: {e})"


@dataclass
class Process:
    """A subprocess in a session of its own, its output in `log`."""

    name: str
    popen: subprocess.Popen
    log: Path

    @classmethod
    def start(cls, name: str, args: list[str], log: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Process:
        with open(log, "wb") as out:
            popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True)
        return cls(name, popen, log)

    def assert_running(self) -> None:
        if self.popen.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.popen.returncode}\n--- {self.log} (tail) ---\n"
                                 f"{tail(self.log)}")

    def stop(self, grace_s: float = 2.0) -> None:
        """SIGTERM to the whole process group (Ray's GCS, raylet and workers are in it too),
        then SIGKILL to whatever of it is left after `grace_s`."""
        stop_all([self], grace_s)


def stop_all(processes: list[Process], grace_s: float = 2.0) -> None:
    """`Process.stop` for several processes at once: SIGTERM to every group, one grace period
    for all of them, then SIGKILL to whatever is left of each."""
    for p in processes:
        signal_group(p.popen.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.popen.poll() is None or group_alive(p.popen.pid) for p in processes):
        time.sleep(0.1)
    for p in processes:
        signal_group(p.popen.pid, signal.SIGKILL)
    for p in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.popen.wait(timeout=5)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------------------------------
# Prometheus


def prometheus_config(standalone_target: str, ray_temp_dir: Path, scrape_interval_s: float,
                      template: Path = DASHBOARDS / "prometheus.yml") -> dict:
    """dashboards/prometheus.yml with the test's own endpoints: the standalone target's
    port, Ray's service-discovery file under `ray_temp_dir` (Ray's --temp-dir) instead of
    /tmp/ray, and a short scrape interval. Everything else is the file as users get it."""
    cfg = yaml.safe_load(template.read_text())
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = f"{scrape_interval_s:g}s"
    rewritten = {"static": 0, "file_sd": 0}
    for job in cfg["scrape_configs"]:
        for sc in job.get("static_configs", []):
            if TEMPLATE_STANDALONE_TARGET in sc["targets"]:
                sc["targets"] = [standalone_target if t == TEMPLATE_STANDALONE_TARGET else t for t in sc["targets"]]
                rewritten["static"] += 1
        for sd in job.get("file_sd_configs", []):
            files = [str(ray_temp_dir / f.removeprefix(TEMPLATE_RAY_TEMP_DIR)) if f.startswith(TEMPLATE_RAY_TEMP_DIR)
                     else f for f in sd["files"]]
            rewritten["file_sd"] += files != sd["files"]
            sd["files"] = files
    if rewritten != {"static": 1, "file_sd": 1}:
        raise AssertionError(f"{template} no longer has one static target {TEMPLATE_STANDALONE_TARGET} and one "
                             f"file_sd file under {TEMPLATE_RAY_TEMP_DIR} (found {rewritten}): update this test")
    return cfg


def prometheus_args(binary: str, config_file: str | Path, port: int, data_dir: str | Path) -> list[str]:
    """The command line dashboards/README.md shows, with the test's own port and data folder."""
    return [binary, f"--config.file={config_file}", f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={data_dir}"]


class PrometheusError(AssertionError):
    pass


@dataclass
class Prometheus:
    """A Prometheus server on 127.0.0.1 and the parts of its HTTP API that Grafana uses."""

    process: Process
    port: int
    config: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, binary: str, config: dict, workdir: Path) -> Prometheus:
        config_file = workdir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(config, sort_keys=False))
        port = free_port()
        process = Process.start("prometheus", prometheus_args(binary, config_file, port, workdir / "data"),
                                workdir / "prometheus.log")
        return cls(process, port, config)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        def ready() -> tuple[bool, str]:
            self.process.assert_running()
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                return r.status == 200, f"HTTP {r.status}"

        wait_until(f"Prometheus to be ready on {self.url}", ready, timeout_s, log=self.process.log)

    def api(self, path: str, **params: str | list[str]) -> dict | list:
        """GET /api/v1/<path>; the `data` of a success, else PrometheusError with Prometheus's error."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{body.get('errorType', 'error')}: {body.get('error', body)}")
        return body["data"]

    def query(self, promql: str) -> list[dict]:
        return self.api("query", query=promql)["result"]

    def query_range(self, promql: str, start: float, end: float, step_s: float) -> list[dict]:
        return self.api("query_range", query=promql, start=f"{start:.3f}", end=f"{end:.3f}",
                        step=f"{step_s:g}")["result"]

    def label_values(self, label: str, selector: str, start: float, end: float) -> list[str]:
        return self.api(f"label/{label}/values", **{"match[]": [selector]}, start=f"{start:.3f}", end=f"{end:.3f}")

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]


# ---------------------------------------------------------------------------------------
# A Ray cluster with its dashboard (which writes the service-discovery file)


def ray_env(token: str, report_interval_ms: int) -> dict[str, str]:
    """Environment for the test cluster and its driver.

    - RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps a one-node cluster on 127.0.0.1: Ray
      otherwise swaps --node-ip-address=127.0.0.1 for the machine's address, and the
      service-discovery file would list that one.
    - Token authentication with a token of the test's own, so neither ~/.ray/auth_token
      nor another cluster's settings matter.
    - Metrics reported to the node's agent every `report_interval_ms` (Ray's default: 10 s).
    - The autoscaler's and the dashboard's metrics servers on free ports instead of their
      fixed defaults (44217, 44227), which another Ray cluster on the machine may hold.
    """
    inherited = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # the driver gets its own
    return {**inherited, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token, "RAY_metrics_report_interval_ms": str(report_interval_ms),
            "AUTOSCALER_METRIC_PORT": str(free_port()), "DASHBOARD_METRIC_PORT": str(free_port()),
            "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@dataclass
class RayHead:
    process: Process
    temp_dir: Path
    gcs_port: int
    env: dict[str, str]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def service_discovery_file(self) -> Path:
        """The path Ray links to the session's file, like /tmp/ray/prom_metrics_service_discovery.json."""
        return self.temp_dir / "prom_metrics_service_discovery.json"

    @classmethod
    def start(cls, temp_dir: Path, num_cpus: int, report_interval_ms: int, log: Path) -> RayHead:
        """`ray start --head --block` with the dashboard, every port its own (another Ray
        cluster may run on this machine)."""
        env = ray_env(secrets.token_hex(16), report_interval_ms)
        gcs_port = free_port()
        ray_cli = str(Path(sys.executable).with_name("ray"))
        args = [ray_cli, "start", "--head", "--block", f"--temp-dir={temp_dir}", "--node-ip-address=127.0.0.1",
                f"--port={gcs_port}", f"--num-cpus={num_cpus}", "--num-gpus=0", "--include-dashboard=true",
                "--dashboard-host=127.0.0.1", f"--dashboard-port={free_port()}",
                f"--dashboard-agent-listen-port={free_port()}", f"--ray-client-server-port={free_port()}",
                "--disable-usage-stats"]
        return cls(Process.start("ray head", args, log, env=env), temp_dir, gcs_port, env)

    def service_discovery_targets(self) -> list[str]:
        groups = json.loads(self.service_discovery_file.read_text())
        return [t for g in groups for t in g["targets"]]

    def wait_for_service_discovery(self, timeout_s: float = 60.0) -> None:
        def written() -> tuple[bool, str]:
            self.process.assert_running()
            if not self.service_discovery_file.exists():
                return False, f"no {self.service_discovery_file}"
            targets = self.service_discovery_targets()
            return bool(targets), f"targets {targets}"

        wait_until(f"Ray's dashboard to write {self.service_discovery_file}", written, timeout_s,
                   log=self.process.log)


# ---------------------------------------------------------------------------------------
# Evaluating dashboard queries


@dataclass(frozen=True)
class Evaluation:
    """How to evaluate queries the way Grafana would over a run's time range."""

    start: float
    end: float
    step_s: float
    scrape_interval_s: float
    # Label values every series set must cover where a panel has that label, e.g. both
    # stages of a pp=2 run: {"stage": {"0", "1"}}.
    expected_values: dict[str, set[str]] = field(default_factory=dict)

    def promql(self, q: Query, run: str) -> str:
        return to_promql(q.expr, {"run": run}, self.scrape_interval_s, self.step_s, self.end - self.start)


def live_problems(prom: Prometheus, q: Query, run: str, ev: Evaluation) -> list[str]:
    """What is wrong with query `q` for run `run` in Prometheus: an error, no samples, only
    NaN, a series without a label its panel shows or groups by, a stage (rank, ...) missing."""
    where = f"{q} (run {run!r})"
    if q.is_variable:
        selector, label = label_values_query(q.expr)
        try:
            values = prom.label_values(label, selector, ev.start, ev.end)
        except PrometheusError as e:
            return [f"{where}: Prometheus refused it: {e}"]
        return [] if run in values else [f"{where}: {label} values {values} lack {run!r}"]
    promql = ev.promql(q, run)
    try:
        series = prom.query_range(promql, ev.start, ev.end, ev.step_s)
    except PrometheusError as e:
        return [f"{where}: Prometheus refused {promql}: {e}"]
    if not series:
        return [f"{where}: no samples (sent {promql})"]
    problems = []
    if not any(math.isfinite(float(v)) for s in series for _, v in s["values"]):
        problems.append(f"{where}: only NaN samples, an empty panel (sent {promql})")
    needed = panel_labels(q)
    for s in series:
        missing = {label for label in needed if not s["metric"].get(label)}
        if missing:
            problems.append(f"{where}: a series lacks {sorted(missing)}: {s['metric']}")
        elif "run" in needed and s["metric"]["run"] != run:
            problems.append(f"{where}: a series of another run: {s['metric']}")
    carried = {label for label in needed if all(s["metric"].get(label) for s in series)}
    for label, expected in ev.expected_values.items():
        if label in carried:
            seen = {s["metric"].get(label) for s in series}
            if not expected <= seen:
                problems.append(f"{where}: {label} values {sorted(seen, key=str)}, expected {sorted(expected)}")
    return problems


def dashboard_problems(prom: Prometheus, board: dict, name: str, runs: tuple[str, ...], ev: Evaluation) -> list[str]:
    """Everything wrong with dashboard `board` (file `name`): each query checked against the
    catalog, then evaluated in Prometheus for each of `runs`."""
    problems = []
    for q in board_queries(board, name):
        problems += static_problems(q, board_variables(board))
        for run in runs:
            problems += live_problems(prom, q, run, ev)
    return problems
