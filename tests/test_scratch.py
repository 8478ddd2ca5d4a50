"""Room in shared memory for the checkpoint that moves the state between cuts of the model."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from raypar.runtime.scratch import MARGIN, PREFIX, make_scratch, remove_scratch


def test_a_directory_only_where_there_is_room(tmp_path) -> None:
    free = shutil.disk_usage(tmp_path).free
    assert make_scratch(int(free / MARGIN) + 2**20, root=tmp_path) is None  # the margin does not fit
    assert make_scratch(1, root=tmp_path / "missing") is None
    path = Path(make_scratch(2**20, root=tmp_path))
    assert path.is_dir() and path.parent == tmp_path and path.name.startswith(f"{PREFIX}{os.getpid()}-")
    assert not any(path.iterdir())


def test_directories_of_ended_processes_go_and_nothing_else(tmp_path) -> None:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"{PREFIX}{int(ended.stdout)}-1"
    mine = tmp_path / f"{PREFIX}{os.getpid()}-1"
    other = tmp_path / "raypar-0123456789abcdef"  # a run's copies in memory: not ours
    for d in (stale, mine, other):
        (d / "step-000000001").mkdir(parents=True)
    made = make_scratch(1, root=tmp_path)
    assert not stale.exists() and mine.exists() and other.exists() and Path(made).exists()
    remove_scratch(str(other))
    assert other.exists()  # not a scratch directory: left alone
    remove_scratch(made)
    remove_scratch(str(mine))
    assert not Path(made).exists() and not mine.exists()
