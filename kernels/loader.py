"""Compiles the CUDA sources in this folder with CuPy and launches them on torch's stream.

Each worker process compiles a module once (`RawModule`, NVRTC) on first use; CuPy caches
the binaries on node-local disk (CUPY_CACHE_DIR, default a per-user folder under the
system temp dir), and a file lock around the first compile makes the workers of a node
that start together compile once and read the cache after. Tensors reach the kernels by
device pointers, not DLPack: a DLPack conversion per tensor costs more host time than a
small kernel runs (bench/kernels.py measures it);
bf16/fp16 travel as 16-bit integers (the kernels convert). Launches go on torch's
current stream, so kernels order with the torch ops around them. A failed launch raises;
with RAYPAR_KERNELS_SYNC=1 every launch is also synchronised, so a fault in a kernel is
reported at that kernel rather than at a later torch call.
"""
from __future__ import annotations

import fcntl
import functools
import logging
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("raypar.kernels")
HERE = Path(__file__).resolve().parent
SYNC = os.environ.get("RAYPAR_KERNELS_SYNC") == "1"
_said: set[str] = set()
_broken: dict[str, str] = {}  # source -> why it did not compile
_enabled = True


def say_once(key: str, message: str) -> None:
    """Log `message` once per process (fallbacks would otherwise repeat every step)."""
    if key not in _said:
        _said.add(key)
        log.warning(message)
        print(f"[raypar.kernels] {message}", flush=True)


def set_enabled(enabled: bool) -> None:
    """runtime.kernels=false: every op runs its torch reference."""
    global _enabled
    _enabled = enabled


@functools.lru_cache(maxsize=None)
def _cupy_or_reason():
    try:
        cache = os.environ.setdefault("CUPY_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"raypar-cupy-{os.getuid()}"))
        os.makedirs(cache, exist_ok=True)
        import cupy
    except Exception as e:  # ImportError, or a CuPy built for another CUDA
        return None, f"CuPy is not usable ({type(e).__name__}: {e})"
    return cupy, None


def unavailable_reason(t: torch.Tensor | None = None, source: str | None = None) -> str | None:
    """None when kernels (of `source`) can run on `t`'s device, else why the torch reference runs.

    The first call for a source compiles it; a source that fails to compile stays off in
    this process, with the compiler's message as the reason.
    """
    if not _enabled:
        return "kernels are off (runtime.kernels=false)"
    if t is not None and not t.is_cuda:
        return f"tensors are on {t.device.type}, kernels need CUDA"
    if not _cuda_available():
        return "no CUDA device"
    _, reason = _cupy_or_reason()
    if reason is None and source is not None:
        if source not in _broken:
            try:
                module(source)
            except Exception as e:  # a kernel that does not compile must not stop training
                _broken[source] = f"{source} failed to compile: {type(e).__name__}: {e}"
        reason = _broken.get(source)
    return reason


@functools.lru_cache(maxsize=None)
def _cuda_available() -> bool:
    # Asked before every launch; torch's check reads the environment each time (~20 us).
    return torch.cuda.is_available()


@functools.lru_cache(maxsize=None)
def module(source: str):
    """The compiled module of `kernels/<source>` (compiled on first use in this process)."""
    cupy, reason = _cupy_or_reason()
    if cupy is None:
        raise RuntimeError(reason)
    common = (HERE / "common.cuh").read_text()
    # Inlined rather than `-I`: CuPy's cache key covers the source text, not included files.
    code = (HERE / source).read_text().replace('#include "common.cuh"', common)
    mod = cupy.RawModule(code=code, options=("--std=c++17",))
    lock_path = Path(os.environ["CUPY_CACHE_DIR"]) / ".raypar-compile.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        mod.compile()
    return mod


_streams: dict[int, object] = {}  # torch's raw stream handle -> the CuPy object wrapping it


def _external(cupy, handle: int, device: int):
    """torch's stream as a CuPy stream (made once per stream: launches are hot)."""
    wrapped = _streams.get(handle)
    if wrapped is None:
        wrapped = _streams[handle] = cupy.cuda.ExternalStream(handle, device)
    return wrapped


def _pointer(t: torch.Tensor, device: int) -> np.uint64:
    # Pinned host memory is reachable at its host address (unified addressing).
    if t.is_cuda and t.device.index != device:
        raise ValueError(f"kernel argument on {t.device}, the launch is on cuda:{device}")
    if not (t.is_cuda or t.is_pinned()):
        raise ValueError("kernel arguments must be CUDA or pinned host tensors")
    return np.uint64(t.data_ptr())


_functions: dict[tuple[str, str, int], object] = {}  # (source, kernel, device) -> CuPy function


def launch(source: str, name: str, grid: int | tuple[int, ...], block: int, args: tuple) -> None:
    """Run kernel `name` of `source` on torch's current stream.

    Tensors in `args` are passed as device pointers: converting each one by DLPack costs
    tens of microseconds of host time per launch (bench/kernels.py measures it), more than
    a small kernel runs. The ops check dtype, device and contiguity before they get here.
    """
    cupy, _ = _cupy_or_reason()
    grid = (grid,) if isinstance(grid, int) else tuple(grid)
    if min(grid) <= 0:
        return
    # The raw handle, not torch.cuda.current_stream(): that object costs ~40 us a launch.
    device = torch.cuda.current_device()
    handle = torch._C._cuda_getCurrentRawStream(device)
    fn = _functions.get((source, name, device))
    if fn is None:
        with cupy.cuda.Device(device):
            fn = _functions[(source, name, device)] = module(source).get_function(name)
    if cupy.cuda.runtime.getDevice() != device:
        cupy.cuda.runtime.setDevice(device)
    # torch's stream stays CuPy's current stream of this thread: switching per launch costs
    # more than the small kernels run (nothing else in a worker launches through CuPy).
    wrapped = _external(cupy, handle, device)
    if cupy.cuda.get_current_stream() is not wrapped:
        wrapped.use()
    fn(grid, (block,), tuple(_pointer(a, device) if isinstance(a, torch.Tensor) else a for a in args))
    if SYNC:
        torch.cuda.current_stream(device).synchronize()


def dtype_suffix(dtype: torch.dtype) -> str | None:
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}.get(dtype)


def vector_width(dtype: torch.dtype) -> int:
    return 16 // dtype.itemsize


def check_contiguous(op: str, **tensors: torch.Tensor) -> None:
    bad = [k for k, t in tensors.items() if t is not None and not t.is_contiguous()]
    if bad:
        raise ValueError(f"{op}: {', '.join(bad)} must be contiguous (call .contiguous() first)")
