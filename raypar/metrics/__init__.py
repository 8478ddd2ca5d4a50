"""Training metrics for Prometheus and Grafana: the catalog of names and the exporter."""
from raypar.metrics.catalog import BY_NAME, CATALOG, MetricSpec, spec
from raypar.metrics.exporter import (
    BACKENDS,
    MetricsError,
    MetricsExporter,
    WorkerTimes,
    build_exporter,
    detect_device_name,
    peak_flops_per_device,
    stage_times,
)

__all__ = [
    "BACKENDS",
    "BY_NAME",
    "CATALOG",
    "MetricSpec",
    "MetricsError",
    "MetricsExporter",
    "WorkerTimes",
    "build_exporter",
    "detect_device_name",
    "peak_flops_per_device",
    "spec",
    "stage_times",
]
