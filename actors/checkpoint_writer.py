"""Checkpoint writer: one actor per node writes its workers' shards; one of them commits."""
from __future__ import annotations

import time
import warnings

import numpy as np
import ray
import torch

from raypar.checkpoint import Manifest, checkpoint_dir, cleanup_uncommitted, commit, merge_entries, rotate, write_shard


def to_wire(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, str]]:
    """numpy views travel through Ray's shared-memory object store without pickling data;
    dtypes numpy lacks (bf16, fp8) travel as same-width integers plus their name."""
    wire = {}
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if t.dtype in (torch.bfloat16, torch.float16):
            arr = t.view(torch.int16).numpy()
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            arr = t.view(torch.uint8).numpy()
        else:
            arr = t.numpy()
        wire[name] = (arr, dtype)
    return wire


def from_wire(wire: dict[str, tuple[np.ndarray, str]]) -> dict[str, torch.Tensor]:
    out = {}
    for name, (arr, dtype) in wire.items():
        with warnings.catch_warnings():
            # Arrays from the object store are read-only; the writer only reads them.
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(np.ascontiguousarray(arr))
        out[name] = t.view(getattr(torch, dtype)) if str(t.dtype).removeprefix("torch.") != dtype else t
    return out


@ray.remote
class CheckpointWriter:
    def __init__(self, root: str, keep_last: int):
        self.root = root
        self.keep_last = keep_last

    def write(self, step: int, rank: int, wire: dict) -> dict:
        """Write one worker's share as `shard-<rank>.safetensors` of checkpoint `step`."""
        t0 = time.perf_counter()
        tensors = from_wire(wire)
        pieces = [(name, t, (0,) * t.ndim, tuple(t.shape)) for name, t in tensors.items()]
        results = write_shard(checkpoint_dir(self.root, step), f"shard-{rank:05d}.safetensors", pieces)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"results": results, "shapes": {n: tuple(t.shape) for n, t in tensors.items()},
                "bytes": nbytes, "seconds": time.perf_counter() - t0}

    def commit(self, step: int, meta: dict, *written: dict) -> dict:
        """Runs once every shard is written (Ray resolves `written` first): manifest, rename, rotate."""
        t0 = time.perf_counter()
        ckpt = checkpoint_dir(self.root, step)
        shapes: dict = {}
        for w in written:
            shapes.update(w["shapes"])
        manifest = Manifest(step=step, consumed_samples=meta["consumed_samples"], topology=meta["topology"],
                            config=meta["config"], extra=meta.get("extra", {}),
                            tensors=merge_entries([w["results"] for w in written], shapes))
        commit(ckpt, manifest)
        removed = rotate(self.root, self.keep_last)
        nbytes = sum(w["bytes"] for w in written)
        write_s = max(w["seconds"] for w in written)
        return {"step": step, "path": str(ckpt), "bytes": nbytes, "write_s": write_s,
                "commit_s": time.perf_counter() - t0, "rotated": [str(p) for p in removed]}

    def cleanup(self, keep: list[str] = ()) -> list[str]:
        return [str(p) for p in cleanup_uncommitted(self.root, keep=set(keep))]
