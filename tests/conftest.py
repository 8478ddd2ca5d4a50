import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ports import free_port

# `python -m pytest` in the checkout puts its root first on sys.path, where the folder
# `kernels/` (installed as `raypar.kernels`) would stand in for the `kernels` package of
# Hugging Face that transformers imports: the root goes last, behind site-packages.
_ROOT = str(Path(__file__).resolve().parent.parent)
_at_front = [p for p in sys.path if os.path.abspath(p or os.curdir) == _ROOT]
if _at_front:
    sys.path[:] = [p for p in sys.path if p not in _at_front] + [_ROOT]

# Workers get fractional CPUs so an 8-worker grid schedules on a 2-core machine.
LOGICAL_CPUS = 8
WORKER_CPUS = 0.25


@pytest.fixture(scope="session")
def ray_session():
    import ray

    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    ray.init(address="local", num_cpus=LOGICAL_CPUS, include_dashboard=False, log_to_driver=True)
    yield ray
    from raypar.actors import worker_pool

    worker_pool.release()
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    import torch

    # Files holding a test marked slow first, each file's tests still together and in order:
    # under `-n 2 --dist loadfile` the longest files start first, so the two processes end
    # together rather than one running a long file alone at the end.
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def moto_port():
    """A moto S3 server of this module's own on the loopback address, with a bucket `raypar`."""
    import pyarrow.fs as pafs

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto's S3 server did not start on the loopback address")
                time.sleep(0.2)
        fs, _ = pafs.FileSystem.from_uri(f"s3://testing:testing@raypar?{s3_query(port)}&allow_bucket_creation=true")
        fs.create_dir("raypar")
        yield port
    finally:
        server.kill()
        server.wait()


def s3_query(port: int) -> str:
    return f"endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"


@pytest.fixture(scope="module")
def s3_root(moto_port):
    """URIs in the bucket; each carries the endpoint and the credentials."""
    return lambda prefix: f"s3://testing:testing@raypar/{prefix}?{s3_query(moto_port)}"
