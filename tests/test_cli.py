"""The README's first command: the embedded default runs to completion and prints the summary."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_default_job_runs_and_prints_the_summary(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run(
        [sys.executable, "-m", "raypar.train", "--config", str(ROOT / "configs" / "tiny.yaml"),
         "train.steps=4", "runtime.log_every=1", "runtime.timeline_step=2", "runtime.num_cpus=2", f"runtime.run_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "step 4/4" in out.stdout
    for line in ("final loss", "tokens/s", "bubble", "measured", "simulated", "peak activations"):
        assert line in out.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["consumed_samples"] == 4 * 16
    assert 0.0 <= summary["bubble_measured"] <= 1.0 and summary["tokens_per_s"] > 0
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert (tmp_path / "run" / "timeline-step2.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "run" / "timeline-step2.json").read_text())["traceEvents"]
    assert records[-1]["loss"] < records[0]["loss"]
    status = subprocess.run([sys.executable, "-m", "raypar", "status", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "FINISHED" in status.stdout and "dp=1 x pp=2 x ep=1" in status.stdout and "4/4" in status.stdout
