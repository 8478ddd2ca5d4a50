"""Peak FLOP/s of the devices raypar knows, for MFU."""
from __future__ import annotations

import logging

from raypar.config import Config

log = logging.getLogger(__name__)


# Dense (no sparsity) peak FLOP/s per device by model dtype, from the vendors' datasheets.
# "float32" is the plain FP32 rate: PyTorch does not use TF32 for fp32 matmuls by default.
# Order matters: the first name fragment found in the device name wins.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H200", {"bfloat16": 989e12, "float32": 67e12}),
    ("H100 PCIe", {"bfloat16": 756e12, "float32": 51e12}),
    ("H100 NVL", {"bfloat16": 835e12, "float32": 60e12}),
    ("H100", {"bfloat16": 989e12, "float32": 67e12}),  # SXM
    ("A100", {"bfloat16": 312e12, "float32": 19.5e12}),
    ("L40S", {"bfloat16": 362e12, "float32": 91.6e12}),
    ("L4", {"bfloat16": 121e12, "float32": 30.3e12}),
)


def peak_flops_per_device(device_name: str | None, dtype: str) -> float:
    """Peak FLOP/s of one device for `dtype`, or 0.0 when unknown (CPUs, unlisted GPUs).

    0 makes MFU read 0 ("unknown") rather than a number built on a guessed peak.
    """
    if not device_name:
        return 0.0
    for fragment, by_dtype in PEAK_FLOPS:
        if fragment.lower() in device_name.lower():
            return by_dtype.get(dtype, 0.0)
    return 0.0


def mfu(tokens_per_s: float, flops_per_token: float, devices: int, peak_flops: float) -> float:
    """Model FLOPs utilisation: the model's FLOP/s over the peak of the `devices` running it
    (`peak_flops` per device; 0 when unknown, and then MFU reads 0 too)."""
    if peak_flops <= 0 or devices <= 0:
        return 0.0
    return tokens_per_s * flops_per_token / (devices * peak_flops)


def detect_device_name(cfg: Config) -> str | None:
    """The CUDA device name as the driver sees it; None on CPU runs or a GPU-less driver."""
    if cfg.runtime.device == "cpu":
        return None
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # a broken CUDA setup must not stop training; MFU just reads 0
        log.debug("could not query the CUDA device name", exc_info=True)
    return None
