"""Typed run configuration: dataclasses loaded from YAML, overridable with `a.b=value`.

Every key is checked: an unknown key, a value of the wrong type or an impossible
combination raises ConfigError naming the key and saying what would work.
"""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

import yaml

from raypar.topology import Grid


class ConfigError(ValueError):
    """A configuration key or value that cannot work."""


@dataclass
class ModelConfig:
    vocab_size: int = 256  # token ids are 0 .. vocab_size - 1
    dim: int = 64  # width of the residual stream
    n_layers: int = 4  # transformer blocks, split over the pipeline stages
    n_heads: int = 4  # attention heads; dim / n_heads is the head size
    n_kv_heads: int | None = None  # None: same as n_heads (no grouped-query attention)
    ffn_dim: int | None = None  # None: about 8/3 * dim, rounded up to a multiple of 8
    max_seq_len: int = 256  # longest sequence the rotary tables cover
    rope_theta: float = 10000.0  # rotary embedding base
    norm_eps: float = 1e-5  # RMSNorm epsilon
    init_std: float = 0.02  # std of the normal init (output projections get / sqrt(2 * n_layers))
    # Dropout on the two residual branches of each block (after attention and after the
    # MLP), fused with the residual add. Masks come from per-sample seeds, so every grid
    # drops the same elements.
    dropout: float = 0.0
    # Parameter dtype. bfloat16 keeps fp32 master weights and fp32 gradient accumulation.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Mixture of experts: 0 experts is a dense model. Layer i is MoE when
    # (i + 1) % moe_every == 0 (every layer with 1, every second layer with 2).
    n_experts: int = 0
    moe_top_k: int = 2  # experts each token is sent to
    moe_every: int = 1  # every k-th layer is MoE (see above)
    moe_ffn_dim: int | None = None  # None: the dense hidden_dim
    moe_aux_loss_coef: float = 0.01  # weight of the per-sequence load-balancing loss
    moe_z_loss_coef: float = 0.0  # weight of the router z-loss (mean squared logsumexp)
    moe_capacity_factor: float = 0.0  # 0: dropless; else per-sample capacity, extra tokens dropped
    # Balancing without a loss (DeepSeek-V3's expert bias): each expert's bias is added to
    # its router probability when the top-k are chosen (not to the weights), and after each
    # step moves this much towards an even load: up where the expert received fewer rows
    # than the mean of the step, down where more. 0: no bias.
    moe_bias_update_rate: float = 0.0
    # A Hugging Face folder (Llama or Mixtral, safetensors) whose weights replace the
    # random initialisation; its config.json must match this model.
    init_from: str | None = None

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.n_experts > 0 and (layer_id + 1) % self.moe_every == 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return 8 * ((int(8 * self.dim / 3) + 7) // 8)


@dataclass
class ParallelConfig:
    dp: int = 1  # data-parallel replicas of the whole pipeline
    pp: int = 1  # pipeline stages
    ep: int = 1  # expert-parallel workers per stage (each holds n_experts / ep experts)
    # Tensor-parallel workers per stage cell, splitting its layers: attention by heads, the
    # MLP column- then row-parallel, embedding, head and cross-entropy by vocabulary; norms
    # whole on every tp worker, as are MoE layers (their experts split over ep). Where tp
    # does not divide the heads, the MLP's hidden size or the vocabulary, that part splits
    # the model dimension instead, or is whole on every worker (the driver logs which). With
    # shard_optimizer, each tp worker shards its slices over its dp peers
    tp: int = 1
    # With tp: norms, residuals and the hidden states sent between stages hold each tp
    # worker's slice of the sequence rather than all of it (activation memory and pipeline
    # sends / tp); the split layers gather and reduce-scatter instead of all-reducing.
    # MoE layers run on the gathered sequence. Needs data.seq_len a multiple of tp
    sequence_parallel: bool = False
    # fthenb (GPipe), 1f1b, or zero bubble (backward split into input and weight gradients):
    # zb-h1 holds no more micro-batches than 1F1B's first stage, zb-h2 up to twice that;
    # auto: the first two steps on each grid time F, I and W (with zb-h1), the schedules the
    # simulator predicts within 5% of the fastest that fits memory_budget_gb run two steps
    # each, and the fastest measured runs on; one of several chunks per stage runs on its own
    # cut of the model, the workers moved there (`move_through`). Several model chunks per stage (`chunks`):
    # interleaved-1f1b (chunks in a loop; microbatches a multiple of pp), zb-v (2 chunks in a
    # V, split backward, at most 1F1B's peak activations) and zb-v-half (about half of it)
    schedule: Literal["fthenb", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "zb-v-half", "auto"] = "1f1b"
    # Model chunks per stage: None, the schedule's own (2 for interleaved-1f1b, zb-v and
    # zb-v-half, 1 for the others); interleaved-1f1b takes any count >= 2 (also as auto's candidate)
    chunks: int | None = None
    # How the workers move to another cut of the model (a schedule with other chunks per stage,
    # auto's or switch_schedule's): "devices" keeps each worker's state on its device while
    # the stages are rebuilt and sends each tensor to the worker that now needs it (where
    # every device has room for its state twice, else through a checkpoint); "checkpoint"
    # always saves it (in shared memory on one node, else the checkpoint directory) and loads it
    move_through: Literal["devices", "checkpoint"] = "devices"
    # Device memory a stage may hold, for schedule=auto; None: 90% of the device's (no limit on CPU)
    memory_budget_gb: float | None = None
    microbatches: int = 1  # per data-parallel replica and step
    # Layers of each pipeline stage: None, as even as possible (extra layers to the middle
    # stages); "auto", balanced by modelled FLOPs so that the last stage's head does not make
    # it the slowest, cutting between a layer's attention and its MLP where that evens the
    # stages out (any pp, also after an elastic re-plan); or a list, one count of layers per
    # stage, whole or ending in .5 ([7.5, 6.5]: the cut between layer 7's attention and its
    # MLP); with several chunks per stage, one per virtual stage: pp x chunks, in model order.
    # On 2 x H200 with the 1B config, "auto" ran 1F1B 1.02x its even split's speed, and
    # zb-h2 on its 7.5 | 6.5 cut was the fastest configuration measured, 0.95 of 2 x one GPU
    # (BENCHMARKS.md)
    layers_per_stage: list[int | float] | Literal["auto"] | None = None
    # With MoE at ep > 1: every this many steps (0: never, else at least 2), move experts
    # between each layer's ep workers so that the busiest worker's experts receive fewer
    # rows (the routed counts of the steps since the last time), where that lowers the
    # busiest workers' rows summed over layers by at least 2%, and so would a placement made
    # from the first half of those steps on the second half (routing holds still); the
    # workers move as to another cut (move_through). Results do not change
    # (docs/concepts.md "Where experts live")
    rebalance_experts_every: int = 0
    # Which experts each ep worker holds: per MoE layer in model order, the expert ids in slot
    # order (worker r holds slots r x n_experts / ep onwards). None: expert e on worker
    # e // (n_experts / ep). rebalance_experts_every sets it; checkpoints name experts by id
    # whatever the placement
    expert_placement: list[list[int]] | None = None
    # Split the fp32 masters and AdamW moments over the workers that hold the same weights
    # (ZeRO-1): gradients reduce-scattered, updated weights all-gathered
    shard_optimizer: bool = False
    grad_bucket_mb: float = 128.0  # fp32 gradients per reduce-scatter of a sharded optimizer
    # Start a bucket's reduce-scatter inside the step's last backwards, once its gradients are
    # complete, instead of after every backward (sharded optimizer)
    overlap_grad_reduce: bool = True

    @property
    def grid(self) -> Grid:
        """The configured grid of stage workers."""
        return Grid(self.dp, self.pp, self.ep, self.tp)


@dataclass
class TrainConfig:
    steps: int = 30  # optimizer steps of the whole run
    global_batch_size: int = 8  # samples per optimizer step, over all replicas
    lr: float = 3e-3  # peak learning rate, reached after warmup
    min_lr: float = 3e-4  # learning rate at the last step (cosine decay)
    warmup_steps: int = 3  # linear warmup steps
    weight_decay: float = 0.1  # AdamW decay of matrices (norm gains are not decayed)
    beta1: float = 0.9  # AdamW first-moment decay
    beta2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW epsilon
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    seed: int = 0  # initialisation and data order; the same on every grid


@dataclass
class DataConfig:
    path: str | None = None  # token file or folder (Parquet, a datasets folder), local or a URI (s3://...); None: synthetic corpus in the run dir
    seq_len: int = 32  # tokens per sample (the file holds seq_len + 1 per row)
    shuffle: bool = True  # a new seeded permutation of the samples every epoch
    synthetic_samples: int = 4096  # size of the generated corpus when data.path is unset
    # Most megabytes of the corpus's blocks (Parquet row groups) a process keeps after
    # reading them; the corpus itself is streamed, never held whole.
    window_mb: float = 256.0
    # Workers that read data load the next step's batch on a background thread into pinned
    # memory while the current step runs; off: each step reads its batch as it starts.
    prefetch: bool = True
    # "bytes" or a local tokenizer.json (or its folder): the run refuses a corpus that
    # `prepare-data` made with another tokenizer. None: not checked.
    tokenizer: str | None = None


@dataclass
class RuntimeConfig:
    run_dir: str = "runs/default"  # config.json, metrics.jsonl, events.jsonl, summary.json, checkpoints/
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: one GPU per worker when the cluster has GPUs
    release: bool = True  # free activations backward no longer needs
    # Activation recompute: "block" keeps each block's input and recomputes the block in
    # backward; "stage" keeps only the stage input and recomputes the whole stage.
    recompute: Literal["none", "block", "stage"] = "none"
    cpus_per_worker: float = 1.0  # Ray CPUs per stage worker (fractions let many workers share cores)
    # Local cluster size when the driver starts Ray itself; None lets Ray count the machine.
    num_cpus: int | None = None
    ray_address: str | None = None  # None: RAY_ADDRESS, else a new local cluster
    placement_timeout_s: float = 30.0  # longest wait for the cluster to place all workers
    # Leave the stage workers (processes, imports, CUDA contexts) idle when a run finishes, for
    # the next run of this driver process to take in a fraction of a second instead of
    # starting them again; they hold their resources until that run starts or the driver ends.
    keep_workers: bool = False
    collective_timeout_s: float = 120.0  # longest wait in a p2p exchange or collective
    step_timeout_s: float = 600.0  # longest wait for every worker to finish a step
    # Steps sent to the workers before the running one's reports are back. 1: workers start
    # the next step as the last ends, while the driver reads reports and starts saves;
    # 0: the driver waits for every step before sending the next.
    steps_ahead: int = 1
    # The first stage runs ahead of its device: it issues the next step's first forward
    # before it reports, so that forward runs right after the optimizer instead of after Ray
    # returns the report and brings the next call, and on GPU it reports without waiting for
    # its device (at most one step ahead; the driver fetches the norm and its last units'
    # times with a second call beside the next step). Off: it reports once its device has
    # the norm, and every step starts at its call.
    forward_ahead: bool = True
    log_every: int = 1  # print a progress line every N steps
    timeline_step: int | None = None  # draw this step's timeline (PNG + Chrome trace) into run_dir while training
    # Profile this step (or each step of a list) on every worker with torch.profiler: a
    # Chrome trace per worker and step (CPU ops and, on GPU, every kernel) in
    # run_dir/profile/ on the worker's node.
    profile_step: int | list[int] | None = None
    # Metrics: "ray" exports through ray.util.metrics (Ray's metrics agent, dashboard and
    # Grafana); "standalone" serves them from the driver with prometheus_client; "off".
    metrics: Literal["ray", "standalone", "off"] = "ray"
    metrics_host: str = "127.0.0.1"  # standalone endpoint address (loopback by default)
    metrics_port: int = 9464  # standalone endpoint port; 0 picks a free one
    run_name: str = "default"  # metric label that tells runs apart
    # CUDA kernels (kernels/, CuPy) on GPU workers; false runs the torch reference of every
    # kernel, for debugging. CPU runs always use the references.
    kernels: bool = True
    # Under mixed precision, linear layers add their weight gradients into the fp32
    # gradients inside the weight GEMM (bf16 inputs, fp32 accumulator) instead of writing a
    # bf16 gradient that a kernel then adds in (raypar.model.main_grad). Off: through autograd
    # and a hook, as a plain torch module does. Products are summed in fp32 either way; on
    # the fused path without first rounding each micro-batch's gradient to bf16.
    grad_accumulation_fusion: bool = True
    # How MoE layers with parallel.ep > 1 size their all-to-alls. "padded": every rank sends
    # each peer a buffer of all its (token, choice) rows, filled as far as routing needs, so
    # no layer waits for the host to read split sizes (costs ep x the routed bytes and
    # expert buffers sized for the worst case). "exact": the host reads the split sizes
    # once per layer and sends only routed rows.
    moe_alltoall: Literal["padded", "exact"] = "padded"
    # Pieces a padded exchange splits a micro-batch's tokens into: every piece's rows leave
    # before any piece's experts run, so one piece's all-to-all overlaps another's expert
    # compute. Pays where moving rows costs more than issuing the pieces' extra ops; on
    # NVLink (2 x H100) 2 pieces ran 0.77x and 4 ran 0.43x the tokens/s of 1, whose
    # exchanges are waited for in line (BENCHMARKS.md). The exact exchange is always whole.
    moe_chunks: int = 1
    # A backward of MoE layers with parallel.ep > 1 (padded exchange) leaves each layer's
    # weight gradients until the next all-to-all has left, and computes them while its rows
    # travel: backward has nothing else to do then. Gradients are the same products, added
    # in another order. Off: every backward exchange is waited for in line. Not used by
    # schedules that split backward into I and W themselves (zb-*).
    moe_backward_overlap: bool = True
    # The same for tensor parallelism (parallel.tp > 1): a backward leaves the split linear
    # layers' weight gradients until the next sum of input gradients over the tp ranks (an
    # all-reduce, or a reduce-scatter under sequence parallelism) has left, and computes
    # them while it travels. Off: every such exchange is waited for in line.
    tp_backward_overlap: bool = True
    # On GPU, each micro-batch's forward and backward on a stage replay CUDA graphs captured
    # at the first step, one graph set per micro-batch the schedule holds live (per model
    # chunk; a split backward's I and W are two graphs): the host issues a few launches per
    # micro-batch instead of every op (MoE layers issue ~60 a layer and direction; a tp
    # stage's device time halves, its host ops do not). Runs eagerly where a graph cannot
    # hold what the step does: activation recompute, the exact all-to-all (docs/concepts.md).
    cuda_graphs: bool = True
    # With those graphs, on MoE layers with parallel.ep > 1 (tp=1): consecutive micro-batches
    # replay on two streams, each forward beside the previous micro-batch's backward, so
    # one's all-to-all waits while the other computes (the backward's exchanges run on a
    # communicator of their own). Costs one more micro-batch of activations, a second graph
    # set and a second ep communicator; the results are the same (backwards still add into
    # the gradients in micro-batch order).
    moe_microbatch_overlap: bool = True
    # The same on a stage split by tp (pp=1): each forward's all-reduces (or sequence
    # gathers and reduce-scatters) wait while the previous micro-batch's backward computes,
    # and the backward's on a second tp communicator while the forward computes. Where a
    # stage has both (MoE at ep > 1 and tp > 1), either switch on overlaps its micro-batches.
    tp_microbatch_overlap: bool = True
    # The ep and tp communicators on high-priority CUDA streams (NCCL): their kernels, also
    # those a CUDA graph captured, take SMs ahead of compute kernels waiting for them, so an
    # exchange is not held behind a grouped GEMM while the peer waits in it (GPU only)
    collectives_high_priority: bool = False

    @property
    def profiled_steps(self) -> frozenset[int]:
        """The steps `profile_step` names (none, one or several)."""
        steps = self.profile_step
        return frozenset() if steps is None else frozenset([steps] if isinstance(steps, int) else steps)


@dataclass
class CheckpointConfig:
    every: int = 0  # save after every N optimizer steps (and after the last one); 0: never
    # A folder, or a URI that pyarrow.fs opens (s3://bucket/prefix: no shared file system
    # needed); None: <runtime.run_dir>/checkpoints.
    dir: str | None = None
    keep_last: int = 2  # committed checkpoints kept; older ones are deleted after a commit
    save_optimizer: bool = True  # AdamW moments and step counts
    save_master: bool = True  # fp32 master weights of a bf16 model
    when_busy: Literal["wait", "skip"] = "wait"  # a save due while the last is still writing (the final save waits)
    timeout_s: float = 600.0  # longest wait for a save to commit or a load to finish
    resume: str | None = None  # "latest", a checkpoint path or a step: continue from it
    # With resume=latest (and after a failure): fail when the newest committed checkpoint does
    # not verify or load, instead of going on from the newest older one that does.
    resume_strict: bool = False
    # An exponential moving average of the fp32 master weights, kept beside them on each
    # worker's device (4 bytes a parameter) and saved with every checkpoint as ema.<name>: 0
    # disables it, else ema = decay * ema + (1 - decay) * w, starting from the initial weights.
    ema_decay: float = 0.0
    ema_every: int = 1  # update the EMA after every N steps
    # Keep the EMA in host memory instead (4 bytes a parameter less on the device): the
    # masters are copied to the host beside the next step and folded in on the CPU. A fold
    # that has not finished by the next update holds the step up, so raise ema_every until
    # checkpoint stalls stay near zero.
    ema_on_host: bool = False


@dataclass
class ElasticConfig:
    enabled: bool = False  # survive lost workers and nodes: re-plan, reload the last checkpoint, go on
    min_workers: int = 1  # the smallest grid worth running; below it the run waits, then fails
    max_restarts: int = 3  # recoveries before the run gives up
    # Copy each worker's whole state into host memory after every N steps, beside the next
    # step, and send copies to a peer worker (on another node where there is one) as fast as
    # they travel: a recovery restores the newest step every rank has somewhere, so a lost
    # process redoes at most N steps and a lost node the steps since its replicas, without
    # reading storage. 0: recover from checkpoints only. Host memory per worker: about eight
    # times its state (the three newest own copies, one being made, the two its replicas come
    # from, two of a peer's); four where it sends no replicas (one node, memory_shared).
    memory_every: int = 1
    # Make those copies, and the replicas of peers', in the node's shared memory (/dev/shm)
    # rather than the worker's own: a worker whose process dies leaves its copies on its node,
    # where the run's other workers serve them, so a lost process redoes at most N steps (its
    # replica may lag further). The space counts against /dev/shm's size; where it is short,
    # copies fall back to the worker's own memory.
    memory_shared: bool = True
    resource_timeout_s: float = 60.0  # how long planning waits for enough resources
    grow: bool = True  # move back toward the configured grid at a checkpoint when resources return
    # After a failure keep the stage workers that still answer (new process groups among them
    # and replacements) instead of starting every worker again.
    keep_survivors: bool = True
    # How long a surviving worker may take to leave its step and process groups after a
    # failure; one that does not answer in time is killed and replaced.
    survivor_timeout_s: float = 15.0
    # Stage-worker processes started beside the grid and kept idle, each holding one worker's
    # resources (a GPU on GPU runs), to replace a lost worker without starting a process, CUDA
    # and kernels then. On GPU each also pins host memory for the largest stage's checkpoint
    # snapshots. Used when survivors are kept; replaced from the lost worker's resources.
    standby_workers: int = 0
    # What a standby holds on GPU runs. "own": a GPU of its own (one beyond the grid's).
    # "borrow": CPUs only; it sees its node's GPUs and, replacing a worker lost on its node,
    # runs on that worker's GPU once its process has ended (a node whose GPUs the grid
    # fills still recovers without starting a process). A borrowing standby replaces only
    # workers of its own node.
    standby_gpu: Literal["own", "borrow"] = "own"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    @property
    def microbatch_size(self) -> int:
        p = self.parallel
        return self.train.global_batch_size // (p.dp * p.ep * p.microbatches)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Config from a YAML file (or the defaults) with `section.key=value` overrides applied."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p} (configs/ holds the shipped ones, e.g. configs/tiny.yaml)")
        try:
            raw = _load_yaml(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, got {type(raw).__name__}")
    for item in overrides:
        _apply_override(raw, item)
    cfg = from_dict(Config, raw)
    validate(cfg)
    return cfg


def config_from_dict(raw: dict[str, Any]) -> Config:
    cfg = from_dict(Config, raw)
    validate(cfg)
    return cfg


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like section.key=value, e.g. parallel.pp=2")
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {item!r}: {part!r} is not a section")
    node[parts[-1]] = _load_yaml(text) if text.strip() else None


class _Loader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true and false. YAML 1.1 also reads on, off, yes and no as
    booleans, which turns a choice such as `runtime.metrics: off` into False."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regex) for tag, regex in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
_WORDS = {"true": True, "yes": True, "on": True, "false": False, "no": False, "off": False}


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def from_dict(cls: type, raw: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping, checking every key and value type."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        where = prefix or "the top level"
        raise ConfigError(
            f"unknown config key {_join(prefix, unknown[0])!r}; valid keys at {where}: {', '.join(sorted(fields))}"
        )
    values = {}
    for name, value in raw.items():
        values[name] = _coerce(hints[name], value, _join(prefix, name))
    return cls(**values)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value or {}, key)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        errors = []
        for option in non_none:  # the first that takes the value
            try:
                return _coerce(option, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}={value!r} fits none of: " + "; ".join(errors))
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of {', '.join(map(str, choices))}")
        return value
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, str) and value.lower() in _WORDS:
            return _WORDS[value.lower()]  # yes / no / on / off, as YAML 1.1 read them
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads 1e-5 (no dot) as a string; accept what Python reads as a number.
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return str(value)
    raise TypeError(f"config field {key} has unsupported type {tp}")


# ---------------------------------------------------------------------------------------
# Validation of values and their combinations


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_sequence_parallel(cfg: Config) -> None:
    p = cfg.parallel
    if p.tp < 2:
        raise ConfigError(f"parallel.sequence_parallel=true splits the sequence over tensor-parallel workers, but "
                          f"parallel.tp={p.tp}; set parallel.tp >= 2 or sequence_parallel=false")
    if cfg.data.seq_len % p.tp:
        raise ConfigError(f"parallel.sequence_parallel=true: data.seq_len={cfg.data.seq_len} is not a multiple of "
                          f"parallel.tp={p.tp}")


def validate(cfg: Config) -> None:
    m, p, t, d, r = cfg.model, cfg.parallel, cfg.train, cfg.data, cfg.runtime
    positive = {
        "model.vocab_size": m.vocab_size, "model.dim": m.dim, "model.n_layers": m.n_layers,
        "model.n_heads": m.n_heads, "model.max_seq_len": m.max_seq_len,
        "parallel.dp": p.dp, "parallel.pp": p.pp, "parallel.ep": p.ep, "parallel.tp": p.tp,
        "parallel.microbatches": p.microbatches,
        "train.global_batch_size": t.global_batch_size, "data.seq_len": d.seq_len,
        "data.synthetic_samples": d.synthetic_samples, "runtime.log_every": r.log_every,
        "runtime.moe_chunks": r.moe_chunks,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value} must be at least 1")
    c = cfg.checkpoint
    if not 0.0 <= c.ema_decay < 1.0 or c.ema_every < 1:
        raise ConfigError(f"checkpoint.ema_decay={c.ema_decay} must be in [0, 1) and checkpoint.ema_every={c.ema_every} >= 1")
    if c.ema_on_host and not c.ema_decay:
        raise ConfigError("checkpoint.ema_on_host=true but checkpoint.ema_decay=0 keeps no EMA: set "
                          "checkpoint.ema_decay (e.g. 0.999) or drop ema_on_host")
    if c.ema_decay and not c.every:
        raise ConfigError("checkpoint.ema_decay is set but checkpoint.every=0: the EMA is saved only with "
                          "checkpoints; set checkpoint.every")
    if c.every < 0 or c.keep_last < 1 or c.timeout_s <= 0:
        raise ConfigError(f"checkpoint.every={c.every} must be >= 0, checkpoint.keep_last={c.keep_last} >= 1, "
                          f"checkpoint.timeout_s={c.timeout_s} > 0")
    if t.steps < 0:
        raise ConfigError(f"train.steps={t.steps} must be >= 0")
    if p.memory_budget_gb is not None and p.memory_budget_gb <= 0:
        raise ConfigError(f"parallel.memory_budget_gb={p.memory_budget_gb} must be > 0 (GiB a stage may hold), or "
                          "null for 90% of the device's memory")
    if any(step < 0 for step in r.profiled_steps):
        raise ConfigError(f"runtime.profile_step={r.profile_step} must be a step number (0 or more), a list of them "
                          "(e.g. [6, 100]), or null for none")
    if r.steps_ahead < 0:
        raise ConfigError(f"runtime.steps_ahead={r.steps_ahead} must be >= 0 (0 waits for each step, 1 sends the next early)")
    e = cfg.elastic
    if e.min_workers < 1 or e.max_restarts < 0 or e.resource_timeout_s < 0 or e.survivor_timeout_s <= 0 \
            or e.standby_workers < 0:
        raise ConfigError(f"elastic.min_workers={e.min_workers} must be >= 1, elastic.max_restarts={e.max_restarts} "
                          f">= 0, elastic.resource_timeout_s={e.resource_timeout_s} >= 0, "
                          f"elastic.survivor_timeout_s={e.survivor_timeout_s} > 0, "
                          f"elastic.standby_workers={e.standby_workers} >= 0")
    if e.memory_every < 0:
        raise ConfigError(f"elastic.memory_every={e.memory_every} must be >= 0 (0 keeps no states in memory, "
                          f"1 keeps the state after every step)")
    if e.standby_workers and not (e.enabled and e.keep_survivors):
        raise ConfigError(f"elastic.standby_workers={e.standby_workers} replaces lost workers during a recovery that "
                          f"keeps the survivors: set elastic.enabled=true and elastic.keep_survivors=true, "
                          f"or elastic.standby_workers=0")
    if e.standby_gpu == "borrow" and not e.standby_workers:
        raise ConfigError("elastic.standby_gpu=borrow says what standby workers hold, but elastic.standby_workers=0 "
                          "starts none: set elastic.standby_workers (e.g. 1) or leave standby_gpu at own")
    if t.seed < 0:
        raise ConfigError(f"train.seed={t.seed} must be >= 0")
    for key, value in {"runtime.cpus_per_worker": r.cpus_per_worker, "runtime.placement_timeout_s": r.placement_timeout_s,
                       "runtime.collective_timeout_s": r.collective_timeout_s, "runtime.step_timeout_s": r.step_timeout_s}.items():
        if value <= 0:
            raise ConfigError(f"{key}={value} must be > 0")
    if m.dim % m.n_heads:
        raise ConfigError(
            f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; "
            f"n_heads could be one of {_divisors(m.dim)[-6:]}"
        )
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(f"model.dim / model.n_heads = {m.dim // m.n_heads} must be even for rotary embeddings")
    if m.n_heads % m.kv_heads:
        raise ConfigError(f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.kv_heads}")
    if d.seq_len > m.max_seq_len:
        raise ConfigError(f"data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}; raise max_seq_len or shorten seq_len")
    if d.window_mb <= 0:
        raise ConfigError(f"data.window_mb={d.window_mb} must be > 0 (megabytes of the corpus a process keeps)")
    if not 0 <= t.min_lr <= t.lr:
        raise ConfigError(f"train.min_lr={t.min_lr} must be between 0 and train.lr={t.lr}")
    if p.grad_bucket_mb <= 0:
        raise ConfigError(f"parallel.grad_bucket_mb={p.grad_bucket_mb} must be > 0 (megabytes of fp32 gradients)")
    if t.grad_clip < 0:
        raise ConfigError(f"train.grad_clip={t.grad_clip} must be >= 0 (0 disables clipping)")
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout={m.dropout} must be in [0, 1)")
    if m.n_experts < 0 or m.moe_every < 1 or m.moe_capacity_factor < 0 or m.moe_aux_loss_coef < 0 or m.moe_z_loss_coef < 0:
        raise ConfigError("model.n_experts, moe_aux_loss_coef, moe_z_loss_coef and moe_capacity_factor must be >= 0, moe_every >= 1")
    if m.moe_bias_update_rate < 0 or (m.moe_bias_update_rate > 0 and m.n_experts == 0):
        raise ConfigError(f"model.moe_bias_update_rate={m.moe_bias_update_rate} must be >= 0, and above 0 only with "
                          f"experts (model.n_experts={m.n_experts}); e.g. 0.001 with model.n_experts=8")
    if p.rebalance_experts_every < 0 or p.rebalance_experts_every == 1:
        raise ConfigError(f"parallel.rebalance_experts_every={p.rebalance_experts_every} must be 0 (never) or at least "
                          f"2: a move is checked on the second half of the steps since the last look")
    if p.expert_placement is not None:
        from raypar.expert_placement import placement_problem

        why = placement_problem(m, p.expert_placement)
        if why is not None:
            raise ConfigError(f"parallel.expert_placement does not fit the model: {why}")
    if m.n_experts and not 1 <= m.moe_top_k <= m.n_experts:
        raise ConfigError(f"model.moe_top_k={m.moe_top_k} must be between 1 and model.n_experts={m.n_experts}")
    if p.ep > 1 and not m.n_experts:
        raise ConfigError(f"parallel.ep={p.ep} splits experts, but model.n_experts=0 (a dense model); set model.n_experts or use parallel.ep=1")
    if m.n_experts and m.n_experts % p.ep:
        fits = [k for k in _divisors(m.n_experts) if k <= p.ep]
        raise ConfigError(
            f"model.n_experts={m.n_experts} is not divisible by parallel.ep={p.ep}; "
            f"parallel.ep={fits[-1]} would work (the largest divisor of n_experts not above {p.ep})"
        )
    if p.sequence_parallel:
        _check_sequence_parallel(cfg)
    if p.pp > m.n_layers:
        raise ConfigError(
            f"parallel.pp={p.pp} stages but the model has only model.n_layers={m.n_layers} layers; "
            f"use parallel.pp <= {m.n_layers}"
        )
    from raypar.schedule.generators import run_layout, schedule_fits

    why = schedule_fits(p.schedule, p.pp, p.microbatches, m.n_layers, p.chunks)
    if why is not None:
        raise ConfigError(f"parallel.schedule={p.schedule} with parallel.pp={p.pp}, parallel.microbatches={p.microbatches}"
                          f", parallel.chunks={p.chunks}: {why}")
    n_virtual = run_layout(p.schedule, p.pp, p.chunks).n_virtual
    if isinstance(p.layers_per_stage, list):
        if len(p.layers_per_stage) != n_virtual:
            per = "" if n_virtual == p.pp else f" x {n_virtual // p.pp} chunks = {n_virtual} virtual stages"
            raise ConfigError(f"parallel.layers_per_stage has {len(p.layers_per_stage)} entries but parallel.pp={p.pp}"
                              f"{per}")
        if any(2 * n != int(2 * n) for n in p.layers_per_stage):
            raise ConfigError(f"parallel.layers_per_stage={p.layers_per_stage}: each count is whole or ends in .5 "
                              f"(the cut between a layer's attention and its MLP), e.g. [7.5, 6.5]")
        if any(n < 0.5 for n in p.layers_per_stage):
            raise ConfigError(f"parallel.layers_per_stage={p.layers_per_stage}: every stage needs at least half a "
                              f"layer")
        if sum(p.layers_per_stage) != m.n_layers:
            raise ConfigError(
                f"parallel.layers_per_stage={p.layers_per_stage} sums to {sum(p.layers_per_stage):g} "
                f"but model.n_layers={m.n_layers}"
            )
    replicas = p.dp * p.ep  # every pipeline of the grid reads its own share of the batch
    per_step = replicas * p.microbatches
    if t.global_batch_size % per_step:
        if t.global_batch_size % replicas == 0:
            hint = f"parallel.microbatches could be one of {_divisors(t.global_batch_size // replicas)}"
        else:
            hint = f"train.global_batch_size must be a multiple of parallel.dp * parallel.ep = {replicas}"
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} is not divisible by parallel.dp * parallel.ep * "
            f"parallel.microbatches = {p.dp} * {p.ep} * {p.microbatches} = {per_step}; {hint}"
        )
