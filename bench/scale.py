"""Scale suite (issue 8): one MoE model on 4 or 8 GPUs, on several dp x pp x ep grids.

    python -m bench.run --suite scale --out DIR            # 4 or 8 GPUs, ~8 minutes
    python -m bench.run --suite scale --cpu --out DIR      # tiny model, 4 CPU workers (the test)

Rows, all in one Ray session:

- a 2-GPU reference, grid (1,1,2), of the same model with n_experts / (N/2) experts: the same
  depth, width and flops per token (top-k is unchanged) and as many expert weights per GPU as
  the pp x ep grids, at the same batch per GPU;
- the N-GPU grids (8 GPUs: (1,4,2), (2,2,2), (1,8,1); 4 GPUs: (1,2,2), (2,1,2), (1,4,1)) of the
  model in configs/moe-scale.yaml (~2.4B on 4 GPUs; 16 layers, ~4.7B, on 8), 16 sequences per
  GPU per step: tokens/s, measured bubble, all-to-all share of the step, peak memory per stage,
  MFU and weak-scaling efficiency against the 2-GPU reference;
- on the first grid, in the same run (one launch fewer): a checkpoint of all N stage workers
  through the checkpoint writer (stall, overlap, write throughput against the disk), then one of
  the N workers killed once it committed, with its GPU held from then on as if it had died with
  it (where the trainer tears every worker down; see LoseWorker): detection, recovery, the grid
  the controller re-plans onto and tokens/s before and after.

Any GPU count works: 8 or more use the 8-GPU grids, 4 to 7 the 4-GPU grids (on 4 of them),
fewer than 4 record the suite as unavailable. The time budget is bench.run's.
"""
from __future__ import annotations

import statistics
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from raypar.driver.callbacks import Callback

if TYPE_CHECKING:
    from raypar.config import Config
    from raypar.driver import StepRecord, Trainer

    from bench.run import Context

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "moe-scale.yaml")

TITLE = "scale-out: one MoE model on N GPUs over dp x pp x ep grids, weak scaling, checkpoint and a lost worker"
NOTES = ("Weak scaling: every run has the same batch per GPU (global batch = per-GPU batch x GPUs); the N-GPU model "
         "has N/2 times the experts of the 2-GPU reference (same depth, width, top-k, so the same flops per token "
         "up to the router); efficiency = (tokens/s per GPU x flops/token) at N / the same at 2 "
         "(= MFU ratio; the plain tokens/s-per-GPU ratio is `tokens_per_gpu_ratio` in results.json). MFU: "
         "raypar.model.flops_per_token x tokens/s / (GPUs x the card's dense bf16 peak, raypar.metrics). "
         "All-to-all share: the slowest worker's host time in the MoE exchanges / step time. The first grid's "
         "figures come from its run's clean steps before the save (warm-up, snapshot and in-flight steps left out). "
         "Checkpoint: every worker's shards (weights, fp32 masters, AdamW moments) through its node's writer; "
         "stall = the loop's hold-up at the save step (a run's first save also allocates the pinned host "
         "buffers); overlap = extra time of the snapshot step and of the steps "
         "run while the write was in flight, against the clean steps, less the stall; writer MiB/s = bytes / the slowest shard's "
         "write; save to commit = snapshot to committed manifest. Lost worker: the last stage worker is killed "
         "once that save committed; where the trainer tears every worker down, its GPU is then held (a GPU that "
         "died with it), so the controller must re-plan on N-1 (where it keeps the survivors, their group keeps "
         "the lost worker's bundle too: nothing is held, the grid may stay); detection = the next step's issue to the failure seen, recovery = detection to the "
         "end of the first step on the new grid (teardown, re-plan, launch, resharded load, step); tokens/s after "
         "leaves that first step out.")

# (dp, pp, ep) per GPU family. The first grid also carries the checkpoint and the lost worker.
GRIDS = {8: [(1, 4, 2), (2, 2, 2), (1, 8, 1)], 4: [(1, 2, 2), (2, 1, 2), (1, 4, 1)]}
REFERENCE_GRID = (1, 1, 2)
CPU_WORKERS = 4  # --cpu runs the 4-GPU grids on 4 CPU workers
# Layers of the model for 4 GPUs (configs/moe-scale.yaml on GPU, bench/pipeline.py's TINY on CPU); 8 GPUs double it.
LAYERS = {"gpu": 8, "cpu": 4}
# Sequences per GPU per step, and per micro-batch.
PER_GPU = {"gpu": 16, "cpu": 4}
MICRO = {"gpu": 4, "cpu": 2}
STEPS = {"gpu": 8, "cpu": 3}  # plain runs: the first step is warm-up
# The lost-worker run: a save after SAVE_AT steps (its snapshot in step SAVE_AT - 1, 0-based), the
# kill after one more step once it committed, then POST steps on the new grid (the first is warm-up).
SAVE_AT = {"gpu": 6, "cpu": 4}
POST = {"gpu": 4, "cpu": 3}  # < SAVE_AT: the run stops before the next save is due
# Seconds on GPU: a plain row is not started with less than ROW_S left (a launch is ~25-35 s, its
# first step 6-12 s); the lost-worker run (two launches, the whole checkpoint written and loaded:
# ~130 s for 32 GiB on 4 x H200) needs LOSS_S by GPU family, held back for it, and runs last.
ROW_S = 60.0
LOSS_S = {4: 160.0, 8: 260.0}


def run(ctx: "Context") -> list[dict]:
    n = CPU_WORKERS if ctx.cpu else torch.cuda.device_count()
    family = 8 if n >= 8 else 4 if n >= 4 else 0
    if not family:
        return [{"label": "scale suite", "unavailable": f"needs at least 4 GPUs, this machine has {n}"}]
    kind = "cpu" if ctx.cpu else "gpu"
    peak = peak_flops(ctx)
    grids = GRIDS[family]
    rows: list[dict] = []
    if not ctx.cpu:
        from bench.checkpoint import disk_row

        where = ctx.work / ctx.suite
        where.mkdir(parents=True, exist_ok=True)
        rows += ctx.attempt("disk: sequential write + fsync", lambda: {**disk_row(where, 256 * 2**20), "kind": "disk"},
                            min_time_s=5)

    # The plain rows leave the lost-worker run its time: they see a deadline LOSS_S earlier.
    deadline = ctx.deadline
    ctx.deadline = deadline - (0 if ctx.cpu else LOSS_S[family])
    try:
        ref_cfg = config(ctx, kind, family, REFERENCE_GRID, experts_div=family // 2, label="reference")
        label = f"2-GPU reference, grid {fmt(REFERENCE_GRID)}, {ref_cfg.model.n_experts} experts"
        rows += ctx.attempt(label, lambda: plain_row(ctx, label, ref_cfg, peak, reference=True),
                            min_time_s=0 if ctx.cpu else ROW_S)
        for grid in grids[1:]:
            label = f"grid {fmt(grid)}"
            cfg = config(ctx, kind, family, grid, label=label)
            rows += ctx.attempt(label, lambda label=label, cfg=cfg: plain_row(ctx, label, cfg, peak),
                                min_time_s=0 if ctx.cpu else ROW_S)
    finally:
        ctx.deadline = deadline

    grid = grids[0]
    label = f"grid {fmt(grid)}"
    cfg = config(ctx, kind, family, grid, label=label + " lost worker", loss=SAVE_AT[kind])
    rows += ctx.attempt(f"{label}, checkpoint and a lost worker",
                        lambda: loss_rows(ctx, label, cfg, kind, peak), min_time_s=0 if ctx.cpu else LOSS_S[family])
    relate(rows)
    order = {"reference": 0, "grid": 1, "disk": 2, "checkpoint": 3, "lost worker": 4}
    return sorted(rows, key=lambda r: (order.get(r.get("kind", ""), 5), r.get("grid_index", 0)))


# -- configs ---------------------------------------------------------------------------------


def fmt(grid: tuple[int, int, int]) -> str:
    return "({},{},{})".format(*grid)


def config(ctx: "Context", kind: str, family: int, grid: tuple[int, int, int], label: str,
           experts_div: int = 1, loss: int = 0) -> "Config":
    """The suite's model on `grid`, 16 sequences (4 on CPU) per GPU per step.

    experts_div: the 2-GPU reference divides the experts by N/2. loss: the lost-worker run,
    saving after `loss` steps.
    """
    from raypar.config import load_config

    dp, pp, ep = grid
    gpus = dp * pp * ep
    batch = PER_GPU[kind] * gpus
    base = load_config(CONFIG)
    experts = base.model.n_experts // experts_div
    overrides = [f"model.n_layers={LAYERS[kind] * family // 4}", f"model.n_experts={experts}",
                 f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.ep={ep}",
                 f"parallel.microbatches={batch // (dp * ep * MICRO[kind])}", "parallel.schedule=1f1b",
                 f"train.global_batch_size={batch}"]
    steps = STEPS[kind] if not ctx.steps else ctx.steps
    if loss:
        overrides += ["elastic.enabled=true", "elastic.min_workers=2", "elastic.resource_timeout_s=60",
                      "elastic.grow=false", f"checkpoint.every={loss}", "checkpoint.keep_last=1"]
        steps = 2 * loss  # the run is stopped after POST steps on the new grid, before a second save
    cfg = ctx.config(overrides, label, steps=steps, path=CONFIG)
    cfg.data.path = ctx.corpus(cfg)  # one synthetic corpus for every run
    return cfg


def peak_flops(ctx: "Context") -> float:
    """The card's dense bf16 peak per GPU (0 on CPU or an unlisted card: MFU reads None)."""
    from raypar.metrics import peak_flops_per_device

    if ctx.cpu or not torch.cuda.is_available():
        return 0.0
    return peak_flops_per_device(torch.cuda.get_device_name(0), "bfloat16")


def params_per_gpu(cfg: "Config") -> list[int]:
    """Parameters one worker of each pipeline stage holds (its expert share, replicated dense layers)."""
    from raypar.model import Transformer, num_params
    from raypar.model.partition import layer_parts, stage_halves

    p = cfg.parallel
    out = []
    with torch.device("meta"):
        for s, halves in enumerate(stage_halves(cfg.model, p.pp, p.layers_per_stage)):
            stage = Transformer(cfg.model, layer_ids=layer_parts(halves), has_embed=s == 0, has_head=s == p.pp - 1,
                                ep_rank=0, ep_size=p.ep)
            out.append(num_params(stage))
    return out


# -- rows --------------------------------------------------------------------------------------


def figures(cfg: "Config", tokens_per_s: float, step_time_s: float, alltoall_s: float, peak: float) -> dict:
    """Per-GPU rates, MFU and the all-to-all share for one run's steady steps."""
    from raypar.model import flops_per_token

    p = cfg.parallel
    gpus = p.dp * p.pp * p.ep
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    flops_per_gpu = tokens_per_s * fpt / gpus
    return {"gpus": gpus, "tokens_per_s_per_gpu": tokens_per_s / gpus, "flops_per_token": fpt,
            "model_tflops_per_gpu": flops_per_gpu / 1e12, "mfu": flops_per_gpu / peak if peak else None,
            "alltoall_share": alltoall_s / step_time_s if step_time_s else 0.0,
            "params_per_gpu": params_per_gpu(cfg)}


def plain_row(ctx: "Context", label: str, cfg: "Config", peak: float, reference: bool = False) -> dict:
    summary, reused = ctx.fit(cfg, label)
    extra = figures(cfg, summary.tokens_per_s, summary.step_time_s, summary.alltoall_s_per_step, peak)
    return ctx.row(label, cfg, summary, reused, kind="reference" if reference else "grid",
                   grid_index=grid_index(cfg), **extra)


def grid_index(cfg: "Config") -> int:
    p = cfg.parallel
    for grids in GRIDS.values():
        if (p.dp, p.pp, p.ep) in grids:
            return grids.index((p.dp, p.pp, p.ep))
    return -1


def steady(records: list["StepRecord"], cfg: "Config") -> dict:
    """What RunSummary reports for a run, for a chosen subset of its steps (`records`, measured ones)."""
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    step = statistics.fmean(r.step_time_s for r in records)
    a2a = [r.alltoall_s for r in records if r.alltoall_s is not None]
    return {"steps_measured": [r.step for r in records], "step_time_s": step, "tokens_per_s": tokens / step,
            "bubble_measured": statistics.fmean(r.bubble_measured for r in records),
            "bubble_simulated": statistics.fmean(r.bubble_simulated for r in records),
            "control_overhead": statistics.fmean(r.control_overhead for r in records),
            "alltoall_bytes_per_step": statistics.fmean(r.alltoall_bytes for r in records),
            "alltoall_s_per_step": statistics.fmean(a2a) if a2a else 0.0}


class LoseWorker(Callback):
    """Kills worker `rank` after step `kill_after` once the save before it committed; holds its slot.

    The slot (its GPU, or on CPU its share of the CPUs) is taken by a placement group when the
    controller re-plans after tearing every worker down, so the new grid has one worker fewer.
    Records each step with the grid it ran on; stops the run `post` steps after the recovery,
    or at `last`.
    """

    def __init__(self, kill_after: int, rank: int, post: int, last: int):
        self.kill_after, self.rank, self.post, self.last = kill_after, rank, post, last
        self.killed_at: float | None = None
        self.commit_wait_s = 0.0
        self.steps: list[tuple[str, bool, "StepRecord"]] = []  # grid, after the recovery, record
        self.hold = None
        self.held: dict[str, float] = {}
        self.slots_left: int | None = None
        self.saves: list = []  # SaveResult of each save, committed or failed
        self.tried_hold = False
        self.not_held: str | None = None

    def on_checkpoint(self, trainer: "Trainer", result) -> None:
        self.saves.append(result)

    def on_step_end(self, trainer: "Trainer", record: "StepRecord") -> None:
        import ray

        after = bool(trainer.recoveries)
        self.steps.append((str(trainer.grid), after, record))
        if record.step == self.kill_after and self.killed_at is None:
            t0 = time.perf_counter()
            trainer.saver.finish()  # the recovery then loads this step's checkpoint
            self.commit_wait_s = time.perf_counter() - t0
            self.slots_left = trainer.grid.size - 1
            self.killed_at = time.time()
            ray.kill(trainer.group.workers[self.rank])
        post = [r for g, a, r in self.steps if a]
        if len(post) >= self.post or record.step >= self.last:
            trainer.request_stop(save=False)

    def on_state_change(self, trainer: "Trainer", state: str) -> None:
        # PLANNING after the failure, the new grid not chosen yet. When the trainer tore every
        # worker down (no group left), the freed resources are all there is: hold the lost one's.
        # When it kept the survivors, their group also keeps the lost worker's bundle, which
        # nothing outside can take: then nothing is held and the same grid may come back.
        if state == "PLANNING" and self.killed_at is not None and self.hold is None and not self.tried_hold:
            self.tried_hold = True
            if trainer.group is None:
                self.hold, self.held = hold_slots(trainer, self.slots_left)
            else:
                self.not_held = "the trainer kept the surviving workers and their bundles (the lost one's too)"

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        if self.hold is not None:
            remove_placement_group(self.hold)
            self.hold = None


def hold_slots(trainer: "Trainer", slots_left: int):
    """A placement group over what the cluster has beyond `slots_left` worker slots."""
    import ray
    from ray.util.placement_group import placement_group

    total = ray.cluster_resources()
    if trainer.device == "cuda":
        bundle = {"GPU": float(int(total.get("GPU", 0)) - slots_left)}
    else:
        bundle = {"CPU": total.get("CPU", 0.0) - slots_left * trainer.cfg.runtime.cpus_per_worker}
    if min(bundle.values()) <= 0:
        return None, {}
    pg = placement_group([bundle])
    ray.get(pg.ready(), timeout=120)
    return pg, bundle


def loss_rows(ctx: "Context", label: str, cfg: "Config", kind: str, peak: float) -> list[dict]:
    """The first grid's row, its checkpoint row and the lost-worker row, from one run.

    A failure after the save (in the kill or the recovery) still keeps the rows measured before it.
    """
    save_at = cfg.checkpoint.every
    p = cfg.parallel
    workers = p.dp * p.pp * p.ep
    lose = LoseWorker(kill_after=save_at, rank=workers - 1, post=POST[kind], last=cfg.train.steps - 2)
    trainer = ctx.trainer(cfg, f"{label} + checkpoint + lost worker", callbacks=[lose])
    failure: dict | None = None
    try:
        trainer.fit()
    except Exception as e:  # noqa: BLE001 - the rows measured before the failure are kept
        ctx.log(label)(f"FAILED: {e!r}"[:2000])
        failure = {"error": f"{type(e).__name__}: {e}"[:800], "traceback": traceback.format_exc()[-3000:]}
    finally:
        lose.release()
    before = [r for g, a, r in lose.steps if not a]
    after = [r for g, a, r in lose.steps if a]
    rows = []
    # The grid row: clean steps before the save (not the warm-up, the snapshot step or later).
    clean = [r for r in before if 0 < r.step < save_at - 1] or before[1:] or before
    if clean:
        stats = steady(clean, cfg)
        rows.append({"label": label, "kind": "grid", "grid_index": 0, "grid": lose.steps[0][0],
                     "microbatches": p.microbatches, "schedule": p.schedule, "device": trainer.device,
                     **stats, "peak_activation_bytes": _peaks(before, "peak_activation_bytes"),
                     "peak_device_bytes": _peaks(before, "peak_device_bytes"),
                     "global_batch_size": cfg.train.global_batch_size, "seq_len": cfg.data.seq_len,
                     "params": _params(cfg), "from_run": "the lost-worker run, before its save",
                     **figures(cfg, stats["tokens_per_s"], stats["step_time_s"], stats["alltoall_s_per_step"], peak),
                     "config": cfg.to_dict()})
    rows.append(checkpoint_row(label, cfg, before, clean, save_at, lose, failure))
    lost_label = f"{label}: worker {lose.rank} of {workers} killed after {save_at + 1} steps"
    if failure is not None:
        rows.append({"label": lost_label, "kind": "lost worker", **failure})
        return rows
    if lose.killed_at is None:
        stopped = trainer.bench_stop.stopped_after
        rows.append({"label": lost_label, "kind": "lost worker",
                     "skipped": f"time budget: stopped after step {stopped}, before the kill"})
        return rows
    if not trainer.recoveries:
        rows.append({"label": lost_label, "kind": "lost worker",
                     "error": f"a worker was killed but no recovery was recorded (restarts {trainer.restarts})"})
        return rows
    event = trainer.recoveries[0].to_dict()
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    rate = lambda rs: tokens / statistics.fmean(r.step_time_s for r in rs) if rs else None  # noqa: E731
    rows.append({"label": lost_label, "kind": "lost worker", "failed_grid": event["failed_grid"],
                 "recovered_grid": event["grid"], "detection_s": event["detection_s"],
                 "recovery_s": event["recovery_s"], "steps_lost": event["steps_lost"],
                 "resumed_step": event["resumed_step"], "attempts": event.get("attempts", 1), "held": lose.held,
                 **({"not_held": lose.not_held} if lose.not_held else {}),
                 **{k: event[k] for k in ("workers_kept", "workers_started") if k in event},
                 "commit_wait_s": lose.commit_wait_s, "tokens_per_s_before": rate(clean),
                 "tokens_per_s_after": rate(after[1:] or after), "steps_after": [r.step for r in after],
                 "peak_device_bytes_after": _peaks(after, "peak_device_bytes"),
                 "microbatches_after": trainer.cfg.parallel.microbatches, "restarts": trainer.restarts,
                 "controller_states": [state.value for _, state, _ in trainer.controller.history]})
    return rows


def checkpoint_row(label: str, cfg: "Config", before: list, clean: list, save_at: int, lose: LoseWorker,
                   failure: dict | None) -> dict:
    p = cfg.parallel
    row_label = f"{label}: checkpoint of all {p.dp * p.pp * p.ep} workers, saved after {save_at} steps"
    ok = [c for c in lose.saves if c.error is None]
    if not ok:
        if not any(r.step >= save_at - 1 for r in before):
            why = failure["error"] if failure else "time budget: stopped before the save"
            return {"label": row_label, "kind": "checkpoint", "skipped": why}
        return {"label": row_label, "kind": "checkpoint",
                "error": f"no checkpoint committed: {[c.error for c in lose.saves]}"[:800]}
    c = ok[0]
    base = statistics.median(r.step_time_s for r in clean) if clean else None
    save_step = next((r for r in before if r.step == save_at - 1), None)
    stall = save_step.checkpoint_stall_s if save_step else None
    # The snapshot step and the steps the write overlapped, less the stall inside the snapshot step.
    busy = [r for r in before if r.step >= save_at - 1]
    overlap = max(0.0, sum(r.step_time_s - base for r in busy) - (stall or 0.0)) if base else None
    return {"label": row_label, "kind": "checkpoint", "bytes": c.bytes, "stall_s": stall,
            "stall_per_step": stall / base if stall is not None and base else None,
            "overlap_s": overlap, "overlap_steps": [r.step for r in busy], "clean_step_s": base,
            "write_s": c.write_s, "write_bytes_per_s": c.bytes / c.write_s if c.write_s else None,
            "save_duration_s": c.duration_s, "end_to_end_bytes_per_s": c.bytes / c.duration_s,
            "commit_wait_s": lose.commit_wait_s, "workers": p.dp * p.pp * p.ep, "path": c.path}


def _peaks(records: list, attr: str) -> list[int]:
    stages = max((len(getattr(r, attr)) for r in records), default=0)
    return [max((getattr(r, attr)[s] for r in records if s < len(getattr(r, attr))), default=0) for s in range(stages)]


def _params(cfg: "Config") -> int:
    from bench.run import model_params

    return model_params(cfg)


def relate(rows: list[dict]) -> None:
    """Weak scaling against the 2-GPU reference; checkpoint writes against the disk."""
    ref = next((r for r in rows if r.get("kind") == "reference" and "tokens_per_s" in r), None)
    disk = next((r for r in rows if "disk_bytes_per_s" in r), None)
    for r in rows:
        if ref and r.get("kind") == "grid" and "tokens_per_s" in r:
            r["weak_scaling"] = (r["tokens_per_s_per_gpu"] * r["flops_per_token"]
                                 / (ref["tokens_per_s_per_gpu"] * ref["flops_per_token"]))
            r["tokens_per_gpu_ratio"] = r["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"]
        if disk and r.get("kind") == "checkpoint" and r.get("write_bytes_per_s"):
            r["vs_disk"] = r["write_bytes_per_s"] / disk["disk_bytes_per_s"]
            r["end_to_end_vs_disk"] = r["end_to_end_bytes_per_s"] / disk["disk_bytes_per_s"]


# -- the tables -------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    gib = lambda b: f"{b / 2**30:.1f}"  # noqa: E731
    pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    num = lambda x, f="{:.2f}": "-" if x is None else f.format(x)  # noqa: E731
    out = ["| run | GPUs | grid, micro-batches | params per GPU (M, per stage) | tokens/s | tokens/s per GPU | step ms | "
           "bubble measured / simulated | all-to-all share | peak GPU mem GiB (per stage) | MFU | weak scaling vs 2 GPUs |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("kind") not in ("reference", "grid"):
            continue
        mem = r.get("peak_device_bytes") or []
        mem_s = " / ".join(gib(b) for b in mem) if any(mem) else "act. " + " / ".join(
            gib(b) for b in r.get("peak_activation_bytes", []))
        out.append(f"| {r['label']} | {r['gpus']} | {r['grid']}, {r['microbatches']} mb | "
                   f"{' / '.join(f'{n / 1e6:,.0f}' if n >= 1e7 else f'{n / 1e6:.2f}' for n in r['params_per_gpu'])} | {r['tokens_per_s']:,.0f} | "
                   f"{r['tokens_per_s_per_gpu']:,.0f} | {r['step_time_s'] * 1000:.1f} | "
                   f"{r['bubble_measured']:.3f} / {r['bubble_simulated']:.3f} | {pct(r['alltoall_share'])} | {mem_s} | "
                   f"{pct(r.get('mfu'))} | {num(r.get('weak_scaling'))} |")
    ckpt = [r for r in rows if r.get("kind") in ("disk", "checkpoint")]
    if ckpt:
        ms = lambda s: "-" if s is None else f"{s * 1000:.1f}"  # noqa: E731
        out += ["", "| checkpoint | GiB | stall ms (/ step) | overlap ms | writer s | writer MiB/s (vs disk) | "
                    "save to commit s | MiB/s end to end (vs disk) |", "|---|---|---|---|---|---|---|---|"]
        for r in ckpt:
            if "disk_bytes_per_s" in r:
                out.append(f"| {r['label']} | {gib(r['bytes'])} | | | {r['write_s']:.2f} | "
                           f"{r['disk_bytes_per_s'] / 2**20:,.0f} | | |")
                continue
            vs = lambda k, r=r: f" ({r[k]:.2f})" if r.get(k) else ""  # noqa: E731
            out.append(f"| {r['label']} | {gib(r['bytes'])} | {ms(r['stall_s'])} ({pct(r['stall_per_step'])}) | "
                       f"{ms(r['overlap_s'])} | {r['write_s']:.2f} | "
                       f"{num(r['write_bytes_per_s'] and r['write_bytes_per_s'] / 2**20, '{:,.0f}')}{vs('vs_disk')} | "
                       f"{r['save_duration_s']:.2f} | {r['end_to_end_bytes_per_s'] / 2**20:,.0f}{vs('end_to_end_vs_disk')} |")
    lost = [r for r in rows if r.get("kind") == "lost worker" and "recovery_s" in r]
    if lost:
        out += ["", "| lost worker | detection s | recovery s | grid before -> after (micro-batches after) | "
                    "steps redone | tokens/s before | tokens/s after | held after the loss |",
                "|---|---|---|---|---|---|---|---|"]
        for r in lost:
            held = ", ".join(f"{v:g} {k}" for k, v in r["held"].items()) or "none: survivors kept"
            if "workers_kept" in r:
                held += f" (kept {r['workers_kept']}, started {r.get('workers_started', '?')})"
            out.append(f"| {r['label']} | {r['detection_s']:.2f} | {r['recovery_s']:.2f} | {r['failed_grid']} -> "
                       f"{r['recovered_grid']} ({r['microbatches_after']} mb) | {r['steps_lost']} | "
                       f"{num(r['tokens_per_s_before'], '{:,.0f}')} | {num(r['tokens_per_s_after'], '{:,.0f}')} | "
                       f"{held} |")
    return "\n".join(out)
