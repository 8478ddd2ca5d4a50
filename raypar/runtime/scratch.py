"""Node-local room for a checkpoint that only carries the state from one cut of the model to
another (`Trainer.switch_schedule`, `parallel.schedule: auto`): in shared memory, where
writing and reading it costs memory bandwidth, not the disk's.

Only for workers that all run on one node (the files are read where they were written) and
only where the node has the room, in /dev/shm and in memory, beside what Ray's memory
monitor keeps free: otherwise the move goes through the run's checkpoint directory. A
directory is named after the process that made it, so one left by a process that ended
(a driver killed mid-move) is removed the next time one is made.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from raypar.resources import host_available_bytes
from raypar.runtime.shared_copies import SHM_ROOT, process_running

PREFIX = "raypar-move-"
# Room asked for beyond the state's bytes: safetensors headers, and what else may grow meanwhile.
MARGIN = 1.25


def make_scratch(nbytes: int, root: Path = SHM_ROOT) -> str | None:
    """A new, empty directory under `root` with room for `nbytes` more, or None where
    there is none (no such filesystem, too little space or memory)."""
    try:
        for old in root.glob(PREFIX + "*"):
            pid = old.name[len(PREFIX):].split("-")[0]
            if pid.isdigit() and not process_running(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        free = shutil.disk_usage(root).free
    except OSError:
        return None
    if min(free, host_available_bytes()) < MARGIN * nbytes:
        return None
    path = root / f"{PREFIX}{os.getpid()}-{time.time_ns()}"
    path.mkdir()
    return str(path)


def remove_scratch(path: str) -> None:
    """Remove a directory `make_scratch` made (and nothing else)."""
    if Path(path).name.startswith(PREFIX):
        shutil.rmtree(path, ignore_errors=True)
