"""Tensor-parallel suite: the 1B model with its layers split over tp GPUs, against the grids
without tp on as many GPUs, in one call.

Rows by GPUs: on 2, tp=2 (with and without sequence parallelism) against tp=1 on one GPU
(the split layers' efficiency); on 4 also
tp=2 x pp=2 against pp=4 and dp=2 x pp=2. Named only (`--suite tp`): it is not part of `all`.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bench.run import Context

TITLE = "tensor parallelism: tp=2 against tp=1, and tp=2 x pp=2 against pp=4 and dp=2 x pp=2"
NOTES = ("configs/gpt-1b.yaml (bf16, 8 micro-batches of 4 x 1024 tokens per replica), tokens/s of the steady steps. "
         "Efficiency: tokens/s per GPU at tp=2 (one stage over 2 GPUs) / tokens/s of the same model on one GPU "
         "(tp=1); every block then costs two all-reduces of its activations forward and two backward over the "
         "pair. The 4-GPU rows hold the same global batch: dp=2 runs 4 micro-batches per replica.")

# (label, GPUs, overrides): the reference of each family first.
ROWS = [
    ("tp=1, 1 GPU", 1, ["parallel.pp=1", "parallel.tp=1"]),
    ("tp=2, 2 GPUs", 2, ["parallel.pp=1", "parallel.tp=2"]),
    ("tp=2, sequence parallel, 2 GPUs", 2, ["parallel.pp=1", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    ("pp=4, 4 GPUs", 4, ["parallel.pp=4", "parallel.tp=1"]),
    ("tp=2 x pp=2, 4 GPUs", 4, ["parallel.pp=2", "parallel.tp=2"]),
    ("dp=2 x pp=2, 4 GPUs", 4, ["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=4"]),
]


def run(ctx: "Context") -> list[dict]:
    gpus = 2 if ctx.cpu else torch.cuda.device_count()  # --cpu: the 2-worker rows, on CPU workers
    rows: list[dict] = []
    for label, need, overrides in ROWS:
        if ctx.cpu and "sequence" in label:
            continue  # the same path as its GPU run, tested elsewhere (tests/test_tensor_parallel.py)
        if need > gpus:
            have = "a CPU run takes the rows of up to 2 workers" if ctx.cpu else f"this machine has {gpus}"
            rows.append({"label": label, "unavailable": f"needs {need} GPUs; {have}"})
            continue
        cfg = ctx.config(overrides, label, steps=ctx.default_steps(gpu=8))
        cfg.data.path = ctx.corpus(cfg)
        rows += ctx.attempt(label, lambda cfg=cfg, label=label, need=need: ctx.row(
            label, cfg, ctx.trainer(cfg, label).fit(), gpus=need, tp=cfg.parallel.tp))
    one = next((r for r in rows if r["label"] == ROWS[0][0] and "tokens_per_s" in r), None)
    for r in rows:
        if one and r.get("tp") == 2 and r.get("gpus") == 2 and "tokens_per_s" in r:
            r["tp_efficiency"] = (r["tokens_per_s"] / 2) / one["tokens_per_s"]
    four = next((r for r in rows if r["label"] == ROWS[2][0] and "tokens_per_s" in r), None)
    for r in rows:
        if four and r.get("gpus") == 4 and "tokens_per_s" in r:
            r["vs_pp4"] = r["tokens_per_s"] / four["tokens_per_s"]
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| run | GPUs | tokens/s | step ms | MFU | tp efficiency | vs pp=4 |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        eff = f"{r['tp_efficiency']:.2f}" if "tp_efficiency" in r else ""
        vs = f"{r['vs_pp4']:.2f}x" if "vs_pp4" in r else ""
        lines.append(f"| {r['label']} | {r['gpus']} | {r['tokens_per_s']:,.0f} | {r['step_time_s'] * 1000:.1f} | "
                     f"{r.get('mfu', 0.0):.3f} | {eff} | {vs} |")
    return "\n".join(lines)
