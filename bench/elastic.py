"""Elastic suite: what keeping the workers' states in memory costs a step, and a stage worker
killed mid-run, recovered in place (`elastic.enabled`), against a full restart of the job
from its last committed checkpoint (a new Trainer resuming it, as Ray Train restarts a
failed run).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from raypar.driver.callbacks import Callback

if TYPE_CHECKING:
    from raypar.driver.trainer import Trainer

    from bench.run import Context

TITLE = ("states in memory every step against none; a killed stage worker recovered in place against a full restart "
         "from the last committed checkpoint")
NOTES = ("memory copies: `elastic.memory_every=1` (every worker copies its whole state to host memory after each step "
         "and sends copies to a peer as fast as they travel) against `=0`, no saves, tokens/s of the steady steps, "
         "same config otherwise; copies in shared memory registered with CUDA (`elastic.memory_shared`, the default), "
         "on GPU also in the workers' own pinned memory. "
         "Killed runs: `elastic.memory_every=1` and a save every few steps (`when_busy=skip`); the worker dies at the "
         "end of the first step after a checkpoint has committed and the memory ring is full, whatever is being "
         "copied or replicated then. kill to step: from the kill to the end of the first step completed after it, "
         "as a user sees it; detection: from the killed step's start to the failure being seen; recovery: from "
         "detection to the end of the first step after it (raypar's summary.recoveries), in phases: the survivors' "
         "abort and teardown, workers up (replacements started, process groups and stages built), state load "
         "(from memory or storage), first step. With `elastic.memory_shared=false` the lost worker's own copies die with "
         "it and its rank comes back from its replica. Standby: a started idle worker takes the lost one's place, holding "
         "a GPU of its own (`elastic.standby_gpu=own`: a GPU beyond the grid's) or borrowing the lost worker's once "
         "its process has ended (`=borrow`). Restart: from constructing a new Trainer "
         "(checkpoint.resume=the newest checkpoint committed at the kill) to the end of its first step, in the same "
         "Ray cluster; its steps redone are those since that checkpoint. ratio: kill to step / restart.")

KILL_RANK = -1  # the last stage's worker (it holds the head; pp=2: rank 1)


def every(ctx: "Context") -> int:
    # A 1B model's save takes seconds: saves every 4 of ~0.3 s steps, skipped while one writes.
    return 2 if ctx.cpu else 4


class KillOnceCommitted(Callback):
    """Kills the stage worker `rank` at the end of the first step from `min_step` on at which a
    checkpoint has committed (and any standby has started), records when, and stops the run
    after the first step completed after the recovery."""

    def __init__(self, rank: int, min_step: int):
        self.rank, self.min_step = rank, min_step
        self.killed_at: float | None = None
        self.killed_after: int | None = None
        self.checkpoint: str | None = None
        self.kill_to_step_s: float | None = None
        # Where the step before the kill and the first step after the recovery spent their time.
        self.before: dict | None = None
        self.after: dict | None = None

    def on_step_end(self, trainer: "Trainer", record) -> None:
        import ray

        if self.kill_to_step_s is not None and self.after is None:
            self.after = step_parts(record)
        if self.killed_at is not None or record.step < self.min_step:
            return
        committed = trainer.saver.last_committed()
        if committed is None:
            return
        # A standby still starting would not be used: measure the recovery it is there for.
        ray.get([w.address.remote() for w, _ in trainer.group.reserve.standbys], timeout=300)
        self.checkpoint, self.killed_after = committed, record.step
        self.before = step_parts(record)
        self.killed_at = time.monotonic()
        ray.kill(trainer.group.workers[self.rank])

    def on_recovery(self, trainer: "Trainer", recovery) -> None:
        # Called once the first step after the recovery is done.
        self.kill_to_step_s = time.monotonic() - self.killed_at
        trainer.request_stop(save=False)


def step_parts(record) -> dict:
    """A step's time as the driver saw it and as each worker spent it (ms): forward,
    backward and idle per worker, checkpoint or memory-copy stall, data wait, and the
    driver's share outside the workers."""
    ms = lambda v: round(v * 1000, 1)  # noqa: E731
    return {"step": record.step, "step_ms": ms(record.step_time_s), "stall_ms": ms(record.checkpoint_stall_s),
            "data_wait_ms": ms(record.data_wait_s), "control_overhead": round(record.control_overhead, 4),
            "workers": [{"stage": t.stage, "forward_ms": ms(t.forward_s), "backward_ms": ms(t.backward_s),
                         "idle_ms": ms(t.idle_s)} for t in record.stage_times]}


class FirstStep(Callback):
    """When the workers came up and when the first step ended (time.monotonic)."""

    def __init__(self) -> None:
        self.up: float | None = None
        self.first_step: float | None = None

    def on_train_start(self, trainer: "Trainer") -> None:
        self.up = self.up or time.monotonic()

    def on_step_end(self, trainer: "Trainer", record) -> None:
        self.first_step = self.first_step or time.monotonic()


def run(ctx: "Context") -> list[dict]:
    rows = memory_cost_rows(ctx)
    base = ["parallel.pp=2", "elastic.enabled=true", "elastic.min_workers=2", "elastic.resource_timeout_s=60",
            "elastic.memory_every=1", f"checkpoint.every={every(ctx)}", "checkpoint.when_busy=skip",
            "checkpoint.keep_last=3", "elastic.survivor_timeout_s=5"]
    # Enough steps for a save to commit beside them (a 1B model's takes ~10 s); the run stops
    # after the recovery's first step.
    steps = 12 if ctx.cpu else 200
    gpus, pp = ray_gpus(), 2
    kinds = [("without a standby", [])]
    if not ctx.cpu:
        # The lost process's own copies die with it: its rank comes back from its replica.
        kinds.append(("without a standby, copies in the workers' own memory", ["elastic.memory_shared=false"]))
    if gpus > pp:
        kinds.append(("with a standby holding a GPU of its own", ["elastic.standby_workers=1"]))
    elif not ctx.cpu:  # on CPU a standby holds no GPU either way: the borrowing row runs its path
        kinds.append(("with a standby holding a GPU of its own", None))
    if ctx.cpu or gpus >= pp:
        kinds.append(("with a standby borrowing the lost worker's GPU",
                      ["elastic.standby_workers=1", "elastic.standby_gpu=borrow"]))
    killed: dict = {}
    for kind, extra in kinds:
        label = f"stage worker {pp - 1} killed, recovered in place {kind}"
        if extra is None:
            rows.append({"label": label, "unavailable": f"needs a GPU beyond the grid's {pp}"})
            continue
        cfg = ctx.config([*base, *extra], label, steps=steps)
        cfg.data.path = ctx.corpus(cfg)
        rows += ctx.attempt(label, lambda: recovery_row(ctx, cfg, label, killed), min_time_s=90)
    if killed:
        rows += ctx.attempt("full restart from the last committed checkpoint", lambda: restart_row(ctx, killed))
    restart = next((r for r in rows if "restart_s" in r), None)
    for r in rows:
        if restart is not None and r.get("kill_to_step_s"):
            r["vs_restart"] = r["kill_to_step_s"] / restart["restart_s"]
    return rows


def memory_cost_rows(ctx: "Context") -> list[dict]:
    """The same run without and with states in memory after every step (no saves, no kill)."""
    steps = ctx.default_steps(gpu=16)
    rows = []
    # On GPU also copies into the workers' own pinned memory, against shared memory
    # registered with CUDA (`elastic.memory_shared`, the default).
    runs = [(0, True), (1, True)] + ([] if ctx.cpu else [(1, False)])
    for every_n, shared in runs:
        label = f"memory copies: elastic.memory_every={every_n}" + ("" if shared else ", memory_shared=false")
        cfg = ctx.config(["parallel.pp=2", "elastic.enabled=true", f"elastic.memory_every={every_n}",
                          f"elastic.memory_shared={str(shared).lower()}", "checkpoint.every=0"], label, steps=steps)
        cfg.data.path = ctx.corpus(cfg)
        rows += ctx.attempt(label, lambda: memory_row(ctx, label, cfg, every_n) | {"memory_shared": shared})
    off = next((r for r in rows if r.get("memory_every") == 0 and "tokens_per_s" in r), None)
    for on in rows:
        if off and on.get("memory_every") == 1 and "tokens_per_s" in on:
            on["vs_no_memory"] = on["tokens_per_s"] / off["tokens_per_s"]
    return rows


def memory_row(ctx: "Context", label: str, cfg, every_n: int) -> dict:
    """A run's row with how many of its steps' states were copied into memory and sent to a
    peer: a copy waits for the last copy, a replica for the last replica, so `memory_every=1`
    may copy and replicate fewer steps than it asks for, and what the copies cost depends on
    how many there were."""
    summary = ctx.trainer(cfg, label).fit()
    copied = [r.step for r in summary.records if r.memory_copied]
    replicated = [r.step for r in summary.records if r.memory_replicated]
    return ctx.row(label, cfg, summary, memory_every=every_n, memory_copies=len(copied), copied_steps=copied,
                   memory_replicas=len(replicated), replicated_steps=replicated, steps_run=len(summary.records))


def ray_gpus() -> int:
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def recovery_row(ctx: "Context", cfg, label: str, killed: dict) -> dict:
    kill = KillOnceCommitted(KILL_RANK % cfg.parallel.pp, min_step=every(ctx) + 3)
    trainer = ctx.trainer(cfg, label, callbacks=[kill])
    summary = trainer.fit()
    if not summary.recoveries and trainer.bench_stop.stopped_after is not None:
        return {"label": label, "skipped": f"time budget: stopped after step {trainer.bench_stop.stopped_after}, "
                                           f"before the kill"}
    if not summary.recoveries:
        raise RuntimeError(f"no recovery recorded (killed after step {kill.killed_after}, restarts {summary.restarts})")
    event = summary.recoveries[0]
    killed.setdefault("checkpoint", kill.checkpoint)
    killed.setdefault("killed_after", kill.killed_after)
    killed.setdefault("cfg", cfg)
    phases = {k: event.get(k) for k in ("salvage_s", "workers_s", "setup_s", "load_s", "first_step_s", "workers_kept",
                                         "workers_started", "workers_from_standby", "source")}
    return ctx.row(label, cfg, summary, kill_to_step_s=kill.kill_to_step_s, killed_after=kill.killed_after,
                   detection_s=event["detection_s"], recovery_s=event["recovery_s"], steps_lost=event["steps_lost"],
                   failed_grid=event["failed_grid"], recovered_grid=event["grid"], resumed_step=event["resumed_step"],
                   step_before_kill=kill.before, first_step_after=kill.after, **phases)


def restart_row(ctx: "Context", killed: dict) -> dict:
    from raypar.checkpoint import read_manifest

    label = "full restart from the last committed checkpoint"
    path = killed["checkpoint"]
    resumed = read_manifest(path).step
    cfg = ctx.config(["parallel.pp=2", "checkpoint.every=0", f"checkpoint.resume={path}"], "restart",
                     steps=resumed + 1)
    cfg.data.path = killed["cfg"].data.path
    first = FirstStep()
    t0 = time.monotonic()
    summary = ctx.trainer(cfg, label, callbacks=[first]).fit()
    if first.first_step is None:
        raise RuntimeError("the restarted run ran no step")
    return ctx.row(label, cfg, summary, restart_s=first.first_step - t0, workers_up_s=first.up - t0,
                   first_step_s=first.first_step - first.up, resumed_step=resumed,
                   steps_lost=killed["killed_after"] + 1 - resumed)


def table(rows: list[dict]) -> str:
    f = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    lines = ["| run | tokens/s | vs memory_every=0 | steps copied |", "|---|---|---|---|"]
    for r in rows:
        if "memory_every" in r and "tokens_per_s" in r:
            lines.append(f"| {r['label']} | {r['tokens_per_s']:,.0f} | {f(r.get('vs_no_memory'))} | "
                         f"{r.get('memory_copies', '')} of {r.get('steps_run', '')} |")
    lines += ["", "| run | kill to step s | steps redone (from) | detection s | recovery s | survivors' teardown s | "
              "workers up s | state load s | first step s | workers kept / started / from standby | vs restart |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for r in rows:
        if "recovery_s" in r:
            kept = f"{r.get('workers_kept')} / {r.get('workers_started', 0)} / {r.get('workers_from_standby', 0)}"
            setup = r.get("setup_s") or {}
            up = f(r.get("workers_s")) + (" (setup: " + ", ".join(f"{k} {v:.2f}" for k, v in setup.items()) + ")"
                                          if setup else "")
            lines.append(f"| {r['label']} | {f(r.get('kill_to_step_s'))} | {r['steps_lost']} ({r.get('source')}, "
                         f"step {r['resumed_step']}) | {r['detection_s']:.2f} | {r['recovery_s']:.2f} | "
                         f"{f(r.get('salvage_s'))} | {up} | {f(r.get('load_s'))} | {f(r.get('first_step_s'))} | "
                         f"{kept} | {f(r.get('vs_restart'))} |")
            for when, parts in (("the step before the kill", r.get("step_before_kill")),
                                ("the first step after", r.get("first_step_after"))):
                if parts:
                    notes.append(f"- {r['label']}, {when} (step {parts['step']}): {parts['step_ms']:.0f} ms; "
                                 f"stall {parts['stall_ms']:.0f} ms, data wait {parts['data_wait_ms']:.0f} ms, "
                                 f"driver outside the workers {parts['control_overhead']:.1%}; " + "; ".join(
                                     f"stage {w['stage']} forward {w['forward_ms']:.0f}, backward "
                                     f"{w['backward_ms']:.0f}, idle {w['idle_ms']:.0f} ms" for w in parts["workers"]))
        elif "restart_s" in r:
            lines.append(f"| {r['label']} | {r['restart_s']:.2f} (from its start) | {r['steps_lost']} (storage, "
                         f"step {r['resumed_step']}) | | | | {r['workers_up_s']:.2f} (with the load) | | "
                         f"{f(r.get('first_step_s'))} | | |")
    return "\n".join(lines + ([""] + notes if notes else []))
