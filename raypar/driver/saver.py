"""Driver side of checkpointing: when to save, the save in flight, what saves cost, resuming.

Saves never block the step loop unless `checkpoint.when_busy=wait` meets a save that is
still writing. Workers copy their state after the step (overlapping the next one), the
writers write, and the commit lands later; the driver only polls. The worker group's
`checkpoints` part does the work; this decides and keeps the account.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from raypar.checkpoint import CheckpointError
from raypar.checkpoint.storage import Location, is_uri, redact
from raypar.config import Config
from raypar.driver.policies import SavePolicy
from raypar.topology import Grid

if TYPE_CHECKING:
    from raypar.actors.checkpoints import WorkerCheckpoints


@dataclass
class SaveResult:
    step: int
    path: str | None
    bytes: int
    write_s: float  # slowest worker's time writing its shard
    duration_s: float  # from the save's start to its commit being seen
    error: str | None = None
    copy_wait_s: float = 0.0  # slowest worker's wait for its snapshot's device-to-host copies, before writing
    commit_s: float = 0.0  # checking the shards, publishing the manifest, rotating

    @property
    def write_bytes_per_s(self) -> float:
        return self.bytes / self.write_s if self.write_s > 0 else 0.0


def _root(directory: str | None, run_dir: Path) -> Location:
    """Where checkpoints go: `checkpoint.dir` (a local folder, or a URI such as
    s3://bucket/prefix that pyarrow.fs opens), else <run_dir>/checkpoints."""
    if not directory:
        return run_dir / "checkpoints"
    return directory if is_uri(directory) else Path(directory).expanduser().resolve()


def _meta(consumed: int, cfg: Config, grid: Grid, run_state: dict) -> dict:
    """What a checkpoint's manifest says beside its tensors; `run_state`: what the driver
    keeps of the run besides the workers' tensors (the MoE expert biases)."""
    return {"consumed_samples": consumed, "config": cfg.to_dict(),
            "topology": {"dp": grid.dp, "pp": grid.pp, "ep": grid.ep, "tp": grid.tp},
            "extra": {"schedule": "lr is a function of the step (raypar.optim.lr_at)", **run_state}}


class ModelMismatchError(CheckpointError):
    """A checkpoint of another model: the config is wrong, not the checkpoint; no fallback."""


@dataclass(frozen=True)
class Resumed:
    """Where a run resumed: the first step to run and the samples consumed before it."""

    step: int
    consumed_samples: int
    path: Location | None  # None: from step 0, nothing loaded
    loaded: list[dict]  # per worker: rank and bytes read
    load_s: float = 0.0  # reading the manifest and every worker's share
    extra: dict = field(default_factory=dict)  # the manifest's `extra` (what the driver keeps of the run)


class Saver:
    def __init__(self, cfg: Config, run_dir: Path, log: Callable[[str], None],
                 on_result: Callable[[SaveResult], object] = lambda r: None,
                 run_state: Callable[[int], dict] = lambda steps_done: {}):
        """`run_state(steps_done)`: what a checkpoint's manifest adds to its `extra` (`_meta`)."""
        self.run_state = run_state
        self.policy = SavePolicy(cfg.checkpoint, cfg.train.steps)
        self.timeout_s = cfg.checkpoint.timeout_s
        self.when_busy = cfg.checkpoint.when_busy
        self.on_result = on_result
        self.log = lambda message: log(redact(message))  # a storage URI may carry credentials
        self.root = _root(cfg.checkpoint.dir, run_dir)
        self.results: list[SaveResult] = []
        self.skipped = 0
        self._workers: WorkerCheckpoints | None = None
        self._pending = None  # (step, commit ref, start time)
        self._writers_failed = False

    def start(self, workers: WorkerCheckpoints) -> None:
        """Save through `workers` from now on; their writers start before training, since an
        actor start inside the loop would stall it."""
        self._workers = workers
        if self.policy.checkpoint.every > 0:
            workers.start_writers(str(self.root))

    def ready_for(self, final: bool = False) -> tuple[bool, float]:
        """May a save start now? Returns (go, seconds the loop was held up deciding). The
        run's final save is never skipped: it waits for the one still writing."""
        self.poll()
        if self._pending is None:
            return True, 0.0
        if self.when_busy == "skip" and not final:
            self.skipped += 1
            self.log(f"checkpoint: step {self._pending[0]} is still being written; skipping this save "
                     f"(checkpoint.when_busy=skip)")
            return False, 0.0
        t0 = time.perf_counter()
        self.finish()
        return True, time.perf_counter() - t0

    def skips(self, final: bool = False) -> bool:
        """Whether a save due now would be skipped (`ready_for` says no without waiting)."""
        self.poll()
        return self._pending is not None and self.when_busy == "skip" and not final

    def idle(self) -> bool:
        """No save in flight and the last snapshot written: a save may start without waiting."""
        self.poll()
        return self._pending is None and self._workers.shard_writes_done()

    def snapshot(self, step: int) -> None:
        """Snapshot the state after `step` (between steps) for a save."""
        self._workers.snapshot(step, self.policy.snapshot_options())

    def begin(self, steps_done: int, consumed: int, cfg: Config, grid: Grid) -> None:
        """Save the snapshot taken after `steps_done` steps, on `grid` with `cfg`."""
        from raypar.checkpoint import checkpoint_dir

        if self._writers_failed:
            self._workers.reset_writers()
            self._writers_failed = False
        try:
            self._workers.wait_writers(self.timeout_s)
        except Exception as e:  # noqa: BLE001 - like a failed save: training goes on, the next save tries again
            self._record(SaveResult(steps_done, None, 0, 0.0, 0.0, error=repr(e)[:500]))
            self._writers_failed = True
            self.log(f"checkpoint: not saving step {steps_done}: {e}; the last committed checkpoint stays valid")
            return
        # Partial directories of failed saves go; the one about to be written stays.
        self._workers.clean_before(str(self.root), str(checkpoint_dir(self.root, steps_done)))
        ref = self._workers.save(str(self.root), steps_done, _meta(consumed, cfg, grid, self.run_state(steps_done)))
        self._pending = (steps_done, ref, time.perf_counter())

    def save_scratch(self, steps_done: int, consumed: int, cfg: Config, grid: Grid, scratch: str) -> SaveResult:
        """Save the state after `steps_done` steps (between steps) under `scratch`
        (`WorkerCheckpoints.make_scratch`) and wait for its commit: a checkpoint that only
        moves the state, not one of the run's (not in `results`, never rotated). Its error
        says when it failed."""
        import ray

        self.finish()
        self.wait_shard_writes()  # the last snapshot's buffers are reused
        t0 = time.perf_counter()
        try:
            self._workers.wait_writers(self.timeout_s)
            self.snapshot(steps_done - 1)
            ref = self._workers.save(str(self.root), steps_done, _meta(consumed, cfg, grid, self.run_state(steps_done)),
                                     scratch=scratch)
            r = ray.get(ref, timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - the caller saves to storage instead, or recovers
            return SaveResult(steps_done, None, 0, 0.0, time.perf_counter() - t0, error=repr(e)[:500])
        return SaveResult(steps_done, r["path"], r["bytes"], r["write_s"], time.perf_counter() - t0,
                          copy_wait_s=r["copy_wait_s"], commit_s=r["commit_s"])

    def save_now(self, steps_done: int, consumed: int, cfg: Config, grid: Grid) -> SaveResult:
        """Save the state after `steps_done` steps (between steps) and wait for its commit,
        before the workers' stages are cut anew; one of that step already committed is the
        result. Its error says when it failed."""
        self.finish()
        last = self.results[-1] if self.results else None
        if last is not None and last.step == steps_done and last.error is None and last.path is not None:
            return last
        self.wait_shard_writes()  # the last snapshot's buffers are reused
        self.snapshot(steps_done - 1)
        self.begin(steps_done, consumed, cfg, grid)
        self.finish()
        return self.results[-1]

    def discard(self, result: SaveResult) -> None:
        """Remove a committed checkpoint the run does not keep (one that only carried the state
        from one cut of the model to another); its result stays, without a path."""
        from raypar.checkpoint import checkpoint_dir
        from raypar.checkpoint.storage import delete_dir

        delete_dir(checkpoint_dir(self.root, result.step))
        result.path = None

    def wait_shard_writes(self) -> float:
        """Wait until the last snapshot left the workers (its buffers are reused next)."""
        return self._workers.wait_shard_writes(self.timeout_s)

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
            self._record(SaveResult(step, None, 0, 0.0, time.perf_counter() - t0, error=repr(e)[:500]))
            self._writers_failed = True
            self.log(f"checkpoint: saving step {step} failed ({type(e).__name__}); its partial files are "
                     f"removed at the next save, the last committed checkpoint stays valid")
            return
        result = SaveResult(step, r["path"], r["bytes"], r["write_s"], time.perf_counter() - t0,
                            copy_wait_s=r["copy_wait_s"], commit_s=r["commit_s"])
        self._record(result)
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
        self._record(SaveResult(step, None, 0, 0.0, 0.0, error="abandoned: workers lost during the save"))
        self._writers_failed = True
        return True

    def finish(self) -> None:
        """Wait for the save in flight, up to checkpoint.timeout_s."""
        if self._pending is None:
            return
        step = self._pending[0]
        self.poll(timeout=self.timeout_s)
        if self._pending is not None:
            self._pending = None
            self._record(SaveResult(step, None, 0, 0.0, self.timeout_s,
                                    error=f"not committed within checkpoint.timeout_s={self.timeout_s:g}s"))
            self.log(f"checkpoint: step {step} did not commit within checkpoint.timeout_s; it is not valid")

    def _record(self, result: SaveResult) -> None:
        self.results.append(result)
        self.on_result(result)

    def last_committed(self) -> str | None:
        kept = [r for r in self.results if r.error is None and r.path is not None]
        return kept[-1].path if kept else None

    # -- resuming ----------------------------------------------------------------------------

    def checkpoint_path(self, spec: str | None, recovering: bool) -> Location | None:
        """The checkpoint `spec` names, or None when the run starts from step 0.

        "latest" is the newest committed checkpoint that verifies (manifest and shard files);
        newer ones that do not are set aside (renamed `<dir>.corrupt`, nothing deleted) and
        named in the log, unless `checkpoint.resume_strict`. After a failure `spec` is
        "latest", which may not exist yet: then the run starts over from step 0
        (initialisation is deterministic, so nothing differs).
        """
        from raypar.checkpoint import newest_verified, resolve

        if spec is None:
            return None
        if spec != "latest":
            return resolve(self.root, spec)
        path, passed = newest_verified(self.root)
        if recovering and path is None and not passed:
            return None  # nothing committed yet
        if passed and self.policy.checkpoint.resume_strict:
            raise CheckpointError(f"the newest checkpoint does not verify: {passed[0][1]} "
                                  "(checkpoint.resume_strict=false goes on from the newest one that does)")
        for bad, why in passed:
            self._set_aside(bad, why)
        if path is None:
            raise CheckpointError(f"no committed checkpoint under {self.root} verifies")
        return path

    def resume(self, path: Location | None, cfg: Config, grid: Grid, fall_back: bool = False) -> Resumed:
        """Load checkpoint `path` (`checkpoint_path`) into the workers (`start` first); None:
        the run starts from step 0. With `fall_back` (the path came from "latest"), a
        checkpoint whose tensors fail to load (a checksum mismatch) is set aside for the next
        older one that verifies, unless `checkpoint.resume_strict`."""
        while True:
            try:
                return self._load(path, cfg, grid)
            except CheckpointError as e:
                if path is None or not fall_back or self.policy.checkpoint.resume_strict \
                        or isinstance(e, ModelMismatchError):
                    raise
                self._set_aside(path, str(e))
                path = self.checkpoint_path("latest", recovering=False)

    def _set_aside(self, path: Location, why: str) -> None:
        from raypar.checkpoint import set_aside

        moved = set_aside(path)
        self.log(f"raypar: checkpoint {path} is corrupt ({why}); moved it to {moved} and going on from the one "
                 f"before it (checkpoint.resume_strict=true fails instead)")

    def _load(self, path: Location | None, cfg: Config, grid: Grid) -> Resumed:
        from raypar.checkpoint import read_manifest

        if path is None:
            return Resumed(0, 0, None, [])
        t0 = time.perf_counter()
        manifest = read_manifest(path)
        saved_model = manifest.config.get("model", {})
        current = cfg.to_dict()["model"]
        # The dtype, the initial weights and how routing is balanced may differ; the shapes may not.
        changed = {k: (saved_model.get(k), v) for k, v in current.items()
                   if k not in ("dtype", "init_from", "moe_bias_update_rate") and saved_model.get(k) != v}
        if changed:
            raise ModelMismatchError(
                f"{path} was written for another model: "
                + ", ".join(f"model.{k}={old!r} there, {new!r} here" for k, (old, new) in changed.items())
            )
        topology = {"dp": grid.dp, "pp": grid.pp, "ep": grid.ep, "tp": grid.tp}
        loaded = self._workers.load(str(path), same_grid={"tp": 1, **manifest.topology} == topology)
        self.log(f"raypar: resumed from {path} (step {manifest.step}, {manifest.consumed_samples} samples consumed, "
                 f"saved on grid {manifest.topology})")
        return Resumed(manifest.step, manifest.consumed_samples, path, loaded, time.perf_counter() - t0,
                       extra=manifest.extra)
