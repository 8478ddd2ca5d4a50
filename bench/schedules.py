"""Pipeline schedules side by side against the bubble-free ideal (issue 27), in one call.

    python -m bench.schedules --out DIR [--rounds 2] [--steps 10] [--kinds pp1,1f1b,...]   # 2 GPUs
    python -m bench.schedules --out DIR --pp 4 --kinds pp1,1f1b,zb-h2-auto,...             # 4 GPUs
    python -m bench.schedules --out DIR --cpu --rounds 1 --kinds pp1,zb-v                  # tiny model, CPU

The 1B config (`configs/gpt-1b.yaml`, 8 micro-batches) on one GPU (`pp1`: the ideal for
--pp GPUs is that many times its tokens/s) and on pp=--pp (default 2) with each schedule,
with the even layer split or with `parallel.layers_per_stage=auto` (kinds ending in `-auto`:
layers balanced by modelled cost, the head's work counted on its stage). Every launch is its
own process (fresh Ray, fresh workers) and the order reverses between rounds. Per launch:
tokens/s (median steady step), measured bubble, peak device memory of the fullest stage.
The table gives each kind's median over rounds, its share of pp x pp1 and its peak memory
over 1F1B's. Writes DIR/schedules.json and .md. On CPU the tiny model has 2 layers per stage
(--pp x 2), so that the two-chunk schedules can cut it.
"""
from __future__ import annotations

import statistics
from pathlib import Path

from bench.launches import alternate

ROOT = Path(__file__).resolve().parent.parent
SCHEDULES = ("1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "zb-v-half")
KINDS: dict[str, list[str]] = {"pp1": ["parallel.pp=1", "parallel.schedule=1f1b"]}
for _s in SCHEDULES:
    KINDS[_s] = ["parallel.pp=2", f"parallel.schedule={_s}"]
    KINDS[f"{_s}-auto"] = [*KINDS[_s], "parallel.layers_per_stage=auto"]
# 1F1B's stages with their micro-batches issued op by op rather than replayed as CUDA graphs.
KINDS["1f1b-eager"] = [*KINDS["1f1b"], "runtime.cuda_graphs=false"]
KINDS["1f1b-auto-eager"] = [*KINDS["1f1b-auto"], "runtime.cuda_graphs=false"]
KINDS["interleaved-1f1b-auto-eager"] = [*KINDS["interleaved-1f1b-auto"], "runtime.cuda_graphs=false"]
# Interleaved 1F1B with more model chunks per stage: a smaller bubble, more sends.
for _v in (3, 4):
    KINDS[f"interleaved-1f1b-v{_v}-auto"] = [*KINDS["interleaved-1f1b-auto"], f"parallel.chunks={_v}"]
# The ideal (pp1), the plain schedules and those on cost-balanced stages.
DEFAULT_KINDS = ["pp1", "1f1b", "zb-h2", "interleaved-1f1b", "zb-v", "1f1b-auto", "zb-h2-auto",
                 "interleaved-1f1b-auto", "zb-v-auto"]
CPU_MODEL = ["model.vocab_size=256", "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.max_seq_len=64",
             "model.dtype=float32", "data.seq_len=32", "data.synthetic_samples=512", "runtime.device=cpu",
             "runtime.cpus_per_worker=0.25", "train.global_batch_size=16"]


def launch(kind: str, steps: int, work: Path, cpu: bool, pp: int = 2) -> dict:
    """One training run in this process, pipelined kinds over `pp` stages; returns its figures."""
    from raypar import Trainer, load_config
    from raypar.model.partition import stage_sizes
    from raypar.schedule import run_layout

    stages = [] if kind == "pp1" else [f"parallel.pp={pp}"]
    cfg = load_config(str(ROOT / "configs" / "gpt-1b.yaml"),
                      [*(CPU_MODEL + [f"model.n_layers={2 * pp}"] if cpu else []), "parallel.microbatches=8",
                       *KINDS[kind], *stages, f"train.steps={steps}", f"runtime.run_dir={work / kind}",
                       "runtime.log_every=100"])
    p = cfg.parallel
    n_virtual = run_layout(p.schedule, p.pp, p.chunks).n_virtual
    split = stage_sizes(cfg.model, n_virtual, p.layers_per_stage)
    s = Trainer(cfg, log=lambda m: None).fit()
    steady = s.records[2:] if len(s.records) > 3 else s.records[1:]
    step_s = statistics.median(r.step_time_s for r in steady)
    return {"kind": kind, "pp": p.pp, "tokens_per_s": cfg.train.global_batch_size * cfg.data.seq_len / step_s,
            "step_ms": step_s * 1000, "bubble": statistics.median(r.bubble_measured for r in steady),
            "peak_device_bytes": s.peak_device_bytes, "peak_activation_bytes": s.peak_activation_bytes,
            "layers_per_stage": split, "final_loss": s.final_loss, "cuda_graphs_share": s.cuda_graphs_share}


def main() -> None:
    alternate("bench.schedules", __doc__, list(KINDS), DEFAULT_KINDS, 10, "/tmp/schedules", launch,
              lambda r: f"{r['tokens_per_s']:,.0f} tokens/s, step {r['step_ms']:.1f} ms, bubble {r['bubble']:.3f}, "
                        f"graphed {r['cuda_graphs_share']:.2f}",
              table, "schedules",
              options={"--pp": {"type": int, "default": 2, "help": "pipeline stages of every kind but pp1 (GPUs)"}})


def table(results: list[dict]) -> str:
    """Per kind: median tokens/s over rounds, against pp x pp1 (the ideal) and 1F1B."""
    by_kind: dict[str, list[dict]] = {}
    for r in results:
        by_kind.setdefault(r["kind"], []).append(r)
    tps = {k: statistics.median(x["tokens_per_s"] for x in rs) for k, rs in by_kind.items()}
    # Results of launches before --pp existed ran pp=2.
    pp = max((r.get("pp", 2) for r in results if r["kind"] != "pp1"), default=2)
    # The fullest stage's device peak (its activations' on CPU, where no device is measured).
    key = "peak_device_bytes" if max(results[0]["peak_device_bytes"] or [0]) else "peak_activation_bytes"
    peak = {k: max(max(x[key]) for x in rs) for k, rs in by_kind.items()}
    lines = [f"| launch | layers per (virtual) stage | tokens/s (each round) | vs ideal ({pp} x pp1) | vs 1f1b "
             "| bubble measured | peak memory vs 1f1b |", "|---|---|---|---|---|---|---|"]
    for k, rs in by_kind.items():
        ideal = f"{tps[k] / (pp * tps['pp1']):.3f}" if "pp1" in tps and k != "pp1" else ""
        vs = f"{tps[k] / tps['1f1b']:.3f}" if "1f1b" in tps and k != "pp1" else ""
        mem = f"{peak[k] / peak['1f1b']:.2f}" if "1f1b" in peak and k != "pp1" else ""
        each = " / ".join(f"{x['tokens_per_s']:,.0f}" for x in rs)
        split = " ".join(f"{n:g}" for n in rs[0]["layers_per_stage"])  # per virtual stage, in model order
        lines.append(f"| {k} | {split} | {each} | {ideal} | {vs} | {statistics.median(x['bubble'] for x in rs):.3f} "
                     f"| {mem} |")
    best = max((k for k in tps if k != "pp1"), key=tps.get, default=None)
    if best is not None and "pp1" in tps:
        lines.append(f"\nFastest pipelined launch: {best}, {tps[best] / (pp * tps['pp1']):.3f} of the ideal")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
