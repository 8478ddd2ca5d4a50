"""Exports training metrics to Prometheus: through Ray's metrics agent, or a server of its own.

`MetricsExporter` is a Trainer `on_step_end` callback. Backends:

- "ray": `ray.util.metrics` instruments; Ray's metrics agent serves them (with Ray's
  `ray_` prefix) next to Ray's own metrics, and Ray's Grafana picks them up.
- "standalone": a private prometheus_client registry served over HTTP from this process,
  for runs whose Ray cluster has no metrics agent (e.g. a minimal Ray install).
- "off": does nothing.

Step metrics come from each StepRecord; data a record may or may not carry (per-worker
times, MoE counts) is read from optional attributes (see `MetricsExporter.__call__`).
Checkpoint results and recoveries arrive through the Callback hooks; controller states are
set by their owner through `set_controller_state`.
"""
from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from raypar.config import Config, ConfigError
from raypar.driver.callbacks import Callback
from raypar.driver.stats import WorkerTimes
from raypar.metrics import CATALOG, MetricSpec, detect_device_name, mfu, peak_flops_per_device, spec

if TYPE_CHECKING:
    from raypar.driver.records import Recovery, StepRecord

log = logging.getLogger(__name__)

BACKENDS = ("ray", "standalone", "off")


class MetricsError(ConfigError):
    """The metrics exporter cannot start with this configuration (e.g. its port is taken)."""


# ---------------------------------------------------------------------------------------
# Backends: the same three verbs over prometheus_client or ray.util.metrics


class _NullBackend:
    port: int | None = None

    def set(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        pass

    def inc(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        pass

    def observe(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        pass

    def close(self) -> None:
        pass


class _PrometheusBackend(_NullBackend):
    def __init__(self, host: str, port: int):
        import prometheus_client as pc

        # A registry of its own: two exporters in one process (tests, notebooks) must not
        # collide in the global default registry.
        self.registry = pc.CollectorRegistry(auto_describe=True)
        self.instruments: dict[str, Any] = {}
        for s in CATALOG:
            if s.kind == "gauge":
                m = pc.Gauge(s.name, s.description, s.labels, registry=self.registry)
            elif s.kind == "counter":
                m = pc.Counter(s.name, s.description, s.labels, registry=self.registry)
            else:
                m = pc.Histogram(s.name, s.description, s.labels, registry=self.registry, buckets=s.buckets)
            self.instruments[s.name] = m
        try:
            self.server, self.thread = pc.start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise MetricsError(
                    f"cannot serve metrics on {host}:{port}: the port is already in use; set "
                    f"runtime.metrics_port to a free port (0 picks one), or runtime.metrics=off"
                ) from None
            raise MetricsError(
                f"cannot serve metrics on runtime.metrics_host={host} runtime.metrics_port={port}: {e}"
            ) from None
        self.port = self.server.server_address[1]

    def set(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self.instruments[name].labels(**labels).set(value)

    def inc(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self.instruments[name].labels(**labels).inc(value)

    def observe(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self.instruments[name].labels(**labels).observe(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def ray_metrics_agent_installed() -> bool:
    """Whether this Ray install can run the metrics agent that serves ray.util.metrics.

    A minimal `pip install ray` (and ray[train]) lacks the agent's packages; ray.util.metrics
    then records into nothing, silently.
    """
    from importlib.util import find_spec

    return all(find_spec(m) is not None for m in ("aiohttp", "opentelemetry.exporter.prometheus"))


class _RayBackend(_NullBackend):
    """ray.util.metrics instruments, created on first use: they need a connected driver."""

    def __init__(self) -> None:
        self.instruments: dict[str, Any] = {}
        self._zero_series: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        if not ray_metrics_agent_installed():
            log.warning("runtime.metrics=ray, but this Ray install has no metrics agent, so no metrics will be "
                        "served: install ray[default], or use runtime.metrics=standalone")

    def _get(self, name: str):
        m = self.instruments.get(name)
        if m is None:
            import ray
            from ray.util import metrics

            if not ray.is_initialized():
                raise MetricsError("runtime.metrics=ray needs a connected Ray driver (ray.init) before the first step")
            s: MetricSpec = spec(name)
            if s.kind == "gauge":
                m = metrics.Gauge(s.name, s.description, tag_keys=s.labels)
            elif s.kind == "counter":
                # Ray appends `_total` to counters itself; leaving ours on would export
                # `..._total_total` under the older OpenCensus exporter.
                m = metrics.Counter(s.name.removesuffix("_total"), s.description, tag_keys=s.labels)
            else:
                m = metrics.Histogram(s.name, s.description, boundaries=list(s.buckets), tag_keys=s.labels)
            self.instruments[name] = m
        return m

    def set(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self._get(name).set(value, tags=dict(labels))

    def inc(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        if value > 0:
            self._get(name).inc(value, tags=dict(labels))
        elif value == 0:
            self._create_at_zero(name, labels)

    def _create_at_zero(self, name: str, labels: Mapping[str, str]) -> None:
        """Export a counter's series at 0, as the standalone backend does on inc(0), so that
        "no tokens dropped" reads 0 on the dashboards rather than "no data".

        Ray's Counter.inc rejects 0; its `_record`, which inc calls after that check, adds 0
        and so creates the series. Should a Ray version lack it, the series waits for its
        first increment, as before.
        """
        key = (name, tuple(sorted(labels.items())))
        if key in self._zero_series:
            return
        self._zero_series.add(key)
        record = getattr(self._get(name), "_record", None)
        if record is not None:
            record(0, tags=dict(labels))

    def observe(self, name: str, value: float, labels: Mapping[str, str]) -> None:
        self._get(name).observe(value, tags=dict(labels))


# ---------------------------------------------------------------------------------------
# The exporter


class MetricsExporter(Callback):
    """Turns StepRecords, checkpoint results and recoveries into Prometheus metrics.

    Use as `Trainer(cfg, callbacks=[exporter])`; call `close()` when the run ends. It is also
    a plain `fn(record)` step callback, and the `observe_*` methods take data from anywhere.
    """

    def __init__(self, backend: str = "standalone", *, run_name: str = "default", host: str = "127.0.0.1",
                 port: int = 9464, flops_per_token: float = 0.0, n_devices: int = 1, peak_flops: float = 0.0):
        if backend not in BACKENDS:
            raise MetricsError(f"runtime.metrics={backend!r} is not allowed; choose one of {', '.join(BACKENDS)}")
        self.backend_name = backend
        self.run = run_name
        self.flops_per_token = flops_per_token
        self.n_devices = n_devices
        self.peak_flops = peak_flops  # per device; 0 = unknown, MFU reads 0
        self._consumed = 0
        self._state: str | None = None
        self._skips_seen = 0
        self._backend: _NullBackend
        if backend == "standalone":
            self._backend = _PrometheusBackend(host, port)
        elif backend == "ray":
            self._backend = _RayBackend()
        else:
            self._backend = _NullBackend()

    @property
    def port(self) -> int | None:
        """The port the standalone server listens on (the real one when 0 was asked); else None."""
        return self._backend.port

    @property
    def registry(self):
        """The standalone backend's prometheus_client registry (e.g. to push it elsewhere); else None."""
        return getattr(self._backend, "registry", None)

    @property
    def enabled(self) -> bool:
        return self.backend_name != "off"

    # -- the step callback ---------------------------------------------------------------

    def __call__(self, record: StepRecord) -> None:
        """Export one step.

        Besides the core fields, exported when the record has them: expert_tokens
        ({layer: [tokens per expert]}), expert_biases ({layer: [bias per expert]}),
        tokens_dropped and alltoall_bytes (this step's counts), alltoall_s, checkpoint_stall_s,
        and stage_times (list of WorkerTimes or their dicts; see `stage_times`).
        """
        if not self.enabled:
            return
        run = {"run": self.run}
        b = self._backend
        b.inc("raypar_steps_total", 1, run)
        # The record carries the cumulative count; counters take increments.
        delta = record.consumed_samples - self._consumed
        if delta > 0:
            b.inc("raypar_consumed_samples_total", delta, run)
        self._consumed = max(self._consumed, record.consumed_samples)
        b.observe("raypar_step_time_seconds", record.step_time_s, run)
        b.set("raypar_tokens_per_second", record.tokens_per_s, run)
        b.set("raypar_loss", record.loss, run)
        b.set("raypar_grad_norm", record.grad_norm, run)
        b.set("raypar_learning_rate", record.lr, run)
        # The driver's records carry MFU from the workers' devices and the grid running now.
        recorded = getattr(record, "mfu", None)
        b.set("raypar_mfu_ratio", self.mfu(record.tokens_per_s) if recorded is None else recorded, run)
        b.set("raypar_bubble_ratio", record.bubble_measured, {**run, "kind": "measured"})
        b.set("raypar_bubble_ratio", record.bubble_simulated, {**run, "kind": "simulated"})
        b.set("raypar_control_overhead_ratio", record.control_overhead, run)
        for stage, nbytes in enumerate(record.peak_activation_bytes):
            b.set("raypar_stage_peak_activation_bytes", nbytes, {**run, "stage": str(stage)})
        for stage, nbytes in enumerate(record.peak_device_bytes):
            b.set("raypar_stage_peak_device_memory_bytes", nbytes, {**run, "stage": str(stage)})
        for stage, nbytes in enumerate(getattr(record, "optimizer_bytes", None) or []):
            b.set("raypar_stage_optimizer_state_bytes", nbytes, {**run, "stage": str(stage)})
        if getattr(record, "reduce_s", None) is not None:
            b.set("raypar_gradient_reduction_seconds", record.reduce_s, run)
            b.set("raypar_optimizer_step_seconds", record.optimizer_s, run)

        times = getattr(record, "stage_times", None)
        if times:
            self.observe_stage_times(times)
        # Dense runs leave these at their defaults; only MoE runs get MoE series.
        if getattr(record, "expert_tokens", None) or getattr(record, "alltoall_s", None) is not None:
            self.observe_moe(getattr(record, "expert_tokens", None), getattr(record, "tokens_dropped", 0),
                             getattr(record, "alltoall_bytes", 0), getattr(record, "alltoall_s", None),
                             getattr(record, "expert_biases", None))
        b.set("raypar_data_wait_seconds", getattr(record, "data_wait_s", 0.0) or 0.0, run)
        for stage, nbytes in enumerate(getattr(record, "data_window_bytes", None) or []):
            b.set("raypar_stage_data_window_bytes", nbytes, {**run, "stage": str(stage)})
        # Most steps do not checkpoint (stall 0); the gauge keeps the last save's stall.
        stall = getattr(record, "checkpoint_stall_s", 0.0) or 0.0
        if stall > 0:
            b.set("raypar_checkpoint_stall_seconds", stall, run)

    def mfu(self, tokens_per_s: float) -> float:
        """MFU from this exporter's own figures, for records that do not carry one."""
        return mfu(tokens_per_s, self.flops_per_token, self.n_devices, self.peak_flops)

    # -- explicit observations -------------------------------------------------------------

    def observe_stage_times(self, times: Iterable[WorkerTimes | Mapping[str, float]]) -> None:
        """Per-worker forward/backward/idle seconds of the last step."""
        if not self.enabled:
            return
        for t in times:
            t = t if isinstance(t, WorkerTimes) else WorkerTimes(**t)
            labels = {"run": self.run, "stage": str(t.stage), "dp_rank": str(t.dp), "ep_rank": str(t.ep)}
            self._backend.set("raypar_stage_forward_seconds", t.forward_s, labels)
            self._backend.set("raypar_stage_backward_seconds", t.backward_s, labels)
            self._backend.set("raypar_stage_idle_seconds", t.idle_s, labels)

    def observe_moe(self, expert_tokens: Mapping[str, Sequence[int]] | None = None, tokens_dropped: int = 0,
                    alltoall_bytes: int = 0, alltoall_s: float | None = None,
                    expert_biases: Mapping[str, Sequence[float]] | None = None) -> None:
        """One step's expert routing ({layer: tokens per expert}), the routing biases after it
        ({layer: bias per expert}, model.moe_bias_update_rate) and all-to-all traffic.

        tokens_dropped and alltoall_bytes are this step's counts, not running totals.
        """
        if not self.enabled:
            return
        run = {"run": self.run}
        for layer, counts in (expert_tokens or {}).items():
            for expert, n in enumerate(counts):
                self._backend.set("raypar_expert_tokens", n, {**run, "layer": str(layer), "expert": str(expert)})
        for layer, biases in (expert_biases or {}).items():
            for expert, bias in enumerate(biases):
                self._backend.set("raypar_expert_bias", bias, {**run, "layer": str(layer), "expert": str(expert)})
        # inc(0) still creates the series (both backends), so "no drops" reads 0 rather than "no data".
        self._backend.inc("raypar_tokens_dropped_total", tokens_dropped or 0, run)
        self._backend.inc("raypar_alltoall_bytes_total", alltoall_bytes or 0, run)
        if alltoall_s is not None:
            self._backend.set("raypar_alltoall_seconds", alltoall_s, run)

    def observe_checkpoint(self, nbytes: int, duration_s: float, write_s: float | None = None,
                           stall_s: float | None = None, error: str | None = None) -> None:
        """A finished save: its size, start-to-commit time, the writers' time and the loop's stall.

        Throughput is bytes over write_s (the writers' time, as the driver's Saver reports it),
        else over duration_s.
        """
        if not self.enabled:
            return
        run = {"run": self.run}
        b = self._backend
        if error:
            b.inc("raypar_checkpoints_total", 1, {**run, "outcome": "failed"})
            return
        b.inc("raypar_checkpoints_total", 1, {**run, "outcome": "committed"})
        b.set("raypar_checkpoint_bytes", nbytes, run)
        seconds = write_s if write_s else duration_s
        b.set("raypar_checkpoint_write_bytes_per_second", nbytes / seconds if seconds > 0 else 0.0, run)
        b.observe("raypar_checkpoint_duration_seconds", duration_s, run)
        if stall_s is not None:
            b.set("raypar_checkpoint_stall_seconds", stall_s, run)

    def observe_save(self, result: Any) -> None:
        """A `raypar.driver.saver.SaveResult` (bytes, write_s, duration_s, error)."""
        self.observe_checkpoint(result.bytes, result.duration_s, write_s=result.write_s, error=result.error)

    def _count_skipped_saves(self, trainer: Any) -> None:
        # Skipped saves (checkpoint.when_busy=skip) produce no result, only the saver's count.
        skipped = getattr(getattr(trainer, "saver", None), "skipped", 0)
        if skipped > self._skips_seen:
            self._backend.inc("raypar_checkpoints_total", skipped - self._skips_seen,
                              {"run": self.run, "outcome": "skipped"})
            self._skips_seen = skipped

    def observe_restart(self, detection_s: float | None = None, recovery_s: float | None = None,
                        steps_redone: int | None = None, source: str | None = None) -> None:
        """A restart after a failure: time to notice it, time until steps ran again, and the
        steps it ran again with where its state came from."""
        if not self.enabled:
            return
        run = {"run": self.run}
        self._backend.inc("raypar_restarts_total", 1, run)
        if detection_s is not None:
            self._backend.set("raypar_failure_detection_seconds", detection_s, run)
        if recovery_s is not None:
            self._backend.set("raypar_recovery_seconds", recovery_s, run)
        if steps_redone is not None and source is not None:
            self._backend.set("raypar_recovery_steps_redone", steps_redone, {**run, "source": source})

    def set_controller_state(self, state: str, states: Iterable[str] = ()) -> None:
        """Mark `state` current (1); the previous state and any of `states` read 0.

        Listing every state up front gives each its own series from the start, so a
        dashboard's state timeline shows the states that were never entered too.
        """
        if not self.enabled:
            return
        run = {"run": self.run}
        for other in {*states, *([self._state] if self._state else [])} - {state}:
            self._backend.set("raypar_controller_state", 0, {**run, "state": other})
        self._backend.set("raypar_controller_state", 1, {**run, "state": state})
        self._state = state

    # -- Trainer callback hooks (raypar.driver.callbacks.Callback) -----------------------

    def on_step_end(self, trainer: Any, record: StepRecord) -> None:
        self(record)
        self._count_skipped_saves(trainer)

    def on_checkpoint(self, trainer: Any, result: Any) -> None:
        self.observe_save(result)

    def on_state_change(self, trainer: Any, state: str) -> None:
        from raypar.driver.states import State

        self.set_controller_state(state, [s.value for s in State])

    def on_recovery(self, trainer: Any, recovery: Recovery) -> None:
        self.observe_restart(recovery.detection_s, recovery.recovery_s, recovery.steps_lost, recovery.source)

    def on_train_end(self, trainer: Any, summary: Any) -> None:
        self._count_skipped_saves(trainer)

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the standalone server; Ray's instruments live as long as the driver."""
        self._backend.close()
        self._backend = _NullBackend()
        self.backend_name = "off"

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def build_exporter(cfg: Config, *, device_name: str | None = None, peak_flops: float | None = None) -> MetricsExporter:
    """The exporter `cfg.runtime.metrics` asks for.

    peak_flops is per device; without it the peak comes from `device_name` (default: the
    driver's CUDA device) and the model dtype, and is 0 (MFU 0) when unknown.
    """
    from raypar.model import flops_per_token

    r = cfg.runtime
    if peak_flops is None:
        peak_flops = peak_flops_per_device(device_name or detect_device_name(cfg), cfg.model.dtype)
    return MetricsExporter(
        r.metrics, run_name=r.run_name, host=r.metrics_host, port=r.metrics_port,
        flops_per_token=flops_per_token(cfg.model, cfg.data.seq_len),
        n_devices=cfg.parallel.dp * cfg.parallel.pp * cfg.parallel.ep * cfg.parallel.tp, peak_flops=peak_flops,
    )
