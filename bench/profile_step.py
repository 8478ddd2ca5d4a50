"""Where one training step's GPU time goes: torch.profiler over forward + backward of the
whole model on one GPU, ops ranked by CUDA time. This is how kernels are chosen: an op
that takes a visible share of the step and moves more bytes than it computes.

    python -m bench.profile_step --out DIR [--moe] [--dropout 0.1] [--kernels on|off]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from raypar import kernels
from raypar.config import load_config
from raypar.kernels import sample_seeds
from raypar.model import build_stage

ROOT = Path(__file__).resolve().parent.parent
MOE = ["model.n_experts=8", "model.moe_top_k=2", "model.moe_every=1"]
# One GPU's share of bench/moe.py's model: half its layers.
SIZE = ["model.vocab_size=32000", "model.dim=1536", "model.n_layers=4", "model.n_heads=12",
        "model.max_seq_len=1024", "model.dtype=bfloat16", "data.seq_len=1024"]


def profile(moe: bool, dropout: float, batch: int, steps: int) -> dict:
    cfg = load_config(str(ROOT / "configs" / "gpt-1b.yaml"),
                      [*SIZE, *(MOE if moe else []), f"model.dropout={dropout}"])
    model = build_stage(cfg.model, 0, 1, seed=0, device=torch.device("cuda"))
    model.train()
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, cfg.data.seq_len), device="cuda")
    seeds = sample_seeds(0, 0, list(range(batch)), "cuda") if dropout else None

    def step():
        model(tokens, tokens, seeds).backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:20]
    return {"moe": moe, "dropout": dropout, "batch": batch, "steps": steps, "cuda_ms_per_step": total / 1000 / steps,
            "top": [{"op": e.key[:90], "calls_per_step": e.count / steps, "ms_per_step": e.self_device_time_total / 1000 / steps,
                     "share": e.self_device_time_total / total} for e in top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--moe", action="store_true")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--kernels", choices=["on", "off"], default="on")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.profile_step needs a GPU")
    kernels.set_enabled(args.kernels == "on")
    result = profile(args.moe, args.dropout, args.batch, args.steps)
    result["kernels"] = args.kernels
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"profile-{'moe' if args.moe else 'dense'}-dropout{args.dropout}-kernels-{args.kernels}.json"
    (out / name).write_text(json.dumps(result, indent=1))
    print(f"{name}: {result['cuda_ms_per_step']:.1f} CUDA ms per step")
    for t in result["top"][:12]:
        print(f"  {t['share']:6.1%} {t['ms_per_step']:8.2f} ms {t['calls_per_step']:6.0f} calls  {t['op']}")


if __name__ == "__main__":
    main()
