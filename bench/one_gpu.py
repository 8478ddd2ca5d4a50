"""What one GPU can show of issues 24 and 26, in alternating launches (each its own process):

- MoE against dense on one device: `configs/moe-scale.yaml` at pp=1, ep=1 with the custom
  kernels on and off, against `configs/gpt-1b.yaml` at pp=1, the same batch (16 x 1024
  tokens); MFU by active parameters. No all-to-all (ep=1): its exposed share needs 2 GPUs.
  `dense-accumulation-unfused`: the dense run with its linear layers' weight gradients
  written in bf16 and added into the fp32 gradients by a kernel after each GEMM
  (`runtime.grad_accumulation_fusion=false`), against the GEMM accumulating into them.
- States copied to host memory after every step (`elastic.memory_every=1`), into shared
  memory registered with CUDA (the default) or the worker's own pinned memory, against none:
  the whole `gpt-1b.yaml` (0.84B) on one worker, so no replica travels to a peer and the
  worker holds 4 copies of its 11.8 GB state (`-4-layers` kinds: the model cut to 4 layers).
- A killed worker's recovery on one GPU (`recovery-borrowed`: the 4-layer model; `-whole`: the
  0.84B model), with copies every step and a save every 4 steps; its only worker is killed
  after a save has committed, and a standby that holds no GPU takes the GPU once the lost
  process is gone, restoring from the copies the lost process left in shared memory. Kill
  to the first step after it, and the recovery's phases. One worker, so no survivor and no
  replica. `recovery-borrowed-storage`: the same with no copies in memory, so the standby
  loads the last committed checkpoint from storage.
- A switch of schedule that moves the model to another cut (`Trainer.switch_schedule`): the
  whole 0.84B on one worker goes from one chunk (1F1B) to ZB-V's two chunks after step
  MOVE_AT, on the device (`cut-move`: the state stays where it is while the stage is rebuilt),
  against the same run without (`cut-stay`): the move's phases (saves in flight finished or
  checkpoint to commit, stages rebuilt, loaded), its wall time seen by the loop, and the losses
  of the runs side by side; `cut-zb-v` runs ZB-V from the start. `cut-move-shm` moves through
  a checkpoint in the node's shared memory (`parallel.move_through=checkpoint`), and
  `cut-move-storage` through the checkpoint directory, as where the workers span nodes.

    python -m bench.one_gpu --out DIR [--rounds 2] [--kinds dense,moe-kernels-on,...] [--cpu]

Writes DIR/one_gpu.json and DIR/one_gpu.md.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench.launches import alternate

ROOT = Path(__file__).resolve().parent.parent
ON_ONE = ["parallel.pp=1", "parallel.ep=1", "train.global_batch_size=16"]
MEMORY = ["parallel.pp=1", "elastic.enabled=true", "checkpoint.every=0"]
FOUR_LAYERS = [*MEMORY, "model.n_layers=4"]
RECOVERY = ["elastic.memory_every=1", "checkpoint.every=4", "checkpoint.when_busy=skip", "checkpoint.keep_last=2",
            "elastic.standby_workers=1", "elastic.standby_gpu=borrow", "elastic.survivor_timeout_s=5",
            "elastic.min_workers=1"]
KINDS = {
    "dense": ("gpt-1b.yaml", ON_ONE),
    "dense-accumulation-unfused": ("gpt-1b.yaml", [*ON_ONE, "runtime.grad_accumulation_fusion=false"]),
    "moe-kernels-on": ("moe-scale.yaml", [*ON_ONE, "runtime.kernels=true"]),
    "moe-kernels-off": ("moe-scale.yaml", [*ON_ONE, "runtime.kernels=false"]),
    "memory-off": ("gpt-1b.yaml", [*MEMORY, "elastic.memory_every=0"]),
    "memory-shared": ("gpt-1b.yaml", [*MEMORY, "elastic.memory_every=1", "elastic.memory_shared=true"]),
    "memory-pinned": ("gpt-1b.yaml", [*MEMORY, "elastic.memory_every=1", "elastic.memory_shared=false"]),
    "memory-off-4-layers": ("gpt-1b.yaml", [*FOUR_LAYERS, "elastic.memory_every=0"]),
    "memory-shared-4-layers": ("gpt-1b.yaml", [*FOUR_LAYERS, "elastic.memory_every=1"]),
    "recovery-borrowed": ("gpt-1b.yaml", [*FOUR_LAYERS, *RECOVERY]),
    "recovery-borrowed-whole": ("gpt-1b.yaml", [*MEMORY, *RECOVERY]),
    "recovery-borrowed-storage": ("gpt-1b.yaml", [*MEMORY, *RECOVERY, "elastic.memory_every=0"]),
    "cut-stay": ("gpt-1b.yaml", ON_ONE),
    "cut-move": ("gpt-1b.yaml", ON_ONE),
    "cut-move-shm": ("gpt-1b.yaml", [*ON_ONE, "parallel.move_through=checkpoint"]),
    "cut-move-storage": ("gpt-1b.yaml", [*ON_ONE, "parallel.move_through=checkpoint"]),
    "cut-zb-v": ("gpt-1b.yaml", [*ON_ONE, "parallel.schedule=zb-v"]),
}
# Ratios the table shows: (kind, against).
RATIOS = [("moe-kernels-on", "dense"), ("moe-kernels-on", "moe-kernels-off"), ("dense", "dense-accumulation-unfused"),
          ("memory-shared", "memory-off"),
          ("memory-pinned", "memory-off"), ("memory-shared-4-layers", "memory-off-4-layers"),
          ("cut-move", "cut-stay")]
STEADY_FROM = 3  # steps before this one pay for warm-up
MOVE_AT = 4  # cut-move switches to zb-v after this step


def switch_once(at: int, schedule: str):
    """A callback that switches the run to `schedule` after step `at`."""
    from raypar.driver.callbacks import Callback

    class SwitchOnce(Callback):
        def on_step_end(self, trainer, record) -> None:
            if record.step == at:
                trainer.switch_schedule(schedule)

    return SwitchOnce()


def launch(kind: str, steps: int, work: Path, cpu: bool) -> dict:
    from raypar import Trainer, load_config

    config, overrides = KINDS[kind]
    if cpu:  # the script's check: tiny models, same switches
        config = "tiny-moe.yaml" if kind.startswith("moe") else "tiny.yaml"
        overrides = [o for o in overrides if not o.startswith(("model.n_layers", "train.global_batch_size"))]
        overrides += ["runtime.device=cpu"]
    if kind.startswith("recovery"):
        return recovery(kind, config, overrides, work)
    cfg = load_config(str(ROOT / "configs" / config),
                      [*overrides, f"train.steps={steps}", f"runtime.run_dir={work / kind}", "runtime.log_every=100"])
    callbacks = [switch_once(MOVE_AT, "zb-v")] if kind.startswith("cut-move") else []
    if kind == "cut-move-storage":
        from raypar.actors.checkpoints import WorkerCheckpoints

        WorkerCheckpoints.make_scratch = lambda self, root, nbytes: None  # this launch's process only
    t0 = time.perf_counter()
    s = Trainer(cfg, callbacks=callbacks, log=lambda m: None).fit()
    wall_s = time.perf_counter() - t0
    # A moved run's steady steps: those after the first on the new cut.
    steady = s.records[MOVE_AT + 2:] if kind.startswith("cut") else s.records[STEADY_FROM:]
    step_s = statistics.median(r.step_time_s for r in steady)
    out = {"kind": kind, "tokens_per_s": cfg.train.global_batch_size * cfg.data.seq_len / step_s,
           "step_ms": 1000 * step_s, "mfu": s.mfu, "steps_ms": [round(1000 * r.step_time_s) for r in s.records],
           "memory_copies": sum(1 for r in s.records if r.memory_copied), "overrides": overrides, "config": config,
           "peak_gib": max(max(r.peak_device_bytes) for r in s.records) / 2**30}
    if kind.startswith("cut"):
        out.update(losses=[r.loss for r in s.records], schedules=[r.schedule for r in s.records], moves=s.moves,
                   wall_s=wall_s, peak_device_gib=[round(max(r.peak_device_bytes) / 2**30, 2) for r in s.records])
    return out


def recovery(kind: str, config: str, overrides: list[str], work: Path) -> dict:
    """Kill the only worker once a save has committed; the run stops after the first step
    completed after the recovery (`bench.elastic.KillOnceCommitted`)."""
    from bench.elastic import KillOnceCommitted
    from raypar import Trainer, load_config

    kill = KillOnceCommitted(0, min_step=7)  # after the save of step 4 (the first can be skipped)
    cfg = load_config(str(ROOT / "configs" / config),
                      [*overrides, "train.steps=200", f"runtime.run_dir={work / kind}", "runtime.log_every=100"])
    s = Trainer(cfg, callbacks=[kill], log=lambda m: None).fit()
    if not s.recoveries or kill.kill_to_step_s is None:
        raise RuntimeError(f"no recovery recorded (killed after step {kill.killed_after})")
    event = s.recoveries[0]
    keys = ("detection_s", "salvage_s", "workers_s", "setup_s", "load_s", "first_step_s", "recovery_s", "steps_lost",
            "source", "workers_kept", "workers_started", "workers_from_standby")
    return {"kind": kind, "kill_to_step_s": kill.kill_to_step_s, "killed_after": kill.killed_after,
            **{k: event.get(k) for k in keys}, "overrides": overrides, "config": config}


def describe(r: dict) -> str:
    if "kill_to_step_s" in r:
        return (f"kill to step {r['kill_to_step_s']:.2f} s (state load {r['load_s']:.2f} s, first step "
                f"{r['first_step_s']:.2f} s), {r['steps_lost']} steps redone from {r['source']}")
    return f"{r['tokens_per_s']:,.0f} tokens/s, step {r['step_ms']:.0f} ms, MFU {r['mfu']:.3f}"


def table(results: list[dict]) -> str:
    by_kind: dict[str, list[dict]] = {}
    for r in results:
        if "kill_to_step_s" not in r:
            by_kind.setdefault(r["kind"], []).append(r)
    med = {k: statistics.median(x["tokens_per_s"] for x in rs) for k, rs in by_kind.items()}
    lines = ["| launch | tokens/s (each round) | median | MFU | memory copies | peak GiB |", "|---|---|---|---|---|---|"]
    for k, rs in by_kind.items():
        each = " / ".join(f"{x['tokens_per_s']:,.0f}" for x in rs)
        mfu = statistics.median(x["mfu"] for x in rs)
        peak = max((x["peak_gib"] for x in rs if "peak_gib" in x), default=float("nan"))
        lines.append(f"| {k} | {each} | {med[k]:,.0f} | {mfu:.3f} | {rs[0]['memory_copies']} | {peak:.2f} |")
    lines += ["", "| ratio | tokens/s |", "|---|---|"]
    lines += [f"| {a} / {b} | {med[a] / med[b]:.3f} |" for a, b in RATIOS if a in med and b in med]
    moved = [r for r in results if r["kind"].startswith("cut-move") and r.get("moves")]
    stays = [r for r in results if r["kind"] == "cut-stay"]
    if moved:
        lines += ["", "| launch | through | move s (loop waits) | saves finished, or checkpoint to commit s (copies "
                  "off the device, write) | stages rebuilt s | loaded s (exchange, state load) | GiB | run wall s vs "
                  "cut-stay | max loss diff vs cut-stay |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in moved:
            i = [x for x in results if x["kind"] == r["kind"]].index(r)  # its round
            m, stay = r["moves"][0], stays[i] if i < len(stays) else None
            diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], stay["losses"])) if stay else float("nan")
            wall = f"{r['wall_s']:.1f} vs {stay['wall_s']:.1f}" if stay else "-"
            saved = (f"{m['save_s']:.2f}" if m["through"] == "devices" else
                     f"{m['save_s']:.2f} ({m['copy_wait_s']:.2f}, {m['write_s']:.2f})")
            loaded = (f"{m['load_s']:.2f} ({m['exchange_s']:.2f}, {m['state_load_s']:.2f})" if m["through"] == "devices"
                      else f"{m['load_s']:.2f}")
            lines.append(f"| {r['kind']} {i} | {m['through']} | {m['total_s']:.2f} | {saved} | {m['rebuild_s']:.2f} | "
                         f"{loaded} | {m['bytes'] / 2**30:.1f} | {wall} | {diff:.2e} |")
    killed = [r for r in results if "kill_to_step_s" in r]
    if killed:
        lines += ["", "| launch | kill to step s | detection s | survivors' teardown s | workers up s | state load s | "
                  "first step s | steps redone (from) |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['kind']} | {r['kill_to_step_s']:.2f} | {r['detection_s']:.2f} | {r['salvage_s']:.2f} | "
                  f"{r['workers_s']:.2f} | {r['load_s']:.2f} | {r['first_step_s']:.2f} | {r['steps_lost']} "
                  f"({r['source']}) |" for r in killed]
    return "\n".join(lines) + "\n"


def main() -> None:
    alternate("bench.one_gpu", __doc__, list(KINDS), list(KINDS), 12, "/tmp/one-gpu", launch, describe, table,
              "one_gpu")


if __name__ == "__main__":
    main()
