"""Training metrics' names (the catalog dashboards are checked against) and device peaks for MFU.

The exporter that serves them is Ray-side: `raypar.driver.exporter`.
"""
from raypar.metrics.catalog import BY_NAME, CATALOG, MetricSpec, spec
from raypar.metrics.peak import PEAK_FLOPS, detect_device_name, mfu, peak_flops_per_device

__all__ = ["BY_NAME", "CATALOG", "PEAK_FLOPS", "MetricSpec", "detect_device_name", "mfu", "peak_flops_per_device",
           "spec"]
