"""A driver script: build a config in code, watch steps and checkpoints, resume, export.

    python examples/driver_script.py                # local Ray cluster
    RAY_ADDRESS=auto python examples/driver_script.py   # an existing cluster
"""
from __future__ import annotations

import sys
from pathlib import Path

from raypar import Callback, Trainer, load_config


class StopWhenLossBelow(Callback):
    """Print every checkpoint and end the run early once the loss is low enough."""

    def __init__(self, target: float):
        self.target = target

    def on_step_end(self, trainer, record):
        if record.loss < self.target:
            print(f"loss {record.loss:.3f} < {self.target} at step {record.step + 1}: stopping")
            trainer.request_stop()

    def on_checkpoint(self, trainer, result):
        print(f"checkpoint of step {result.step}: {result.error or result.path}")


def main() -> int:
    run_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/example")
    cfg = load_config("configs/tiny.yaml", [f"runtime.run_dir={run_dir}", "checkpoint.every=5", "train.steps=20"])
    summary = Trainer(cfg, callbacks=[StopWhenLossBelow(target=3.0)]).fit()
    print(summary.format())

    # Continue the same run on another grid from its last checkpoint.
    more = load_config("configs/tiny.yaml", [f"runtime.run_dir={run_dir}", "checkpoint.every=5", "train.steps=30",
                                             "parallel.pp=1", "checkpoint.resume=latest"])
    print(Trainer(more).fit().format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
