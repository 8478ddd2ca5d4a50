"""What one GPU can show of issues 24 and 26, in alternating launches (each its own process):

- MoE against dense on one device: `configs/moe-scale.yaml` at pp=1, ep=1 with the custom
  kernels on and off, against `configs/gpt-1b.yaml` at pp=1, the same batch (16 x 1024
  tokens); MFU by active parameters. No all-to-all (ep=1): its exposed share needs 2 GPUs.
- States copied to host memory after every step (`elastic.memory_every=1`), into shared
  memory registered with CUDA (the default) or the worker's own pinned memory, against none:
  `gpt-1b.yaml` cut to 4 layers (its 6 copies of a whole 0.84B state do not fit a 128 GiB
  host beside Ray), one worker, so no replica travels to a peer.

    python -m bench.one_gpu --out DIR [--rounds 2] [--kinds dense,moe-kernels-on,...] [--cpu]

Writes DIR/one_gpu.json and DIR/one_gpu.md.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from bench.launches import alternate

ROOT = Path(__file__).resolve().parent.parent
ON_ONE = ["parallel.pp=1", "parallel.ep=1", "train.global_batch_size=16"]
MEMORY = ["model.n_layers=4", "parallel.pp=1", "elastic.enabled=true", "checkpoint.every=0"]
KINDS = {
    "dense": ("gpt-1b.yaml", ON_ONE),
    "moe-kernels-on": ("moe-scale.yaml", [*ON_ONE, "runtime.kernels=true"]),
    "moe-kernels-off": ("moe-scale.yaml", [*ON_ONE, "runtime.kernels=false"]),
    "memory-off": ("gpt-1b.yaml", [*MEMORY, "elastic.memory_every=0"]),
    "memory-shared": ("gpt-1b.yaml", [*MEMORY, "elastic.memory_every=1", "elastic.memory_shared=true"]),
    "memory-pinned": ("gpt-1b.yaml", [*MEMORY, "elastic.memory_every=1", "elastic.memory_shared=false"]),
}
# Ratios the table shows: (kind, against).
RATIOS = [("moe-kernels-on", "dense"), ("moe-kernels-on", "moe-kernels-off"), ("memory-shared", "memory-off"),
          ("memory-pinned", "memory-off")]
STEADY_FROM = 3  # steps before this one pay for warm-up


def launch(kind: str, steps: int, work: Path, cpu: bool) -> dict:
    from raypar import Trainer, load_config

    config, overrides = KINDS[kind]
    if cpu:  # the script's check: tiny models, same switches
        config = "tiny-moe.yaml" if kind.startswith("moe") else "tiny.yaml"
        overrides = [o for o in overrides if not o.startswith(("model.n_layers", "train.global_batch_size"))]
        overrides += ["runtime.device=cpu"]
    cfg = load_config(str(ROOT / "configs" / config),
                      [*overrides, f"train.steps={steps}", f"runtime.run_dir={work / kind}", "runtime.log_every=100"])
    s = Trainer(cfg, log=lambda m: None).fit()
    step_s = statistics.median(r.step_time_s for r in s.records[STEADY_FROM:])
    return {"kind": kind, "tokens_per_s": cfg.train.global_batch_size * cfg.data.seq_len / step_s,
            "step_ms": 1000 * step_s, "mfu": s.mfu, "steps_ms": [round(1000 * r.step_time_s) for r in s.records],
            "memory_copies": sum(1 for r in s.records if r.memory_copied), "overrides": overrides, "config": config}


def table(results: list[dict]) -> str:
    by_kind: dict[str, list[dict]] = {}
    for r in results:
        by_kind.setdefault(r["kind"], []).append(r)
    med = {k: statistics.median(x["tokens_per_s"] for x in rs) for k, rs in by_kind.items()}
    lines = ["| launch | tokens/s (each round) | median | MFU | memory copies |", "|---|---|---|---|---|"]
    for k, rs in by_kind.items():
        each = " / ".join(f"{x['tokens_per_s']:,.0f}" for x in rs)
        mfu = statistics.median(x["mfu"] for x in rs)
        lines.append(f"| {k} | {each} | {med[k]:,.0f} | {mfu:.3f} | {rs[0]['memory_copies']} |")
    lines += ["", "| ratio | tokens/s |", "|---|---|"]
    lines += [f"| {a} / {b} | {med[a] / med[b]:.3f} |" for a, b in RATIOS if a in med and b in med]
    return "\n".join(lines) + "\n"


def main() -> None:
    alternate("bench.one_gpu", __doc__, list(KINDS), list(KINDS), 12, "/tmp/one-gpu", launch,
              lambda r: f"{r['tokens_per_s']:,.0f} tokens/s, step {r['step_ms']:.0f} ms, MFU {r['mfu']:.3f}",
              table, "one_gpu")


if __name__ == "__main__":
    main()
