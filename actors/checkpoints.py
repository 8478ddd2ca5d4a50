"""A worker group's checkpoint work: its nodes' writers, snapshots, saves, loads.

Nothing here decides when: the driver's `Saver` asks. Nothing here waits on the step loop
either: workers write their snapshots as shard files on an I/O thread while they train on
(from the pinned host buffers, no copy through the object store), and a save's commit
runs on a writer once every shard is written.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import ray

from .placement import kill

if TYPE_CHECKING:
    from .worker_group import WorkerGroup


class WorkerCheckpoints:
    def __init__(self, group: WorkerGroup):
        self.group = group
        self.writers: dict = {}  # node id -> CheckpointWriter, started on first use
        self._shard_writes: list = []  # the last snapshot's shard writes, still reading the workers' buffers
        # The started writers' first cleanups: a save waits for them, or one could remove the
        # directory the save is writing.
        self._cleanups: list = []

    def _started_writers(self, root: str) -> dict:
        """One checkpoint writer per node that holds workers, pinned to that node: it removes
        that node's view of interrupted saves, and the first node's commits."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from .checkpoint_writer import CheckpointWriter

        cfg = self.group.cfg.checkpoint
        for node in dict.fromkeys(i["node_id"] for i in self.group.info):
            if node not in self.writers:
                self.writers[node] = CheckpointWriter.options(
                    num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote(root, cfg.keep_last)
        return self.writers

    def start_writers(self, root: str) -> None:
        """Start the writers (an actor start inside the step loop would stall it), each to
        remove the partial directories of saves that never committed, without waiting for
        them: their processes start while the workers load and step (on a recovery's path, a
        writer's start took as long as the rest of the state load). `wait_writers` first."""
        self._cleanups = [w.cleanup.remote() for w in self._started_writers(root).values()]

    def wait_writers(self, timeout: float) -> float:
        """Block until the writers `start_writers` started are up and have cleaned up;
        returns the seconds waited. Raises CheckpointError when they are not within `timeout`."""
        from raypar.checkpoint import CheckpointError

        t0 = time.perf_counter()
        cleanups, self._cleanups = self._cleanups, []
        try:
            ray.get(cleanups, timeout=timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise CheckpointError(f"the checkpoint writers did not start within checkpoint.timeout_s={timeout:g}s "
                                  f"(an actor each on {len(self.writers)} node(s))") from e
        return time.perf_counter() - t0

    def clean_before(self, root: str, keep: str) -> None:
        """Remove partial directories of failed saves, except `keep` (about to be written)."""
        self._started_writers(root)[self.group.info[0]["node_id"]].cleanup.remote([keep])

    def reset_writers(self) -> None:
        """Drop the writers (after one died); the next save starts fresh ones."""
        for w in self.writers.values():
            kill(w)
        self.writers = {}
        self._cleanups = []

    def keep_writers_on(self, nodes: set[str]) -> None:
        """Keep the writers of `nodes` (those that still hold workers); drop the others."""
        for node in [n for n in self.writers if n not in nodes]:
            kill(self.writers.pop(node))

    # -- snapshots and saves ----------------------------------------------------------------------

    def snapshot(self, step: int, options: dict) -> None:
        """Start a snapshot of the state as it is now (between steps)."""
        g = self.group
        ray.get([w.start_snapshot.remote(step, options) for w in g.workers], timeout=g.cfg.checkpoint.timeout_s)

    def save(self, root: str, step: int, meta: dict, scratch: str | None = None):
        """Each worker writes its last snapshot as its shard (under `scratch`, from
        `make_scratch`, instead of `root`); returns the commit's ObjectRef."""
        g = self.group
        writer = self._started_writers(root)[g.info[0]["node_id"]]
        self._shard_writes = [w.write_snapshot.remote(scratch or root, step) for w in g.workers]
        if scratch is not None:
            return writer.commit_scratch.remote(scratch, step, meta, *self._shard_writes)
        return writer.commit.remote(step, meta, *self._shard_writes)

    def make_scratch(self, root: str, nbytes: int) -> str | None:
        """Where all the workers run on one node with room for `nbytes` in its shared memory:
        a directory there for a checkpoint that only moves the state; else None."""
        nodes = {i["node_id"] for i in self.group.info}
        if len(nodes) != 1:
            return None
        writer = self._started_writers(root)[nodes.pop()]
        return ray.get(writer.make_scratch.remote(nbytes), timeout=self.group.cfg.checkpoint.timeout_s)

    def remove_scratch(self, root: str, path: str) -> None:
        writer = self._started_writers(root)[self.group.info[0]["node_id"]]
        ray.get(writer.remove_scratch.remote(path), timeout=self.group.cfg.checkpoint.timeout_s)

    def wait_shard_writes(self, timeout: float) -> float:
        """Block until every worker has written the last snapshot (its host buffers get reused
        next); returns the seconds waited."""
        t0 = time.perf_counter()
        writes, self._shard_writes = self._shard_writes, []
        if writes:
            ray.wait(writes, num_returns=len(writes), timeout=timeout)
        return time.perf_counter() - t0

    def shard_writes_done(self) -> bool:
        """Whether every worker has written the last snapshot (no waiting)."""
        done, _ = ray.wait(self._shard_writes, num_returns=len(self._shard_writes), timeout=0) if self._shard_writes else ([], [])
        return len(done) == len(self._shard_writes)

    def forget_shard_writes(self) -> None:
        """The workers that were writing are gone or reset: nothing is left to wait for."""
        self._shard_writes = []

    # -- loads -----------------------------------------------------------------------------------

    def load(self, path: str, same_grid: bool) -> list[dict]:
        """Every worker reads its share of checkpoint `path`; per worker: rank and bytes read."""
        g = self.group
        return ray.get([w.load_checkpoint.remote(path, same_grid) for w in g.workers],
                       timeout=g.cfg.checkpoint.timeout_s)

    def shutdown(self) -> None:
        self.reset_writers()
        self._shard_writes = []
