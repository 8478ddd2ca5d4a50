"""Runs one after another in one driver process, with the workers kept between them
(`runtime.keep_workers=true`) against started afresh for each (`false`), in alternating
launches (each launch its own process and Ray).

Each launch runs RUNS (3) runs of the same config in a row (`configs/gpt-1b.yaml` at pp=1 on
one GPU: the whole 0.84B on one worker; `--cpu`: the tiny config on CPU workers, pp=2), and
times each: `to first step`, from `Trainer(...)` to the end of its first step (planning,
placing and starting or taking the workers, building the stage, the first step), and the
whole `fit()`. The first run of a launch always starts its workers; the later ones are what
keeping them changes. Same data and seed in every run, so the losses must match.

    python -m bench.kept_workers --out DIR [--rounds 2] [--steps 3] [--cpu]

Writes DIR/kept_workers.json and DIR/kept_workers.md.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench.launches import alternate

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"started": "runtime.keep_workers=false", "kept": "runtime.keep_workers=true"}
RUNS = 3


def launch(kind: str, steps: int, work: Path, cpu: bool) -> dict:
    from raypar import Callback, Trainer, load_config

    class FirstStep(Callback):
        """When the first step ended, and the workers' process ids."""

        def on_train_start(self, trainer) -> None:
            self.pids = [info["pid"] for info in trainer.group.info]

        def on_step_end(self, trainer, record) -> None:
            if not hasattr(self, "at"):
                self.at = time.perf_counter()

    config = "tiny.yaml" if cpu else "gpt-1b.yaml"
    overrides = ["runtime.device=cpu", "parallel.pp=2"] if cpu else ["parallel.pp=1", "train.global_batch_size=16"]
    runs = []
    for run in range(RUNS):
        cfg = load_config(str(ROOT / "configs" / config),
                          [*overrides, KINDS[kind], f"train.steps={steps}", f"runtime.run_dir={work / kind / str(run)}",
                           "runtime.log_every=100", "checkpoint.every=0"])
        first = FirstStep()
        t0 = time.perf_counter()
        summary = Trainer(cfg, callbacks=[first], log=lambda m: None).fit()
        t1 = time.perf_counter()
        runs.append({"to_first_step_s": first.at - t0, "fit_s": t1 - t0, "pids": first.pids,
                     "losses": [r.loss for r in summary.records]})
    return {"kind": kind, "runs": runs, "config": config, "overrides": overrides}


def describe(res: dict) -> str:
    return ", ".join(f"run {i}: first step after {r['to_first_step_s']:.2f} s, fit {r['fit_s']:.2f} s"
                     for i, r in enumerate(res["runs"]))


def table(results: list[dict]) -> str:
    lines = ["| round | workers | run | to first step (s) | fit (s) | worker processes |", "|---|---|---|---|---|---|"]
    for res in results:
        for i, r in enumerate(res["runs"]):
            same = "" if i == 0 else (" (the run before's)" if r["pids"] == res["runs"][i - 1]["pids"] else " (new)")
            lines.append(f"| {res['round']} | {res['kind']} | {i} | {r['to_first_step_s']:.2f} | {r['fit_s']:.2f} | "
                         f"{', '.join(map(str, r['pids']))}{same} |")
    later = {kind: [r["to_first_step_s"] for res in results if res["kind"] == kind for r in res["runs"][1:]]
             for kind in KINDS}
    if all(later.values()):
        kept, started = statistics.median(later["kept"]), statistics.median(later["started"])
        lines += ["", f"Runs after a launch's first, median to first step: kept {kept:.2f} s, started {started:.2f} s: "
                      f"**{kept / started:.3f}** of the time."]
    # bf16 on a GPU: runs started afresh differ in the last digits too (atomic adds in backward).
    lines += ["", f"Largest spread of a step's loss over all runs: {_spread(results):.1e} of it "
                  f"(started: {_spread(results, 'started'):.1e}, kept: {_spread(results, 'kept'):.1e})."]
    return "\n".join(lines) + "\n"


def _spread(results: list[dict], kind: str | None = None) -> float:
    """The largest spread of one step's loss over the runs (of `kind`, else all), relative to it."""
    runs = [r["losses"] for res in results if kind in (None, res["kind"]) for r in res["runs"]]
    return max((max(step) - min(step)) / abs(min(step)) for step in zip(*runs)) if runs else float("nan")


def main() -> None:
    alternate("bench.kept_workers", __doc__, list(KINDS), list(KINDS), 3, "/tmp/kept-workers", launch, describe,
              table, "kept_workers")


if __name__ == "__main__":
    main()
