"""Checkpoint writer: one actor per node writes its workers' shards; one of them commits."""
from __future__ import annotations

import time
import warnings

import numpy as np
import ray
import torch

from raypar.checkpoint import (
    CheckpointReader,
    Manifest,
    checkpoint_dir,
    cleanup_uncommitted,
    commit,
    is_model_weight,
    merge_entries,
    rotate,
    write_shard,
)


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
    def __init__(self, root: str, keep_last: int, ema_decay: float = 0.0):
        self.root = root
        self.keep_last = keep_last
        self.ema_decay = ema_decay
        self.ema: dict[str, torch.Tensor] = {}  # fp32, for the weights this node's workers write

    def update_ema(self, wire: dict) -> int:
        """Fold one worker's weights into the EMA; returns how many tensors it updated."""
        return self._update_ema(from_wire(wire))

    def _update_ema(self, tensors: dict[str, torch.Tensor]) -> int:
        n = 0
        for name, w in tensors.items():
            if not is_model_weight(name):
                continue
            if name not in self.ema:
                self.ema[name] = w.float().clone()  # the first update starts the average
            else:
                self.ema[name].lerp_(w.float(), 1.0 - self.ema_decay)
            n += 1
        return n

    def load_ema(self, path: str, names: list[str]) -> int:
        """Resume the EMA of `names` from a checkpoint's ema.<name> tensors (if it has them)."""
        with CheckpointReader(path) as reader:
            saved = set(reader.names())
            for name in names:
                if f"ema.{name}" in saved:
                    self.ema[name] = reader.read(f"ema.{name}").float()
        return len(self.ema)

    def write(self, step: int, rank: int, wire: dict, update_ema: bool = False) -> dict:
        """Write one worker's share as `shard-<rank>.safetensors` of checkpoint `step`
        (with the EMA of its weights when one is kept)."""
        t0 = time.perf_counter()
        tensors = from_wire(wire)
        if update_ema:
            self._update_ema(tensors)
        if self.ema:
            tensors.update({f"ema.{n}": self.ema[n] for n in list(tensors) if n in self.ema})
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
