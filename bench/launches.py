"""One benchmark launch in its own process (a fresh Ray, fresh workers), shared by the
scripts that alternate launches of several kinds in one call (data_stream, moe_speed,
sharded_optimizer): the script re-runs itself with `--launch KIND`, which prints one
`LAUNCH {json}` line (written out in each script: a launch may run under another checkout's
`bench` package, for a baseline)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

PREFIX = "LAUNCH "


def tree_env(tree: Path) -> dict[str, str]:
    """The environment that imports the project from `tree` (another checkout, for a baseline)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}


def run_launch(argv: list[str], tree: Path, what: str) -> dict:
    """Run `python argv...` in `tree`; its printed result. A launch that prints none ends the
    script with its output's tail (`what` names it: kind and round)."""
    proc = subprocess.run([sys.executable, *argv], cwd=tree, env=tree_env(tree), capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(PREFIX)), None)
    if line is None:
        print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"launch {what} failed (exit {proc.returncode})")
    return json.loads(line[len(PREFIX):])

