"""Kernels suite: each CUDA kernel against the torch eager code it replaces, in the driver
process on one GPU, and its achieved bandwidth against the copy bandwidth measured in the
same run (device-to-device for kernels that stay on the GPU, device-to-pinned-host for the
snapshot copy). Times are medians of CUDA-event timings after warm-up: of calls replayed from
a CUDA graph (the GPU's time alone, as the stages replay their graphs in training), and of
calls queued back to back from Python, which the host's launch cost bounds for small ops.

On CPU only the torch references are timed (tiny sizes), so the suite cannot rot.
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from bench.run import Context

TITLE = "CUDA kernels (CuPy) against torch eager, and against the copy bandwidth"
NOTES = ("GPU ms per call: median over 7 timings of 10 calls replayed from one CUDA graph (the GPU's time "
         "alone: training replays graphs too); queued: the same, issued from Python back to back, which the host "
         "bounds where its cost per call exceeds the GPU's; host us: the time to issue one call; "
         "GB/s counts bytes read plus bytes written once each; "
         "copy: torch copy_ of one large tensor (device to device, or device to pinned host for the snapshot "
         "copy), measured in the same run. Eager: what the model runs without the kernel (index gather, "
         "index_add in fp32, F.dropout then add, the rotary formula with its roll, F.silu then a multiply, "
         "a foreach lerp, one copy_ per tensor).")
REPEATS = 7  # medians over these
CALLS = 10  # calls per timing


def run(ctx: "Context") -> list[dict]:
    from raypar import kernels

    gpu = not ctx.cpu and torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    scale = 1 if gpu else 64  # CPU: tiny shapes, references only
    if gpu and kernels.unavailable_reason(torch.empty(0, device="cuda")):
        return [{"label": "kernels", "unavailable": kernels.unavailable_reason(torch.empty(0, device="cuda"))}]
    rows: list[dict] = []
    d2d = _copy_gbps(device, 1 << 30 if gpu else 1 << 20, pinned=False)
    d2h = _copy_gbps(device, 1 << 30 if gpu else 1 << 20, pinned=gpu)
    rows.append({"label": "copy bandwidth", "d2d_gbps": d2d, "d2h_pinned_gbps": d2h})
    if gpu:
        rows += ctx.attempt("launch overhead", _launch_overhead_row, min_time_s=5)
    for label, make in _cases(device, scale):
        rows += ctx.attempt(label, lambda make=make, label=label: _row(label, make, gpu, d2d, d2h), min_time_s=5)
    return rows


def _cases(device: str, scale: int) -> list[tuple[str, Callable]]:
    # MoE shapes of the 1B-class models: 16k tokens of width 4096, top-2 over 8 experts.
    tokens, dim, k, experts = 16384 // scale, 4096 // scale, 2, 8
    # The 1B dense model's MLP: a micro-batch of 4 x 1024 tokens, 5632 hidden units.
    batch, seq, ffn = 4 // min(scale, 4), 1024 // scale, 5632 // scale
    return [
        (f"permute, {tokens} tokens x top-{k}, d={dim}, bf16", lambda: _permute_case(device, tokens, dim, k, experts)),
        (f"unpermute + combine, {tokens} tokens x top-{k}, d={dim}, bf16",
         lambda: _unpermute_case(device, tokens, dim, k, experts)),
        (f"permute + unpermute, forward and backward, {tokens} tokens x top-{k}, d={dim}, bf16",
         lambda: _moe_train_case(device, tokens, dim, k, experts)),
        (f"dropout + residual add, {8 // min(scale, 8)} x 2048 x {dim}, bf16, p=0.1",
         lambda: _dropout_case(device, 8 // min(scale, 8), 2048 // scale, dim)),
        (f"dropout + residual add, forward and backward, {8 // min(scale, 8)} x 2048 x {dim}, bf16, p=0.1",
         lambda: _dropout_case(device, 8 // min(scale, 8), 2048 // scale, dim, backward=True)),
        (f"rotary embedding, forward and backward, {4 // min(scale, 4)} x {1024 // scale} x 16 heads x 128, bf16",
         lambda: _rope_case(device, 4 // min(scale, 4), 1024 // scale, 16, 128)),
        (f"SwiGLU of separate gate and up, forward and backward, {batch} x {seq} tokens, h={ffn}, bf16",
         lambda: _swiglu_pair_case(device, batch * seq, ffn)),
        (f"EMA update, 200 tensors, {200 * (4 << 20) // scale**2 / 1e6:.0f}M bf16 weights into fp32",
         lambda: _ema_case(device, 200, (4 << 20) // scale**2)),
        (f"snapshot copy to pinned host, 200 tensors, {200 * (2 << 20) * 2 // scale**2 / 2**20:.0f} MiB",
         lambda: _copy_case(device, 200, (2 << 20) // scale**2)),
        (f"snapshot copy to pinned host, 2000 small tensors, {2000 * (32 << 10) * 2 // scale / 2**20:.0f} MiB",
         lambda: _copy_case(device, 2000, (32 << 10) // scale)),
    ]


def _routing(device: str, n: int, k: int, experts: int):
    g = torch.Generator(device=device).manual_seed(0)
    choice = torch.rand(n, experts, device=device, generator=g).topk(k, dim=-1).indices
    kept = torch.argsort(choice.flatten(), stable=True)
    slots = torch.empty(n * k, dtype=torch.int64, device=device)
    slots[kept] = torch.arange(n * k, device=device)
    weight = torch.rand(n * k, device=device, generator=g)
    return kept // k, slots.view(n, k), weight


def _permute_case(device, n, d, k, experts):
    from raypar.kernels import permute

    token, slots, _ = _routing(device, n, k, experts)
    x = torch.randn(n, d, device=device, dtype=torch.bfloat16)
    nbytes = 2 * token.numel() * d * 2
    return (lambda: permute(x, token, slots)), (lambda: x[token]), nbytes, "d2d"


def _unpermute_case(device, n, d, k, experts):
    from raypar.kernels import unpermute

    token, slots, weight = _routing(device, n, k, experts)
    y = torch.randn(token.numel(), d, device=device, dtype=torch.bfloat16)

    def eager():
        out = torch.zeros(n, d, dtype=torch.float32, device=device)
        return out.index_add_(0, token, y.float() * weight.unsqueeze(1)).to(y.dtype)

    nbytes = token.numel() * d * 2 + n * d * 2
    return (lambda: unpermute(y, weight, token, slots)), eager, nbytes, "d2d"


def _moe_train_case(device, n, d, k, experts):
    """Forward and backward through both ops, against the same code with kernels off."""
    from raypar.kernels import permute, set_enabled, unpermute

    token, slots, weight = _routing(device, n, k, experts)
    x = torch.randn(n, d, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = weight.clone().requires_grad_(True)
    up = torch.randn(n, d, device=device, dtype=torch.bfloat16)

    def step():
        unpermute(permute(x, token, slots), w, token, slots).backward(up)

    def eager():
        set_enabled(False)
        try:
            step()
        finally:
            set_enabled(True)

    m = token.numel()
    # forward: read x rows, write m rows; read m rows, write n. backward: the same twice over
    # plus the weight gradient's reads.
    nbytes = (2 * m * d + m * d + n * d) * 2 + (2 * m * d + n * d + m * d + m * d) * 2
    return step, eager, nbytes, "d2d"


def _dropout_case(device, b, t, d, backward: bool = False):
    from raypar.kernels import dropout_add, sample_seeds, site_salt

    x = torch.randn(b, t, d, device=device, dtype=torch.bfloat16, requires_grad=backward)
    res = torch.randn(b, t, d, device=device, dtype=torch.bfloat16, requires_grad=backward)
    up = torch.randn_like(res)
    seeds, salt = sample_seeds(0, 0, list(range(b)), device), site_salt(0, 0)
    ours = lambda: dropout_add(x, res, seeds, 0.1, salt)  # noqa: E731
    eager = lambda: res + torch.nn.functional.dropout(x, 0.1)  # noqa: E731
    if not backward:
        return ours, eager, 3 * x.numel() * 2, "d2d"
    # Backward reads the gradient and writes x's (the residual's gradient is the same tensor).
    return (lambda: ours().backward(up)), (lambda: eager().backward(up)), 5 * x.numel() * 2, "d2d"


def _rope_case(device, b, t, heads, hd):
    """q of the 1B model: the attention's layout [b, t, heads, hd], tables cast to bf16 once."""
    from raypar.kernels import rope, rope_reference
    from raypar.model.layers import rope_tables

    cos, sin = (tab.to(torch.bfloat16)[:, None] for tab in rope_tables(hd, t, 10000.0, device=device))
    x = torch.randn(b, t, heads, hd, device=device, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn_like(x)
    # autograd.grad, not backward: accumulating into x.grad would add a kernel to both sides.
    ours = lambda: torch.autograd.grad(rope(x, cos, sin), x, up)  # noqa: E731
    eager = lambda: torch.autograd.grad(rope_reference(x, cos, sin), x, up)  # noqa: E731
    # Forward reads x and writes y, backward reads the gradient and writes x's (tables aside).
    return ours, eager, 4 * x.numel() * 2, "d2d"


def _swiglu_pair_case(device, tokens, h):
    """The dense MLP's activation in the 1B model: gate and up are w1's and w3's outputs."""
    from raypar.kernels import swiglu_pair, swiglu_pair_reference

    gate, up = (torch.randn(tokens, h, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dy = torch.randn(tokens, h, device=device, dtype=torch.bfloat16)
    ours = lambda: torch.autograd.grad(swiglu_pair(gate, up), (gate, up), dy)  # noqa: E731
    eager = lambda: torch.autograd.grad(swiglu_pair_reference(gate, up), (gate, up), dy)  # noqa: E731
    # Forward reads gate and up and writes the output; backward reads gate, up and the
    # output's gradient and writes gate's and up's.
    return ours, eager, 8 * gate.numel() * 2, "d2d"


def _ema_case(device, count, numel):
    from raypar.kernels import ema_update_

    weights = [torch.randn(numel, device=device, dtype=torch.bfloat16) for _ in range(count)]
    emas = [w.float() for w in weights]
    nbytes = count * numel * (2 + 4 + 4)
    return (lambda: ema_update_(emas, weights, 0.999)), (lambda: torch._foreach_lerp_(emas, [w.float() for w in weights], 0.001)), nbytes, "d2d"


def _copy_case(device, count, numel):
    from raypar.kernels import copy_

    src = [torch.randn(numel, device=device, dtype=torch.bfloat16) for _ in range(count)]
    dst = [torch.empty(numel, dtype=torch.bfloat16, pin_memory=device == "cuda") for _ in range(count)]

    def eager():
        for s, t in zip(src, dst):
            t.copy_(s, non_blocking=True)

    nbytes = count * numel * 2  # crosses the bus once
    return (lambda: copy_(src, dst)), eager, nbytes, "d2h"


def _row(label: str, make: Callable, gpu: bool, d2d: float, d2h: float) -> dict:
    kernel, eager, nbytes, kind = make()
    if not gpu:
        eager_ms = _median_ms(eager, gpu)
        return {"label": label, "bytes": nbytes, "eager_ms": eager_ms, "eager_gbps": nbytes / eager_ms / 1e6,
                "kernel_status": "CPU: the op runs its torch reference; only eager is timed"}
    kernel_queued, eager_queued = _median_ms(kernel, gpu), _median_ms(eager, gpu)
    kernel_graph, eager_graph = _graph_ms(kernel), _graph_ms(eager)
    # Both sides from graphs, or both queued: never a ratio of one against the other.
    graphed = isinstance(kernel_graph, float) and isinstance(eager_graph, float)
    kernel_ms, eager_ms = (kernel_graph, eager_graph) if graphed else (kernel_queued, eager_queued)
    copy = d2d if kind == "d2d" else d2h
    row = {"label": label, "bytes": nbytes, "timed": "graph replay" if graphed else "queued",
           "kernel_ms": kernel_ms, "eager_ms": eager_ms, "eager_gbps": nbytes / eager_ms / 1e6,
           "kernel_gbps": nbytes / kernel_ms / 1e6, "speedup": eager_ms / kernel_ms,
           "copy_kind": kind, "vs_copy": nbytes / kernel_ms / 1e6 / copy,
           "kernel_queued_ms": kernel_queued, "eager_queued_ms": eager_queued,
           "kernel_host_us": _host_us(kernel), "eager_host_us": _host_us(eager)}
    if not graphed:
        row["graph_failed"] = next(g for g in (kernel_graph, eager_graph) if isinstance(g, str))
    return row


def _launch_overhead_row() -> dict:
    """Host cost of a launch, and of the DLPack conversion the launch path avoids."""
    import time

    import cupy

    from raypar.kernels import permute

    t = torch.zeros(1024, device="cuda")
    per = []
    for _ in range(200):
        t0 = time.perf_counter()
        cupy.from_dlpack(t)
        per.append((time.perf_counter() - t0) * 1e6)
    token, slots, _ = _routing("cuda", 8, 2, 4)
    x = torch.randn(8, 64, device="cuda", dtype=torch.bfloat16)
    return {"label": "launch overhead", "dlpack_us_per_tensor": statistics.median(per),
            "tiny_permute_host_us": _host_us(lambda: permute(x, token, slots)),
            "tiny_index_host_us": _host_us(lambda: x[token])}


def _median_ms(fn: Callable, gpu: bool) -> float:
    """GPU time per call of calls queued back to back from Python between two events: the
    host bounds it where its launch cost exceeds the GPU's time. On CPU, one call's wall time."""
    import time

    def queued() -> None:
        for _ in range(CALLS):
            fn()

    for _ in range(3):
        fn()
    if gpu:
        return _events_ms(queued)
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _events_ms(calls: Callable[[], object]) -> float:
    """Median over REPEATS of `calls` (CALLS calls of an op) between two CUDA events, per call."""
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        calls()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / CALLS)
    return statistics.median(times)


def _graph_ms(fn: Callable) -> float | str:
    """GPU time per call replaying CALLS calls captured in one CUDA graph: no host launch
    cost at all. Returns why when the calls cannot be captured."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        # Warm-up on a side stream, as capture needs (autograd and the allocator settle there).
        with torch.cuda.stream(stream):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                fn()
    except Exception as exc:  # noqa: BLE001 - a row that cannot be captured is timed queued only
        torch.cuda.synchronize()
        return f"not capturable in a CUDA graph: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    graph.replay()
    return _events_ms(graph.replay)


def _host_us(fn: Callable) -> float:
    """Host time to issue one call (median), with the GPU left to run behind."""
    import time

    times = []
    for _ in range(REPEATS * 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def _copy_gbps(device: str, nbytes: int, pinned: bool) -> float:
    """Bytes read plus written per second by one large copy_ (to pinned host when `pinned`)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if pinned:
        dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        ms = _median_ms(lambda: dst.copy_(src, non_blocking=True), device == "cuda")
        return nbytes / ms / 1e6  # over the bus once
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), device == "cuda")
    return 2 * nbytes / ms / 1e6


def table(rows: list[dict]) -> str:
    lines = ["| kernel | kernel ms | eager ms | speedup | kernel GB/s | vs copy | queued ms (kernel / eager) "
             "| host us per call (kernel / eager) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "d2d_gbps" in r:
            lines.append(f"| copy bandwidth: device-to-device {r['d2d_gbps']:.0f} GB/s, "
                         f"device-to-pinned-host {r['d2h_pinned_gbps']:.1f} GB/s | | | | | | | |")
            continue
        if "dlpack_us_per_tensor" in r:
            lines.append(f"| launch overhead: DLPack conversion {r['dlpack_us_per_tensor']:.1f} us per tensor; "
                         f"permute of 8 rows {r['tiny_permute_host_us']:.0f} us host, x[token] "
                         f"{r['tiny_index_host_us']:.0f} us | | | | | | | |")
            continue
        if "kernel_ms" not in r:
            lines.append(f"| {r['label']} | - | {r['eager_ms']:.3f} | - | - | - | - | - |")
            continue
        # Times queued, not replayed, are marked: the host may bound them.
        mark = "" if r["timed"] == "graph replay" else " (queued)"
        lines.append(f"| {r['label']} | {r['kernel_ms']:.3f}{mark} | {r['eager_ms']:.3f}{mark} | {r['speedup']:.2f}x | "
                     f"{r['kernel_gbps']:.0f} | {r['vs_copy']:.0%} ({r['copy_kind']}) | "
                     f"{r['kernel_queued_ms']:.3f} / {r['eager_queued_ms']:.3f} | "
                     f"{r['kernel_host_us']:.0f} / {r['eager_host_us']:.0f} |")
    return "\n".join(lines)
