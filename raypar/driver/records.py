"""What a run records: a record per step, a record per recovery, the run's summary."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from statistics import fmean
from typing import Iterable

from raypar.driver.stats import (WorkerTimes, measured_bubble, pipelines, simulated_bubble, stage_times, step_loss,
                                 unit_seconds)
from raypar.metrics import mfu
from raypar.runtime.report import StepReport
from raypar.schedule import Op, Prepared
from raypar.topology import Grid


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
    # The routing biases after the step, per MoE layer and expert (model.moe_bias_update_rate).
    expert_biases: dict[str, list[float]] = field(default_factory=dict)
    tokens_dropped: int = 0
    alltoall_bytes: int = 0
    alltoall_s: float | None = None  # slowest worker's host time in all-to-all (MoE with ep > 1)
    checkpoint_stall_s: float = 0.0  # time this step was held up by checkpointing
    data_wait_s: float = 0.0  # the longest any worker waited to read its batch
    data_window_bytes: list[int] = field(default_factory=list)  # per stage: the corpus one worker keeps
    optimizer_bytes: list[int] = field(default_factory=list)  # per stage: masters and moments of one worker
    # Device seconds in the gradient reduction (all-reduce, or the reduce-scatters a sharded
    # optimizer did not start inside backward; the first stage's, the last to finish backward,
    # so it waits for no other stage) and in the optimizer step (the slowest worker's; a
    # sharded optimizer's all-gather runs beside the next step's forwards).
    reduce_s: float = 0.0
    optimizer_s: float = 0.0
    # Sharded optimizer: gradient buckets reduced over replicas (all workers), and those whose
    # reduce-scatter was queued from inside backward.
    grad_buckets: int = 0
    grad_buckets_early: int = 0
    # Micro-batches run by all workers, and those that replayed CUDA graphs (runtime.cuda_graphs).
    microbatches: int = 0
    graphed_microbatches: int = 0
    overlapped_microbatches: int = 0  # of those, replayed beside another's (runtime.*_microbatch_overlap)
    stage_times: list[WorkerTimes] = field(default_factory=list)  # per worker: forward, backward, idle seconds
    # Model FLOPs (active parameters for MoE) per second over the dense peak of the grid's devices;
    # 0 where the device's peak is unknown (CPUs, unlisted GPUs).
    mfu: float = 0.0
    schedule: str = ""  # the schedule the step ran (parallel.schedule=auto changes it)
    # The workers copied their state after this step into memory (elastic.memory_every); a
    # copy is not asked for while the last one is still being made.
    memory_copied: bool = False
    # And sent that copy to their peers; not asked for while the last one is still on its way.
    memory_replicated: bool = False


def step_record(step: int, reports: list[StepReport], grid: Grid, programs: Prepared, step_time_s: float,
                tokens: int, consumed_samples: int, flops_per_token: float = 0.0,
                peak_flops: float = 0.0, schedule: str = "") -> StepRecord:
    """The record of one step from its completed reports; `tokens` per step, `consumed_samples`
    after it; `peak_flops` per device of the grid."""
    worker_time = max(r.wall_s for r in reports)
    by_stage = lambda attr: [max(getattr(r, attr) for r in reports if r.stage == s) for s in range(grid.pp)]  # noqa: E731
    return StepRecord(
        step=step,
        loss=step_loss(reports),
        lr=reports[0].lr,
        grad_norm=next(r.grad_norm for r in reports if r.stage == 0),  # the stage that reports it
        step_time_s=step_time_s,
        tokens_per_s=tokens / step_time_s,
        bubble_measured=measured_bubble(reports, grid),
        bubble_simulated=simulated_bubble(programs, pipelines(reports, grid)[0]),
        control_overhead=max(0.0, step_time_s - worker_time) / step_time_s,
        consumed_samples=consumed_samples,
        peak_activation_bytes=by_stage("peak_activation_bytes"),
        peak_device_bytes=by_stage("peak_device_bytes"),
        expert_tokens=sum_expert_tokens(r.expert_tokens for r in reports),
        tokens_dropped=sum(r.tokens_dropped for r in reports),
        alltoall_bytes=sum(r.alltoall_bytes for r in reports),
        alltoall_s=max(r.alltoall_s for r in reports) if grid.ep > 1 else None,
        checkpoint_stall_s=max(r.checkpoint_stall_s for r in reports),
        data_wait_s=max(r.data_wait_s for r in reports),
        data_window_bytes=by_stage("data_window_bytes"),
        optimizer_bytes=by_stage("optimizer_bytes"),
        # The first stage finishes its backward last: its reduction waits for no other stage.
        reduce_s=unit_seconds(reports, Op.REDUCE_GRAD, stage=0),
        optimizer_s=unit_seconds(reports, Op.STEP),
        grad_buckets=sum(r.buckets for r in reports),
        grad_buckets_early=sum(r.buckets_early for r in reports),
        microbatches=sum(r.microbatches for r in reports),
        graphed_microbatches=sum(r.graphed_microbatches for r in reports),
        overlapped_microbatches=sum(r.overlapped_microbatches for r in reports),
        stage_times=stage_times(reports, grid),
        mfu=mfu(tokens / step_time_s, flops_per_token, grid.size, peak_flops),
        schedule=schedule,
    )


@dataclass
class Recovery:
    """One recovery, from the failure to the first step completed after it.

    recovery_s = salvage_s + (planning) + workers_s + load_s + first_step_s.
    """

    restart: int  # 1 for the run's first restart
    error: str  # the failure's type
    failed_grid: str
    detection_s: float  # from the start of the step in flight to noticing the failure
    salvage_s: float  # keeping the survivors (or tearing everything down)
    steps_done: int  # steps the run had done when it failed
    detected_at: float  # wall clock
    attempts: int = 1  # failures before the first good step (each one more restart)
    workers_kept: int = 0
    workers_started: int = 0
    workers_from_standby: int = 0
    grid: str | None = None  # the grid it resumed on
    resumed_step: int | None = None
    workers_s: float | None = None  # placing, starting and setting up the workers
    setup_s: dict[str, float] = field(default_factory=dict)  # setup phases, each the longest over the workers
    load_s: float | None = None  # loading the checkpoint
    running_at: float | None = None  # wall clock when RUNNING began again
    first_step_s: float | None = None
    recovery_s: float | None = None
    steps_lost: int | None = None  # steps done before the failure that the run did again
    # Where the state came from: "memory" (the workers' copies and replicas), "storage" (a
    # checkpoint) or "start" (nothing kept: step 0).
    source: str | None = None

    def workers_placed(self, kept: int, started: int, from_standby: int) -> None:
        self.workers_kept = kept
        self.workers_started += started
        self.workers_from_standby += from_standby

    def resumed(self, grid: str, step: int, workers_s: float, setup_s: dict[str, float], load_s: float,
                now: float, source: str | None = None) -> None:
        self.grid, self.resumed_step, self.source = grid, step, source
        self.workers_s, self.setup_s, self.load_s, self.running_at = workers_s, setup_s, load_s, now

    def finished(self, now: float) -> None:
        """The first step after it completed at `now` (wall clock)."""
        self.recovery_s = now - self.detected_at
        self.first_step_s = now - self.running_at
        self.steps_lost = max(0, self.steps_done - self.resumed_step)

    def to_dict(self) -> dict:
        """As summary.json holds it: the measured fields, not the clock readings."""
        d = asdict(self)
        for internal in ("detected_at", "running_at", "steps_done"):
            d.pop(internal)
        return d


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
    mfu: float = 0.0  # steady steps' mean; by active parameters, over the devices of the grid that ran them
    expert_tokens: dict[str, list[int]] = field(default_factory=dict)  # summed over steps
    tokens_dropped: int = 0
    optimizer_bytes: list[int] = field(default_factory=list)  # per stage, one worker's
    reduce_s_per_step: float = 0.0
    optimizer_s_per_step: float = 0.0
    # Sharded optimizer: the share of gradient buckets whose reduce-scatter began inside backward.
    grad_buckets_early_share: float = 0.0
    cuda_graphs_share: float = 0.0  # of all micro-batches run, those that replayed CUDA graphs
    overlap_share: float = 0.0  # of all micro-batches run, those replayed beside another micro-batch's
    alltoall_bytes_per_step: float = 0.0
    alltoall_s_per_step: float = 0.0
    data_wait_s_per_step: float = 0.0  # the longest wait of any worker for its batch, per step
    start_step: int = 0  # > 0 when resumed from a checkpoint
    checkpoints: list[dict] = field(default_factory=list)  # one per save: step, path, bytes, timings
    checkpoint_stall_s: float = 0.0  # total time the loop was held up by saves
    checkpoints_skipped: int = 0
    restarts: int = 0  # times the workers were torn down after a failure
    recoveries: list[dict] = field(default_factory=list)  # per failure: `Recovery.to_dict()`
    controller_states: list[str] = field(default_factory=list)
    # parallel.schedule=auto: per grid run, the schedule chosen, why, and the costs and predictions
    schedule_choices: list[dict] = field(default_factory=list)
    # Each move of the workers to another cut of the model (a schedule of other chunks per
    # stage): its schedule, step, and checkpoint, rebuild and load seconds.
    moves: list[dict] = field(default_factory=list)
    # Each move of experts between ep workers (parallel.rebalance_experts_every): its step,
    # the busiest workers' rows against an even share before and after, the experts moved,
    # and the move's seconds.
    expert_moves: list[dict] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("records")
        return d

    def format(self) -> str:
        lines = [
            f"steps               {self.steps}  (grid {self.grid}, {self.schedule}, {self.microbatches} micro-batches, {self.device})",
            f"final loss          {self.final_loss:.4f}",
            f"tokens/s            {self.tokens_per_s:,.0f}" + (f"  (MFU {self.mfu:.1%})" if self.mfu else ""),
            f"step time           {self.step_time_s * 1000:.1f} ms",
            f"bubble              measured {self.bubble_measured:.3f}  simulated {self.bubble_simulated:.3f}",
            f"control overhead    {self.control_overhead * 100:.2f}% of the step",
            f"data wait           {self.data_wait_s_per_step * 1000:.2f} ms per step"
            + (f" ({self.data_wait_s_per_step / self.step_time_s:.2%} of a step)" if self.step_time_s else ""),
            *([f"CUDA graphs         {self.cuda_graphs_share:.0%} of micro-batches replayed (runtime.cuda_graphs)"
               + (f", {self.overlap_share:.0%} beside another's backward (runtime.*_microbatch_overlap)"
                  if self.overlap_share else "")]
              if self.device.startswith("cuda") else []),
            "peak activations    " + "  ".join(f"stage {s}: {_mib(b)}" for s, b in enumerate(self.peak_activation_bytes)),
        ]
        if self.optimizer_bytes:
            lines.append("optimizer state     " + "  ".join(f"stage {s}: {_mib(b)}" for s, b in enumerate(self.optimizer_bytes))
                         + f"  (per worker; gradient reduction {self.reduce_s_per_step * 1000:.1f} ms, "
                         f"optimizer step {self.optimizer_s_per_step * 1000:.1f} ms per step"
                         + (f"; {self.grad_buckets_early_share:.0%} of gradient buckets reduced inside backward"
                            if self.grad_buckets_early_share else "") + ")")
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
                each = sum(c["bytes"] for c in ok) / len(ok)
                timed = [c["bytes"] / c["write_s"] for c in ok if c["write_s"] > 0]
                line += f"; {_mib(each, 1)} each, written at {fmean(timed) / 2**20 if timed else 0.0:.0f} MiB/s"
            lines.append(line)
            if ok:
                mean = lambda key: fmean(c.get(key, 0.0) for c in ok)  # noqa: E731
                lines.append(f"checkpoint path     {mean('duration_s'):.2f} s snapshot to commit: copies "
                             f"{mean('copy_wait_s'):.2f} s, write {mean('write_s'):.2f} s, commit {mean('commit_s'):.2f} s")
            share = per_save / self.step_time_s * 100 if self.step_time_s else 0.0
            lines.append(f"checkpoint stall    {per_save * 1000:.1f} ms per save ({share:.2f}% of a step)")
        for c in self.schedule_choices:
            lines.append(f"schedule choice     {c['schedule']} on {c['grid']}: {c['reason']}")
        for m in self.moves:
            lines.append(f"moved to a new cut  {m['cut']} for {m['schedule']} at step {m['step']}: {m['total_s']:.2f} s "
                         f"(checkpoint {m['save_s']:.2f}, rebuild {m['rebuild_s']:.2f}, load {m['load_s']:.2f})")
        for m in self.expert_moves:
            lines.append(f"experts moved       {m['experts_moved']} at step {m['step']}: busiest workers "
                         f"{m['busiest_before']:.3f}x -> {m['busiest_after']:.3f}x an even share of the rows, "
                         f"{m['total_s']:.2f} s (rebuild {m['rebuild_s']:.2f}, load {m['load_s']:.2f})")
        for r in self.recoveries:
            lines.append(f"recovery {r['restart']}          {r['error']} on {r['failed_grid']} -> {r['grid']}: detected in "
                         f"{r['detection_s']:.1f}s, recovered in {r['recovery_s']:.1f}s, {r['steps_lost']} steps redone")
        if any(self.peak_device_bytes):
            lines.append("peak device memory  " + "  ".join(
                f"stage {s}: {_mib(b)}" for s, b in enumerate(self.peak_device_bytes)))
        return "\n".join(lines)


def _mib(nbytes: float, digits: int = 2) -> str:
    return f"{nbytes / 2**20:.{digits}f} MiB"


def summarise(records: list[StepRecord], *, grid: Grid, schedule: str, microbatches: int, device: str,
              tokens_per_step: int, consumed: int, start_step: int, checkpoints: list[dict],
              checkpoints_skipped: int, restarts: int, recoveries: list[Recovery],
              controller_states: list[str], schedule_choices: list[dict] | None = None,
              moves: list[dict] | None = None, expert_moves: list[dict] | None = None) -> RunSummary:
    # The first step pays for allocation and warm-up; leave it out of the rates when there are others.
    steady = records[1:] if len(records) > 1 else records
    avg = lambda attr: fmean(getattr(r, attr) for r in steady) if steady else 0.0  # noqa: E731
    step_time = avg("step_time_s")
    stages = range(grid.pp)
    timed_a2a = [r.alltoall_s for r in steady if r.alltoall_s is not None]
    return RunSummary(
        steps=len(records),
        grid=str(grid),
        schedule=schedule,
        microbatches=microbatches,
        device=device,
        final_loss=records[-1].loss if records else float("nan"),
        tokens_per_s=tokens_per_step / step_time if step_time else 0.0,
        step_time_s=step_time,
        bubble_measured=avg("bubble_measured"),
        bubble_simulated=avg("bubble_simulated"),
        control_overhead=avg("control_overhead"),
        mfu=avg("mfu"),
        # Per stage of the final grid; steps run on a deeper grid before a re-plan count where they fit.
        peak_activation_bytes=[max((r.peak_activation_bytes[s] for r in records if s < len(r.peak_activation_bytes)),
                                   default=0) for s in stages],
        peak_device_bytes=[max((r.peak_device_bytes[s] for r in records if s < len(r.peak_device_bytes)),
                               default=0) for s in stages],
        consumed_samples=consumed,
        expert_tokens=sum_expert_tokens(r.expert_tokens for r in records),
        tokens_dropped=sum(r.tokens_dropped for r in records),
        optimizer_bytes=records[-1].optimizer_bytes if records else [],
        reduce_s_per_step=avg("reduce_s"),
        optimizer_s_per_step=avg("optimizer_s"),
        grad_buckets_early_share=(sum(r.grad_buckets_early for r in steady) / max(1, sum(r.grad_buckets for r in steady))),
        cuda_graphs_share=sum(r.graphed_microbatches for r in records) / max(1, sum(r.microbatches for r in records)),
        overlap_share=sum(r.overlapped_microbatches for r in records) / max(1, sum(r.microbatches for r in records)),
        alltoall_bytes_per_step=avg("alltoall_bytes"),
        alltoall_s_per_step=fmean(timed_a2a) if timed_a2a else 0.0,
        data_wait_s_per_step=avg("data_wait_s"),
        start_step=start_step,
        checkpoints=checkpoints,
        checkpoint_stall_s=sum(r.checkpoint_stall_s for r in records),
        checkpoints_skipped=checkpoints_skipped,
        restarts=restarts,
        recoveries=[r.to_dict() for r in recoveries],
        controller_states=controller_states,
        schedule_choices=schedule_choices or [],
        moves=moves or [],
        expert_moves=expert_moves or [],
        records=records,
    )


def sum_expert_tokens(tables: Iterable[dict[str, list[int]]]) -> dict[str, list[int]]:
    total: dict[str, list[int]] = {}
    for table in tables:
        for layer, counts in table.items():
            acc = total.setdefault(layer, [0] * len(counts))
            for i, c in enumerate(counts):
                acc[i] += c
    return dict(sorted(total.items(), key=lambda kv: int(kv[0])))
