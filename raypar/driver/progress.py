"""What a run shows while it trains: a live line on a terminal, plain lines in job logs,
and `status.json` in the run directory for `raypar status`."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TextIO


def format_eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """One line per step: rewritten in place on a terminal, appended when logs are captured."""

    def __init__(self, total_steps: int, every: int = 1, stream: TextIO | None = None):
        self.total = total_steps
        self.every = every
        self.stream = stream or sys.stdout
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._times: list[float] = []

    def step(self, step: int, loss: float, tokens_per_s: float, step_time_s: float, lr: float, grad_norm: float) -> None:
        self._times = (self._times + [step_time_s])[-20:]
        remaining = (self.total - step - 1) * (sum(self._times) / len(self._times))
        line = (f"step {step + 1}/{self.total}  loss {loss:.4f}  lr {lr:.2e}  grad_norm {grad_norm:.3f}  "
                f"{tokens_per_s:,.0f} tokens/s  {step_time_s * 1000:.0f} ms  eta {format_eta(remaining)}")
        last = step == self.total - 1
        if self.live:
            self.stream.write("\r\x1b[2K" + line + ("\n" if last else ""))
            self.stream.flush()
        elif step % self.every == 0 or last:
            print(line, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """A line of its own that must not be overwritten by the live line."""
        print(("\r\x1b[2K" if self.live else "") + text, file=self.stream, flush=True)


def write_status(directory: Path, **fields) -> None:
    """status.json, replaced atomically so a reader never sees half of it."""
    path = Path(directory) / "status.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({**fields, "updated": time.time()}, indent=2))
    os.replace(tmp, path)


def read_status(run_dir: Path) -> dict:
    path = Path(run_dir) / "status.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir} has no status.json: not a raypar run directory, or the run has not started")
    return json.loads(path.read_text())


def format_status(status: dict) -> str:
    age = time.time() - status.get("updated", time.time())
    lines = [
        f"run dir          {status.get('run_dir')}",
        f"state            {status.get('state')}  (updated {age:.0f}s ago)",
        f"grid             {status.get('grid')}  ({status.get('schedule')}, {status.get('microbatches')} micro-batches, {status.get('device')})",
        f"step             {status.get('step')}/{status.get('total_steps')}  loss {status.get('loss')}",
        f"last checkpoint  {status.get('last_checkpoint') or 'none'}",
        f"restarts         {status.get('restarts', 0)}",
    ]
    return "\n".join(lines)
