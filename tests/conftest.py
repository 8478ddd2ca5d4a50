import os

import pytest

# Workers get fractional CPUs so an 8-worker grid schedules on a 2-core machine.
LOGICAL_CPUS = 8
WORKER_CPUS = 0.25


@pytest.fixture(scope="session")
def ray_session():
    import ray

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ray.init(address="local", num_cpus=LOGICAL_CPUS, include_dashboard=False, log_to_driver=True)
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
