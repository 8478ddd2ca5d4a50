"""The benchmark entry point: every suite in one Ray session, side by side.

    python -m bench.run --suite all --out DIR               # GPU machine (2 GPUs), within ~9 minutes
    python -m bench.run --suite quick --out DIR             # a subset, within ~3 minutes
    python -m bench.run --suite moe,elastic --out DIR       # named suites
    python -m bench.run --suite all --cpu --steps 2 --out DIR   # tiny models on CPU (the tests)
    python -m bench.run --suite scale --out DIR             # 4 or 8 GPUs (bench/scale.py), within ~8.5 minutes
    python -m bench.run --suite baselines --repeats 3 --out DIR  # each row launched 3 times: median, spread
    python -m bench.run --suite baselines --profile --out DIR    # plus one profiled step of raypar and torch

Suites: kernels, pipeline (bench/pipeline.py's rows), moe, checkpoint, elastic, baselines; and scale
(bench/scale.py, for 4-8 GPUs: not part of all or quick, which are for 2 GPUs). Writes
DIR/results.json (environment, every suite's rows, each row's config) and DIR/results.md
(one table per suite, printed last). Both files are rewritten after every suite, so a call
cut short still keeps the suites that finished. A suite that fails records its error and
the others still run. Run directories, checkpoints and corpora go to a scratch folder
(--work), never under --out: a 1B model's checkpoint is ~12 GB.

On GPU the suites share a time budget (--budget-s): a row that would start with too little
time left is recorded as skipped, and a run past its suite's deadline stops after its
current step (at least 2), so the call ends with results instead of being killed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from bench import baselines, checkpoint, elastic, moe, scale, tensor_parallel
from bench import kernels as kernels_bench
from bench import pipeline as pipeline_bench
from raypar.driver.callbacks import Callback
from raypar.config import Config, load_config
from raypar.data import write_synthetic_corpus
from raypar.model import Transformer, num_params
from raypar.driver import RunSummary, Trainer

ROOT = Path(__file__).resolve().parent.parent
GPU_CONFIG = str(ROOT / "configs" / "gpt-1b.yaml")
# Steps per run when --steps is not given: the first step is warm-up, the rest are averaged.
DEFAULT_STEPS = {"gpu": 6, "cpu": 4}
# Order of `all`: the suites with no GPU numbers yet first; pipeline last, because its 1F1B
# rows are already in BENCHMARKS.md and its fthenb rows on the 1B model once hung.
ORDER = ["kernels", "moe", "baselines", "checkpoint", "elastic", "pipeline"]
QUICK = ["kernels", "moe", "baselines", "checkpoint", "pipeline"]
# Share of the budget held back for each suite still to come: a suite may use whatever the
# earlier ones left, less these, so one slow or hung suite cannot starve the rest. The
# pipeline suite, last and already measured in part, gets only what is left.
RESERVE = {"kernels": 0.03, "moe": 0.12, "baselines": 0.15, "checkpoint": 0.15, "elastic": 0.18, "pipeline": 0.0, "scale": 0.0,
           "tp": 0.0}
# Seconds for the suites, inside one device call of ~9 (all) or ~3 (quick) minutes: the rest
# is Ray's start, the environment, and a run that overruns its suite's deadline (a started
# Trainer finishes its launch and at least 2 steps).
# scale (4-8 GPUs) alone: ~8.5 minutes in all; its rows hold back time for its last, longest run.
BUDGET_S = {"quick": 150.0, "other": 510.0, "scale": 420.0}
# Seconds a Trainer launch needs on GPU (workers, NCCL, model init) before a row is started.
LAUNCH_S = 30.0


class StopAtDeadline(Callback):
    """Ends a run early (no save) once its suite's time is up, after `min_steps` steps."""

    def __init__(self, deadline: float, min_steps: int = 2):
        self.deadline, self.min_steps = deadline, min_steps
        self.stopped_after: int | None = None

    def on_step_end(self, trainer: Trainer, record) -> None:
        done = record.step + 1 - trainer.start_step
        if time.monotonic() > self.deadline and done >= self.min_steps and self.stopped_after is None:
            self.stopped_after = record.step
            trainer.request_stop(save=False)


@dataclass
class Context:
    """What a suite needs from the harness: configs, runs, time left, where to write."""

    work: Path
    cpu: bool
    steps: int | None
    quick: bool
    repeats: int = 1  # launches of each row of the baselines suite (median and spread when > 1)
    profile: bool = False  # baselines, tp: one profiled step of each kind of row (kernel time by kind)
    suite: str = ""
    rows: str | None = None  # --rows: a regular expression; rows whose label it does not find are skipped
    deadline: float = math.inf  # time.monotonic() by which this suite should be done
    _runs: dict[str, tuple[str, RunSummary]] = field(default_factory=dict)  # finished plain runs, by config

    # -- configs ---------------------------------------------------------------------------

    def default_steps(self, gpu: int | None = None) -> int:
        """--steps, else the suite's GPU default (`gpu`) or the harness's."""
        if self.steps:
            return self.steps
        return DEFAULT_STEPS["cpu"] if self.cpu else gpu or DEFAULT_STEPS["gpu"]

    def base_overrides(self) -> list[str]:
        """The sizes: bench/pipeline.py's tiny CPU model, or the config file's GPU sizes."""
        if self.cpu:
            # On CPU the harness is checked, not timed: rows take the workers the row before
            # kept rather than each starting its own processes (~3 s of CPU a worker).
            return [*pipeline_bench.TINY, "runtime.keep_workers=true"]
        # A hung collective or step fails the row instead of the whole call.
        hang = int(min(300, max(90, self.time_left())))
        return [f"runtime.step_timeout_s={hang}", f"runtime.collective_timeout_s={hang}", f"checkpoint.timeout_s={hang}"]

    def config(self, overrides: list[str], name: str, steps: int | None = None, path: str = GPU_CONFIG) -> Config:
        """`path` with the size overrides, then the suite's, then steps and the run dir."""
        return load_config(path, [*self.base_overrides(), *overrides, f"train.steps={steps or self.default_steps()}",
                                  f"runtime.run_dir={self.work / self.suite / _slug(name)}"])

    def corpus(self, cfg: Config) -> str:
        """The synthetic corpus a Trainer would generate for `cfg`, written once and shared."""
        d = cfg.data
        path = self.work / "data" / f"synthetic-v{cfg.model.vocab_size}-t{d.seq_len}-n{d.synthetic_samples}-s{cfg.train.seed}.parquet"
        if not path.exists():
            write_synthetic_corpus(path, d.synthetic_samples, d.seq_len, cfg.model.vocab_size, seed=cfg.train.seed)
        return str(path)

    # -- runs ------------------------------------------------------------------------------

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, label: str) -> Callable[[str], None]:
        return lambda s: print(f"  [{self.suite}: {label}] {s}", flush=True)

    def trainer(self, cfg: Config, label: str, callbacks: list[Callback] = ()) -> Trainer:
        """A Trainer that logs with the row's label and stops when the suite's time is up."""
        stop = StopAtDeadline(self.deadline)
        trainer = Trainer(cfg, callbacks=[*callbacks, stop], log=self.log(label))
        trainer.bench_stop = stop  # read by row(): a run cut short says so
        return trainer

    def fit(self, cfg: Config, label: str, fresh: bool = False) -> tuple[RunSummary, str | None]:
        """A plain run; an identical one already done by another suite is reused (unless `fresh`).

        Returns the summary and, when reused, the suite that ran it.
        """
        key = _run_key(cfg)
        if key in self._runs and not fresh:
            return self._runs[key][1], self._runs[key][0]
        trainer = self.trainer(cfg, label)
        summary = trainer.fit()
        if trainer.bench_stop.stopped_after is None:
            self._runs[key] = (self.suite, summary)
        summary.bench_stopped_after = trainer.bench_stop.stopped_after
        return summary, None

    def row(self, label: str, cfg: Config, summary: RunSummary, reused_from: str | None = None, **extra: Any) -> dict:
        """A result row: the run's summary, its config and model size."""
        row = {"label": label, **summary.to_dict(), "global_batch_size": cfg.train.global_batch_size,
               "seq_len": cfg.data.seq_len, "params": model_params(cfg), **extra, "config": cfg.to_dict()}
        if reused_from:
            row["reused_from"] = reused_from
        stopped = getattr(summary, "bench_stopped_after", None)
        if stopped is not None:
            row["stopped_early"] = f"time budget: stopped after step {stopped}"
        return row

    def attempt(self, label: str, fn: Callable[[], dict | list[dict]], min_time_s: float = LAUNCH_S) -> list[dict]:
        """Run one row (or a few); a failure becomes an error row, too little time left or a
        label --rows does not select a skipped one."""
        if self.rows is not None and not re.search(self.rows, label):
            return [{"label": label, "skipped": f"not selected by --rows {self.rows!r}"}]
        if self.time_left() < min_time_s:
            return [{"label": label, "skipped": f"time budget: {max(0.0, self.time_left()):.0f}s left in this suite"}]
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - a failed row is recorded, the others still run
            self.log(label)(f"FAILED: {e!r}"[:2000])
            out = {"label": label, "error": f"{type(e).__name__}: {e}"[:800],
                   "traceback": traceback.format_exc()[-3000:]}
        rows = out if isinstance(out, list) else [out]
        for r in rows:
            r.setdefault("wall_s", time.monotonic() - t0)  # what the row cost, for sizing the budget
        return rows


def model_params(cfg: Config) -> int:
    with torch.device("meta"):
        return num_params(Transformer(cfg.model))


def _run_key(cfg: Config) -> str:
    d = cfg.to_dict()
    for key in ("run_dir", "step_timeout_s", "collective_timeout_s"):  # where and how long, not what
        d["runtime"].pop(key)
    d["checkpoint"].pop("timeout_s")
    return json.dumps(d, sort_keys=True)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip("-")[:80]


# -- the pipeline suite: bench/pipeline.py's rows, run here ------------------------------------


class PipelineSuite:
    """bench/pipeline.py's configurations (schedule, release, recompute) on the same model."""

    TITLE = "pipeline runtime: throughput, bubble, control overhead, peak memory (pp=2)"
    NOTES = "Rows as in `python -m bench.pipeline`; a row reused from another suite is the same config, run once."

    @staticmethod
    def run(ctx: Context) -> list[dict]:
        rows = []
        for label, overrides in pipeline_bench.ROWS[:1] if ctx.quick else pipeline_bench.ROWS:
            cfg = ctx.config(overrides, label)

            def one(label=label, cfg=cfg) -> dict:
                summary, reused = ctx.fit(cfg, label)
                return ctx.row(label, cfg, summary, reused)

            rows += ctx.attempt(label, one)
        return rows

    @staticmethod
    def table(rows: list[dict]) -> str:
        return pipeline_bench.table(rows)


SUITES: dict[str, Any] = {"pipeline": PipelineSuite, "moe": moe, "checkpoint": checkpoint, "elastic": elastic,
                          "baselines": baselines, "scale": scale, "tp": tensor_parallel,
                          "kernels": kernels_bench}
# Suites that run only when named: they need more GPUs than `all` is for.
EXTRA = ["scale", "tp"]


# -- environment, results ------------------------------------------------------------------


def environment(args: argparse.Namespace, names: list[str]) -> dict:
    import ray

    env = pipeline_bench.environment()
    env.update(argv=sys.argv, suites=names, cpu_mode=args.cpu, steps=args.steps, budget_s=args.budget_s,
               host_cpus=os.cpu_count(), platform=platform.platform(), ray=ray.__version__)
    if torch.cuda.is_available():
        env.update(cuda=torch.version.cuda, cards=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
        try:
            version = torch.cuda.nccl.version()
            env["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:  # noqa: BLE001 - informational only
            pass
        env["topology"] = _command(["nvidia-smi", "topo", "-m"])
    root = Path(__file__).resolve().parent.parent
    env["commit"] = _command(["git", "rev-parse", "HEAD"], cwd=root)
    if env["commit"] and _command(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root):
        env["commit"] += " with uncommitted changes"  # the numbers are not that commit's alone
    return env


def _command(argv: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def render(name: str, result: dict) -> str:
    """One suite as markdown: its table, then rows that did not run, then notes."""
    suite = SUITES[name]
    lines = [f"## {name}: {suite.TITLE}", ""]
    if result.get("error"):
        lines.append(f"**suite failed**: {result['error']}")
    done = [r for r in result.get("rows", []) if not ({"error", "skipped", "unavailable"} & r.keys())]
    if done:
        try:
            lines.append(suite.table(done))
        except Exception as e:  # noqa: BLE001 - a formatting bug must not lose the JSON
            lines.append(f"(table failed: {e!r}; see results.json)")
    for r in result.get("rows", []):
        for key in ("error", "unavailable", "skipped"):
            if key in r:
                lines.append(f"- {r['label']}: {key}: {r[key]}")
    for r in done:
        if "stopped_early" in r:
            lines.append(f"- {r['label']}: {r['stopped_early']}")
    lines += ["", f"_{suite.NOTES}_", f"_suite wall time {result.get('wall_s', 0):.0f}s_"]
    return "\n".join(lines)


def write_results(out: Path, env: dict, results: dict[str, dict]) -> str:
    (out / "results.json").write_text(json.dumps({"environment": env, "suites": results}, indent=1, default=str))
    where = (f"{env.get('gpus')} x {env.get('card')}, driver {env.get('driver', '?')}" if env.get("gpus")
             else f"CPU only ({env.get('host_cpus')} cores)")
    head = (f"# raypar benchmarks: {env.get('date')}, {where}, torch {env.get('torch')}, Ray {env.get('ray')}, "
            f"Python {env.get('python')}")
    md = "\n\n".join([head, *(render(n, r) for n, r in results.items())]) + "\n"
    (out / "results.md").write_text(md)
    return md


# -- main --------------------------------------------------------------------------------


def suite_names(spec: str) -> list[str]:
    if spec == "all":
        return list(ORDER)
    if spec == "quick":
        return list(QUICK)
    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        raise SystemExit(f"unknown suite {unknown[0]!r}; choose all, quick or some of {', '.join(ORDER + EXTRA)}")
    return names


def start_ray(cpu: bool) -> None:
    import ray

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    # Actors defined in bench/ (moe's p2p pair) are imported by name in the workers.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)
    if not cpu:
        from raypar.actors.placement import gpu_env

        # NVLink multicast off for everything this process starts (Ray workers, spawned stages);
        # a variable this process was started with keeps its value. Eager CUDA module loading
        # stays with the processes that need it: the driver's own CUDA start would only get slower.
        os.environ.update({k: v for k, v in gpu_env().items() if k != "CUDA_MODULE_LOADING"})
    # On CPU: 8 logical CPUs, so fractional workers of every suite's grid fit on 2 cores.
    ray.init(address="local", num_cpus=8 if cpu else None, include_dashboard=False, log_to_driver=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="all", help="all, quick, or a comma-separated list of " + ", ".join(ORDER + EXTRA))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cpu", action="store_true", help="tiny models on CPU")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 6 GPU, 4 CPU)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="seconds for all suites (GPU default: 150 for quick, 420 for scale, else 510; none on CPU)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder for runs and checkpoints (default: a temp dir)")
    ap.add_argument("--keep-work", action="store_true", help="keep the scratch folder, every suite's runs included")
    ap.add_argument("--rows", default=None, metavar="REGEX",
                    help="run only the rows whose label this regular expression finds (re.search); "
                         "the others are listed as skipped")
    ap.add_argument("--repeats", type=int, default=1,
                    help="launch each baselines row this many times, interleaved; rows report the median, the spread "
                         "and raypar / torch launch by launch")
    ap.add_argument("--profile", action="store_true",
                    help="baselines: one more launch of raypar and torch with one step under torch.profiler; "
                         "tp: one more launch each of tp=1 and tp=2, profiled the same way; rows give each stage's "
                         "(or tp rank's) kernel time by kind and the device's busy time")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: give 1 or more launches per row")
    names = suite_names(args.suite)
    if args.budget_s is None and not args.cpu:
        args.budget_s = BUDGET_S.get(args.suite, BUDGET_S["other"])
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="raypar-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    end = start + args.budget_s if args.budget_s else math.inf

    start_ray(args.cpu)
    env = environment(args, names)
    print(f"environment: {json.dumps({k: v for k, v in env.items() if k != 'topology'})}", flush=True)
    ctx = Context(work=work.resolve(), cpu=args.cpu, steps=args.steps, quick=args.suite == "quick",
                  repeats=args.repeats, profile=args.profile, rows=args.rows)
    results: dict[str, dict] = {}
    try:
        for i, name in enumerate(names):
            ctx.suite = name
            ctx.deadline = end - args.budget_s * sum(RESERVE[n] for n in names[i + 1:]) if args.budget_s else math.inf
            print(f"== suite {name} ({ctx.time_left():.0f}s)" if math.isfinite(end) else f"== suite {name}", flush=True)
            t0 = time.monotonic()
            try:
                results[name] = {"rows": SUITES[name].run(ctx)}
            except Exception as e:  # noqa: BLE001 - a failed suite is recorded, the others still run
                print(f"== suite {name} FAILED: {e!r}", flush=True)
                results[name] = {"rows": [], "error": f"{type(e).__name__}: {e}"[:800],
                                 "traceback": traceback.format_exc()[-3000:]}
            results[name]["wall_s"] = time.monotonic() - t0
            write_results(args.out, env, results)
            if not args.keep_work:
                shutil.rmtree(work / name, ignore_errors=True)  # checkpoints of big models fill disks
    finally:
        import ray

        ray.shutdown()
        if not args.keep_work and args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    env["wall_s"] = time.monotonic() - start
    md = write_results(args.out, env, results)
    print("\n" + md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
