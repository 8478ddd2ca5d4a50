"""Every metric raypar exports, as data.

The exporter creates its instruments from this list and the dashboard test checks the
Grafana panels against it, so a metric is renamed in one place or not at all.

Names follow Prometheus conventions: a `raypar_` prefix, the base unit in the name,
`_total` on counters. Through Ray's metrics agent (backend "ray") every name gains Ray's
own `ray_` prefix (`raypar_loss` is scraped as `ray_raypar_loss`); the dashboards match
both spellings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["gauge", "counter", "histogram"]

RUN = ("run",)
WORKER = ("run", "stage", "dp_rank", "ep_rank")
STAGE = ("run", "stage")

# Step times span ~1 ms (tiny CPU models) to minutes (large GPU steps).
STEP_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                     120.0, 300.0)
CHECKPOINT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    description: str
    labels: tuple[str, ...]
    unit: str  # base unit, informational (the name already carries it); "" when dimensionless
    buckets: tuple[float, ...] = ()  # histograms only

    def __post_init__(self) -> None:
        if not self.name.startswith("raypar_"):
            raise ValueError(f"metric {self.name} must start with raypar_")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"metric {self.name}: counters, and only counters, end in _total")
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"metric {self.name}: histograms, and only histograms, need buckets")


CATALOG: tuple[MetricSpec, ...] = (
    # -- training progress -------------------------------------------------------------
    MetricSpec("raypar_steps_total", "counter", "Optimizer steps completed.", RUN, ""),
    MetricSpec("raypar_consumed_samples_total", "counter", "Training samples consumed.", RUN, "samples"),
    MetricSpec("raypar_step_time_seconds", "histogram", "Wall-clock time of a training step, seen by the driver.",
               RUN, "seconds", STEP_TIME_BUCKETS),
    MetricSpec("raypar_tokens_per_second", "gauge", "Training throughput of the last step.", RUN, "tokens/s"),
    MetricSpec("raypar_loss", "gauge", "Training loss of the last step (mean over micro-batches and replicas).",
               RUN, ""),
    MetricSpec("raypar_grad_norm", "gauge", "Global gradient norm of the last step, before clipping.", RUN, ""),
    MetricSpec("raypar_learning_rate", "gauge", "Learning rate of the last step.", RUN, ""),
    MetricSpec("raypar_mfu_ratio", "gauge",
               "Model FLOPs utilisation: achieved training FLOP/s over the devices' peak (0 when the peak is unknown).",
               RUN, "ratio"),
    # -- pipeline efficiency -----------------------------------------------------------
    MetricSpec("raypar_bubble_ratio", "gauge",
               "Idle share of the pipeline's forward/backward window: measured, or simulated from measured F/B times.",
               ("run", "kind"), "ratio"),
    MetricSpec("raypar_control_overhead_ratio", "gauge",
               "Share of the step the driver spent outside the stage workers.", RUN, "ratio"),
    MetricSpec("raypar_stage_forward_seconds", "gauge", "Time a stage worker spent in forward in the last step.",
               WORKER, "seconds"),
    MetricSpec("raypar_stage_backward_seconds", "gauge", "Time a stage worker spent in backward in the last step.",
               WORKER, "seconds"),
    MetricSpec("raypar_stage_idle_seconds", "gauge",
               "Time a stage worker spent outside forward/backward within the pipeline window of the last step.",
               WORKER, "seconds"),
    # -- memory (max over the replicas of a stage) ------------------------------------
    MetricSpec("raypar_stage_peak_activation_bytes", "gauge",
               "Peak bytes of activations held by a stage in the last step.", STAGE, "bytes"),
    MetricSpec("raypar_stage_peak_device_memory_bytes", "gauge",
               "Peak device memory allocated by a stage in the last step (0 on CPU).", STAGE, "bytes"),
    MetricSpec("raypar_stage_optimizer_state_bytes", "gauge",
               "Bytes of fp32 master weights and AdamW moments one worker of a stage holds (its share when "
               "parallel.shard_optimizer is on).", STAGE, "bytes"),
    # -- data parallelism ------------------------------------------------------------------
    MetricSpec("raypar_gradient_reduction_seconds", "gauge",
               "Device time the slowest worker spent reducing gradients over data-parallel replicas in the "
               "last step (all-reduce, or reduce-scatter when the optimizer is sharded).", RUN, "seconds"),
    MetricSpec("raypar_optimizer_step_seconds", "gauge",
               "Device time the slowest worker spent in the optimizer step in the last step (a sharded "
               "optimizer's all-gather of the updated weights runs beside the next step's forwards).", RUN, "seconds"),
    # -- mixture of experts --------------------------------------------------------------
    MetricSpec("raypar_alltoall_bytes_total", "counter",
               "Bytes sent by expert-parallel all-to-all (forward and backward, all workers).", RUN, "bytes"),
    MetricSpec("raypar_alltoall_seconds", "gauge", "Time spent in expert-parallel all-to-all in the last step.",
               RUN, "seconds"),
    MetricSpec("raypar_expert_tokens", "gauge",
               "Token assignments routed to each expert of each MoE layer in the last step, summed over replicas.",
               ("run", "layer", "expert"), "tokens"),
    MetricSpec("raypar_expert_bias", "gauge",
               "Routing bias of each expert of each MoE layer after the last step (model.moe_bias_update_rate; "
               "added to the router probability when the top-k are chosen).", ("run", "layer", "expert"), ""),
    MetricSpec("raypar_tokens_dropped_total", "counter",
               "Token assignments dropped by expert capacity limits, summed over MoE layers.", RUN, "tokens"),
    # -- data -------------------------------------------------------------------------------
    MetricSpec("raypar_data_wait_seconds", "gauge",
               "Time the last step waited to read its batch (the slowest worker); above zero only when the "
               "corpus is read slower than training or data.prefetch is off.", RUN, "seconds"),
    MetricSpec("raypar_stage_data_window_bytes", "gauge",
               "Bytes of the corpus a worker of each stage keeps (its window of recently read blocks; the most "
               "of the stage's replicas; only first and last stages read data).", ("run", "stage"), "bytes"),
    # -- checkpoints ---------------------------------------------------------------------
    MetricSpec("raypar_checkpoints_total", "counter", "Checkpoint saves by outcome: committed, failed or skipped.",
               ("run", "outcome"), ""),
    MetricSpec("raypar_checkpoint_stall_seconds", "gauge",
               "Time the last checkpointing step was held up by the save (snapshot, waiting for the previous one).",
               RUN, "seconds"),
    MetricSpec("raypar_checkpoint_bytes", "gauge", "Size of the last committed checkpoint.", RUN, "bytes"),
    MetricSpec("raypar_checkpoint_write_bytes_per_second", "gauge",
               "Write throughput of the last committed checkpoint (bytes over the slowest writer's time).",
               RUN, "bytes/s"),
    MetricSpec("raypar_checkpoint_duration_seconds", "histogram",
               "Time from a save's start to its commit being seen by the driver.", RUN, "seconds", CHECKPOINT_BUCKETS),
    # -- elasticity ------------------------------------------------------------------------
    MetricSpec("raypar_restarts_total", "counter", "Worker-group restarts after a failure.", RUN, ""),
    MetricSpec("raypar_failure_detection_seconds", "gauge",
               "Time from the last failure to the controller noticing it.", RUN, "seconds"),
    MetricSpec("raypar_recovery_seconds", "gauge",
               "Time from noticing the last failure to training steps running again.", RUN, "seconds"),
    MetricSpec("raypar_recovery_steps_redone", "gauge",
               "Steps done before the last failure that its recovery ran again, by where the state it "
               "restored came from (memory: the workers' copies and replicas; storage: a checkpoint; start: step 0).",
               ("run", "source"), ""),
    MetricSpec("raypar_controller_state", "gauge", "1 for the controller's current state, 0 for the others.",
               ("run", "state"), ""),
)

BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in CATALOG}


def spec(name: str) -> MetricSpec:
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not in raypar.metrics.catalog.CATALOG") from None
