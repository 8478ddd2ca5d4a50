"""A fresh stage worker's start, as a recovery without a standby pays it: this checkout
against another (`--baseline TREE`), in alternating launches of one call.

    python -m bench.worker_start --out DIR --baseline OLD_TREE [--rounds 3]   # 1 GPU, the 1B config
    python -m bench.worker_start --out DIR --cpu [--baseline OLD_TREE]        # tiny model, a CPU worker

Each launch is its own process with a fresh local Ray. It places one stage worker of the
whole model (pp=1) and times: start, from asking for the worker to its set-up done (process,
imports, device context, the stage and optimizer built; the set-up's own phases as the
worker measured them); first step, from there to the first step's reports (its first
forward, backward and optimizer step included); and which of torch's compiler modules
(dynamo, sympy: over a second of imports) the worker loaded by then. Writes
DIR/worker_start.json and .md.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY_MODULES = ("torch._dynamo", "torch._inductor", "sympy")
CPU_MODEL = ["model.vocab_size=256", "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.max_seq_len=64",
             "model.dtype=float32", "data.seq_len=32", "runtime.device=cpu", "runtime.cpus_per_worker=0.5"]
PREFIX = "LAUNCH "


def launch(work: Path, cpu: bool) -> dict:
    """One worker started and stepped in this process's own Ray; its figures."""
    import ray

    from raypar.actors.worker_group import WorkerGroup
    from raypar.config import load_config
    from raypar.data import write_synthetic_corpus
    from raypar.resources import WorkerResources
    from raypar.schedule import build_programs
    from raypar.topology import Grid

    cfg = load_config(str(ROOT / "configs" / "gpt-1b.yaml"),
                      [*(CPU_MODEL if cpu else []), "parallel.pp=1", "parallel.dp=1", "parallel.ep=1",
                       "parallel.microbatches=2", "train.global_batch_size=4", f"runtime.run_dir={work}"])
    data = write_synthetic_corpus(work / "data.parquet", 16, cfg.data.seq_len, cfg.model.vocab_size, seed=0)
    device = "cpu" if cpu else "cuda"
    ray.init(address="local", num_cpus=2 if cpu else None, include_dashboard=False, log_to_driver=False)
    try:
        t0 = time.perf_counter()
        group = WorkerGroup(cfg, Grid(1, 1, 1), WorkerResources(device, cfg.runtime.cpus_per_worker, 0 if cpu else 1),
                            str(data))
        t1 = time.perf_counter()
        group.set_programs(build_programs("1f1b", 1, cfg.parallel.microbatches))
        group.wait_reports(0, group.issue_step(0, [list(range(cfg.train.global_batch_size))]))
        t2 = time.perf_counter()
        loaded = ray.get(group.workers[0].__ray_call__.remote(
            lambda self: [m for m in HEAVY_MODULES if m in sys.modules]))
        return {"start_s": t1 - t0, "first_step_s": t2 - t1, "setup_s": group.info[0]["setup_s"],
                "heavy_modules": loaded}
    finally:
        ray.shutdown()


def table(rows: list[dict], cpu: bool) -> str:
    lines = [f"# A fresh stage worker's start ({'CPU, tiny model' if cpu else '1 GPU, configs/gpt-1b.yaml, pp=1'})", "",
             "Median over launches (each launch: its own process and Ray; trees alternate, the order reversing "
             "each round). start: asking for the worker to its set-up done; first step: from there to the first "
             "step's reports; build: the stage and optimizer built inside the set-up.", "",
             "| tree | launches | start s | first step s | start + first step s | build s | compiler modules loaded |",
             "|---|---|---|---|---|---|---|"]
    for tree in dict.fromkeys(r["tree"] for r in rows):
        mine = [r for r in rows if r["tree"] == tree]
        med = lambda key: statistics.median(r[key] for r in mine)  # noqa: E731
        build = statistics.median(r["setup_s"].get("build", 0.0) for r in mine)
        modules = ", ".join(sorted({m for r in mine for m in r["heavy_modules"]})) or "none"
        lines.append(f"| {tree} | {len(mine)} | {med('start_s'):.2f} | {med('first_step_s'):.2f} | "
                     f"{med('start_s') + med('first_step_s'):.2f} | {build:.2f} | {modules} |")
    trees = list(dict.fromkeys(r["tree"] for r in rows))
    if len(trees) == 2:
        total = {t: statistics.median(r["start_s"] + r["first_step_s"] for r in rows if r["tree"] == t) for t in trees}
        lines += ["", f"start + first step, {trees[0]} / {trees[1]}: {total[trees[0]] / total[trees[1]]:.3f}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to compare with (its raypar)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cpu", action="store_true", help="a tiny model on a CPU worker (checks the harness)")
    ap.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.launch:
        print(PREFIX + json.dumps(launch(args.out, args.cpu)), flush=True)
        return
    from bench.launches import run_launch

    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"this checkout": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    rows = []
    for rnd in range(args.rounds):
        order = list(trees.items()) if rnd % 2 == 0 else list(trees.items())[::-1]
        for label, tree in order:
            work = args.out / "work" / f"{label.replace(' ', '-')}-{rnd}"
            # This script runs in every tree; `raypar` is imported from the tree's own checkout.
            argv = [str(Path(__file__).resolve()), "--launch", "--out", str(work), *(["--cpu"] if args.cpu else [])]
            rows.append({"tree": label, "round": rnd, **run_launch(argv, tree, f"{label}, round {rnd}")})
            print(f"{label}, round {rnd}: start {rows[-1]['start_s']:.2f} s, first step "
                  f"{rows[-1]['first_step_s']:.2f} s, loaded {rows[-1]['heavy_modules']}", flush=True)
    (args.out / "worker_start.json").write_text(json.dumps(rows, indent=2))
    (args.out / "worker_start.md").write_text(table(rows, args.cpu))
    print(table(rows, args.cpu))


if __name__ == "__main__":
    main()
