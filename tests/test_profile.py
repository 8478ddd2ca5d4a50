"""runtime.profile_step: every worker writes each profiled step's torch.profiler trace, and
`device_time` sums a trace's GPU kernels by kind and finds the device's busy time."""
import json

import pytest

from raypar.config import ConfigError, load_config
from raypar.runtime.profile import (PROFILER_READY, collective, device_time, exchange_waits, graph_replays,
                                    kernel_kind, replay_overlap, trace_events)
from raypar.driver.trainer import Trainer

from helpers import tiny_config


@pytest.mark.parametrize("profiled", [0, 1, [1, 2]], ids=["first-step", "later-step", "two-steps-in-a-row"])
def test_every_worker_writes_the_profiled_steps_trace(ray_session, tmp_path, profiled):
    """The profiler starts after the step before (or before the first) and records from the
    barrier that waits for every worker's: the barrier itself is not in the trace. Of two
    profiled steps in a row, the second's profiler starts as the first's stops."""
    cfg = tiny_config(tmp_path, train={"steps": 4}, runtime={"profile_step": profiled})
    Trainer(cfg).fit()
    steps = profiled if isinstance(profiled, list) else [profiled]
    traces = sorted((tmp_path / "run" / "profile").iterdir())
    assert [t.name for t in traces] == sorted(f"rank{r}-step{s}.json" for r in (0, 1) for s in steps)
    for trace in traces:
        names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
        assert any(n and n.startswith("aten::") for n in names)  # the step's ops
        assert PROFILER_READY not in names
        assert device_time(trace)["kernels"] == 0  # a CPU run has no kernels
    if len(steps) == 2:  # each trace holds its own step: the first's ops end before the second's begin
        ops = [[e for e in trace_events(tmp_path / "run" / "profile" / f"rank0-step{s}.json")
                if str(e.get("name", "")).startswith("aten::")] for s in steps]
        assert max(e["ts"] + e["dur"] for e in ops[0]) <= min(e["ts"] for e in ops[1])


def test_device_time_sums_kernels_by_kind_and_the_busy_time(tmp_path):
    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [kernel("sm90_xmma_gemm_bf16", 0, 100), kernel("ncclDevKernel_SendRecv", 50, 200),
              kernel("flash_fwd_kernel", 300, 50), kernel("vectorized_elementwise_kernel", 320, 10),
              kernel("multi_tensor_apply_kernel", 400, 100), {"ph": "X", "cat": "cpu_op", "name": "aten::mm",
                                                              "ts": 0, "dur": 1000}]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = device_time(trace)
    assert got["kernels"] == 5 and got["span_ms"] == pytest.approx(0.5) and got["traced_ms"] == pytest.approx(1.0)
    # Any kernel: 0-250, 300-350, 400-500; compute (all but NCCL): 0-100, 300-350, 400-500.
    assert got["busy_ms"] == pytest.approx(0.4) and got["compute_busy_ms"] == pytest.approx(0.25)
    assert {k: v["count"] for k, v in got["by_kind"].items()} == {
        "communication": 1, "attention": 1, "matmul": 1, "multi_tensor": 1, "other": 1}
    assert got["by_kind"]["communication"]["ms"] == pytest.approx(0.2)
    assert kernel_kind("nvjet_tst_128x256_h_bz_coopA_NNT") == "matmul"
    # The send/receive ran 50-250; compute covered 50-100 of it: 150 us exposed.
    assert got["exposed_ms"] == {"SendRecv": pytest.approx(0.15)}


def test_exposed_time_is_per_collective(tmp_path):
    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 0, 100),
              kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 200, 100),
              kernel("sm90_xmma_gemm_bf16", 250, 100)]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = device_time(trace)
    assert got["exposed_ms"] == {"SendRecv": pytest.approx(0.1), "AllReduce": pytest.approx(0.05)}
    assert collective("ncclKernel_AllGather_RING_LL_Sum_int8_t(x)") == "AllGather"


def test_a_negative_profile_step_is_refused():
    with pytest.raises(ConfigError, match="runtime.profile_step=-1 must be a step number"):
        load_config(None, ["runtime.profile_step=-1"])
    with pytest.raises(ConfigError, match=r"runtime.profile_step=\[3, -2\] must be a step number .* a list of them"):
        load_config(None, ["runtime.profile_step=[3, -2]"])
    assert load_config(None, ["runtime.profile_step=[6, 100]"]).runtime.profiled_steps == {6, 100}


def test_idle_gaps_are_the_stretches_no_kernel_covers_longest_first():
    from raypar.runtime.profile import idle_gaps

    kernels = [(0.0, 100.0, "gemm"), (50.0, 300.0, "nccl"), (1300.0, 1400.0, "flash"), (1450.0, 1500.0, "adam")]
    gaps = idle_gaps(kernels)
    assert [(g["at_ms"], g["ms"], g["after"], g["before"]) for g in gaps] == [
        (0.3, 1.0, "nccl", "flash"), (1.4, 0.05, "flash", "adam")]


def test_exchange_waits_split_a_peers_lateness_from_the_transfer(tmp_path):
    """Two workers' traces on one clock (different bases): worker 0 enters the first exchange
    100 us before worker 1 and waits for it; the second starts together."""
    def trace(path, base_ns, kernels):
        events = [{"ph": "X", "cat": "kernel", "name": n, "ts": ts - base_ns / 1000, "dur": dur} for n, ts, dur in kernels]
        path.write_text(json.dumps({"baseTimeNanoseconds": base_ns, "traceEvents": events}))
        return path

    a2a, gemm = "ncclDevKernel_SendRecv(x)", "sm90_xmma_gemm_bf16"
    w0 = trace(tmp_path / "w0.json", 5_000_000, [(gemm, 1000, 50), (a2a, 1100, 150), (a2a, 1400, 50),
                                                   (gemm, 1410, 20)])
    w1 = trace(tmp_path / "w1.json", 7_000_000, [(gemm, 1000, 190), (a2a, 1200, 50), (a2a, 1400, 50)])
    got = exchange_waits([w0, w1])
    assert got[0]["peer_wait_ms"] == pytest.approx(0.1) and got[1]["peer_wait_ms"] == 0
    assert got[0]["transfer_ms"] == pytest.approx(0.1) and got[1]["transfer_ms"] == pytest.approx(0.1)
    # Worker 0's second transfer overlaps its GEMM for 20 of 50 us.
    assert got[0]["exposed_transfer_ms"] == pytest.approx(0.08) and got[1]["exposed_transfer_ms"] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="matching them needs the same count"):
        exchange_waits([w0, trace(tmp_path / "w2.json", 0, [(a2a, 1100, 10)])])


def test_exchange_waits_match_exchanges_stream_by_stream(tmp_path):
    """Forwards and backwards on communicators of their own: worker 1 starts its backward's
    exchange before its second forward's, worker 0 after. Each exchange still meets the same
    exchange of the other worker: the i-th of its stream."""
    def trace(path, kernels):
        events = [{"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(x)", "ts": ts, "dur": dur,
                   "args": {"stream": stream}} for stream, ts, dur in kernels]
        path.write_text(json.dumps({"traceEvents": events}))
        return path

    w0 = trace(tmp_path / "w0.json", [(7, 1000, 100), (7, 1200, 50), (9, 1210, 90)])
    w1 = trace(tmp_path / "w1.json", [(3, 1050, 50), (4, 1150, 150), (3, 1200, 50)])
    got = exchange_waits([w0, w1])
    # Worker 0 waits 50 us for worker 1's first forward; worker 1 60 us for worker 0's backward.
    assert got[0]["peer_wait_ms"] == pytest.approx(0.05) and got[1]["peer_wait_ms"] == pytest.approx(0.06)
    assert got[0]["exchanges"] == got[1]["exchanges"] == 3


def test_graph_replays_are_spans_of_their_launches_kernels_and_their_overlap(tmp_path):
    """Kernels belong to the graph launch with their correlation id; eager kernels to none.
    The second replay starts while the first runs: the time both ran is the overlap."""
    def launch(corr, ts):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5,
                "args": {"correlation": corr}}

    def kernel(corr, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [launch(7, 90), launch(9, 95), launch(11, 97),
              kernel(7, 100, 50), kernel(7, 160, 40),  # replay 7: 100 .. 200
              kernel(9, 180, 30), kernel(9, 230, 20),  # replay 9: 180 .. 250, beside 7 for 20 us
              kernel(None, 300, 100)]  # eager; launch 11 ran nothing
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    got = graph_replays(trace)
    assert [(r["start_ms"], r["end_ms"], r["kernels"]) for r in got["replays"]] == [(0.0, 0.1, 2), (0.08, 0.15, 2)]
    assert got["replays"][0]["host_ms"] == pytest.approx(-0.01)
    assert got["replay_ms"] == pytest.approx(0.15) and got["concurrent_ms"] == pytest.approx(0.02)
    assert replay_overlap(trace) == {"replays": 2, "replay_ms": got["replay_ms"], "concurrent_ms": got["concurrent_ms"]}
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    assert graph_replays(empty) == {"replays": [], "replay_ms": 0.0, "concurrent_ms": 0.0}
