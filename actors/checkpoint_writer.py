"""Checkpoint writer: one actor per node removes interrupted saves; one of them commits.

The stage workers write their own shards (`StageWorker.write_snapshot`); the commit runs
once every shard's result has arrived (Ray resolves them first).
"""
from __future__ import annotations

import time

import ray

from raypar.checkpoint import Manifest, checkpoint_dir, cleanup_uncommitted, commit, merge_entries, rotate


@ray.remote
class CheckpointWriter:
    def __init__(self, root: str, keep_last: int):
        self.root = root
        self.keep_last = keep_last

    def commit(self, step: int, meta: dict, *written: dict) -> dict:
        """Runs once every shard is written (Ray resolves `written` first): manifest, rename, rotate."""
        return self._commit(self.root, step, meta, written)

    def commit_scratch(self, scratch: str, step: int, meta: dict, *written: dict) -> dict:
        """`commit` of a checkpoint written under `scratch` (`make_scratch`): not rotated."""
        return self._commit(scratch, step, meta, written)

    def make_scratch(self, nbytes: int) -> str | None:
        """Room on this node for a checkpoint of `nbytes` that only moves the state (`raypar.runtime.scratch`)."""
        from raypar.runtime.scratch import make_scratch

        return make_scratch(nbytes)

    def remove_scratch(self, path: str) -> None:
        from raypar.runtime.scratch import remove_scratch

        remove_scratch(path)

    def _commit(self, root: str, step: int, meta: dict, written: tuple[dict, ...]) -> dict:
        t0 = time.perf_counter()
        ckpt = checkpoint_dir(root, step)
        shapes: dict = {}
        for w in written:
            shapes.update(w["shapes"])
        manifest = Manifest(step=step, consumed_samples=meta["consumed_samples"], topology=meta["topology"],
                            config=meta["config"], extra=meta.get("extra", {}),
                            tensors=merge_entries([w["results"] for w in written], shapes))
        commit(ckpt, manifest)
        removed = rotate(root, self.keep_last) if root == self.root else []
        nbytes = sum(w["bytes"] for w in written)
        write_s = max(w["seconds"] for w in written)
        return {"step": step, "path": str(ckpt), "bytes": nbytes, "write_s": write_s,
                "copy_wait_s": max(w.get("copy_wait_s", 0.0) for w in written),
                "commit_s": time.perf_counter() - t0, "rotated": [str(p) for p in removed]}

    def cleanup(self, keep: list[str] = ()) -> list[str]:
        return [str(p) for p in cleanup_uncommitted(self.root, keep=set(keep))]
