"""torch.profiler around one step of a worker, and where its device time went.

`profiled` writes the step's Chrome trace (open it in chrome://tracing or
ui.perfetto.dev). `device_time` reads a trace back and sums its GPU kernels by kind,
with the time the device was busy at all and busy computing: comparing those with the
step's span tells kernels that ran slower from gaps where the device waited.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

# Kernel kinds by name (lower case), first match wins.
KINDS = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention")),
    ("matmul", ("gemm", "cutlass", "nvjet", "cublas", "xmma")),
    ("multi_tensor", ("multi_tensor", "foreach")),
)


@contextmanager
def profiled(path: Path, cuda: bool) -> Iterator[None]:
    """Profile the block (CPU ops, and GPU kernels when `cuda`) into Chrome trace `path`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()  # every kernel of the block inside the trace
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))


def kernel_kind(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, marks in KINDS if any(m in lower for m in marks)), "other")


def collective(kernel: str) -> str:
    """A communication kernel's collective: `ncclDevKernel_SendRecv(...)` is SendRecv (an
    all-to-all or pipeline transfers), `ncclDevKernel_AllReduce_Sum_f32_RING_LL` AllReduce."""
    name = kernel.split("(", 1)[0]
    for prefix in ("ncclDevKernel_", "ncclKernel_"):
        if name.startswith(prefix):
            return name[len(prefix):].split("_", 1)[0]
    return name


def device_time(trace: Path) -> dict:
    """A trace's GPU kernels: span (first start to last end), busy (any kernel running) and
    compute busy (any kernel but communication) in ms, ms and count per kind, the longest
    idle gaps (`idle_gaps`), `exposed_ms` (per collective, e.g. SendRecv or AllReduce: the
    time its kernels ran while no compute kernel did); and `traced_ms`, the profiled
    block's length (its first event's start to its last's end)."""
    events = [e for e in json.loads(Path(trace).read_text()).get("traceEvents", [])
              if e.get("ph") == "X" and "ts" in e]
    kernels = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events if e.get("cat") == "kernel"]
    traced = (max(e["ts"] + e.get("dur", 0) for e in events) - min(e["ts"] for e in events)) / 1000 if events else 0.0
    out: dict = {"traced_ms": traced, "kernels": len(kernels), "span_ms": 0.0, "busy_ms": 0.0,
                 "compute_busy_ms": 0.0, "gaps": [], "exposed_ms": {},
                 "by_kind": {kind: {"ms": 0.0, "count": 0} for kind, _ in (*KINDS, ("other", ()))}}
    if not kernels:
        return out
    out["span_ms"] = (max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels)) / 1000
    out["busy_ms"] = _union_us([(s, e) for s, e, _ in kernels]) / 1000
    compute = [(s, e) for s, e, n in kernels if kernel_kind(n) != "communication"]
    out["compute_busy_ms"] = _union_us(compute) / 1000
    by_collective: dict[str, list[tuple[float, float]]] = {}
    for s, e, n in kernels:
        if kernel_kind(n) == "communication":
            by_collective.setdefault(collective(n), []).append((s, e))
    for name, spans in by_collective.items():
        out["exposed_ms"][name] = (_union_us(spans + compute) - _union_us(compute)) / 1000
    for start, end, name in kernels:
        kind = out["by_kind"][kernel_kind(name)]
        kind["ms"] += (end - start) / 1000
        kind["count"] += 1
    out["gaps"] = idle_gaps(kernels)
    return out


def idle_gaps(kernels: list[tuple[float, float, str]], top: int = 12, shorter: int = 60) -> list[dict]:
    """The device's longest idle stretches between kernels (trace microseconds in, ms out):
    where each starts (ms from the first kernel), how long, and the kernels around it."""
    kernels = sorted(kernels)
    first, reach, last_name = kernels[0][0], kernels[0][1], kernels[0][2]
    gaps = []
    for start, end, name in kernels[1:]:
        if start > reach:
            gaps.append({"at_ms": (reach - first) / 1000, "ms": (start - reach) / 1000,
                         "after": last_name[:shorter], "before": name[:shorter]})
        if end > reach:
            reach, last_name = end, name
    return sorted(gaps, key=lambda g: -g["ms"])[:top]


def _union_us(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total
