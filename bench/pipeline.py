"""Pipeline runtime benchmark: throughput, bubble, Ray control overhead, peak memory.

Runs several configurations side by side in one Ray session (same machine, same call)
and writes results.json and results.md under --out; prints the table last.

    python -m bench.pipeline --out DIR                  # GPU machine: configs/gpt-1b.yaml
    python -m bench.pipeline --out DIR --quick --cpu    # a tiny CPU smoke run
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from raypar.config import load_config
from raypar.model import Transformer, num_params
from raypar.driver.trainer import Trainer

ROWS = [
    # (label, overrides)
    ("1f1b, release", ["parallel.schedule=1f1b", "runtime.release=true"]),
    ("fthenb, release", ["parallel.schedule=fthenb", "runtime.release=true"]),
    ("fthenb, no release", ["parallel.schedule=fthenb", "runtime.release=false"]),
    ("fthenb, recompute=block, release", ["parallel.schedule=fthenb", "runtime.release=true", "runtime.recompute=block"]),
    ("fthenb, recompute=block, no release", ["parallel.schedule=fthenb", "runtime.release=false", "runtime.recompute=block"]),
    ("1f1b, 32 micro-batches", ["parallel.schedule=1f1b", "parallel.microbatches=32", "train.global_batch_size=128"]),
]

TINY = ["model.vocab_size=256", "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.max_seq_len=64",
        "model.dtype=float32", "data.seq_len=32", "data.synthetic_samples=512", "runtime.device=cpu",
        "runtime.cpus_per_worker=0.5", "train.steps=4"]


def environment() -> dict:
    env = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(), "torch": torch.__version__}
    import ray

    env["ray"] = ray.__version__
    if torch.cuda.is_available():
        env["card"] = torch.cuda.get_device_name(0)
        env["gpus"] = torch.cuda.device_count()
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.split("\n")[0].strip()
        except (OSError, subprocess.TimeoutExpired):
            pass
    else:
        env["card"] = "cpu"
    return env


def run_row(config: str, base: list[str], label: str, overrides: list[str], out: Path) -> dict:
    cfg = load_config(config, [*base, *overrides, f"runtime.run_dir={out / 'runs' / label.replace(', ', '_').replace(' ', '-')}"])
    try:
        summary = Trainer(cfg, log=lambda s: print(f"  [{label}] {s}", flush=True)).fit()
    except Exception as e:  # noqa: BLE001 - a failed row is recorded, the others still run
        print(f"  [{label}] FAILED: {e!r}"[:2000], flush=True)
        return {"label": label, "overrides": overrides, "error": repr(e)[:500]}
    return {"label": label, "overrides": overrides, **summary.to_dict(),
            "global_batch_size": cfg.train.global_batch_size, "seq_len": cfg.data.seq_len}


def table(rows: list[dict]) -> str:
    gib = lambda b: f"{b / 2**30:.2f}"  # noqa: E731
    head = ("| run | tokens/s | step ms | bubble measured | bubble simulated | control overhead | "
            "peak act. GiB (per stage) | peak GPU mem GiB (per stage) |\n|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error'][:120]} | | | | | | |")
            continue
        lines.append(
            f"| {r['label']} ({r['microbatches']} mb) | {r['tokens_per_s']:,.0f} | {r['step_time_s'] * 1000:.1f} | "
            f"{r['bubble_measured']:.3f} | {r['bubble_simulated']:.3f} | {r['control_overhead'] * 100:.2f}% | "
            f"{' / '.join(gib(b) for b in r['peak_activation_bytes'])} | "
            f"{' / '.join(gib(b) for b in r['peak_device_bytes'])} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--config", default="configs/gpt-1b.yaml")
    ap.add_argument("--quick", action="store_true", help="only the first three rows")
    ap.add_argument("--cpu", action="store_true", help="tiny model on CPU (smoke test)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--only", default=None, help="run only rows whose label contains this text")
    ap.add_argument("overrides", nargs="*", help="config overrides for every row, e.g. runtime.step_timeout_s=90")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    base = (list(TINY) if args.cpu else []) + list(args.overrides)
    if args.steps:
        base.append(f"train.steps={args.steps}")
    cfg = load_config(args.config, base)
    env = environment()
    with torch.device("meta"):
        env["params"] = num_params(Transformer(cfg.model))
    env["config"] = args.config
    print(f"environment: {json.dumps(env)}", flush=True)
    chosen = [(label, o) for label, o in (ROWS[:3] if args.quick else ROWS) if not args.only or args.only in label]
    given = {o.split("=", 1)[0] for o in args.overrides}
    for label, overrides in chosen:
        clash = sorted(given & {o.split("=", 1)[0] for o in overrides})
        if clash:
            # The row's own setting would win and the run would silently measure something else.
            ap.error(f"row {label!r} sets {', '.join(clash)} itself ({', '.join(overrides)}); "
                     f"leave {'it' if len(clash) == 1 else 'them'} out of the overrides or pick other rows with --only")
    rows = []
    for label, overrides in chosen:
        rows.append(run_row(args.config, base, label, overrides, args.out))
        # After every row: a call cut short keeps the rows that finished.
        (args.out / "results.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
    md = table(rows)
    (args.out / "results.md").write_text(md + "\n")
    print("\n" + md, flush=True)


if __name__ == "__main__":
    main()
