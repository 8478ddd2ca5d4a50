"""Many-tensor copies and EMA updates in one kernel launch each.

`copy_` copies a list of device tensors into destinations that may be pinned host memory
(the GPU writes it directly through unified addressing): a checkpoint snapshot of a
stage with hundreds of tensors is one launch instead of hundreds of copy calls.
`ema_update_` folds weights into fp32 averages: ema = decay * ema + (1 - decay) * w.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch
from torch import Tensor

from raypar.kernels import loader

SOURCE = "multi_tensor.cu"
COPY_CHUNK = 256 * 1024  # bytes per work item
EMA_CHUNK = 64 * 1024  # elements per work item (a multiple of 4: packs stay aligned)
# Blocks for a copy into host memory: enough to fill the bus, few enough to leave the SMs
# to the training step the snapshot overlaps.
HOST_COPY_BLOCKS = 64
DEVICE_BLOCKS = 4096
_tables: OrderedDict = OrderedDict()  # (pointers, sizes) -> device tables; callers reuse buffers


def _table(key: tuple, sizes: list[int], chunk: int, device: torch.device, *pointer_lists: list[int]):
    """Device tables: pointers per tensor, sizes, and work item -> (tensor, offset); cached."""
    hit = _tables.get(key)
    if hit is not None:
        _tables.move_to_end(key)
        return hit
    block_tensor, block_offset = [], []
    for i, n in enumerate(sizes):
        for off in range(0, n, chunk):
            block_tensor.append(i)
            block_offset.append(off)
    # From pinned memory without blocking: a snapshot builds its tables on a side stream
    # that waits for the step's compute.
    as_dev = lambda v, dt: torch.tensor(v, dtype=dt).pin_memory().to(device, non_blocking=True)  # noqa: E731
    hit = (*(as_dev(p, torch.int64) for p in pointer_lists), as_dev(sizes, torch.int64),
           as_dev(block_tensor, torch.int32), as_dev(block_offset, torch.int64), len(block_tensor))
    _tables[key] = hit
    if len(_tables) > 16:
        _tables.popitem(last=False)
    return hit


def _device_reachable(t: Tensor) -> bool:
    return t.is_cuda or (t.device.type == "cpu" and t.is_pinned())


def copy_(sources: list[Tensor], destinations: list[Tensor]) -> None:
    """destinations[i].copy_(sources[i]) for all i, same shapes and dtypes; one launch on CUDA."""
    if len(sources) != len(destinations):
        raise ValueError(f"copy_: {len(sources)} sources but {len(destinations)} destinations")
    for s, d in zip(sources, destinations):
        if s.shape != d.shape or s.dtype != d.dtype:
            raise ValueError(f"copy_: source {tuple(s.shape)} {s.dtype} does not match destination "
                             f"{tuple(d.shape)} {d.dtype}")
    if not sources:
        return
    reason = loader.unavailable_reason(sources[0], SOURCE)
    if reason is None and not all(s.is_cuda and s.is_contiguous() for s in sources):
        reason = "sources must be contiguous CUDA tensors"
    if reason is None and not all(_device_reachable(d) and d.is_contiguous() for d in destinations):
        reason = "destinations must be contiguous CUDA or pinned host tensors"
    if reason is not None:
        if sources[0].is_cuda:
            loader.say_once("multi_copy", f"multi-tensor copy runs as one copy per tensor: {reason}")
        for s, d in zip(sources, destinations):
            d.copy_(s, non_blocking=True)
        return
    src = [s.data_ptr() for s in sources]
    dst = [d.data_ptr() for d in destinations]
    sizes = [s.numel() * s.element_size() for s in sources]
    key = ("copy", tuple(src), tuple(dst), tuple(sizes))
    src_t, dst_t, size_t, item_tensor, item_offset, items = _table(key, sizes, COPY_CHUNK, sources[0].device, src, dst)
    to_host = any(not d.is_cuda for d in destinations)
    loader.launch(SOURCE, "multi_copy", min(items, HOST_COPY_BLOCKS if to_host else DEVICE_BLOCKS), 256,
                  (src_t, dst_t, size_t, item_tensor, item_offset, np.int32(items), np.int64(COPY_CHUNK)))


def ema_update_(emas: list[Tensor], weights: list[Tensor], decay: float) -> None:
    """emas[i] = decay * emas[i] + (1 - decay) * weights[i]; fp32 emas, one launch per weight dtype."""
    if len(emas) != len(weights):
        raise ValueError(f"ema_update_: {len(emas)} averages but {len(weights)} weights")
    for e, w in zip(emas, weights):
        if e.dtype != torch.float32 or e.shape != w.shape:
            raise ValueError(f"ema_update_: the average must be fp32 of the weight's shape {tuple(w.shape)}, "
                             f"got {e.dtype} {tuple(e.shape)}")
    if not emas:
        return
    reason = loader.unavailable_reason(emas[0], SOURCE)
    if reason is None and not all(t.is_cuda and t.is_contiguous() for t in (*emas, *weights)):
        reason = "averages and weights must be contiguous CUDA tensors"
    if reason is None and any(loader.dtype_suffix(w.dtype) is None for w in weights):
        reason = "weights must be fp32, bf16 or fp16"
    if reason is not None:
        if emas[0].is_cuda:
            loader.say_once("multi_ema", f"EMA update runs in torch: {reason}")
        torch._foreach_lerp_(emas, [w.float() for w in weights], 1.0 - decay)
        return
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, w in enumerate(weights):
        by_dtype.setdefault(w.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        wp = [weights[i].data_ptr() for i in idx]
        ep = [emas[i].data_ptr() for i in idx]
        sizes = [weights[i].numel() for i in idx]
        key = ("ema", tuple(wp), tuple(ep), tuple(sizes))
        w_t, e_t, n_t, item_tensor, item_offset, items = _table(key, sizes, EMA_CHUNK, emas[0].device, wp, ep)
        loader.launch(SOURCE, f"multi_ema_{loader.dtype_suffix(dtype)}", min(items, DEVICE_BLOCKS), 256,
                      (w_t, e_t, n_t, item_tensor, item_offset, np.int32(items), np.int64(EMA_CHUNK),
                       np.float32(decay)))
