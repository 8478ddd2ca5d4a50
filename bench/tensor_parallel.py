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

BIG = "tp=2, a 9.4B model too big for one GPU, 2 GPUs"
# (label, GPUs, overrides): the reference of each family first.
ROWS = [
    ("tp=1, 1 GPU", 1, ["parallel.pp=1", "parallel.tp=1"]),
    ("tp=2, 2 GPUs", 2, ["parallel.pp=1", "parallel.tp=2"]),
    # The same with each backward all-reduce waited for in line, its weight gradients after it.
    ("tp=2, backward exchanges in line, 2 GPUs", 2, ["parallel.pp=1", "parallel.tp=2", "runtime.tp_backward_overlap=false"]),
    # The same with micro-batches replayed one after another: what a forward beside the
    # previous micro-batch's backward gains (its all-reduces wait while the other computes).
    ("tp=2, micro-batches one after another, 2 GPUs", 2,
     ["parallel.pp=1", "parallel.tp=2", "runtime.tp_microbatch_overlap=false"]),
    # The same issued op by op: how much of tp's gain needs the host out of the way.
    ("tp=2, eager (runtime.cuda_graphs=false), 2 GPUs", 2, ["parallel.pp=1", "parallel.tp=2", "runtime.cuda_graphs=false"]),
    ("tp=2, sequence parallel, 2 GPUs", 2, ["parallel.pp=1", "parallel.tp=2", "parallel.sequence_parallel=true"]),
    # The same with the tp communicators on high-priority streams (runtime.collectives_high_priority).
    ("tp=2, high-priority collectives, 2 GPUs", 2,
     ["parallel.pp=1", "parallel.tp=2", "runtime.collectives_high_priority=true"]),
    # ~9.4B parameters: 20 bytes each of weights, gradients, fp32 masters, master gradients
    # and moments (~190 GB) do not fit one GPU; tp=2 holds half on each.
    (BIG, 2, ["parallel.pp=1", "parallel.tp=2", "model.dim=6144", "model.n_heads=48", "model.n_layers=20",
              "train.global_batch_size=8", "parallel.microbatches=8"]),
    ("pp=4, 4 GPUs", 4, ["parallel.pp=4", "parallel.tp=1"]),
    ("tp=2 x pp=2, 4 GPUs", 4, ["parallel.pp=2", "parallel.tp=2"]),
    ("dp=2 x pp=2, 4 GPUs", 4, ["parallel.pp=2", "parallel.dp=2", "parallel.microbatches=4"]),
]


def run(ctx: "Context") -> list[dict]:
    gpus = 2 if ctx.cpu else torch.cuda.device_count()  # --cpu: the 2-worker rows, on CPU workers
    rows: list[dict] = []
    for label, need, overrides in ROWS:
        if ctx.cpu and ("sequence" in label or "in line" in label or "eager" in label or "one after another" in label
                        or "high-priority" in label or label == BIG):
            continue  # the same path as its GPU run, tested elsewhere (tests/test_tensor_parallel.py)
        if need > gpus:
            have = "a CPU run takes the rows of up to 2 workers" if ctx.cpu else f"this machine has {gpus}"
            rows.append({"label": label, "unavailable": f"needs {need} GPUs; {have}"})
            continue
        cfg = ctx.config(overrides, label, steps=ctx.default_steps(gpu=4 if label == BIG else 8))
        cfg.data.path = ctx.corpus(cfg)
        rows += ctx.attempt(label, lambda cfg=cfg, label=label, need=need: ctx.row(
            label, cfg, ctx.trainer(cfg, label).fit(), gpus=need, tp=cfg.parallel.tp))
    for r in rows:
        if r["label"] == BIG and "tokens_per_s" in r and not ctx.cpu:
            # Both slices on one device would need about twice what each tp worker peaked at.
            r["device_bytes"] = torch.cuda.get_device_properties(0).total_memory
            r["fits_one_gpu"] = 2 * max(r["peak_device_bytes"]) <= r["device_bytes"]
    if ctx.profile and not ctx.cpu:
        rows += profile_rows(ctx, gpus)
    one = next((r for r in rows if r["label"] == ROWS[0][0] and "tokens_per_s" in r), None)
    for r in rows:
        if one and r.get("tp") == 2 and r.get("gpus") == 2 and "tokens_per_s" in r and r["label"] != BIG:
            r["tp_efficiency"] = (r["tokens_per_s"] / 2) / one["tokens_per_s"]
    four = next((r for r in rows if r["label"] == "pp=4, 4 GPUs" and "tokens_per_s" in r), None)
    for r in rows:
        if four and r.get("gpus") == 4 and "tokens_per_s" in r:
            r["vs_pp4"] = r["tokens_per_s"] / four["tokens_per_s"]
    return rows


PROFILED_STEP = 4
PROFILED = {"tp=1, 1 GPU", "tp=2, 2 GPUs", "tp=2, micro-batches one after another, 2 GPUs",
            "tp=2, sequence parallel, 2 GPUs"}


def profile_rows(ctx: "Context", gpus: int) -> list[dict]:
    """--profile: one more launch each of tp=1, tp=2 (micro-batches overlapped, and one after
    another) and tp=2 with sequence parallelism, with step PROFILED_STEP under torch.profiler:
    each tp rank's kernel time by kind and its exposed collectives, all-reduces or the
    sequence's gathers and reduce-scatters (`raypar.runtime.profile.device_time`), and the
    time two graph replays ran at once (`replay_overlap`: the micro-batch overlap at work)."""
    from pathlib import Path

    from raypar.runtime.profile import device_time, replay_overlap

    rows: list[dict] = []
    for label, need, overrides in (row for row in ROWS if row[0] in PROFILED):
        if need > gpus:
            continue
        name = f"{label}, step {PROFILED_STEP} profiled"
        cfg = ctx.config([*overrides, f"runtime.profile_step={PROFILED_STEP}"], name, steps=PROFILED_STEP + 1)
        cfg.data.path = ctx.corpus(cfg)

        def launch(cfg=cfg, name=name, need=need) -> dict:
            ctx.trainer(cfg, name).fit()
            traces = [Path(cfg.runtime.run_dir) / "profile" / f"rank{r}-step{PROFILED_STEP}.json" for r in range(need)]
            return {"label": name, "kind": "profile", "traces": [str(t) for t in traces],
                    "ranks": [{"rank": r, **device_time(t), "graphs": replay_overlap(t)} for r, t in enumerate(traces)]}

        rows += ctx.attempt(name, launch)
    return rows


def table(rows: list[dict]) -> str:
    profiles = [r for r in rows if r.get("kind") == "profile"]
    rows = [r for r in rows if r.get("kind") != "profile"]
    lines = ["| run | GPUs | tokens/s | step ms | MFU | tp efficiency | vs pp=4 | peak GiB per GPU |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eff = f"{r['tp_efficiency']:.2f}" if "tp_efficiency" in r else ""
        vs = f"{r['vs_pp4']:.2f}x" if "vs_pp4" in r else ""
        peak = f"{max(r['peak_device_bytes']) / 2**30:.1f}"
        if "fits_one_gpu" in r:
            peak += f" (x2 {'fits' if r['fits_one_gpu'] else 'exceeds'} the device's {r['device_bytes'] / 2**30:.0f})"
        lines.append(f"| {r['label']} | {r['gpus']} | {r['tokens_per_s']:,.0f} | {r['step_time_s'] * 1000:.1f} | "
                     f"{r.get('mfu', 0.0):.3f} | {eff} | {vs} | {peak} |")
    if profiles:
        kinds = list(profiles[0]["ranks"][0]["by_kind"])
        lines += ["", "| profiled step | rank | span ms | busy ms | " + " | ".join(f"{k} ms" for k in kinds)
                  + " | exposed collectives ms | two graph replays at once, ms |",
                  "|---|---|---|---|" + "---|" * (len(kinds) + 2)]
        for p in profiles:
            for r in p["ranks"]:
                by = " | ".join(f"{r['by_kind'][k]['ms']:.1f}" for k in kinds)
                lines.append(f"| {p['label']} | {r['rank']} | {r['span_ms']:.1f} | {r['busy_ms']:.1f} | {by} | "
                             f"{sum(r['exposed_ms'].values()):.1f} | {r.get('graphs', {}).get('concurrent_ms', 0.0):.1f} |")
    return "\n".join(lines)
