"""`Trainer(config).fit()`: the public face of a run; the controller behind it does the work."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from raypar.config import Config, ConfigError
from raypar.driver.callbacks import Callback, as_callbacks
from raypar.driver.controller import Controller
from raypar.driver.progress import Progress
from raypar.driver.records import Recovery, RunSummary, StepRecord
from raypar.driver.states import StateMachine
from raypar.topology import Grid

if TYPE_CHECKING:
    from raypar.actors.worker_group import WorkerGroup
    from raypar.driver.saver import Resumed, Saver


class Trainer:
    """Runs one training job on a Ray cluster (an existing one, or a local one it starts).

    Callbacks get this object; what it shows of the run (grid, config, workers, saves,
    recoveries) is read from the controller and changes as the run re-plans.
    """

    def __init__(self, cfg: Config, callbacks: list[Callback | Callable[[StepRecord], None]] | None = None,
                 log: Callable[[str], None] | None = None):
        if cfg.model.init_from:
            # Workers may run elsewhere with another working directory: pass an absolute path.
            hf_dir = Path(cfg.model.init_from).expanduser().resolve()
            if not (hf_dir / "config.json").is_file():
                raise ConfigError(f"model.init_from={cfg.model.init_from}: no config.json in {hf_dir} "
                                  f"(expected a Hugging Face model folder saved with safetensors)")
            cfg.model.init_from = str(hf_dir)
        # Plain functions count as step-end hooks; the list stays open to appends before `fit`.
        self.callbacks = as_callbacks(callbacks)
        self.progress = Progress(cfg.train.steps, cfg.runtime.log_every)
        self._controller = Controller(cfg, self.callbacks, self.progress, log or self.progress.message, owner=self)

    def fit(self) -> RunSummary:
        """Run the job: PLANNING picks a grid for what the cluster has, STARTING places the
        workers and loads a checkpoint, RUNNING steps. A lost worker or node, or a hung
        collective, moves to RECOVERING (with `elastic.enabled`): the run keeps what survives,
        plans again and reloads its last committed checkpoint. GROWING restarts on a larger
        grid at a checkpoint when resources have come back.
        """
        return self._controller.fit()

    @staticmethod
    def release_kept_workers() -> int:
        """End the workers that runs with `runtime.keep_workers` left idle in this process
        (the next such run would take them); returns how many there were."""
        from raypar.actors import worker_pool

        n = worker_pool.kept_workers()
        worker_pool.release()
        return n

    def request_stop(self, save: bool = True) -> None:
        """End the run (from a callback) after the steps already sent to the workers: with
        `runtime.steps_ahead=1`, the one after the step just reported. With `save`, checkpoint
        where it ends."""
        self._controller.stop(save=save and self.cfg.checkpoint.every > 0)

    def switch_schedule(self, schedule: str, chunks: int | None = None) -> None:
        """Run `schedule` (`chunks` model chunks per stage, for interleaved-1f1b) from the
        first step not yet sent to the workers (from a callback: after the steps in flight),
        for the rest of the run. A schedule that cuts the model otherwise (its chunks per
        stage) moves the workers to its cut, their state kept on their devices where they
        have room, else through a checkpoint of that step (`parallel.move_through`); the
        losses go on unchanged. Raises ConfigError at
        once for a schedule that cannot run on this grid, or with parallel.schedule=auto."""
        self._controller.switch_schedule(schedule, chunks)

    # -- what the run looks like now -------------------------------------------------------

    @property
    def cfg(self) -> Config:
        """The config of the plan running now (an elastic re-plan changes its grid)."""
        return self._controller.cfg

    @property
    def grid(self) -> Grid:
        return self._controller.grid

    @property
    def run_dir(self) -> Path:
        return self._controller.run_dir

    @property
    def device(self) -> str | None:
        """"cpu" or "cuda" once the workers are placed."""
        return self._controller.device

    @property
    def group(self) -> WorkerGroup | None:
        """The stage workers, while they run."""
        return self._controller.group

    @property
    def saver(self) -> Saver:
        """Checkpoints: results, the save in flight (`finish` waits for it), the root."""
        return self._controller.saver

    @property
    def controller(self) -> StateMachine:
        """The run's state machine: `state`, and `history` as (time, state, why)."""
        return self._controller.states

    @property
    def resumed(self) -> Resumed:
        """Where the last (re)start resumed: step, samples consumed, checkpoint, what it read."""
        return self._controller.resumed

    @property
    def start_step(self) -> int:
        """The step the last (re)start resumed at: > 0 after loading a checkpoint."""
        return self._controller.resumed.step

    @property
    def loaded(self) -> list[dict]:
        """Per worker, what the last resume read: rank, bytes (and from memory, `states`: how
        many workers' states it fetched them from)."""
        return self._controller.resumed.loaded

    @property
    def restarts(self) -> int:
        return self._controller.restarts

    @property
    def recoveries(self) -> list[Recovery]:
        return self._controller.recoveries
