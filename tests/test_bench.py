"""The benchmark harness runs on CPU with tiny sizes, so it cannot rot between GPU runs."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_pipeline_bench_quick_on_cpu(tmp_path):
    out = subprocess.run([sys.executable, "-m", "bench.pipeline", "--out", str(tmp_path), "--cpu", "--quick",
                          "--steps", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["environment"]["card"] == "cpu" and results["environment"]["params"] > 0
    assert [r["label"] for r in results["rows"]] == ["1f1b, release", "fthenb, release", "fthenb, no release"]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in results["rows"])
    assert "| 1f1b, release (8 mb) |" in out.stdout  # the table is printed last
