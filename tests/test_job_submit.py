"""`ray job submit` end to end: a head started with `ray start`, a job that trains and
checkpoints, its logs, and `ray job stop` leaving no actors and an intact checkpoint."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raypar.checkpoint import CheckpointReader, latest, list_committed

from ports import free_port

ROOT = Path(__file__).resolve().parent.parent
RAY = [sys.executable, "-m", "ray.scripts.scripts"]


@pytest.fixture
def head(tmp_path):
    """A Ray head in its own temp dir (so plain `ray.init()` elsewhere never finds it)."""
    # Every port the head opens is a free one: the tests' own Ray instance already holds
    # the defaults (e.g. its dashboard agent on 52365), and a clash leaves no job agent.
    gcs, dash, agent, client = free_port(), free_port(), free_port(), free_port()
    temp = Path("/tmp") / f"raypar-job-{os.getpid()}"
    # Ray turns token authentication on for new clusters; its job CLI sends the token
    # (from ~/.ray/auth_token) only when told that the mode is "token".
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "token"}
    proc = subprocess.Popen(
        [*RAY, "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2", "--include-dashboard=true",
         f"--dashboard-port={dash}", "--dashboard-host=127.0.0.1", f"--dashboard-agent-listen-port={agent}",
         f"--ray-client-server-port={client}", f"--temp-dir={temp}"],
        stdout=open(tmp_path / "head.log", "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            ok = subprocess.run([*RAY, "job", "list", "--address", address], capture_output=True, env=env)
            if ok.returncode == 0:
                break
            assert proc.poll() is None, (tmp_path / "head.log").read_text()[-2000:]
            time.sleep(1)
        else:
            pytest.fail("the Ray head's job server did not come up in 90 s")
        yield address, env
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the head and everything it started, nothing else
        try:
            # `ray start --block` rarely exits on SIGTERM alone (its GCS and raylet neither,
            # within seconds; the dashboard's processes do in ~2 s): do not wait long for it.
            proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def _job(address, env, command, *args, timeout=180):
    return subprocess.run([*RAY, "job", command, "--address", address, *args], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def _submit(address, env, run_dir, steps, extra=()):
    deadline = time.monotonic() + 90
    while True:
        out = _job(address, env, "submit", "--no-wait", "--working-dir", str(ROOT), "--",
                   sys.executable, "-m", "raypar.train", "--config", "configs/tiny.yaml", f"train.steps={steps}",
                   "runtime.cpus_per_worker=0.5", "runtime.log_every=1", f"runtime.run_dir={run_dir}", *extra)
        # The job server answers before the node's job agent is up; Ray says to retry.
        if out.returncode == 0 or "No available agent" not in out.stderr or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert out.returncode == 0, out.stderr
    return re.search(r"raysubmit_[A-Za-z0-9]+", out.stdout + out.stderr).group(0)


def _status(address, env, job_id) -> str:
    out = _job(address, env, "status", job_id)
    return re.sub(r"\x1b\[[0-9;]*m", "", out.stdout + out.stderr).lower()


# Counts raypar's actors alive on the cluster at argv[1], only those of the submitted job argv[2] if given.
COUNT_ACTORS = """
import sys
from ray.job_submission import JobSubmissionClient
from ray.util.state import list_actors

address, job = sys.argv[1], sys.argv[2:]
filters = [("state", "=", "ALIVE")]
if job:
    filters.append(("job_id", "=", JobSubmissionClient(address).get_job_info(job[0]).driver_info.id))
alive = list_actors(address=address, filters=filters, raise_on_missing_output=False)
print(sum(a.class_name in ("StageWorker", "CheckpointWriter") for a in alive))
"""


def _live_actors(address, env, job: str | None = None) -> int:
    """raypar actors alive on the cluster (only submitted job `job`'s, when given), from Ray's state API."""
    out = subprocess.run([sys.executable, "-c", COUNT_ACTORS, address, *([job] if job else [])], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_job_submit_runs_to_completion_and_stop_is_clean(head, tmp_path):
    address, env = head
    # Two jobs side by side (each takes 1 of the head's 2 CPUs): a short one that runs to
    # completion, and a long one, stopped once it has committed a checkpoint. Both start
    # now, so the long one's start overlaps the short one's run.
    done = _submit(address, env, tmp_path / "done", steps=3)
    run_dir = tmp_path / "stopped"
    job = _submit(address, env, run_dir, steps=100000, extra=["checkpoint.every=3"])
    logs = _job(address, env, "logs", "--follow", done, timeout=300)
    assert "step 3/3" in logs.stdout and "final loss" in logs.stdout, logs.stdout[-3000:]
    assert "succeeded" in _status(address, env, done)

    # The long job, stopped once it has committed a checkpoint.
    deadline = time.monotonic() + 240
    while not list_committed(run_dir / "checkpoints"):
        assert time.monotonic() < deadline, _job(address, env, "logs", job).stdout[-3000:]
        time.sleep(1)
    assert _live_actors(address, env, job) >= 2  # its stage workers (and the checkpoint writer) are up
    assert _job(address, env, "stop", job).returncode == 0
    deadline = time.monotonic() + 60
    while "stopped" not in _status(address, env, job):
        assert time.monotonic() < deadline
        time.sleep(1)
    # Its actors went with its driver (and the short job's with its own): none is left.
    deadline = time.monotonic() + 60
    while _live_actors(address, env):
        assert time.monotonic() < deadline, "raypar actors still alive 60 s after ray job stop"
        time.sleep(2)
    # The last committed checkpoint is intact and loads.
    with CheckpointReader(latest(run_dir / "checkpoints")) as reader:
        assert reader.read("embed.weight").shape[1] == 64
