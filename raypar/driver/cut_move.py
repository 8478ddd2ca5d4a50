"""Moving the workers to another cut of the model between two steps (a schedule with another
number of chunks per stage): on the devices, or through a checkpoint.

On the devices (`parallel.move_through: devices`, where every worker has room): each worker
keeps its state's tensors on its device while the same workers rebuild their stages, then
each tensor goes to the worker that now needs it, point to point (`raypar.runtime.state_move`).
Through a checkpoint: the state is saved and committed, the stages rebuilt, the checkpoint
loaded; in the node's shared memory where every worker runs on one node with room there
(`raypar.runtime.scratch`), else in the run's checkpoint directory (removed once loaded with
checkpoint.every=0).
"""
from __future__ import annotations

import time
from typing import Callable

from raypar.actors.worker_group import WorkerGroup, WorkersLost
from raypar.config import Config
from raypar.driver.saver import Saver, SaveResult
from raypar.runtime.state_move import MoveFailed
from raypar.schedule import Layout
from raypar.schedule.choice import describe
from raypar.topology import Grid


def room_on_devices(group: WorkerGroup, new_cfg: Config) -> str | None:
    """Why the workers cannot move to `new_cfg`'s cut on their devices, or None when they can."""
    short = [(rank, need, free) for rank, (need, free) in enumerate(group.move_room(new_cfg)) if need > free]
    if not short:
        return None
    rank, need, free = short[0]
    return (f"{len(short)} workers lack the memory to hold their state twice (rank {rank}: "
            f"{need / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free)")


def move_on_devices(group: WorkerGroup, saver: Saver, new_cfg: Config) -> dict:
    """Rebuild the workers' stages on `new_cfg`'s cut, their state kept on their devices and
    sent where it is needed; returns the move's record (its phases' seconds)."""
    t0 = time.perf_counter()
    saver.finish()  # a save in flight copies from the stages about to go
    t1 = time.perf_counter()
    held = group.rebuild(new_cfg, hold_state=True)
    t2 = time.perf_counter()
    try:
        done, (local, sent) = group.move_state(held)
    except MoveFailed:
        raise
    except Exception as e:  # noqa: BLE001 - the stages are cut anew but hold no state: recover
        raise MoveFailed(f"moving the state to the new cut failed: {str(e)[:300]}") from e
    return {"through": "devices", "save_s": t1 - t0, "rebuild_s": t2 - t1, "load_s": time.perf_counter() - t2,
            "bytes": local + sent, "sent_bytes": sent,
            # Of load_s, the slowest worker's: sending and receiving, loading into its stage.
            "exchange_s": max(d["exchange_s"] for d in done), "state_load_s": max(d["load_s"] for d in done)}


def move_through_checkpoint(group: WorkerGroup, saver: Saver, cfg: Config, new_cfg: Config, grid: Grid,
                            layout: Layout, steps_done: int, consumed: int,
                            log: Callable[[str], None]) -> dict | str:
    """Save the state after `steps_done` steps, rebuild the stages on `new_cfg`'s cut, load
    it; returns the move's record, or why not when the save failed (the cut is unchanged)."""
    from raypar.checkpoint import checkpoint_dir

    t0 = time.perf_counter()
    root = str(saver.root)
    scratch = group.checkpoints.make_scratch(root, sum(i["state_bytes"] for i in group.info))
    if scratch is not None:
        saved = saver.save_scratch(steps_done, consumed, cfg, grid, scratch)
        if saved.error is not None:
            group.checkpoints.remove_scratch(root, scratch)
            check_alive(group, saved, steps_done, layout)
            log(f"raypar: the move's checkpoint in shared memory failed ({saved.error[:200]}); saving it to "
                f"the checkpoint directory instead")
            scratch = None
    if scratch is None:
        saved = saver.save_now(steps_done, consumed, cfg, grid)
        if saved.error is not None:
            check_alive(group, saved, steps_done, layout)
            return f"the checkpoint that moves the model to its cut failed ({saved.error[:200]})"
    t1 = time.perf_counter()
    group.rebuild(new_cfg)
    t2 = time.perf_counter()
    if scratch is not None:
        # Read where it was written: the workers' node, which the driver may not be on.
        group.checkpoints.load(saved.path, same_grid=True)
        group.checkpoints.remove_scratch(root, scratch)
    else:
        resumed = saver.resume(checkpoint_dir(saver.root, steps_done), cfg, grid)
        if (resumed.step, resumed.consumed_samples) != (steps_done, consumed):
            raise RuntimeError(f"moving to {describe(layout)} loaded step {resumed.step} "
                               f"({resumed.consumed_samples} samples), not {steps_done} ({consumed})")
        if cfg.checkpoint.every <= 0:
            saver.discard(saved)  # the run keeps no checkpoints: this one only moved the state
    return {"through": "shared memory" if scratch is not None else "storage", "save_s": t1 - t0,
            "rebuild_s": t2 - t1, "load_s": time.perf_counter() - t2, "bytes": saved.bytes,
            # Of save_s, the slowest worker's: waiting for its snapshot's copies off the device, writing.
            "copy_wait_s": saved.copy_wait_s, "write_s": saved.write_s}


def check_alive(group: WorkerGroup, saved: SaveResult, steps_done: int, layout: Layout) -> None:
    """A move's save failed: a lost worker is a failure to recover from, not a cut to give up."""
    if not group.all_alive():
        raise WorkersLost(f"a stage worker was lost while saving step {steps_done} to move the model to "
                          f"{describe(layout)}: {saved.error[:200]}")
