"""Elastic suite: a stage worker killed mid-run, recovered in place (`elastic.enabled`), against
a full restart of the same job from the same checkpoint (a new Trainer resuming it, as Ray
Train restarts a failed run).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from raypar.driver.callbacks import Callback

if TYPE_CHECKING:
    from raypar.driver.trainer import Trainer

    from bench.run import Context

TITLE = "recovery from a killed stage worker against a full restart from the same checkpoint"
NOTES = ("detection: from the step's start to the failure being seen; recovery: from detection to the end of "
         "the first step after it (raypar's summary.recoveries), in phases: the survivors' abort and teardown, "
         "workers up (replacements started, process groups and stages built), checkpoint load, first step; "
         "workers up includes the workers' setup: per phase the longest over the workers (groups: the "
         "rendezvous; data_kernels: data and CUDA kernels; build: the stage and optimizer; connect: the first "
         "exchange with the neighbours and the world); "
         "restart: from constructing a new Trainer "
         "(checkpoint.resume=the checkpoint the recovery loaded) to the end of its first step, in the same "
         "Ray cluster; ratio: recovery / restart (below 1: recovering in place is faster). With a standby: "
         "elastic.standby_workers=1, a started idle worker takes the lost one's place (it needs resources beyond "
         "the grid's: a third GPU on GPU).")

EVERY = 2  # checkpoint interval of the killed run
KILL_AFTER = 2  # the worker dies after this step (0-based), once the save before it committed


class KillAfterCommit(Callback):
    """Kills stage worker `rank` after step `at`, once the save started before it committed.

    Waiting for the commit makes the recovery and the full restart resume from the same step.
    After the recovery's first step the run stops: the rest would measure nothing new.
    """

    def __init__(self, at: int, rank: int):
        self.at, self.rank = at, rank
        self.killed_at: float | None = None

    def on_step_end(self, trainer: "Trainer", record) -> None:
        import ray

        if record.step == self.at and self.killed_at is None:
            trainer.saver.finish()
            # A standby still starting would not be used: measure the recovery it is there for.
            ray.get([w.address.remote() for w, _ in trainer.group.reserve.standbys], timeout=300)
            self.killed_at = time.time()
            ray.kill(trainer.group.workers[self.rank])

    def on_recovery(self, trainer: "Trainer", recovery) -> None:
        trainer.request_stop(save=False)


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
    steps = max(ctx.default_steps(), KILL_AFTER + 2)
    # A survivor is back within about a second (its abort and teardown); 5 s bound a
    # recovery whose survivor is stuck, instead of the default 15.
    overrides = ["parallel.pp=2", "elastic.enabled=true", "elastic.min_workers=2", "elastic.resource_timeout_s=60",
                 f"checkpoint.every={EVERY}", "checkpoint.keep_last=3", "elastic.survivor_timeout_s=5"]
    cfg = ctx.config(overrides, "killed", steps=steps)
    cfg.data.path = ctx.corpus(cfg)
    label = f"elastic recovery: stage worker {cfg.parallel.pp - 1} killed after step {KILL_AFTER}"
    recovered: dict = {}
    rows = ctx.attempt(label, lambda: recovery_row(ctx, cfg, label, recovered), min_time_s=60)
    standby_label = label + ", with a standby worker"
    if ctx.cpu or ray_gpus() >= cfg.parallel.pp + 1:
        standby_cfg = ctx.config([*overrides, "elastic.standby_workers=1"], "killed-standby", steps=steps)
        standby_cfg.data.path = cfg.data.path
        rows += ctx.attempt(standby_label, lambda: recovery_row(ctx, standby_cfg, standby_label, {}), min_time_s=60)
    else:
        rows.append({"label": standby_label, "unavailable": f"needs a GPU beyond the grid's {cfg.parallel.pp}"})
    if recovered:
        rows += ctx.attempt("full restart from the same checkpoint", lambda: restart_row(ctx, cfg, recovered))
    restart = next((r for r in rows if "restart_s" in r), None)
    for r in rows:
        if restart is not None and "recovery_s" in r:
            r["recovery_vs_restart"] = r["recovery_s"] / restart["restart_s"]
    return rows


def ray_gpus() -> int:
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def recovery_row(ctx: "Context", cfg, label: str, recovered: dict) -> dict:
    from raypar.checkpoint import checkpoint_dir

    kill = KillAfterCommit(KILL_AFTER, cfg.parallel.pp - 1)
    trainer = ctx.trainer(cfg, label, callbacks=[kill])
    summary = trainer.fit()
    if not summary.recoveries and trainer.bench_stop.stopped_after is not None:
        return {"label": label, "skipped": f"time budget: stopped after step {trainer.bench_stop.stopped_after}, "
                                           f"before the kill"}
    if not summary.recoveries:
        raise RuntimeError(f"no recovery recorded (killed: {kill.killed_at is not None}, restarts {summary.restarts})")
    event = summary.recoveries[0]
    # Step 0 means no checkpoint had committed: the recovery started over, and so does the restart.
    path = checkpoint_dir(trainer.saver.root, event["resumed_step"]) if event["resumed_step"] else None
    recovered.update(event, path=path and str(path))
    phases = {k: event.get(k) for k in ("salvage_s", "workers_s", "setup_s", "load_s", "first_step_s", "workers_kept",
                                         "workers_started", "workers_from_standby")}
    return ctx.row(label, cfg, summary, detection_s=event["detection_s"], recovery_s=event["recovery_s"],
                   steps_lost=event["steps_lost"], failed_grid=event["failed_grid"], recovered_grid=event["grid"],
                   resumed_step=event["resumed_step"], **phases)


def restart_row(ctx: "Context", killed_cfg, recovered: dict) -> dict:
    label = "full restart from the same checkpoint"
    overrides = ["parallel.pp=2", "checkpoint.every=0"]
    if recovered["path"]:
        overrides.append(f"checkpoint.resume={recovered['path']}")
    cfg = ctx.config(overrides, "restart", steps=recovered["resumed_step"] + 1)
    cfg.data.path = killed_cfg.data.path
    first = FirstStep()
    t0 = time.monotonic()
    summary = ctx.trainer(cfg, label, callbacks=[first]).fit()
    if first.first_step is None:
        raise RuntimeError("the restarted run ran no step")
    restart_s = first.first_step - t0
    return ctx.row(label, cfg, summary, restart_s=restart_s, workers_up_s=first.up - t0,
                   first_step_s=first.first_step - first.up, resumed_step=recovered["resumed_step"])


def table(rows: list[dict]) -> str:
    lines = ["| run | detection s | recovery / restart s (to first step end) | survivors' teardown s | "
             "workers up s | checkpoint load s | first step s | workers kept / started / from standby | steps redone | grid | "
             "recovery / restart |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda v: "" if v is None else f"{v:.2f}"  # noqa: E731
    for r in rows:
        if "recovery_s" in r:
            kept = "" if r.get("workers_kept") is None else (
                f"{r['workers_kept']} / {r.get('workers_started', 0)} / {r.get('workers_from_standby', 0)}")
            ratio = "" if r.get("recovery_vs_restart") is None else f"{r['recovery_vs_restart']:.2f}"
            setup = r.get("setup_s") or {}
            up = f(r.get("workers_s")) + (" (setup: " + ", ".join(f"{k} {v:.2f}" for k, v in setup.items()) + ")"
                                          if setup else "")
            lines.append(f"| {r['label']} | {r['detection_s']:.2f} | {r['recovery_s']:.2f} | {f(r.get('salvage_s'))} | "
                         f"{up} | {f(r.get('load_s'))} | {f(r.get('first_step_s'))} | {kept} | "
                         f"{r['steps_lost']} | {r['failed_grid']} -> {r['recovered_grid']} | {ratio} |")
        elif "restart_s" in r:
            lines.append(f"| {r['label']} (from step {r['resumed_step']}) | | {r['restart_s']:.2f} | | "
                         f"{r['workers_up_s']:.2f} (with the load) | | {f(r.get('first_step_s'))} | | | {r['grid']} | |")
    return "\n".join(lines)
