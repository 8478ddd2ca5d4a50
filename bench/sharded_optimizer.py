"""The sharded optimizer (ZeRO-1, issue 28) against the replicated one, in one call.

    python -m bench.sharded_optimizer --out DIR [--rounds 2] [--steps 12]   # 4 GPUs
    python -m bench.sharded_optimizer --out DIR --cpu                       # tiny model, CPU workers

The 1B config (`configs/gpt-1b.yaml`, pp=2) as dp=1 on 2 GPUs and as dp=2 x pp=2 on 4,
with the optimizer replicated, sharded, and sharded without starting reduce-scatters inside
backward; the batch per replica is the same in every launch. Every launch is its own
process (fresh Ray, fresh workers), and the order reverses between rounds. Per launch:
tokens/s (median steady step), optimizer state per worker, device time per step in the
gradient reduction and in the optimizer step (a sharded optimizer's all-gather runs beside
the next step's forwards), peak device memory. The table gives sharded / replicated throughput and state, dp=2 scaling
against 2 x dp=1, and the overlap share: the part of the sharded reduction's exposed time
that starting it inside backward hides. Writes DIR/sharded_optimizer.json and .md.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from bench.launches import alternate

ROOT = Path(__file__).resolve().parent.parent
KINDS = {
    "dp1": ["parallel.dp=1"],
    "dp2": ["parallel.dp=2"],
    "dp2-sharded": ["parallel.dp=2", "parallel.shard_optimizer=true"],
    "dp2-sharded-no-overlap": ["parallel.dp=2", "parallel.shard_optimizer=true", "parallel.overlap_grad_reduce=false"],
}
CPU_MODEL = ["model.vocab_size=256", "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.max_seq_len=64",
             "model.dtype=float32", "data.seq_len=32", "data.synthetic_samples=512", "runtime.device=cpu",
             "runtime.cpus_per_worker=0.25", "parallel.microbatches=4"]


def launch(kind: str, steps: int, work: Path, cpu: bool) -> dict:
    """One training run in this process; returns its figures."""
    from raypar import Trainer, load_config

    base = load_config(str(ROOT / "configs" / "gpt-1b.yaml"), CPU_MODEL if cpu else [])
    per_replica = base.train.global_batch_size
    dp = 2 if kind != "dp1" else 1
    cfg = load_config(str(ROOT / "configs" / "gpt-1b.yaml"),
                      [*(CPU_MODEL if cpu else []), *KINDS[kind], f"train.global_batch_size={per_replica * dp}",
                       f"train.steps={steps}", f"runtime.run_dir={work / kind}", "runtime.log_every=100"])
    s = Trainer(cfg, log=lambda m: None).fit()
    steady = s.records[2:] if len(s.records) > 3 else s.records[1:]
    step_s = statistics.median(r.step_time_s for r in steady)
    return {"kind": kind, "gpus": 2 * dp, "tokens_per_s": cfg.train.global_batch_size * cfg.data.seq_len / step_s,
            "step_ms": step_s * 1000, "steps_ms": [round(r.step_time_s * 1000) for r in s.records],
            "optimizer_bytes": s.optimizer_bytes, "peak_device_bytes": s.peak_device_bytes,
            "reduce_ms": statistics.median(r.reduce_s for r in steady) * 1000,
            "optimizer_ms": statistics.median(r.optimizer_s for r in steady) * 1000}


def main() -> None:
    alternate("bench.sharded_optimizer", __doc__, list(KINDS), list(KINDS), 12, "/tmp/sharded-optimizer", launch,
              lambda r: (f"{r['tokens_per_s']:,.0f} tokens/s, step {r['step_ms']:.0f} ms, optimizer "
                         f"{max(r['optimizer_bytes']) / 2**20:,.0f} MiB per worker, reduce {r['reduce_ms']:.1f} ms, "
                         f"optimizer step {r['optimizer_ms']:.1f} ms"),
              table, "sharded_optimizer")


def table(results: list[dict]) -> str:
    """Per kind: medians over rounds, and the ratios the issue asks for."""
    by_kind: dict[str, list[dict]] = {}
    for r in results:
        by_kind.setdefault(r["kind"], []).append(r)
    med = {k: {key: statistics.median(x[key] for x in rs) for key in ("tokens_per_s", "reduce_ms", "optimizer_ms")}
           for k, rs in by_kind.items()}
    state = {k: max(rs[0]["optimizer_bytes"]) for k, rs in by_kind.items()}
    peak = {k: max(max(x["peak_device_bytes"]) for x in rs) for k, rs in by_kind.items()}
    lines = ["| launch | GPUs | tokens/s (each round) | tokens/s vs dp2 | dp scaling vs 2 x dp1 | optimizer MiB/worker "
             "| state vs dp2 | reduce ms | optimizer step ms | peak device GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for k, rs in by_kind.items():
        tps = med[k]["tokens_per_s"]
        vs = f"{tps / med['dp2']['tokens_per_s']:.3f}" if "dp2" in med and k != "dp1" else ""
        scale = f"{tps / (2 * med['dp1']['tokens_per_s']):.3f}" if "dp1" in med and k != "dp1" else ""
        sv = f"{state[k] / state['dp2']:.3f}" if "dp2" in state and k != "dp1" else ""
        each = " / ".join(f"{x['tokens_per_s']:,.0f}" for x in rs)
        lines.append(f"| {k} | {rs[0]['gpus']} | {each} | {vs} | {scale} | {state[k] / 2**20:,.0f} | {sv} "
                     f"| {med[k]['reduce_ms']:.1f} | {med[k]['optimizer_ms']:.1f} | {peak[k] / 2**30:.2f} |")
    if "dp2-sharded" in med and "dp2-sharded-no-overlap" in med and med["dp2-sharded-no-overlap"]["reduce_ms"] > 0:
        share = 1 - med["dp2-sharded"]["reduce_ms"] / med["dp2-sharded-no-overlap"]["reduce_ms"]
        lines.append(f"\nOverlap share (reduce-scatter time hidden inside backward): {share:.1%}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
