"""Pipeline baselines on the same model, micro-batches and data as raypar's pp=2 rows.

First, what one micro-batch costs each stage alone on one device (GPU and host time);
then:

(a) the whole model on one device with gradient accumulation over the same micro-batches
    (one process, no Ray): a 2-stage pipeline's ideal is 2 x that x (1 - bubble);
(b) torch.distributed.pipelining (PipelineStage + ScheduleGPipe / Schedule1F1B) in 2 spawned
    processes (gloo on CPU, NCCL on GPU) running raypar's own stage modules, and (first launch,
    not --quick) torch's multi-chunk schedules on the model in 4 stages, 2 per process
    (MULTI_CHUNK), paired with raypar's interleaved and V schedules (CHUNKED).

Every run does what raypar's step does: forward and backward of every micro-batch, the
global gradient norm over both stages, clipping and the AdamW step on fp32 masters.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from queue import Empty
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from raypar.config import Config

    from bench.run import Context

TITLE = "one device with gradient accumulation, torch.distributed.pipelining and raypar on pp=2"
NOTES = ("same data, initialisation and optimizer in every row (equal final losses say so); "
         "tokens/s over the steps after the first, each timed from the end of the step before (its batch's "
         "loading included), the slower stage's for torch; ideal 2-stage = 2 x single device x (1 - (p-1)/(m+p-1)); "
         "on CPU every process or worker gets one thread, so one 'device' is one core. "
         "raypar / torch: raypar's tokens/s over torch.distributed.pipelining's for the same schedule. "
         "Stage costs: one micro-batch through each stage alone, the GPU's time (host let ahead) and the host's "
         "time to issue it; when they are close, steps go at the host's speed. Breakdown: raypar's from each run's "
         "events.jsonl (window: first unit to last backward); torch's from events around its schedule's step "
         "(window: the whole call, its last sends' waits included), around each forward (the last stage's loss "
         "in it, as in raypar) and backward of its stage, the norm's all-reduce and the optimizer; "
         "compute vs alone = forward + backward per step / (micro-batches x the stage's cost alone); host ahead at the "
         "first unit: from when raypar's host began issuing a step's first unit to when the device began it "
         "(the first stage issues it during the step before unless runtime.forward_ahead=false). "
         "Step ms on the device: the slower stage's mean time from a step's first unit to the next step's, on its "
         "device (a long run's pace; over a dozen steps the host clock also moves with the host's lead); "
         "raypar / torch on the device: torch's over raypar's. With --repeats: the kept launches' ratio, then "
         "raypar's over torch's launch by launch (each round runs both back to back) and the median of those. "
         "Multi-chunk rows (torch's and raypar's interleaved-1f1b, zb-v, zb-v-half): the model in 4 stages, 2 per "
         "process (loop or V placement). Peak memory vs raypar 1f1b: the fullest stage's device peak (on CPU its "
         "activations') over 1F1B's. "
         "raypar auto: parallel.schedule=auto (its first two steps time zb-h1, the finalists run two steps each, on "
         "their own cut of the model, the workers moved there); its tokens/s over the whole run (the first "
         "step left out, as every row's), and its steps after the choice's first against the fastest schedule "
         "measured here on the same kind of cut (raypar auto, layers_per_stage=auto: every candidate on stages "
         "balanced by cost, against the balanced rows).")

# (raypar parallel.schedule, the torch.distributed.pipelining schedule that does the same)
SCHEDULES = [("1f1b", "Schedule1F1B"), ("fthenb", "ScheduleGPipe")]
# raypar's zero-bubble schedules, against its 1F1B and two devices' worth of the single one.
ZERO_BUBBLE = ["zb-h1", "zb-h2"]
# raypar's schedules of two model chunks per stage, measured as the zero-bubble ones and
# paired with torch's that place chunks alike (TORCH_COUNTERPART).
CHUNKED = ["interleaved-1f1b", "zb-v", "zb-v-half"]
# Stages balanced by modelled cost (the head's work spread over fewer layers on its stage).
BALANCED = ["zb-h2", "interleaved-1f1b", "zb-v"]
# torch's schedules with two model chunks per process (the model in 4 stages over the 2
# processes), by how the chunks are placed: "loop" (stages r and r + 2 on rank r) or "v"
# (stages r and 3 - r, so rank 0 holds the first and the last), as raypar's layouts.
MULTI_CHUNK = {"ScheduleInterleaved1F1B": "loop", "ScheduleInterleavedZeroBubble": "loop",
               "ScheduleZBVZeroBubble": "v", "ScheduleDualPipeV": "v"}


def run(ctx: "Context") -> list[dict]:
    rows: list[dict] = []
    schedules = SCHEDULES[:1] if ctx.quick else SCHEDULES
    # Same overrides as bench/pipeline.py's first rows, so the pipeline suite reuses these runs.
    cfgs = {s: ctx.config([f"parallel.schedule={s}", "runtime.release=true"], f"raypar {s}") for s, _ in schedules}
    cfg = cfgs[schedules[0][0]]
    data_path = ctx.corpus(cfg)  # what the Trainer generates for itself, byte for byte
    names = [n for _, n in schedules]
    rows += ctx.attempt("stage costs", lambda: stage_cost_row(cfg, ctx.cpu), min_time_s=15)
    # With --repeats the launches interleave (raypar, torch, raypar, ...), so a drift of the
    # machine during the suite hits both sides alike.
    for launch in range(ctx.repeats):
        first_of_launch = len(rows)
        rows += ctx.attempt("single device", lambda: single_device_row(cfg, data_path, ctx.cpu), min_time_s=15)
        for schedule, _ in schedules:
            label = f"raypar {schedule}"

            def raypar_row(label=label, c=cfgs[schedule]) -> dict:
                summary, reused = ctx.fit(c, label, fresh=launch > 0)
                return ctx.row(label, c, summary, reused, schedule=c.parallel.schedule,
                               breakdown=step_breakdown(c.runtime.run_dir))

            rows += ctx.attempt(label, raypar_row)
        if not ctx.quick:
            # Side by side with the same run without it: what issuing the first stage's first
            # forward ahead of its call is worth.
            label = f"raypar {schedules[0][0]}, runtime.forward_ahead=false"
            c = ctx.config([f"parallel.schedule={schedules[0][0]}", "runtime.release=true",
                            "runtime.forward_ahead=false"], label)
            rows += ctx.attempt(label, lambda label=label, c=c: ctx.row(
                label, c, *ctx.fit(c, label, fresh=launch > 0), schedule=None, compared_to=schedules[0][0],
                breakdown=step_breakdown(c.runtime.run_dir)))
            # Against the rows of every launch: the zero-bubble and chunked schedules, then some
            # on stages balanced by cost.
            others = [(s, "") for s in [*ZERO_BUBBLE, *CHUNKED]] + [(s, "auto") for s in BALANCED]
            for schedule, split in others if launch == 0 else ():
                label = f"raypar {schedule}" + (f", layers_per_stage={split}" if split else "")
                c = ctx.config([f"parallel.schedule={schedule}", "runtime.release=true",
                                *([f"parallel.layers_per_stage={split}"] if split else [])], label)
                # A chunked row on the even split pairs with torch's schedule that places chunks alike.
                paired = schedule if schedule in CHUNKED and not split else None
                rows += ctx.attempt(label, lambda label=label, c=c, paired=paired: ctx.row(
                    label, c, *ctx.fit(c, label, fresh=launch > 0), schedule=paired, zero_bubble=True,
                    breakdown=step_breakdown(c.runtime.run_dir)))
            if launch == 0:
                # parallel.schedule=auto: what it chose from its timed steps, against every schedule
                # measured on the same kind of cut (even, or balanced by cost).
                from raypar.schedule.choice import TIMING_STEPS, TRIAL_STEPS, candidate_layouts

                # Enough steps to time, try every other schedule and run the choice for a while.
                p = cfg.parallel
                candidates = candidate_layouts(p.pp, p.microbatches, cfg.model.n_layers, p.chunks)
                choice_steps = TIMING_STEPS + (len(candidates) - 1) * TRIAL_STEPS
                for split in ("",) if ctx.cpu else ("", "auto"):  # on CPU: the harness, once
                    label = "raypar auto" + (f", layers_per_stage={split}" if split else "")
                    c = ctx.config(["parallel.schedule=auto", "runtime.release=true",
                                    *([f"parallel.layers_per_stage={split}"] if split else [])], label,
                                   steps=max(ctx.default_steps(), choice_steps + AFTER_CHOICE_STEPS))
                    rows += ctx.attempt(label, lambda label=label, c=c, split=split:
                                        auto_row(ctx, label, c) | {"balanced": bool(split)})
        # Every torch schedule in one pair of processes: a launch (imports, CUDA, NCCL) costs more than a run.
        torch_names = names + (list(MULTI_CHUNK) if not ctx.quick and launch == 0 else [])
        rows += ctx.attempt("torch.distributed.pipelining " + ", ".join(torch_names),
                            lambda: pipelining_rows(cfgs[schedules[0][0]], torch_names, data_path, ctx))
        for r in rows[first_of_launch:]:
            r["launch"] = launch  # raypar's and torch's launches of one round are compared pairwise
    if ctx.repeats > 1:
        rows = combine_launches(rows)
    if ctx.profile:
        rows += profile_rows(ctx, schedules, data_path)
    compare(rows, cfg)
    return rows


# parallel.schedule=auto's row runs this many steps after the longest choice; the first of
# them may be on a cut just made (its allocations), so the chosen schedule's rate is the rest's.
AFTER_CHOICE_STEPS = 5


def auto_row(ctx: "Context", label: str, cfg) -> dict:
    """parallel.schedule=auto's row: the whole run's rate (timing, trials, moves between cuts
    included) and the chosen schedule's, from the steps after the choice's first."""
    summary, reused = ctx.fit(cfg, label)
    row = ctx.row(label, cfg, summary, reused, schedule=None, auto=True)
    choice = summary.schedule_choices[0] if summary.schedule_choices else None
    if choice and choice.get("steps"):
        after = [r for r in summary.records if r.step > choice["steps"][1] + 1]
        if after:
            tokens = cfg.train.global_batch_size * cfg.data.seq_len
            row["chosen_tokens_per_s"] = tokens / (sum(r.step_time_s for r in after) / len(after))
        row["cut_moves"] = choice.get("moves", [])
    return row


BACKWARD = ("B", "I", "W")  # a whole backward, or its input- and weight-gradient parts

# The step profiled with --profile: the first steps pay for warm-up.
PROFILED_STEP = 2


def profile_rows(ctx: "Context", schedules: list[tuple[str, str]], data_path: str) -> list[dict]:
    """One more launch each of raypar and torch, with step PROFILED_STEP under torch.profiler
    (so not timed with the others): each stage's kernel time by kind and the device's busy
    time (`raypar.runtime.profile.device_time`), with the traces' paths."""
    rows: list[dict] = []
    steps = PROFILED_STEP + 1
    for schedule, _ in schedules:
        label = f"raypar {schedule}, step {PROFILED_STEP} profiled"

        def raypar_profile(label=label, schedule=schedule) -> dict:
            c = ctx.config([f"parallel.schedule={schedule}", "runtime.release=true",
                            f"runtime.profile_step={PROFILED_STEP}"], f"raypar {schedule} profiled", steps=steps)
            c.data.path = data_path
            ctx.fit(c, label, fresh=True)
            return profile_row(label, schedule, [Path(c.runtime.run_dir) / "profile" / f"rank{r}-step{PROFILED_STEP}.json"
                                                 for r in range(2)])

        rows += ctx.attempt(label, raypar_profile)
    names = [n for _, n in schedules]
    cfg = ctx.config([f"parallel.schedule={schedules[0][0]}"], "torch profiled", steps=steps)
    trace_dir = ctx.work / "torch-profiled"
    # One launch for both schedules, as the timed rows: each profiles its own step PROFILED_STEP.
    torch_rows = ctx.attempt("torch.distributed.pipelining profiled",
                             lambda: pipelining_rows(cfg, names, data_path, ctx, profile_dir=str(trace_dir)))
    schedule_of = {f"torch.distributed.pipelining {n}": n for n in names}
    for r in torch_rows:
        label = f"{r['label']}, step {PROFILED_STEP} profiled"
        if {"error", "skipped", "unavailable"} & r.keys():
            rows.append({**r, "label": label, "kind": "profile"})
        else:
            name = schedule_of[r["label"]]
            rows.append(profile_row(label, r["schedule"], [trace_dir / f"{name}-rank{rank}.json" for rank in range(2)]))
    return rows


def profile_row(label: str, schedule: str, traces: list[Path]) -> dict:
    """A profiled run's row: each stage's device time from its trace (`device_time`)."""
    from raypar.runtime.profile import device_time

    return {"label": label, "kind": "profile", "schedule": schedule, "traces": [str(t) for t in traces],
            "stages": [{"stage": rank, **device_time(t)} for rank, t in enumerate(traces)]}


def combine_launches(rows: list[dict]) -> list[dict]:
    """One row per label from its launches: the median launch's row by tokens/s (the lower
    middle one for an even count), with every launch's tokens/s and the spread
    (max - min) / median."""
    import statistics

    by_label: dict[str, list[dict]] = {}
    for r in rows:
        by_label.setdefault(r["label"], []).append(r)
    combined = []
    for label, runs in by_label.items():
        measured = sorted((r for r in runs if "tokens_per_s" in r), key=lambda r: r["tokens_per_s"])
        if not measured:
            combined.append(runs[0])  # every launch failed or was skipped: keep the first reason
            continue
        rates = [r["tokens_per_s"] for r in measured]
        median = statistics.median(rates)
        row = dict(measured[(len(measured) - 1) // 2])  # a real launch, not an average of launches
        row.update(launches=len(runs), launches_measured=len(measured), tokens_per_s_launches=rates,
                   tokens_per_s_median=median, spread=(rates[-1] - rates[0]) / median,
                   device_step_ms_launches=[device_step_ms(r) for r in measured],
                   by_launch=sorted(({"launch": r["launch"], "tokens_per_s": r["tokens_per_s"],
                                      "device_step_ms": device_step_ms(r)} for r in measured if "launch" in r),
                                     key=lambda x: x["launch"]))
        combined.append(row)
    return combined


def compare(rows: list[dict], cfg: "Config") -> None:
    """Ratios between rows of this run: to the single device, its 2-stage ideal, torch."""
    single = next((r for r in rows if r.get("kind") == "single" and "tokens_per_s" in r), None)
    p, m = 2, cfg.parallel.microbatches
    for r in rows:
        if "tokens_per_s" not in r or single is None or r is single:
            continue
        r["vs_single_device"] = r["tokens_per_s"] / single["tokens_per_s"]
        r["vs_ideal_2_stage"] = r["tokens_per_s"] / (2 * single["tokens_per_s"] * (1 - (p - 1) / (m + p - 1)))
        r["vs_2_devices"] = r["tokens_per_s"] / (2 * single["tokens_per_s"])  # a zero-bubble schedule's ideal
    one_f_one_b = next((r for r in rows if r.get("label") == "raypar 1f1b" and "tokens_per_s" in r), None)
    for r in rows:
        if r.get("zero_bubble") and "tokens_per_s" in r and one_f_one_b is not None:
            r["vs_1f1b"] = r["tokens_per_s"] / one_f_one_b["tokens_per_s"]
            # The fullest stage's device peak (activations on CPU, where no device is measured).
            key = "peak_device_bytes" if max(one_f_one_b.get("peak_device_bytes") or [0]) else "peak_activation_bytes"
            if max(one_f_one_b.get(key) or [0]) and r.get(key):
                r["peak_vs_1f1b"] = max(r[key]) / max(one_f_one_b[key])
    fixed = {f"raypar {s}" for s in [*(s for s, _ in SCHEDULES), *ZERO_BUBBLE, *CHUNKED]}
    balanced = {f"raypar {s}, layers_per_stage=auto" for s in BALANCED}
    for r in rows:
        labels = balanced if r.get("balanced") else fixed
        measured = [x for x in rows if x.get("label") in labels and "tokens_per_s" in x]
        if r.get("auto") and "tokens_per_s" in r and measured:
            best = max(measured, key=lambda x: x["tokens_per_s"])
            r["chosen"] = r["schedule_choices"][0]["schedule"] if r.get("schedule_choices") else None
            r["best_measured"] = best["label"].removeprefix("raypar ")
            # The chosen schedule's steps against the best fixed run: the choice's own steps
            # (trials of slower schedules, moves between cuts) are a one-off per grid.
            r["vs_best_measured"] = r.get("chosen_tokens_per_s", r["tokens_per_s"]) / best["tokens_per_s"]
    # The yardstick: raypar's fastest schedule over torch's fastest, whichever they are.
    ours = [r for r in rows if r.get("label", "").startswith("raypar ") and "tokens_per_s" in r
            and r.get("kind") != "profile"]
    theirs = [r for r in rows if r.get("kind") == "torch" and "tokens_per_s" in r]
    if ours and theirs:
        best, rival = max(ours, key=lambda r: r["tokens_per_s"]), max(theirs, key=lambda r: r["tokens_per_s"])
        best["vs_torch_best"] = best["tokens_per_s"] / rival["tokens_per_s"]
        best["torch_best"] = rival["label"]
    costs = next((r for r in rows if r.get("kind") == "stage_costs" and "gpu_ms" in r), None)
    for r in rows:
        if costs is not None and r.get("breakdown"):
            # Compute units' spans against the same work alone: above 1, the GPU waited inside them.
            for stage in r["breakdown"]:
                stage["compute_vs_alone"] = ((stage["forward_ms"] + stage["backward_ms"])
                                             / (m * costs["gpu_ms"][stage["stage"]]))
    if single is not None:
        single["ideal_2_stage_tokens_per_s"] = 2 * single["tokens_per_s"] * (1 - (p - 1) / (m + p - 1))
    for r in rows:
        if r.get("kind") == "torch" and "tokens_per_s" in r and r.get("schedule"):
            for ours in rows:
                if r["schedule"] in (ours.get("schedule"), ours.get("compared_to")) and "bubble_measured" in ours:
                    ours["vs_torch"] = ours["tokens_per_s"] / r["tokens_per_s"]
                    theirs, mine = device_step_ms(r), device_step_ms(ours)
                    if theirs and mine:
                        ours["vs_torch_on_device"] = theirs / mine
                    pairwise(ours, r)


def pairwise(ours: dict, theirs: dict) -> None:
    """raypar over torch launch by launch (the launches of one round ran back to back), and
    the median of those ratios: one slow launch on either side then moves one ratio only."""
    import statistics

    mine, other = ({x["launch"]: x for x in row.get("by_launch") or []} for row in (ours, theirs))
    rounds = sorted(set(mine) & set(other))
    if not rounds:
        return
    ours["vs_torch_by_launch"] = [mine[i]["tokens_per_s"] / other[i]["tokens_per_s"] for i in rounds]
    ours["vs_torch_median_pair"] = statistics.median(ours["vs_torch_by_launch"])
    on_device = [other[i]["device_step_ms"] / mine[i]["device_step_ms"] for i in rounds
                 if mine[i]["device_step_ms"] and other[i]["device_step_ms"]]
    if len(on_device) == len(rounds):
        ours["vs_torch_on_device_by_launch"] = on_device
        ours["vs_torch_on_device_median_pair"] = statistics.median(on_device)


def device_step_ms(row: dict) -> float | None:
    """A run's step on the device: the slower stage's mean time from one step's first unit to
    the next's. Timed on the host, a run of a dozen steps also moves with how far the host
    gets ahead of its device between the first step and the last (a few ms per step)."""
    steps = [b.get("device_step_ms") for b in row.get("breakdown") or []]
    return max(steps) if steps and None not in steps else None


# -- (a) one device ---------------------------------------------------------------------------


def single_device_row(cfg: "Config", data_path: str, cpu: bool) -> dict:
    from raypar.data import SampleOrder, TokenDataset, split_batch
    from raypar.model import build_stage
    from raypar.optim import MasterOptimizer

    device = torch.device("cpu" if cpu or not torch.cuda.is_available() else "cuda", 0)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # as one stage worker has
    try:
        model = build_stage(cfg.model, 0, 1, seed=cfg.train.seed, device=device)
        optimizer = MasterOptimizer(model, cfg.train)
        dataset = TokenDataset(data_path, cfg.data.seq_len)
        order = SampleOrder(len(dataset), cfg.train.seed, shuffle=cfg.data.shuffle)
        m, gbs = cfg.parallel.microbatches, cfg.train.global_batch_size
        times, losses = [], []
        for step in range(cfg.train.steps):
            batch = order.indices(step * gbs, gbs)
            _sync(device)
            t0 = time.perf_counter()
            total = torch.zeros((), device=device)
            for i in range(m):
                tokens, labels = dataset.get(split_batch(batch, m, i))
                loss = model(_to(tokens, device), _to(labels, device)) / m
                loss.backward()
                total += loss.detach().float()
            optimizer.step(step, optimizer.local_sq_norm().sqrt())  # no host wait before the update
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(float(total))
        del model, optimizer
    finally:
        torch.set_num_threads(threads)
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next runs need this GPU
    return {"label": f"single device, gradient accumulation over {m} micro-batches", "kind": "single",
            "device": str(device), "microbatches": m, **_rates(times, cfg), "losses": losses, "final_loss": losses[-1],
            "config": cfg.to_dict()}


def _rates(times: list[float], cfg: "Config") -> dict:
    steady = times[1:] or times  # the first step pays for allocation and warm-up
    step_s = sum(steady) / len(steady)
    return {"step_time_s": step_s, "tokens_per_s": cfg.train.global_batch_size * cfg.data.seq_len / step_s,
            "step_times_s": times}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stage_cost_row(cfg: "Config", cpu: bool) -> dict:
    """One micro-batch's forward + backward through each pp=2 stage alone on one device: the
    GPU's time, and the host's time to issue it.

    The GPU time is taken with the host far ahead (a sleep kernel queued first), so it is the
    kernels' own time; when the host needs about as long to issue them, a step is bound by
    the host's speed rather than the GPU's.
    """
    from raypar.kernels import sample_seeds
    from raypar.model import build_stage

    device = torch.device("cpu" if cpu or not torch.cuda.is_available() else "cuda", 0)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # as one stage worker has
    b = cfg.train.global_batch_size // cfg.parallel.microbatches
    t = cfg.data.seq_len
    gpu_ms, host_ms = [], []
    try:
        for stage in range(2):
            model = build_stage(cfg.model, stage, 2, cfg.parallel.layers_per_stage, seed=cfg.train.seed, device=device)
            tokens = torch.randint(0, cfg.model.vocab_size, (b, t), device=device)
            x = torch.randn(b, t, cfg.model.dim, device=device, dtype=next(model.parameters()).dtype)
            seeds = sample_seeds(cfg.train.seed, 0, list(range(b)), device) if cfg.model.dropout else None
            for _ in range(2):
                _forward_backward(model, stage, tokens, x, seeds)
            gpu, host = [], []
            for _ in range(3):
                _sync(device)
                if device.type == "cuda":
                    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time for the host to get ahead
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                t0 = time.perf_counter()
                _forward_backward(model, stage, tokens, x, seeds)
                host.append(time.perf_counter() - t0)
                if device.type == "cuda":
                    end.record()
                    end.synchronize()
                    gpu.append(start.elapsed_time(end) / 1000)
                else:
                    gpu.append(host[-1])
            gpu_ms.append(1000 * sorted(gpu)[1])
            host_ms.append(1000 * sorted(host)[1])
            del model
    finally:
        torch.set_num_threads(threads)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"label": f"one micro-batch ({b} x {t} tokens), forward + backward per stage, alone on one device",
            "kind": "stage_costs", "device": str(device), "gpu_ms": gpu_ms, "host_ms": host_ms}


def _forward_backward(model: torch.nn.Module, stage: int, tokens: torch.Tensor, hidden: torch.Tensor,
                      seeds: torch.Tensor | None) -> None:
    if stage == 0:
        out = model(tokens, None, seeds)
        out.backward(torch.ones_like(out))
    else:
        model(hidden.detach().requires_grad_(), tokens, seeds).backward()


def step_breakdown(run_dir: str) -> list[dict]:
    """Where a raypar run's steps went, per stage: mean ms per step over the steps after the
    first, from the run's events.jsonl (each program unit's span on the device).

    window: from the stage's first unit to its last backward; forward, backward: its compute
    units; window idle: the rest of the window (exchanges and waits for the other stage, the
    bubble); span: from the step's first unit to the end of its last; first unit's lead: how
    long before the device began the step's first unit the host began issuing it (near
    zero, the device waited for the host); device step: from the step's first unit to the
    next step's, on the device: the pace of a long run, whatever the host's lead does over
    a short one;
    gradient norm and optimizer: REDUCE_GRAD (which waits for the other stage's last
    backward) and STEP; between steps: from the end of one step's last unit to the next
    step's first, the device idle; with it, when the step's report was made and when the
    next step's call began, from the end of the step on the device (negative: before it,
    the host ahead of the device, so Ray's return and dispatch cost the device nothing).
    """
    import json
    from collections import defaultdict
    from pathlib import Path

    by_rank: dict[int, list[dict]] = defaultdict(list)
    with open(Path(run_dir) / "events.jsonl") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                by_rank[record["rank"]].append(record)
    by_stage: dict[int, list[dict]] = defaultdict(list)
    for records in by_rank.values():
        records.sort(key=lambda r: r["step"])
        firsts = [min(b for _, _, b, _ in r["events"]) for r in records]
        previous_end = previous_report = None
        for i, r in enumerate(records):
            events = r["events"]
            # Each event is [label, op, start, end] (raypar.driver.event_log).
            span = lambda kind: 1000 * sum(e - b for _, op, b, e in events if op == kind)  # noqa: E731
            first, last = firsts[i], max(e for _, _, _, e in events)
            called, reported = r["call"]
            # How far the host was ahead of the device when the step's first unit began.
            lead = 1000 * (events[0][2] - r["issued"][0]) if r.get("issued") else None
            last_backward = max((e for _, op, _, e in events if op in BACKWARD), default=last)
            forward, backward = span("F"), sum(span(op) for op in BACKWARD)
            window = 1000 * (last_backward - first)
            if i > 0:  # the first step pays for warm-up
                by_stage[r["pp"]].append({
                    "forward_ms": forward, "backward_ms": backward, "window_ms": window,
                    "window_idle_ms": window - forward - backward,
                    "grad_norm_ms": span("REDUCE_GRAD"),
                    "optimizer_ms": span("STEP"),
                    "between_steps_ms": 1000 * (first - previous_end), "first_unit_lead_ms": lead,
                    "span_ms": 1000 * (last - first),
                    "device_step_ms": 1000 * (firsts[i + 1] - first) if i + 1 < len(records) else None,
                    "report_ms": 1000 * (previous_report - previous_end),
                    "next_call_ms": 1000 * (called - previous_end)})
            previous_end = last
            previous_report = reported
    return [{"stage": stage, **_mean(phases)} for stage, phases in sorted(by_stage.items())]


def _mean(phases: list[dict]) -> dict:
    """Each phase's mean over the steps given, leaving out those without it (None)."""
    out = {}
    for k in phases[0]:
        values = [p[k] for p in phases if p[k] is not None]
        out[k] = sum(values) / len(values) if values else None
    return out


# -- (b) torch.distributed.pipelining ----------------------------------------------------------


def pipelining_rows(cfg: "Config", schedules: list[str], data_path: str, ctx: "Context",
                    profile_dir: str | None = None) -> list[dict]:
    """Two spawned processes, one stage each, running each schedule from the same initial
    weights in turn; a step ends when both ranks are done with it. A row's `units` hold, per
    stage and step, each forward's and backward's span from the step's start (ms). With `profile_dir`, step
    PROFILED_STEP of each schedule is profiled into `<dir>/<schedule>-rank<r>.json`."""
    import torch.multiprocessing as mp

    labels = [f"torch.distributed.pipelining {s}" for s in schedules]
    if not ctx.cpu and torch.cuda.device_count() < 2:
        return [{"label": label, "kind": "torch", "unavailable": "needs 2 GPUs (one per stage)"} for label in labels]
    device = "cpu" if ctx.cpu else "cuda"
    spawn = mp.get_context("spawn")

    def run_pair() -> tuple[dict[int, dict], list]:
        queue = spawn.Queue()
        port = _free_port()
        procs = [spawn.Process(target=pipelining_worker,
                               args=(rank, port, cfg.to_dict(), schedules, data_path, device, queue, profile_dir),
                               daemon=True) for rank in range(2)]
        for p in procs:
            p.start()
        results: dict[int, dict] = {}
        deadline = time.monotonic() + min(600.0, max(60.0, ctx.time_left()))
        try:
            while len(results) < 2 and time.monotonic() < deadline:
                try:
                    rank, result = queue.get(timeout=1.0)
                    results[rank] = result
                    if "error" in result:
                        deadline = min(deadline, time.monotonic() + 10.0)  # its peer may wait on it forever
                except Empty:  # are the processes still alive?
                    if any(not p.is_alive() and i not in results for i, p in enumerate(procs)):
                        deadline = min(deadline, time.monotonic() + 5.0)  # a result may still be in flight
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
        return results, procs

    for attempt in range(2):
        results, procs = run_pair()
        failed = {r: res for r, res in results.items() if "error" in res}
        # The port was free when picked, but something bound it before rank 0 did: pick another.
        if not (attempt == 0 and any("EADDRINUSE" in res["error"] for res in failed.values())):
            break
    if failed:
        rank, res = sorted(failed.items())[0]
        return [{"label": label, "kind": "torch", "error": f"rank {rank}: {res['error']}"[:800],
                 "traceback": res["traceback"]} for label in labels]
    if len(results) < 2:
        missing = sorted(set(range(2)) - set(results))
        codes = [procs[i].exitcode for i in missing]
        raise RuntimeError(f"{labels}: no result from ranks {missing} (exit codes {codes})")
    rows = []
    for label, schedule in zip(labels, schedules):
        first, last = results[0][schedule], results[1][schedule]
        times = [max(a, b) for a, b in zip(first["times"], last["times"])]
        steps = [results[rank][schedule]["phases"] for rank in (0, 1)]
        losses = first["losses"] or last["losses"]  # from the rank that holds the last stage
        # The first step pays for warm-up.
        breakdown = [{"stage": rank, **_mean(phases[1:] or phases)} for rank, phases in enumerate(steps)]
        rows.append({"label": label + (" (2 chunks per process)" if schedule in MULTI_CHUNK else ""), "kind": "torch",
                     "schedule": TORCH_COUNTERPART.get(schedule), "chunks": 2 if schedule in MULTI_CHUNK else 1,
                     "device": device, "microbatches": cfg.parallel.microbatches, **_rates(times, cfg),
                     "losses": losses, "final_loss": losses[-1], "breakdown": breakdown,
                     "units": [results[rank][schedule]["units"] for rank in (0, 1)],
                     "config": cfg.to_dict()})
    return rows


# raypar's schedule that does what a torch schedule does (None: raypar has none).
TORCH_COUNTERPART = {"Schedule1F1B": "1f1b", "ScheduleGPipe": "fthenb", "ScheduleInterleaved1F1B": "interleaved-1f1b",
                     "ScheduleZBVZeroBubble": "zb-v"}


def stage_indices(schedule: str, rank: int, ranks: int = 2) -> list[int]:
    """The pipeline stages process `rank` holds under torch's `schedule` (see MULTI_CHUNK)."""
    style = MULTI_CHUNK.get(schedule)
    if style is None:
        return [rank]
    return [rank, rank + ranks] if style == "loop" else [rank, 2 * ranks - 1 - rank]


def pipelining_worker(rank: int, port: int, cfg_dict: dict, schedules: list[str], data_path: str, device_kind: str,
                      queue, profile_dir: str | None = None) -> None:
    """One pipeline stage in its own process; puts (rank, {schedule: result}) or (rank, error) on `queue`."""
    import torch.distributed as dist

    try:
        if device_kind == "cuda":
            # As raypar's GPU workers: lazy module loading can deadlock p2p (actors/placement.py).
            os.environ["CUDA_MODULE_LOADING"] = "EAGER"
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
            torch.set_num_threads(1)  # as a raypar CPU worker has
        dist.init_process_group("nccl" if device_kind == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=2, timeout=timedelta(seconds=300))
        results = {}
        for schedule in schedules:
            trace = Path(profile_dir) / f"{schedule}-rank{rank}.json" if profile_dir else None
            results[schedule] = _train_stage(rank, cfg_dict, schedule, data_path, device, trace)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        queue.put((rank, results))
    except BaseException as e:  # noqa: BLE001 - whatever pipelining raised goes back as the row's reason
        queue.put((rank, {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train_stage(rank: int, cfg_dict: dict, schedule: str, data_path: str, device: torch.device,
                 trace: Path | None = None) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining

    from raypar.config import config_from_dict
    from raypar.data import SampleOrder, TokenDataset
    from raypar.model import build_stage
    from raypar.optim import MasterOptimizer
    from raypar.runtime.profile import profiled

    cfg = config_from_dict(cfg_dict)
    m, gbs = cfg.parallel.microbatches, cfg.train.global_batch_size
    indices = stage_indices(schedule, rank)
    n_stages = 2 * len(indices)  # over the 2 processes
    split = cfg.parallel.layers_per_stage if n_stages == 2 else None
    modules = [build_stage(cfg.model, s, n_stages, split, seed=cfg.train.seed, device=device) for s in indices]
    optimizer = MasterOptimizer(modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules), cfg.train)
    stages = [pipelining.PipelineStage(mod, s, n_stages, device) for mod, s in zip(modules, indices)]
    holds_first, holds_last = 0 in indices, n_stages - 1 in indices

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Per micro-batch mean over tokens in fp32, / m: the step's loss is their mean, as in raypar.
        # (scale_grads=False: bf16 models move grads into fp32 masters, where torch cannot scale them.)
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()) / m

    # Each forward and backward timed as raypar's compute units are (the last stage's loss
    # counts as its forward, as raypar's last stage computes it inside its forward).
    units: list[tuple[str, object, object]] = []

    def timed(kind: str, fn):
        def run(*args, **kwargs):
            begin = _mark(device)
            out = fn(*args, **kwargs)
            units.append((kind, begin, _mark(device)))
            return out
        return run

    for stage in stages:
        stage.forward_one_chunk = timed("F", stage.forward_one_chunk)
        stage.backward_one_chunk = timed("B", stage.backward_one_chunk)
        stage.backward_weight_one_chunk = timed("B", stage.backward_weight_one_chunk)  # zero-bubble W
    sched = getattr(pipelining, schedule)(stages if schedule in MULTI_CHUNK else stages[0], m,
                                          loss_fn=timed("F", loss_fn), scale_grads=False)
    dataset = TokenDataset(data_path, cfg.data.seq_len)
    order = SampleOrder(len(dataset), cfg.train.seed, shuffle=cfg.data.shuffle)
    times, losses, marks = [], [], []
    # Timed as raypar's steps are: from one step's end to the next's, loading its batch included.
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    for step in range(cfg.train.steps):
        tokens, labels = dataset.get(order.indices(step * gbs, gbs))
        tokens, labels = _to(tokens, device), _to(labels, device)
        # As a raypar worker's profiled step: the schedule, the norm and the optimizer.
        with profiled(trace, device.type == "cuda") if trace and step == PROFILED_STEP else nullcontext():
            start = _mark(device)
            mb_losses: list[torch.Tensor] = []
            sched.step(*([tokens] if holds_first else []),
                       **({"target": labels, "losses": mb_losses} if holds_last else {}))
            window_end = _mark(device)
            sq = optimizer.local_sq_norm()
            dist.all_reduce(sq)  # the global norm over both stages, for clipping
            norm_end = _mark(device)
            # Clipped on the device, as torch.nn.utils.clip_grad_norm_ does: the update is
            # issued without the host waiting for the norm.
            optimizer.step(step, sq.sqrt())
            marks.append((start, window_end, norm_end, _mark(device), list(units)))
            units.clear()
            if holds_last:  # the step's loss, read as a training loop logs it, after the update is issued
                losses.append(float(sum(x.detach().float() for x in mb_losses)))
            # The host at most one step ahead of its device, which is never left idle for it.
            _wait_for(marks[-2][3] if len(marks) > 1 else None, device)
        now = time.perf_counter()
        times.append(now - t0)
        t0 = now
    _sync(device)  # the last steps' marks, for their phases
    return {"times": times, "losses": losses, "phases": _phases(marks, device), "units": _units(marks, device)}


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """To the device as a pinning data loader hands it over: without waiting for the device."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _wait_for(mark, device: torch.device) -> None:
    if mark is not None and device.type == "cuda":
        mark.synchronize()


def _mark(device: torch.device):
    """A point in the step: a CUDA event on GPU (when the device gets there), else the clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _phases(marks: list[tuple], device: torch.device) -> list[dict]:
    """ms per step of the schedule's window (its forwards, backwards and exchanges), its
    forwards and backwards alone, the gradient norm, the optimizer, the gap since the
    step before, and from the step's start to the next's (device step), from `_mark` points."""
    ms = ((lambda a, b: a.elapsed_time(b)) if device.type == "cuda"
          else (lambda a, b: 1000 * (b - a)))
    phases = []
    for i, (start, window_end, norm_end, end, units) in enumerate(marks):
        window = ms(start, window_end)
        forward, backward = (sum(ms(b, e) for kind, b, e in units if kind == k) for k in ("F", "B"))
        phases.append({"window_ms": window, "forward_ms": forward, "backward_ms": backward,
                       "window_idle_ms": window - forward - backward, "grad_norm_ms": ms(window_end, norm_end),
                       "optimizer_ms": ms(norm_end, end),
                       "between_steps_ms": ms(marks[i - 1][3], start) if i > 0 else None,
                       "device_step_ms": ms(start, marks[i + 1][0]) if i + 1 < len(marks) else None})
    return phases


def _units(marks: list[tuple], device: torch.device) -> list[list[tuple[str, float, float]]]:
    """Per step: (F or B, start ms, end ms) of each compute unit, from the step's start."""
    ms = ((lambda a, b: a.elapsed_time(b)) if device.type == "cuda"
          else (lambda a, b: 1000 * (b - a)))
    return [[(kind, ms(start, b), ms(start, e)) for kind, b, e in units] for start, *_, units in marks]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(rows: list[dict]) -> str:
    fmt = lambda r, k, f: f.format(r[k]) if r.get(k) is not None else "-"  # noqa: E731

    def vs_torch(r: dict, kind: str) -> str:
        """The kept launches' ratio, then each round's and their median."""
        text = fmt(r, f"vs_torch{kind}", "{:.3f}")
        if r.get(f"vs_torch{kind}_by_launch"):
            rounds = " / ".join(f"{x:.3f}" for x in r[f"vs_torch{kind}_by_launch"])
            text += f"; by launch {rounds}, median {r[f'vs_torch{kind}_median_pair']:.3f}"
        return text

    def between(b: dict) -> str:
        parts = [b.get(k) for k in ("report_ms", "next_call_ms")]
        split = f" ({' / '.join(f'{p:+.1f}' for p in parts)})" if None not in parts else ""
        return fmt(b, "between_steps_ms", "{:.2f}") + split
    lines = ["| run | tokens/s | step ms | step ms on the device | bubble measured | vs single device | "
             "vs ideal 2-stage | vs 2 devices | raypar / torch | raypar / torch on the device | vs raypar 1f1b | "
             "peak memory vs raypar 1f1b | final loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("kind") == "profile":
            continue  # its own table below
        if r.get("kind") == "stage_costs":
            if "gpu_ms" in r:
                lines.append(f"| {r['label']}: GPU {' / '.join(f'{x:.1f}' for x in r['gpu_ms'])} ms, host to issue it "
                             f"{' / '.join(f'{x:.1f}' for x in r['host_ms'])} ms (stage 0 / 1) | | | | | | | | | | | | |")
            continue
        label = r["label"] + (f" ({r['microbatches']} mb)" if r.get("microbatches") else "")
        if r.get("kind") == "single":
            label += f"; ideal 2-stage {r['ideal_2_stage_tokens_per_s']:,.0f} tokens/s" if "ideal_2_stage_tokens_per_s" in r else ""
        if r.get("launches_measured", 1) > 1:
            label += f"; median of {r['launches_measured']} launches, spread {r['spread']:.0%}"
        if r.get("auto") and "vs_best_measured" in r:
            label += (f"; chose {r['chosen']}, its steps after the choice {r['vs_best_measured']:.3f} of the best "
                      f"schedule measured ({r['best_measured']})"
                      + (f", {len(r['cut_moves'])} moves between cuts" if r.get("cut_moves") else ""))
        on_device = device_step_ms(r)
        lines.append(f"| {label} | {r['tokens_per_s']:,.0f} | {r['step_time_s'] * 1000:.1f} | "
                     f"{f'{on_device:.1f}' if on_device else '-'} | "
                     f"{fmt(r, 'bubble_measured', '{:.3f}')} | {fmt(r, 'vs_single_device', '{:.2f}')} | "
                     f"{fmt(r, 'vs_ideal_2_stage', '{:.2f}')} | {fmt(r, 'vs_2_devices', '{:.2f}')} | {vs_torch(r, '')} | "
                     f"{vs_torch(r, '_on_device')} | {fmt(r, 'vs_1f1b', '{:.3f}')} | {fmt(r, 'peak_vs_1f1b', '{:.2f}')} | "
                     f"{fmt(r, 'final_loss', '{:.4f}')} |")
    best = next((r for r in rows if "vs_torch_best" in r), None)
    if best is not None:
        lines += ["", f"Fastest raypar row ({best['label']}) over the fastest torch row ({best['torch_best']}): "
                      f"**{best['vs_torch_best']:.3f}**"]
    broken = [r for r in rows if r.get("breakdown")]
    if broken:
        lines += ["", "Where each pipelined step goes, per stage (ms per step, mean over the steps after the first):", "",
                  "| run | stage | window | forward | backward | compute vs alone | window idle | gradient norm | "
                  "optimizer | between steps (the step's report / the next call, from its end on the device) | "
                  "host ahead at the first unit |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in broken:
            for b in r["breakdown"]:
                lines.append(f"| {r['label']} | {b['stage']} | {b['window_ms']:.1f} | {fmt(b, 'forward_ms', '{:.1f}')} | "
                             f"{fmt(b, 'backward_ms', '{:.1f}')} | {fmt(b, 'compute_vs_alone', '{:.2f}')} | "
                             f"{fmt(b, 'window_idle_ms', '{:.1f}')} | {b['grad_norm_ms']:.1f} | {b['optimizer_ms']:.1f} | "
                             f"{between(b)} | {fmt(b, 'first_unit_lead_ms', '{:.1f}')} |")
    profiles = [r for r in rows if r.get("kind") == "profile"]
    if profiles:
        kinds = list(profiles[0]["stages"][0]["by_kind"])
        lines += ["", "One profiled step (torch.profiler, ms on each stage's device): traced: the step under the "
                  "profiler; span: first kernel to last; busy: any kernel running; compute busy: any but "
                  "communication; then kernel time by kind.", "",
                  "| run | stage | traced | span | busy | compute busy | " + " | ".join(kinds) + " | kernels |",
                  "|---" * (7 + len(kinds)) + "|"]
        for r in profiles:
            for st in r["stages"]:
                by_kind = " | ".join(f"{st['by_kind'][k]['ms']:.1f}" for k in kinds)
                lines.append(f"| {r['label']} | {st['stage']} | {st['traced_ms']:.1f} | {st['span_ms']:.1f} | "
                             f"{st['busy_ms']:.1f} | "
                             f"{st['compute_busy_ms']:.1f} | {by_kind} | {st['kernels']} |")
    return "\n".join(lines)
