"""A training driver for tests/test_prometheus.py, run as its own process.

    python tests/metrics_run.py --config configs/tiny-moe.yaml --backend ray=RUN --backend standalone=RUN:PORT \
        --kill-at 4 --hold FILE key=value ...

It does what `raypar train` does (`raypar.driver.cli`: `build_exporter(cfg)` passed to a
`Trainer`), once per `--backend`, all on the same run: each exporter gets the config with
its own `runtime.metrics`, `runtime.run_name` and port, so every backend exports the same
steps under its own run name and one tiny run serves both (the test stays quick). The
driver connects to the cluster RAY_ADDRESS names, as `raypar train` does on a cluster.

Besides, it
- kills one stage worker after step `--kill-at` (with elastic.enabled the run recovers,
  so the recovery metrics get real values),
- sleeps `--step-pause` seconds after each step, so the run spans several scrapes,
- holds the finished run (exporters still open, gauges still reported) until the file
  `--hold` exists, so the test can wait for the last scrapes before the series go stale.

It prints `TRAINED` once training ended and it starts holding.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import ray

from raypar.config import Config, load_config
from raypar.driver.callbacks import Callback
from raypar.driver.exporter import MetricsExporter, build_exporter
from raypar.driver.trainer import Trainer

HOLD_LIMIT_S = 300.0  # never outlive a test that forgot to release the run


class KillOnce(Callback):
    """Kills stage worker `rank` after step `at`, once, as a crash would."""

    def __init__(self, at: int, rank: int):
        self.at, self.rank, self.done = at, rank, False

    def on_step_end(self, trainer, record) -> None:
        if record.step == self.at and not self.done:
            self.done = True
            ray.kill(trainer.group.workers[self.rank])


class PauseAfterStep(Callback):
    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, trainer, record) -> None:
        time.sleep(self.seconds)


class HoldAtEnd(Callback):
    """Keeps the driver (and so every exporter) alive after the last step until `path` exists."""

    def __init__(self, path: Path):
        self.path = path

    def on_train_end(self, trainer, summary) -> None:
        print("TRAINED", flush=True)
        deadline = time.monotonic() + HOLD_LIMIT_S
        while not self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)


def exporter_for(cfg: Config, backend: str) -> MetricsExporter:
    """What `raypar train` builds for `runtime.metrics=<backend>`; `backend` is
    `ray=RUN_NAME` or `standalone=RUN_NAME:PORT`."""
    kind, _, spec = backend.partition("=")
    run_name, _, port = spec.partition(":")
    runtime = dataclasses.replace(cfg.runtime, metrics=kind, run_name=run_name,
                                  metrics_port=int(port) if port else cfg.runtime.metrics_port)
    return build_exporter(dataclasses.replace(cfg, runtime=runtime))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--backend", action="append", required=True)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--kill-rank", type=int, default=0)
    p.add_argument("--step-pause", type=float, default=0.0)
    p.add_argument("--hold", type=Path, required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    exporters = [exporter_for(cfg, b) for b in args.backend]  # standalone ports bind now, as in the CLI
    callbacks: list[Callback] = [*exporters, PauseAfterStep(args.step_pause)]
    if args.kill_at is not None:
        callbacks.append(KillOnce(args.kill_at, args.kill_rank))
    callbacks.append(HoldAtEnd(args.hold))
    try:
        Trainer(cfg, callbacks=callbacks).fit()
    finally:
        for e in exporters:
            e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
