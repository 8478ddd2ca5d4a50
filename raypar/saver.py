"""Driver side of checkpointing: when to save, what is in flight, what it cost.

Saves never block the step loop unless `checkpoint.when_busy=wait` meets a save that is
still writing. Workers copy their state after the step (overlapping the next one), the
writers write, and the commit lands later; the driver only polls.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from raypar.config import Config
from raypar.topology import Grid


@dataclass
class SaveResult:
    step: int
    path: str | None
    bytes: int
    write_s: float  # slowest writer's time for its shards
    duration_s: float  # from the save's start to its commit being seen
    error: str | None = None

    @property
    def write_bytes_per_s(self) -> float:
        return self.bytes / self.write_s if self.write_s > 0 else 0.0


class Saver:
    def __init__(self, cfg: Config, run_dir: Path, grid: Grid, log: Callable[[str], None],
                 on_result: Callable[[SaveResult], object] = lambda r: None):
        self.cfg = cfg
        self.on_result = on_result
        self.grid = grid
        self.log = log
        self.root = Path(cfg.checkpoint.dir).expanduser().resolve() if cfg.checkpoint.dir else run_dir / "checkpoints"
        self.results: list[SaveResult] = []
        self.skipped = 0
        self._pending = None  # (step, commit ref, start time)
        self._writers_failed = False

    def due(self, steps_done: int) -> bool:
        every = self.cfg.checkpoint.every
        return every > 0 and (steps_done % every == 0 or steps_done == self.cfg.train.steps)

    def snapshot_options(self) -> dict:
        return {"save_optimizer": self.cfg.checkpoint.save_optimizer, "save_master": self.cfg.checkpoint.save_master}

    def ema_due(self, steps_done: int) -> bool:
        c = self.cfg.checkpoint
        return c.ema_decay > 0 and steps_done % c.ema_every == 0

    def ready_for(self) -> tuple[bool, float]:
        """May a save start now? Returns (go, seconds the loop was held up deciding)."""
        self.poll()
        if self._pending is None:
            return True, 0.0
        if self.cfg.checkpoint.when_busy == "skip":
            self.skipped += 1
            self.log(f"checkpoint: step {self._pending[0]} is still being written; skipping this save "
                     f"(checkpoint.when_busy=skip)")
            return False, 0.0
        t0 = time.perf_counter()
        self.finish()
        return True, time.perf_counter() - t0

    def start_writers(self, group) -> None:
        """Start the writers before training: an actor start inside the loop would stall it."""
        if self.cfg.checkpoint.every > 0:
            import ray

            ray.get([w.cleanup.remote() for w in group.writers(str(self.root)).values()],
                    timeout=self.cfg.checkpoint.timeout_s)

    def begin(self, group, steps_done: int, consumed: int, update_ema: bool = False) -> None:
        from raypar.checkpoint import checkpoint_dir

        if self._writers_failed:
            group.reset_writers()
            self._writers_failed = False
        # Partial directories of failed saves go; the one about to be written stays.
        group.writers(str(self.root))[group.info[0]["node_id"]].cleanup.remote([str(checkpoint_dir(self.root, steps_done))])
        meta = {"consumed_samples": consumed, "config": self.cfg.to_dict(),
                "topology": {"dp": self.grid.dp, "pp": self.grid.pp, "ep": self.grid.ep},
                "extra": {"schedule": "lr is a function of the step (raypar.optim.lr_at)"}}
        self._pending = (steps_done, group.save(str(self.root), steps_done, meta, update_ema), time.perf_counter())

    def poll(self, timeout: float = 0.0) -> None:
        import ray

        if self._pending is None:
            return
        step, ref, t0 = self._pending
        done, _ = ray.wait([ref], timeout=timeout)
        if not done:
            return
        self._pending = None
        try:
            r = ray.get(ref)
        except Exception as e:  # noqa: BLE001 - a failed save must not stop training
            self.results.append(SaveResult(step, None, 0, 0.0, time.perf_counter() - t0, error=repr(e)[:500]))
            self._writers_failed = True
            self.on_result(self.results[-1])
            self.log(f"checkpoint: saving step {step} failed ({type(e).__name__}); its partial files are "
                     f"removed at the next save, the last committed checkpoint stays valid")
            return
        result = SaveResult(step, r["path"], r["bytes"], r["write_s"], time.perf_counter() - t0)
        self.results.append(result)
        self.on_result(result)
        self.log(f"checkpoint: step {step} committed, {result.bytes / 2**20:.1f} MiB at "
                 f"{result.write_bytes_per_s / 2**20:.0f} MiB/s -> {result.path}")

    def abandon(self) -> bool:
        """Forget the save in flight (its workers are gone); its partial files are cleaned later.

        Returns whether a save was in flight: its writers are then replaced at the next save.
        """
        if self._pending is None:
            return False
        step = self._pending[0]
        self._pending = None
        self.results.append(SaveResult(step, None, 0, 0.0, 0.0, error="abandoned: workers lost during the save"))
        self.on_result(self.results[-1])
        self._writers_failed = True
        return True

    def finish(self) -> None:
        """Wait for the save in flight, up to checkpoint.timeout_s."""
        if self._pending is None:
            return
        step = self._pending[0]
        self.poll(timeout=self.cfg.checkpoint.timeout_s)
        if self._pending is not None:
            self._pending = None
            self.results.append(SaveResult(step, None, 0, 0.0, self.cfg.checkpoint.timeout_s,
                                           error=f"not committed within checkpoint.timeout_s={self.cfg.checkpoint.timeout_s:g}s"))
            self.on_result(self.results[-1])
            self.log(f"checkpoint: step {step} did not commit within checkpoint.timeout_s; it is not valid")
