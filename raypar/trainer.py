"""The driver: `Trainer(config).fit()` plans the grid, starts the stage workers, steps them.

The driver makes one Ray call per worker per step (DESIGN.md: an awaited actor call
costs ~1 ms, so per-micro-batch calls would dominate small steps); tensors never pass
through it.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING, Callable

from raypar.callbacks import Callback, as_callbacks
from raypar.config import Config, ConfigError
from raypar.controller import Controller
from raypar.data import DataError, SampleOrder, TokenDataset, split_batch, write_synthetic_corpus
from raypar.elastic import State
from raypar.metrics.exporter import stage_times
from raypar.progress import Progress
from raypar.saver import Saver
from raypar.schedule import build_programs, prepare
from raypar.stats import measured_bubble, pipelines, simulated_bubble, step_loss
from raypar.topology import Grid

if TYPE_CHECKING:
    from raypar.actors.worker_group import IssuedStep
    from raypar.event_log import EventLog


@dataclass
class StepRecord:
    step: int
    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    tokens_per_s: float
    bubble_measured: float
    bubble_simulated: float
    control_overhead: float  # share of the step the driver spent outside the workers
    consumed_samples: int
    peak_activation_bytes: list[int]  # per stage (max over replicas)
    peak_device_bytes: list[int]
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)  # per MoE layer, per expert
    tokens_dropped: int = 0
    alltoall_bytes: int = 0
    alltoall_s: float | None = None  # slowest worker's host time in all-to-all (MoE with ep > 1)
    checkpoint_stall_s: float = 0.0  # time this step was held up by checkpointing
    stage_times: list = field(default_factory=list)  # per worker: forward, backward, idle seconds


@dataclass
class RunSummary:
    steps: int
    grid: str
    schedule: str
    microbatches: int
    device: str
    final_loss: float
    tokens_per_s: float
    step_time_s: float
    bubble_measured: float
    bubble_simulated: float
    control_overhead: float
    peak_activation_bytes: list[int]
    peak_device_bytes: list[int]
    consumed_samples: int
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)  # summed over steps
    tokens_dropped: int = 0
    alltoall_bytes_per_step: float = 0.0
    alltoall_s_per_step: float = 0.0
    start_step: int = 0  # > 0 when resumed from a checkpoint
    checkpoints: list[dict] = field(default_factory=list)  # one per save: step, path, bytes, timings
    checkpoint_stall_s: float = 0.0  # total time the loop was held up by saves
    checkpoints_skipped: int = 0
    restarts: int = 0  # times the workers were torn down after a failure
    recoveries: list[dict] = field(default_factory=list)  # per failure: grids, detection/recovery s, steps redone
    controller_states: list[str] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("records")
        return d

    def format(self) -> str:
        mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
        lines = [
            f"steps               {self.steps}  (grid {self.grid}, {self.schedule}, {self.microbatches} micro-batches, {self.device})",
            f"final loss          {self.final_loss:.4f}",
            f"tokens/s            {self.tokens_per_s:,.0f}",
            f"step time           {self.step_time_s * 1000:.1f} ms",
            f"bubble              measured {self.bubble_measured:.3f}  simulated {self.bubble_simulated:.3f}",
            f"control overhead    {self.control_overhead * 100:.2f}% of the step",
            "peak activations    " + "  ".join(f"stage {s}: {mib(b)}" for s, b in enumerate(self.peak_activation_bytes)),
        ]
        if self.expert_tokens:
            for layer, counts in self.expert_tokens.items():
                total = sum(counts) or 1
                share = " ".join(f"{c / total:.2f}" for c in counts)
                lines.append(f"experts, layer {layer:<5} token share {share}  (max/mean {max(counts) * len(counts) / total:.2f})")
            lines.append(f"tokens dropped      {self.tokens_dropped}")
            a2a = f"all-to-all          {self.alltoall_bytes_per_step / 2**20:.2f} MiB per step"
            if self.alltoall_s_per_step and self.step_time_s:
                a2a += f", {self.alltoall_s_per_step * 1000:.1f} ms ({self.alltoall_s_per_step / self.step_time_s:.1%} of a step)"
            lines.append(a2a)
        if self.checkpoints or self.checkpoints_skipped:
            ok = [c for c in self.checkpoints if not c["error"]]
            per_save = self.checkpoint_stall_s / max(1, len(self.checkpoints))
            line = f"checkpoints         {len(ok)} committed, {len(self.checkpoints) - len(ok)} failed, {self.checkpoints_skipped} skipped"
            if ok:
                mib = sum(c["bytes"] for c in ok) / len(ok) / 2**20
                rate = fmean(c["bytes"] / c["write_s"] for c in ok if c["write_s"] > 0) / 2**20 if any(c["write_s"] for c in ok) else 0.0
                line += f"; {mib:.1f} MiB each, written at {rate:.0f} MiB/s"
            lines.append(line)
            share = per_save / self.step_time_s * 100 if self.step_time_s else 0.0
            lines.append(f"checkpoint stall    {per_save * 1000:.1f} ms per save ({share:.2f}% of a step)")
        for r in self.recoveries:
            lines.append(f"recovery {r['restart']}          {r['error']} on {r['failed_grid']} -> {r['grid']}: detected in "
                         f"{r['detection_s']:.1f}s, recovered in {r['recovery_s']:.1f}s, {r['steps_lost']} steps redone")
        if any(self.peak_device_bytes):
            lines.append("peak device memory  " + "  ".join(
                f"stage {s}: {mib(b)}" for s, b in enumerate(self.peak_device_bytes)))
        return "\n".join(lines)


@dataclass
class PendingStep:
    """A step sent to the workers whose reports the driver has not read yet."""

    consumed: int  # samples consumed before it
    issued: float  # time.perf_counter() when it was sent
    issued_step: IssuedStep

    @property
    def step(self) -> int:
        return self.issued_step.step


class Trainer:
    """Runs one training job on a Ray cluster (an existing one, or a local one it starts)."""

    def __init__(self, cfg: Config, callbacks: list[Callback | Callable[[StepRecord], None]] | None = None,
                 log: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.grid = Grid(cfg.parallel.dp, cfg.parallel.pp, cfg.parallel.ep)
        # Plain functions count as step-end hooks.
        self.callbacks = as_callbacks(callbacks)
        self.progress = Progress(cfg.train.steps, cfg.runtime.log_every)
        self._kernels_said = False
        self.log = log or self.progress.message
        self.run_dir = Path(cfg.runtime.run_dir).resolve()
        if cfg.model.init_from:
            # Workers may run elsewhere with another working directory: pass an absolute path.
            hf_dir = Path(cfg.model.init_from).expanduser().resolve()
            if not (hf_dir / "config.json").is_file():
                raise ConfigError(f"model.init_from={cfg.model.init_from}: no config.json in {hf_dir} "
                                  f"(expected a Hugging Face model folder saved with safetensors)")
            cfg.model.init_from = str(hf_dir)
        self.group = None
        self.device: str | None = None  # "cpu" or "cuda" once the workers are placed
        self.saver = Saver(cfg, self.run_dir, self.grid, self.log,
                           on_result=lambda r: [c.on_checkpoint(self, r) for c in self.callbacks])
        self.start_step = 0
        self.loaded: list[dict] = []  # per worker, what the last resume read: rank, bytes
        self.base_cfg = cfg  # the configured grid; elastic re-plans derive from it
        self.configured_grid = self.grid
        self.recoveries: list[dict] = []
        self.restarts = 0
        self._last_step_done = 0.0  # time.perf_counter() when the last step's reports came back
        self._control = Controller(self)
        # Callers follow the run through its state machine (`state`, `history`).
        self.controller = self._control.states
        self._set_programs(build_programs(cfg.parallel.schedule, cfg.parallel.pp, cfg.parallel.microbatches,
                                          release=cfg.runtime.release))

    # -- set-up ----------------------------------------------------------------------------

    def prepare_data(self) -> TokenDataset:
        """The configured token file, or a synthetic corpus generated into the run dir."""
        d = self.cfg.data
        if d.path is None:
            path = self.run_dir / "data" / f"synthetic-v{self.cfg.model.vocab_size}-t{d.seq_len}-n{d.synthetic_samples}-s{self.cfg.train.seed}.parquet"
            if not path.exists():
                write_synthetic_corpus(path, d.synthetic_samples, d.seq_len, self.cfg.model.vocab_size, seed=self.cfg.train.seed)
        else:
            path = Path(d.path).expanduser().resolve()
        dataset = TokenDataset(path, d.seq_len)
        dataset.check_vocab(self.cfg.model.vocab_size)
        if len(dataset) < self.cfg.train.global_batch_size:
            raise DataError(
                f"{path} holds {len(dataset)} samples, fewer than one global batch "
                f"(train.global_batch_size={self.cfg.train.global_batch_size})"
            )
        return dataset

    def _connect(self) -> None:
        import ray

        if ray.is_initialized():
            return
        address = self.cfg.runtime.ray_address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address)
        else:
            # "local": a new cluster even if `ray start` left one registered on this machine.
            ray.init(address="local", num_cpus=self.cfg.runtime.num_cpus, include_dashboard=False)

    def start(self, dataset: TokenDataset, resume: str | None = None) -> None:
        """PLANNING -> STARTING: pick the grid, place and wire its workers. With a checkpoint to
        `resume` (`checkpoint.resume`), the stages are not initialised: the load fills them."""
        import ray

        from raypar.actors.worker_group import WorkerGroup
        from raypar.resources import plan_resources

        if self.cfg.elastic.enabled:
            self._control.plan()
        resources = plan_resources(self.cfg, self.grid, ray.cluster_resources())
        self.controller.to(State.STARTING, str(self.grid))
        self.device = resources.device
        self.log(f"raypar: grid {self.grid} on {resources.device}, {self.cfg.parallel.schedule} with "
                 f"{self.cfg.parallel.microbatches} micro-batches, run dir {self.run_dir}")
        init_weights = self._checkpoint_path(resume) is None
        if self.group is not None:
            # Workers kept after a failure (`Controller._recover`): the new grid on them plus replacements.
            counts = self.group.reconfigure(self.cfg, self.grid, init_weights)
            self._control.workers_reused(counts)
            self.log(f"raypar: kept {counts['kept']} stage workers, started {counts['started']}"
                     + (f", took {counts['standby']} from the standbys" if counts["standby"] else ""))
        else:
            self.group = WorkerGroup(self.cfg, self.grid, resources, str(dataset.path), init_weights)
        self._say_kernels(self.group.info)
        self.group.set_programs(self.programs)

    def _say_kernels(self, info: list[dict]) -> None:
        """Which CUDA kernels the workers run, once per run (CPU workers use the references)."""
        status = next((i.get("kernels") for i in info if i.get("kernels")), None)
        if status and not self._kernels_said:
            self._kernels_said = True
            self.log("raypar: kernels " + ", ".join(f"{k}: {v}" for k, v in status.items()))

    def _set_programs(self, programs) -> None:
        self.programs = programs
        self._sim_programs = prepare(programs)  # checked once; each step only times them

    def finish_events(self, events: "EventLog") -> None:
        """Complete the last step's events (the units its reports did not have) and write them."""
        for rank, step, late_events in self.group.collect_late():
            events.complete(rank, step, late_events)
        events.flush()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.shutdown()
            self.group = None

    # -- the loop ----------------------------------------------------------------------------

    def fit(self) -> RunSummary:
        """Run the job: the controller (`raypar.controller`) runs its state machine around the step loop.

        PLANNING picks a grid for what the cluster has, STARTING places the workers and
        loads a checkpoint, RUNNING steps. A lost worker or node, or a hung collective,
        moves to RECOVERING (with `elastic.enabled`): everything is torn down and planned
        again, and the run reloads its last committed checkpoint. GROWING restarts on a
        larger grid at a checkpoint when resources have come back.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dataset = self.prepare_data()
        order = SampleOrder(len(dataset), self.cfg.train.seed, shuffle=self.cfg.data.shuffle)
        self._connect()
        (self.run_dir / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2))
        records, consumed = self._control.run(dataset, order)
        summary = self._summarise(records, consumed)
        (self.run_dir / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
        for callback in self.callbacks:
            callback.on_train_end(self, summary)
        return summary

    def request_stop(self, save: bool = True) -> None:
        """End the run (from a callback) after the steps already sent to the workers: with
        `runtime.steps_ahead=1`, the one after the step just reported. With `save`, checkpoint
        where it ends."""
        self._control.stop(save=save and self.cfg.checkpoint.every > 0)

    def resume(self, spec: str | None) -> tuple[int, int]:
        """Load checkpoint `spec` into the workers: (first step to run, consumed samples).

        After a failure `spec` is "latest", which may not exist yet: then the run starts
        over from step 0 (initialisation is deterministic, so nothing differs).
        """
        from raypar.checkpoint import CheckpointError, read_manifest

        self.start_step = 0
        path = self._checkpoint_path(spec)
        if path is None:
            return 0, 0
        manifest = read_manifest(path)
        saved_model = manifest.config.get("model", {})
        current = self.cfg.to_dict()["model"]
        # The dtype and the initial weights may differ; the shapes may not.
        changed = {k: (saved_model.get(k), v) for k, v in current.items()
                   if k not in ("dtype", "init_from") and saved_model.get(k) != v}
        if changed:
            raise CheckpointError(
                f"{path} was written for another model: "
                + ", ".join(f"model.{k}={old!r} there, {new!r} here" for k, (old, new) in changed.items())
            )
        topology = {"dp": self.grid.dp, "pp": self.grid.pp, "ep": self.grid.ep}
        self.loaded = self.group.load_checkpoint(str(path), same_grid=manifest.topology == topology)
        if self.cfg.checkpoint.ema_decay:
            self.group.load_ema(str(self.saver.root), str(path))
        self.log(f"raypar: resumed from {path} (step {manifest.step}, {manifest.consumed_samples} samples consumed, "
                 f"saved on grid {manifest.topology})")
        self.start_step = manifest.step
        return manifest.step, manifest.consumed_samples

    def _checkpoint_path(self, spec: str | None) -> Path | None:
        """The checkpoint `resume(spec)` loads, or None when the run starts from step 0."""
        from raypar.checkpoint import latest, resolve

        if spec is None or (spec == "latest" and self._control.recovering and latest(self.saver.root) is None):
            return None
        return resolve(self.saver.root, spec)

    def issue_step(self, step: int, order: SampleOrder, consumed: int, snapshot: dict | None = None) -> PendingStep:
        """Send step `step` (the batch after `consumed` samples) to the workers; do not wait."""
        cfg, grid = self.cfg, self.grid
        issued = time.perf_counter()
        gbs = cfg.train.global_batch_size

        def ids_after(n: int) -> list[list[int]]:
            batch = order.indices(n, gbs)
            return [split_batch(batch, grid.data_parallel_size, grid.data_rank(c)) for c in grid.coords()]

        # The workers hold the programs (set_programs at start and after a re-plan): a step
        # sends only its number, the program version and the sample ids, with the next
        # step's for a forward issued ahead.
        following = ids_after(consumed + gbs) if step + 1 < cfg.train.steps else None
        return PendingStep(consumed, issued, self.group.issue_step(step, ids_after(consumed), snapshot=snapshot,
                                                                   next_sample_ids=following))

    def step_started(self, pending: PendingStep) -> float:
        """When the workers could start `pending` (time.perf_counter()): its issue, or the end
        of the step before it when it was queued behind that one."""
        return max(pending.issued, self._last_step_done)

    def finish_step(self, pending: PendingStep, events_out: "EventLog | None" = None) -> StepRecord:
        """Wait for an issued step and make its record; its time runs from `step_started`
        to when its reports are back (a first stage's tail, fetched afterwards, aside)."""
        cfg, grid, step, consumed = self.cfg, self.grid, pending.step, pending.consumed
        t0 = self.step_started(pending)
        reports = self.group.collect_step(pending.issued_step)
        # Not when the first stages' tails came: the workers were on the next step by then.
        self._last_step_done = pending.issued_step.reports_back
        step_time = self._last_step_done - t0
        if events_out is not None:
            # Each action's measured span, per worker: enough to redraw the step's timeline.
            events_out.add(step, reports, grid)
        tokens = cfg.train.global_batch_size * cfg.data.seq_len
        worker_time = max(r.wall_s for r in reports)
        by_stage = lambda attr: [max(getattr(r, attr) for r in reports if r.stage == s) for s in range(grid.pp)]  # noqa: E731
        return StepRecord(
            step=step,
            loss=step_loss(reports),
            lr=reports[0].lr,
            grad_norm=next(r.grad_norm for r in reports if r.stage == 0),  # the stage that reports it
            step_time_s=step_time,
            tokens_per_s=tokens / step_time,
            bubble_measured=measured_bubble(reports, grid),
            bubble_simulated=simulated_bubble(self._sim_programs, pipelines(reports, grid)[0]),
            control_overhead=max(0.0, step_time - worker_time) / step_time,
            consumed_samples=consumed + cfg.train.global_batch_size,
            peak_activation_bytes=by_stage("peak_activation_bytes"),
            peak_device_bytes=by_stage("peak_device_bytes"),
            expert_tokens=_sum_expert_tokens(r.expert_tokens for r in reports),
            tokens_dropped=sum(r.tokens_dropped for r in reports),
            alltoall_bytes=sum(r.alltoall_bytes for r in reports),
            alltoall_s=max(r.alltoall_s for r in reports) if grid.ep > 1 else None,
            checkpoint_stall_s=max(r.checkpoint_stall_s for r in reports),
            stage_times=stage_times(reports, grid),
        )

    def _summarise(self, records: list[StepRecord], consumed: int) -> RunSummary:
        # The first step pays for allocation and warm-up; leave it out of the rates when there are others.
        steady = records[1:] if len(records) > 1 else records
        avg = lambda attr: fmean(getattr(r, attr) for r in steady) if steady else 0.0  # noqa: E731
        step_time = avg("step_time_s")
        tokens = self.cfg.train.global_batch_size * self.cfg.data.seq_len
        stages = range(self.grid.pp)
        return RunSummary(
            steps=len(records),
            grid=str(self.grid),
            schedule=self.cfg.parallel.schedule,
            microbatches=self.cfg.parallel.microbatches,
            device=self.device or "?",
            final_loss=records[-1].loss if records else float("nan"),
            tokens_per_s=tokens / step_time if step_time else 0.0,
            step_time_s=step_time,
            bubble_measured=avg("bubble_measured"),
            bubble_simulated=avg("bubble_simulated"),
            control_overhead=avg("control_overhead"),
            # Per stage of the final grid; steps run on a deeper grid before a re-plan count where they fit.
            peak_activation_bytes=[max((r.peak_activation_bytes[s] for r in records if s < len(r.peak_activation_bytes)),
                                       default=0) for s in stages],
            peak_device_bytes=[max((r.peak_device_bytes[s] for r in records if s < len(r.peak_device_bytes)),
                                   default=0) for s in stages],
            consumed_samples=consumed,
            expert_tokens=_sum_expert_tokens(r.expert_tokens for r in records),
            tokens_dropped=sum(r.tokens_dropped for r in records),
            alltoall_bytes_per_step=avg("alltoall_bytes"),
            alltoall_s_per_step=fmean(r.alltoall_s for r in steady if r.alltoall_s is not None) if any(
                r.alltoall_s is not None for r in steady) else 0.0,
            start_step=self.start_step,
            checkpoints=[{**asdict(c), "write_bytes_per_s": c.write_bytes_per_s} for c in self.saver.results],
            checkpoint_stall_s=sum(r.checkpoint_stall_s for r in records),
            checkpoints_skipped=self.saver.skipped,
            restarts=self.restarts,
            recoveries=list(self.recoveries),
            controller_states=[state.value for _, state, _ in self.controller.history],
            records=records,
        )


def _sum_expert_tokens(tables) -> dict[str, list[int]]:
    total: dict[str, list[int]] = {}
    for table in tables:
        for layer, counts in table.items():
            acc = total.setdefault(layer, [0] * len(counts))
            for i, c in enumerate(counts):
                acc[i] += c
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))
