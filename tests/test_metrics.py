"""The metrics exporter: what a Prometheus scrape of the standalone endpoint really returns."""
import logging
import socket
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from raypar.driver.exporter import MetricsError, MetricsExporter, build_exporter, ray_metrics_agent_installed
from raypar.driver.records import StepRecord
from raypar.driver.stats import WorkerTimes, stage_times
from raypar.metrics import CATALOG, peak_flops_per_device

from helpers import tiny_config


def record(step: int, **over) -> StepRecord:
    values = dict(step=step, loss=4.0 - 0.1 * step, lr=1e-3, grad_norm=0.5, step_time_s=0.02, tokens_per_s=3200.0,
                  bubble_measured=0.3, bubble_simulated=0.25, control_overhead=0.01,
                  consumed_samples=8 * (step + 1), peak_activation_bytes=[4096, 2048], peak_device_bytes=[0, 0])
    values.update(over)
    return StepRecord(**values)


def scrape(port: int) -> dict[str, list]:
    """Samples by sample name (e.g. raypar_steps_total, raypar_step_time_seconds_count)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def value(samples: dict, name: str, **labels) -> float:
    found = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {found} in {samples.get(name)}"
    return found[0]


@pytest.fixture
def exporter():
    ex = MetricsExporter("standalone", run_name="t", port=0)
    yield ex
    ex.close()


def test_standalone_serves_step_metrics(exporter):
    assert exporter.port and exporter.port > 0
    for step in range(3):
        exporter(record(step))
    s = scrape(exporter.port)
    assert value(s, "raypar_steps_total", run="t") == 3
    assert value(s, "raypar_consumed_samples_total", run="t") == 24
    assert value(s, "raypar_step_time_seconds_count", run="t") == 3
    assert value(s, "raypar_step_time_seconds_sum", run="t") == pytest.approx(0.06)
    assert value(s, "raypar_loss", run="t") == pytest.approx(3.8)
    assert value(s, "raypar_tokens_per_second", run="t") > 0
    for kind, expected in (("measured", 0.3), ("simulated", 0.25)):
        bubble = value(s, "raypar_bubble_ratio", run="t", kind=kind)
        assert 0.0 <= bubble <= 1.0 and bubble == pytest.approx(expected)
    assert value(s, "raypar_stage_peak_activation_bytes", run="t", stage="0") == 4096
    assert value(s, "raypar_stage_peak_activation_bytes", run="t", stage="1") == 2048
    assert value(s, "raypar_mfu_ratio", run="t") == 0.0  # no known peak: unknown, not invented


def test_exported_families_match_the_catalog(exporter):
    rec = record(0, expert_tokens={"1": [5, 7], "3": [6, 6]}, expert_biases={"1": [0.25, -0.25], "3": [0.0, 0.0]},
                 tokens_dropped=2, alltoall_bytes=1024,
                 checkpoint_stall_s=0.01, optimizer_bytes=[3 << 20, 2 << 20], reduce_s=0.004, optimizer_s=0.002,
                 data_wait_s=0.003, data_window_bytes=[5 << 20, 4 << 20])
    rec.stage_times = [WorkerTimes(0, 0, 0, 0.01, 0.02, 0.003), WorkerTimes(1, 0, 0, 0.01, 0.02, 0.001)]
    rec.alltoall_s = 0.001
    exporter(rec)
    exporter.observe_checkpoint(1 << 20, duration_s=0.8, write_s=0.5)
    exporter.observe_restart(detection_s=1.0, recovery_s=5.0, steps_redone=1, source="memory")
    exporter.set_controller_state("running", ["running", "recovering"])
    s = scrape(exporter.port)
    assert value(s, "raypar_stage_optimizer_state_bytes", run="t", stage="1") == 2 << 20
    assert value(s, "raypar_gradient_reduction_seconds", run="t") == pytest.approx(0.004)
    assert value(s, "raypar_data_wait_seconds", run="t") == pytest.approx(0.003)
    assert value(s, "raypar_stage_data_window_bytes", run="t", stage="1") == 4 << 20
    for spec in CATALOG:
        name = spec.name + ("_count" if spec.kind == "histogram" else "")
        assert name in s, f"{spec.name} was not exported"
        assert set(s[name][0].labels) == set(spec.labels), spec.name
    assert value(s, "raypar_stage_idle_seconds", run="t", stage="1", dp_rank="0", ep_rank="0") == pytest.approx(0.001)
    assert value(s, "raypar_expert_tokens", run="t", layer="1", expert="1") == 7
    assert value(s, "raypar_expert_bias", run="t", layer="1", expert="1") == -0.25
    assert value(s, "raypar_tokens_dropped_total", run="t") == 2
    assert value(s, "raypar_alltoall_bytes_total", run="t") == 1024
    assert value(s, "raypar_checkpoint_stall_seconds", run="t") == pytest.approx(0.01)
    assert value(s, "raypar_checkpoint_write_bytes_per_second", run="t") == pytest.approx(2 * (1 << 20))
    assert value(s, "raypar_checkpoint_duration_seconds_sum", run="t") == pytest.approx(0.8)
    assert value(s, "raypar_restarts_total", run="t") == 1


def test_dense_runs_get_no_moe_series(exporter):
    exporter(record(0))
    s = scrape(exporter.port)
    assert not {"raypar_expert_tokens", "raypar_tokens_dropped_total", "raypar_alltoall_bytes_total"} & set(s)
    assert "raypar_checkpoint_stall_seconds" not in s  # no save yet: no data rather than a fake 0


def save(step, nbytes, write_s, duration_s, error=None):
    # The fields of raypar.driver.saver.SaveResult.
    return SimpleNamespace(step=step, bytes=nbytes, write_s=write_s, duration_s=duration_s, error=error)


def test_checkpoint_hooks_count_saves_by_outcome(exporter):
    trainer = SimpleNamespace(saver=SimpleNamespace(skipped=0))
    exporter.on_checkpoint(trainer, save(4, 4096, 0.5, 1.0))
    exporter.on_step_end(trainer, record(4))
    s = scrape(exporter.port)
    assert value(s, "raypar_checkpoint_bytes", run="t") == 4096
    assert value(s, "raypar_checkpoint_write_bytes_per_second", run="t") == pytest.approx(4096 / 0.5)
    assert value(s, "raypar_checkpoint_duration_seconds_count", run="t") == 1
    exporter.on_checkpoint(trainer, save(6, 0, 0.0, 2.0, error="boom"))
    trainer.saver.skipped = 1
    exporter.on_train_end(trainer, None)
    s = scrape(exporter.port)
    outcomes = {x.labels["outcome"]: x.value for x in s["raypar_checkpoints_total"]}
    assert outcomes == {"committed": 1, "failed": 1, "skipped": 1}
    assert value(s, "raypar_checkpoint_bytes", run="t") == 4096  # a failed save leaves the last good one


def test_recovery_hook(exporter):
    from raypar.driver.records import Recovery

    recovery = Recovery(restart=1, error="RayActorError", failed_grid="dp=1 x pp=2 x ep=1", detection_s=2.0,
                        salvage_s=0.5, steps_done=3, detected_at=0.0, recovery_s=9.5, steps_lost=1, source="memory")
    exporter.on_recovery(None, recovery)
    s = scrape(exporter.port)
    assert value(s, "raypar_restarts_total", run="t") == 1
    assert value(s, "raypar_recovery_seconds", run="t") == 9.5
    assert value(s, "raypar_recovery_steps_redone", run="t", source="memory") == 1


def test_controller_state_marks_only_the_current_one(exporter):
    exporter.set_controller_state("starting", ["starting", "running", "recovering"])
    exporter.set_controller_state("running")
    s = scrape(exporter.port)
    states = {x.labels["state"]: x.value for x in s["raypar_controller_state"]}
    assert states == {"starting": 0, "running": 1, "recovering": 0}


def test_two_exporters_in_one_process_do_not_clash(exporter):
    other = MetricsExporter("standalone", run_name="u", port=0)
    try:
        exporter(record(0))
        assert other.port != exporter.port
        assert "raypar_steps_total" not in scrape(other.port)
    finally:
        other.close()


def test_port_in_use_names_the_config_key():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(MetricsError, match="runtime.metrics_port"):
            MetricsExporter("standalone", port=busy.getsockname()[1])


def test_close_stops_the_server():
    ex = MetricsExporter("standalone", port=0)
    port = ex.port
    ex.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    ex(record(0))  # a closed exporter ignores late callbacks


def test_off_is_a_no_op(tmp_path):
    ex = build_exporter(tiny_config(tmp_path, runtime={"metrics": "off"}))
    assert ex.port is None and not ex.enabled
    ex(record(0))
    ex.observe_checkpoint(0.1, 10, 1.0)
    ex.set_controller_state("running")
    ex.close()


def test_mfu_uses_the_device_peak(tmp_path):
    assert peak_flops_per_device("NVIDIA H100 80GB HBM3", "bfloat16") == 989e12
    assert peak_flops_per_device("NVIDIA H200", "bfloat16") == 989e12
    assert peak_flops_per_device("NVIDIA H100 80GB HBM3", "float32") < 989e12
    assert peak_flops_per_device(None, "bfloat16") == 0.0
    assert peak_flops_per_device("Some Future GPU", "bfloat16") == 0.0
    cfg = tiny_config(tmp_path, runtime={"metrics": "off"})
    ex = build_exporter(cfg, device_name="NVIDIA H100 80GB HBM3")
    from raypar.model import flops_per_token

    expected = 1e6 * flops_per_token(cfg.model, cfg.data.seq_len) / (2 * 67e12)  # pp=2 workers, float32
    assert ex.mfu(1e6) == pytest.approx(expected)
    assert build_exporter(cfg).mfu(1e6) == 0.0  # a CPU run: unknown


def test_stage_times_idle_adds_up_to_the_measured_bubble():
    from raypar.driver.stats import measured_bubble
    from raypar.runtime.report import UnitSpan
    from raypar.schedule import Op
    from raypar.topology import Grid

    def spans(*units):
        return [UnitSpan(label, Op(label[0]), b, e) for label, b, e in units]

    grid = Grid(1, 2, 1)
    # Two stages, 2 micro-batches of fthenb: stage 1 starts late and stage 0 waits for gradients.
    r0 = SimpleNamespace(rank=0, stage=0, start=0.0, end_of_backward=10.0,
                         events=spans(("F0", 0.0, 1.0), ("F1", 1.0, 2.0), ("B0", 6.0, 8.0), ("B1", 8.0, 10.0)))
    r1 = SimpleNamespace(rank=1, stage=1, start=1.0, end_of_backward=8.0,
                         events=spans(("F0", 1.0, 2.0), ("F1", 2.0, 3.0), ("B0", 3.0, 5.0), ("B1", 5.0, 7.0)))
    for r in (r0, r1):
        r.compute_s = sum(s.seconds for s in r.events)
    times = stage_times([r0, r1], grid)
    assert [(t.stage, t.forward_s, t.backward_s) for t in times] == [(0, 2.0, 4.0), (1, 2.0, 4.0)]
    window = 10.0
    assert sum(t.idle_s for t in times) / (2 * window) == pytest.approx(measured_bubble([r0, r1], grid))


def ray_agent_samples(ray, run: str) -> dict[str, list]:
    """Samples of `run` that the local Ray node's metrics agent serves."""
    node = ray.nodes()[0]
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(urllib.request.urlopen(url, timeout=10).read().decode()):
        for s in family.samples:
            if s.labels.get("run") == run:
                samples.setdefault(s.name, []).append(s)
    return samples


@pytest.mark.timeout(120)
def test_trainer_feeds_both_backends(ray_session, tmp_path):
    from raypar.driver.trainer import Trainer

    cfg = tiny_config(tmp_path, train={"steps": 2}, runtime={"metrics": "standalone", "metrics_port": 0})
    exporter = build_exporter(cfg)
    # One run into Ray's agent too: the dashboards rely on it serving raypar_x as ray_raypar_x.
    on_ray = MetricsExporter("ray", run_name="ray-backend-test")
    try:
        summary = Trainer(cfg, callbacks=[exporter, on_ray], log=lambda s: None).fit()
        s = scrape(exporter.port)
        run = cfg.runtime.run_name
        assert value(s, "raypar_steps_total", run=run) == 2
        assert value(s, "raypar_consumed_samples_total", run=run) == summary.consumed_samples
        assert value(s, "raypar_loss", run=run) == pytest.approx(summary.final_loss)
        assert value(s, "raypar_tokens_per_second", run=run) > 0
        assert 0.0 <= value(s, "raypar_bubble_ratio", run=run, kind="measured") <= 1.0
        assert value(s, "raypar_stage_peak_activation_bytes", run=run, stage="1") > 0
    finally:
        exporter.close()
        on_ray.close()

    if not ray_metrics_agent_installed():
        pytest.skip("this Ray install has no metrics agent (ray[default]): nothing serves the ray backend")
    deadline = time.monotonic() + 60  # workers push to the agent every few seconds
    while "ray_raypar_steps_total" not in (samples := ray_agent_samples(ray_session, "ray-backend-test")):
        assert time.monotonic() < deadline, f"raypar metrics never reached Ray's agent; got {sorted(samples)}"
        time.sleep(1)
    assert samples["ray_raypar_steps_total"][0].value == 2
    assert samples["ray_raypar_loss"][0].value == pytest.approx(summary.final_loss)
    assert {x.labels["kind"] for x in samples["ray_raypar_bubble_ratio"]} == {"measured", "simulated"}
    assert "ray_raypar_step_time_seconds_count" in samples
    assert not [name for name in samples if not name.startswith("ray_raypar_") or "_total_total" in name]


def test_ray_backend_warns_without_a_metrics_agent(monkeypatch, caplog):
    import raypar.driver.exporter as exporter_module

    monkeypatch.setattr(exporter_module, "ray_metrics_agent_installed", lambda: False)
    with caplog.at_level(logging.WARNING, logger="raypar.driver.exporter"):
        MetricsExporter("ray")
    assert "runtime.metrics=standalone" in caplog.text


def test_ray_backend_exports_a_counter_at_zero_once(monkeypatch):
    """A dropless MoE run's inc(0) of raypar_tokens_dropped_total creates the series at 0 under
    the ray backend too (Ray's Counter.inc refuses 0), so the panel reads 0, not "no data"."""
    import raypar.driver.exporter as exporter_module

    recorded = []

    class FakeCounter:
        def inc(self, value, tags):
            assert value > 0, "Ray's Counter.inc raises on 0"
            recorded.append(("inc", value, tags))

        def _record(self, value, tags):
            recorded.append(("record", value, tags))

    monkeypatch.setattr(exporter_module, "ray_metrics_agent_installed", lambda: True)
    backend = exporter_module._RayBackend()
    monkeypatch.setattr(backend, "_get", lambda name: FakeCounter())
    for value in (0, 0, 3, 0):
        backend.inc("raypar_tokens_dropped_total", value, {"run": "r"})
    backend.inc("raypar_tokens_dropped_total", 0, {"run": "other"})
    assert recorded == [("record", 0, {"run": "r"}), ("inc", 3, {"run": "r"}), ("record", 0, {"run": "other"})]
