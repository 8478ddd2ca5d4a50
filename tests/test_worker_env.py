"""The environment GPU workers start with (`actors/placement.py`)."""
import re
from pathlib import Path

from actors.placement import GPU_ENV, gpu_env
from raypar.runtime.graphs import OVERLAP_HARDWARE_QUEUES, few_hardware_queues

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_workers_get_every_variable_and_the_drivers_own_values_win(monkeypatch):
    for name in GPU_ENV:
        monkeypatch.delenv(name, raising=False)
    assert gpu_env() == GPU_ENV
    # More hardware queues than CUDA's 8: the overlapped micro-batch streams need them.
    assert int(gpu_env()["CUDA_DEVICE_MAX_CONNECTIONS"]) == OVERLAP_HARDWARE_QUEUES > 8
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    monkeypatch.setenv("UNRELATED_VARIABLE", "1")
    env = gpu_env()
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    assert "UNRELATED_VARIABLE" not in env
    assert {k: v for k, v in env.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"} == {
        k: v for k, v in GPU_ENV.items() if k != "CUDA_DEVICE_MAX_CONNECTIONS"}


def test_operations_doc_lists_every_worker_variable_with_its_value():
    doc = (ROOT / "docs" / "operations.md").read_text()
    rows = dict(re.findall(r"^\| `([A-Z_]+)` \| `([^`]*)` \|", doc, flags=re.M))
    assert {k: rows.get(k) for k in GPU_ENV} == GPU_ENV


def test_too_few_hardware_queues_for_overlapped_microbatches_are_named_with_the_fix(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert few_hardware_queues(gpu_env()) is None
    assert few_hardware_queues({"CUDA_DEVICE_MAX_CONNECTIONS": str(OVERLAP_HARDWARE_QUEUES + 1)}) is None
    for environ, named in (({}, "CUDA_DEVICE_MAX_CONNECTIONS unset (8)"),
                           ({"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, "CUDA_DEVICE_MAX_CONNECTIONS=1"),
                           ({"CUDA_DEVICE_MAX_CONNECTIONS": "lots"}, "CUDA_DEVICE_MAX_CONNECTIONS=lots")):
        why = few_hardware_queues(environ)
        assert why.startswith(named) and f"set it to {OVERLAP_HARDWARE_QUEUES}" in why, why
