"""torch.profiler around one step of a worker, and where its device time went.

`StepProfiler` (or `profiled` around a block) writes the step's Chrome trace (open it in chrome://tracing or
ui.perfetto.dev). `device_time` reads a trace back and sums its GPU kernels by kind,
with the time the device was busy at all and busy computing: comparing those with the
step's span tells kernels that ran slower from gaps where the device waited.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

# Kernel kinds by name (lower case), first match wins.
KINDS = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention")),
    ("matmul", ("gemm", "cutlass", "nvjet", "cublas", "xmma")),
    ("multi_tensor", ("multi_tensor", "foreach")),
)


PROFILER_READY = "raypar: every worker's profiler ready"  # the barrier before a step's recording


class StepProfiler:
    """torch.profiler (CPU ops, and GPU kernels when `cuda`) around one step, writing Chrome
    trace `path` at `stop`.

    Starting a profiler takes from ~0.5 s to seconds on a GPU, differently on each worker: a
    trace that began with it would show the step's first collective waiting for a peer still
    starting its own. So the profiler starts without recording (`StepProfiler(...)`, after
    the step before), `record(ready)` waits for `ready` (a barrier of every worker) and only
    then records, and `stop` ends the recording and writes the trace."""

    def __init__(self, path: Path, cuda: bool) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.path, self.cuda = path, cuda
        path.parent.mkdir(parents=True, exist_ok=True)
        self._profile = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])],
                                schedule=schedule(wait=0, warmup=1, active=1, repeat=1),
                                on_trace_ready=lambda p: p.export_chrome_trace(str(path)))
        self._profile.start()  # warming up: set up, recording nothing

    def record(self, ready: Callable[[], None] = lambda: None) -> None:
        ready()
        self._profile.step()

    def stop(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # every kernel of the step inside the trace
        self._profile.step()  # the recording ends: the trace is written
        self._profile.stop()


@contextmanager
def profiled(path: Path, cuda: bool) -> Iterator[None]:
    """A `StepProfiler` around the block (a process of its own, with no peers to wait for)."""
    profiler = StepProfiler(path, cuda)
    profiler.record()
    yield
    profiler.stop()


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
    time its kernels ran while no compute kernel did), `top_kernels` (the kernels that took
    longest in all, by name); and `traced_ms`, the profiled block's length (its first
    event's start to its last's end)."""
    events = trace_events(trace)
    kernels = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events if e.get("cat") == "kernel"]
    traced = (max(e["ts"] + e.get("dur", 0) for e in events) - min(e["ts"] for e in events)) / 1000 if events else 0.0
    out: dict = {"traced_ms": traced, "kernels": len(kernels), "span_ms": 0.0, "busy_ms": 0.0,
                 "compute_busy_ms": 0.0, "gaps": [], "exposed_ms": {}, "top_kernels": [],
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
    out["top_kernels"] = top_kernels(kernels)
    return out


def trace_events(trace: Path) -> list[dict]:
    """A trace's complete events, their times in microseconds since the epoch (the traces of
    one host's processes share that clock)."""
    data = json.loads(Path(trace).read_text())
    base_us = data.get("baseTimeNanoseconds", 0) / 1000
    return [{**e, "ts": e["ts"] + base_us} for e in data.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]


def exchange_waits(traces: Sequence[Path], name: str = "SendRecv") -> list[dict]:
    """The profiled step of every worker of one exchange group (on one host): each worker's
    time in the collective `name`'s kernels split into `peer_wait_ms`, waiting for the last
    worker to enter the exchange, and `transfer_ms`, the rest; and `exposed_transfer_ms`,
    the transfer while no compute kernel ran (what `device_time`'s exposed time is without
    a peer's lateness). Each communicator runs its kernels on a stream of its own, in one
    order on every rank (pp=1: no pipeline transfer shares the name): the i-th such kernel
    of a worker's j-th stream is the same exchange on every worker. Streams are matched by
    id where every worker has the same ones (a CUDA graph's replays run on streams its
    instantiation made, alike on every rank), else in the order of their first such kernel.
    Several streams: forwards and backwards on communicators of their own
    (`runtime.moe_microbatch_overlap`), or graphs."""
    per_worker = []
    for trace in traces:
        kernels = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"], e.get("args", {}).get("stream"))
                   for e in trace_events(trace) if e.get("cat") == "kernel"]
        by_stream: dict[object, list[tuple[float, float]]] = {}
        for s, e, n, stream in sorted(kernels):
            if kernel_kind(n) == "communication" and collective(n) == name:
                by_stream.setdefault(stream, []).append((s, e))
        compute = [(s, e) for s, e, n, _ in kernels if kernel_kind(n) != "communication"]
        per_worker.append((by_stream, compute))
    by_id = len({tuple(sorted(by_stream, key=str)) for by_stream, _ in per_worker}) == 1
    per_worker = [([by_stream[k] for k in sorted(by_stream, key=str)] if by_id else list(by_stream.values()), compute)
                  for by_stream, compute in per_worker]
    shapes = {tuple(len(x) for x in streams) for streams, _ in per_worker}
    if len(shapes) > 1:
        raise ValueError(f"exchange_waits: the workers ran {name} kernels per stream {sorted(shapes)}; matching "
                         f"them needs the same counts on every worker")
    arrivals = [[max(streams[j][i][0] for streams, _ in per_worker) for i in range(n)]
                for j, n in enumerate(shapes.pop() if shapes else ())]
    out = []
    for streams, compute in per_worker:
        pairs = [(x, last) for j, stream in enumerate(streams) for x, last in zip(stream, arrivals[j])]
        exchanges = [x for x, _ in pairs]
        transfers = [(max(start, last), end) for (start, end), last in pairs if end > max(start, last)]
        out.append({"exchanges": len(exchanges),
                    "peer_wait_ms": sum(min(end, last) - start for (start, end), last in pairs if last > start) / 1000,
                    "transfer_ms": sum(e - s for s, e in transfers) / 1000,
                    "exposed_transfer_ms": (_union_us(transfers + compute) - _union_us(compute)) / 1000})
    return out


def graph_replays(trace: Path) -> dict:
    """A trace's CUDA graph replays: each replay's device span (its first kernel's start to
    its last's end, ms from the trace's first kernel) and the host time of its launch, in
    launch order (`replays`); `replay_ms`, the time some replay ran; and `concurrent_ms`,
    the time two or more ran at once. A kernel belongs to the replay whose `cudaGraphLaunch`
    has its correlation id.

    Overlapped micro-batches (`runtime.moe_microbatch_overlap`, `runtime.tp_microbatch_overlap`)
    should keep a forward's replay beside a backward's for most of the forward's span; a
    short `concurrent_ms` says the streams ran one after the other (as when they shared a
    hardware queue: docs/operations.md, `CUDA_DEVICE_MAX_CONNECTIONS`)."""
    events = trace_events(trace)
    launches = sorted((e["ts"], e["args"]["correlation"]) for e in events
                      if e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch"
                      and "correlation" in e.get("args", {}))
    kernels = [e for e in events if e.get("cat") == "kernel"]
    out: dict = {"replays": [], "replay_ms": 0.0, "concurrent_ms": 0.0}
    if not kernels or not launches:
        return out
    first = min(e["ts"] for e in kernels)
    spans: dict[int, list[float]] = {corr: [float("inf"), float("-inf"), 0] for _, corr in launches}
    for e in kernels:
        span = spans.get(e.get("args", {}).get("correlation"))
        if span is not None:
            span[0], span[1], span[2] = min(span[0], e["ts"]), max(span[1], e["ts"] + e.get("dur", 0)), span[2] + 1
    ran = [(host, spans[corr]) for host, corr in launches if spans[corr][2]]
    out["replays"] = [{"host_ms": (host - first) / 1000, "start_ms": (a - first) / 1000, "end_ms": (b - first) / 1000,
                       "kernels": n} for host, (a, b, n) in ran]
    intervals = [(a, b) for _, (a, b, _) in ran]
    out["replay_ms"] = _union_us(intervals) / 1000
    out["concurrent_ms"] = _covered_twice_us(intervals) / 1000
    return out


def replay_overlap(trace: Path) -> dict:
    """`graph_replays` in short: how many replays, the time some ran, the time two ran at once."""
    got = graph_replays(trace)
    return {"replays": len(got["replays"]), "replay_ms": got["replay_ms"], "concurrent_ms": got["concurrent_ms"]}


def _covered_twice_us(spans: list[tuple[float, float]]) -> float:
    """The time two or more of `spans` cover at once."""
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    total, depth, last = 0.0, 0, 0.0
    for at, step in edges:
        if depth >= 2:
            total += at - last
        depth, last = depth + step, at
    return total


def top_kernels(kernels: list[tuple[float, float, str]], top: int = 15, shorter: int = 90) -> list[dict]:
    """The kernels with the most device time in all: name (cut), ms and count."""
    by_name: dict[str, list[float]] = {}
    for start, end, name in kernels:
        entry = by_name.setdefault(name[:shorter], [0.0, 0])
        entry[0] += (end - start) / 1000
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": name, "ms": round(ms, 2), "count": count} for name, (ms, count) in ranked]


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
