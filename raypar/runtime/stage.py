"""Executes one stage's program: the per-actor half of the pipeline scheduler.

A program is a list of schedule actions (raypar.schedule). The runtime keeps, per
micro-batch and model chunk, the received input, the chunk's output and the received
output gradient, and releases them as the program says: an output's data once it has been
sent (its autograd node stays, backward only needs the gradient), an input once its
gradient has been sent. Two chunks of one stage that follow each other in the model (ZB-V's
turn) hand the activation and its gradient over in memory. Nothing here knows about Ray: a
stage worker actor wraps it.
"""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from raypar import host_wait
from raypar.config import Config
from raypar.data import TokenDataset
from raypar.data.prefetch import Prefetcher
from raypar.kernels import sample_seeds
from raypar.model import build_stage, load_unstacked, unstacked
from raypar.model.backward import backward_from
from raypar.model.moe import MoE, update_expert_bias
from raypar.model.tensor_parallel import TensorParallel, gather_whole, slice_whole, tp_slices
from raypar.model.split_backward import (compute_weight_grads, drop_weight_grads, pending_tensors, set_split_backward,
                                         weight_grads_deferred)
from raypar.optim import MasterOptimizer, is_expert_param
from raypar.sharded_optimizer import ShardedOptimizer
from raypar.runtime.clock import StepClock
from raypar.runtime.comm import (CollectiveTimeout, all_reduce_, check_world,
                                 queue_world_check, world_check_failed)
from raypar.runtime.graphs import (GraphCaptureError, MicroBatchGraph, MicroBatchStreams, few_hardware_queues,
                                   graph_key, graphs_blocked, live_microbatches, overlap_blocked, overlap_switches,
                                   overlap_wanted)
from raypar.runtime.groups import StageGroups
from raypar.runtime.memory import ActivationTracker
from raypar.runtime.p2p import Inflight, connect_channels
from raypar.runtime.report import ReportTail, StepReport, Unit, compute_seconds, program_units
from raypar.runtime.recent_states import RecentStates
from raypar.runtime.snapshot import StateSnapshot
from raypar.runtime.state import (checkpoint_pieces, global_shapes, load_state, names_to_load, rng_states,
                                  state_layout, state_tensors, takes_snapshots, tp_named)
from raypar.schedule import Action, Op, comm_groups, run_layout
from raypar.topology import Grid

# The snapshot's copy of the peer check's sum (`start_snapshot`), never written.
PEER_CHECK = "peer_check"
_OVERLAPPED = "whole backward"  # the key a whole backward's overlapped weight gradients wait under


@dataclass
class _StepState:
    """One step on this stage: the tensors its units hold and what they measured."""
    step: int
    sample_ids: list[int]
    tokens: tuple[torch.Tensor, ...] | None  # per micro-batch (first and last stage)
    labels: tuple[torch.Tensor, ...] | None
    seeds: tuple[torch.Tensor, ...] | None  # per-sample dropout seeds, per micro-batch
    act_shape: tuple[int, int, int]  # a received activation's shape
    inflight: Inflight  # sends and receives posted and not seen complete
    # By (chunk, micro-batch): received (or handed over, or token) inputs, outputs, received output gradients
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    grad_out: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    losses: list[torch.Tensor] = field(default_factory=list)  # the stage with the head only
    # Forwards that replayed a CUDA graph, and the graph their backward replays.
    graphed: dict[tuple[int, int], MicroBatchGraph] = field(default_factory=dict)
    awaiting_weights: dict[tuple[int, int], MicroBatchGraph] = field(default_factory=dict)  # graphed I, W to come
    graphed_count: int = 0
    backwards: int = 0  # backwards issued: a chunk's graphs are captured before the step's first
    marks: list[tuple[object, object]] = field(default_factory=list)  # (start, end) per unit issued
    issued: list[float] = field(default_factory=list)  # wall clock when the host began each unit
    released: int = 0
    peak_live: int = 0
    last_backward: object | None = None  # the end mark of its last backward
    # (start, end) of the unit just issued when it ran on a stream of its own (`MicroBatchStreams`).
    unit_marks: tuple[object, object] | None = None
    data_wait_s: float = 0.0  # what reading its batch held the step up (none when prefetched in time)

    def release(self) -> None:
        """Drop the step's tensors (the device frees them once its queued work is done)."""
        self.inputs.clear(), self.outputs.clear(), self.grad_out.clear()


@dataclass
class _Unfinished:
    """A step reported before its device finished it: what `report_tail` waits for."""
    marks: list[tuple[object, object]]  # its units the device had not passed
    units: list[Unit]  # those units
    anchor: object  # the clock's anchor when it reported: one step's times come from one anchor
    readback: "ReadBack"
    last_backward: object | None


class ReadBack:
    """The values a step report reads from the device, copied to host without a wait; `values`
    waits for nothing: the caller waits for `mark` first."""

    def __init__(self, losses: torch.Tensor | None, grad_norm: torch.Tensor | None,
                 routed: dict[str, torch.Tensor], dropped: list[torch.Tensor], clock: StepClock):
        # Copies even on CPU: the MoE counters are zeroed in place by the next step.
        host = lambda t: t.detach().to("cpu", non_blocking=True, copy=True)  # noqa: E731 - pinned on CUDA
        self._losses = host(losses) if losses is not None else None
        self._norm = host(grad_norm) if grad_norm is not None else None
        self._routed = {layer: host(t) for layer, t in routed.items()}
        self._dropped = [host(t) for t in dropped]
        self.mark = clock.mark()  # passed once the copies are done

    def values(self) -> tuple[list[float], float | None, dict[str, list[int]], int]:
        """(losses, gradient norm, tokens routed per expert by layer, tokens dropped)."""
        return (self._losses.tolist() if self._losses is not None else [],
                float(self._norm) if self._norm is not None else None,
                {layer: t.tolist() for layer, t in self._routed.items()},
                sum(int(t) for t in self._dropped))


def _releasable(t: torch.Tensor) -> bool:
    # Freeing the data is safe only if nothing reads it in backward: not a view of a
    # larger buffer, and not the saved result of the op that produced it (exp, tanh, ...).
    # A graph replay's output is a copy outside any autograd graph.
    return t._base is None and (t.grad_fn is None or not hasattr(t.grad_fn, "_saved_result"))


class StageRuntime:
    def __init__(self, cfg: Config, grid: Grid, rank: int, groups: StageGroups,
                 device: torch.device, dataset: TokenDataset | None, init_weights: bool = True,
                 snapshot_buffers: dict[str, torch.Tensor] | None = None):
        """`init_weights=False`: every parameter comes from a checkpoint loaded next (`load_checkpoint`).
        `snapshot_buffers`: this process's earlier stage's host buffers (`StateSnapshot.release`)."""
        self.cfg = cfg
        self.grid = grid
        self.rank = rank
        self.coord = grid.coord(rank)
        self.stage = self.coord.pp
        self.is_first = self.stage == 0
        self.is_last = self.stage == grid.pp - 1
        # Where the model's chunks sit (one per stage but for interleaved schedules).
        self.layout = run_layout(cfg.parallel.schedule, grid.pp, cfg.parallel.chunks)
        self.groups = groups
        self.device = device
        self.dataset = dataset
        self._prefetch = (Prefetcher(dataset.get, pin=device.type == "cuda")
                          if dataset is not None and self.layout.holds_data(self.stage) else None)
        self.timeout = timedelta(seconds=cfg.runtime.collective_timeout_s)
        t0 = time.perf_counter()

        tp = None
        if grid.tp > 1:
            tp = TensorParallel(self.coord.tp, grid.tp, sequence=cfg.parallel.sequence_parallel)
            tp.group, tp.backward_group = groups.tp, groups.tp_backward
        self.model = build_stage(cfg.model, self.stage, grid.pp, cfg.parallel.layers_per_stage,
                                 seed=cfg.train.seed, device=device, ep_rank=self.coord.ep, ep_size=grid.ep,
                                 init=init_weights, layout=self.layout, tp=tp,
                                 expert_placement=cfg.parallel.expert_placement)
        # By parameter name, this worker's tp slices; the parameters every tp rank holds whole
        # (norms) are counted once in the gradient norm.
        self._tp_sliced = tp_slices(self.model) if tp else {}
        self._tp_whole = {name for name, _ in self.model.named_parameters() if name not in self._tp_sliced} if tp else set()
        self.moe_layers = {name.split(".")[1]: m for name, m in self.model.named_modules() if isinstance(m, MoE)}
        for moe in self.moe_layers.values():
            moe.ep_group = groups.ep
            moe.padded_alltoall = cfg.runtime.moe_alltoall == "padded"
            moe.chunks = cfg.runtime.moe_chunks
            moe.ep_group_backward = groups.ep_backward
        if cfg.model.init_from and init_weights:
            from raypar.hf import load_hf_weights

            names = [n for n, _ in unstacked(self.model)]  # this stage's and ep rank's share
            # Whole tensors from the folder; a tp worker keeps its slices.
            load_unstacked(self.model, slice_whole(load_hf_weights(cfg.model.init_from, cfg.model, names=names),
                                                   self._tp_sliced))
        self.model.train()
        self.recompute = cfg.runtime.recompute
        self.model.recompute = self.recompute == "block"
        self.model.on_block_input = lambda t: self.tracker.hold(self._mb, t)
        if cfg.parallel.shard_optimizer:
            self.optimizer = ShardedOptimizer(self.model, cfg.train,
                                              {"dense": groups.dense_grad, "expert": groups.expert_grad},
                                              bucket_numel=int(cfg.parallel.grad_bucket_mb * 2**20) // 4,
                                              overlap=cfg.parallel.overlap_grad_reduce,
                                              timeout=self.timeout,
                                              fuse_grad_accumulation=cfg.runtime.grad_accumulation_fusion)
        else:
            self.optimizer = MasterOptimizer(self.model, cfg.train,
                                             fuse_grad_accumulation=cfg.runtime.grad_accumulation_fusion)
        self._optimizer_bytes = self.optimizer.state_bytes()  # fixed for the stage's life
        if cfg.checkpoint.ema_decay > 0:
            # From the initial weights; a checkpoint load replaces it.
            self.optimizer.enable_ema(on_host=cfg.checkpoint.ema_on_host)
        self.tracker = ActivationTracker(list(self.model.parameters()))
        self.act_dtype = next(self.model.parameters()).dtype
        self.clock = StepClock(device)
        self.snapshot = StateSnapshot(snapshot_buffers)
        self.recent: RecentStates | None = None  # the worker's (`keep_recent`), kept across re-plans
        c = cfg.checkpoint
        if device.type == "cuda" and takes_snapshots(cfg):
            # Pinned buffers for the first save, allocated while the first steps run.
            self.snapshot.reserve(state_layout(self.optimizer, self.coord, save_optimizer=c.save_optimizer,
                                               save_master=c.save_master))
        self._mb: tuple[int, int] = (0, -1)  # (chunk, micro-batch) of the forward running
        # This program's captured micro-batch (runtime.cuda_graphs): a graph set per
        # micro-batch the program holds live, or two that alternate when micro-batches
        # overlap (runtime.moe_microbatch_overlap).
        self._graphs: dict[int, list[MicroBatchGraph]] = {}  # by model chunk
        self._streams: MicroBatchStreams | None = None
        # The last step's units the device had not finished when it reported: (step, marks,
        # the clock's anchor then, so one step's times all come from one anchor).
        self._late: tuple[int, list[tuple[object, object]], object] | None = None
        # Steps a first stage reported ahead of its device, until `report_tail` (another thread).
        self._unfinished: dict[int, _Unfinished] = {}
        self._step_end = None  # the end mark of the last step this stage issued
        self.set_program([])
        t1 = time.perf_counter()
        connect_channels(groups.channels, self.stage, groups.line, device, self.timeout)
        check_world(device, self.timeout)  # also connects the world's communicator before any step
        # Building the stage and optimizer; connecting (waiting for the peers to get here too).
        self.setup_s = {"build": t1 - t0, "connect": time.perf_counter() - t1}

    def _has_backward_groups(self) -> bool:
        """Whether backward has a communicator of its own for each collective the stage runs
        (MoE all-to-alls at ep > 1, tp collectives at tp > 1): what micro-batch overlap needs."""
        return ((not self.moe_layers or self.grid.ep == 1 or self.groups.ep_backward is not None)
                and (self.grid.tp == 1 or self.groups.tp_backward is not None))

    def _say_one_after_another(self) -> None:
        switches = " / ".join(f"runtime.{s}" for s in overlap_switches(self.cfg, self.grid, bool(self.moe_layers)))
        print(f"stage {self.stage} rank {self.rank}: micro-batches replay one after another, not beside each other "
              f"({switches}): {self.overlap_blocked}", file=sys.stderr, flush=True)

    # -- one step --------------------------------------------------------------------

    def set_program(self, program: list[Action]) -> None:
        """The program every step runs until the next call (sent once per plan, not per step)."""
        chunks = {a.chunk for a in program if a.op == Op.F}
        if program and chunks != set(range(self.layout.n_chunks)):
            raise ValueError(f"stage {self.stage}: the program runs forwards on chunk(s) {sorted(chunks)}, but this "
                             f"stage holds {self.layout.n_chunks} chunk(s) (parallel.schedule="
                             f"{self.cfg.parallel.schedule}): build it for this layout "
                             f"(raypar.schedule.build_programs with the run's chunks)")
        self.program = list(program)
        self._late = None  # labelled by the old program's units
        self._units = comm_groups(self.program)  # what runs
        self._program_units = program_units(self.program)  # what a unit's times are of
        self._n_mb = len({a.mb for a in self.program if a.op == Op.F})
        self._graphs = {}
        # Graph sets each model chunk needs when its micro-batches replay one after another
        # (None: out of order).
        self._graph_sets = {c: live_microbatches(self.program, c) for c in chunks}
        # None, or why this program's micro-batches run eagerly rather than as CUDA graphs.
        self.graphs_blocked = graphs_blocked(self.cfg, self.grid, self.program, self.device)
        # None, or why its graphed micro-batches run one after another rather than overlapped.
        self.overlap_blocked = self.graphs_blocked or overlap_blocked(
            self.cfg, self.grid, bool(self.moe_layers), self.program, self._has_backward_groups())
        if self.overlap_blocked is None:
            if self._streams is None:
                self._streams = MicroBatchStreams()
                few = few_hardware_queues(os.environ)
                if few:
                    print(f"stage {self.stage} rank {self.rank}: micro-batches replay beside each other, but {few}",
                          file=sys.stderr, flush=True)
        else:
            self._join()
            self._streams = None
            if (program and self.graphs_blocked is None and self.grid.pp == 1
                    and overlap_wanted(self.cfg, self.grid, bool(self.moe_layers))):
                self._say_one_after_another()
        # I and W need the linear layers to leave their weight gradients for later; so does
        # a whole backward that computes them while its MoE exchanges travel.
        splits = self._splits = any(a.op in (Op.I, Op.W) for a in self.program)
        self._overlaps_exchanges = not splits and (
            (self.cfg.runtime.moe_backward_overlap and self.grid.ep > 1 and bool(self.moe_layers)
             and self.cfg.runtime.moe_alltoall == "padded")
            or (self.cfg.runtime.tp_backward_overlap and self.grid.tp > 1))
        set_split_backward(self.model, splits or self._overlaps_exchanges)
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.program_changed()
        self._ahead: _StepState | None = None
        # Only a forward that talks to no peer may be issued ahead of its call: the first
        # stage's first one, without MoE layers (whose all-to-alls need their group's peers).
        self._runs_ahead = (self.cfg.runtime.forward_ahead and self.is_first and not self.moe_layers
                            and bool(self._units) and self._units[0][0].op == Op.F)
        # The first stage of a pipeline ends the backward, so a report that waits for its device
        # leaves it only the optimizer's few milliseconds of queued work. It reports at once
        # instead, and the driver fetches the rest (`report_tail`) while it issues the next step.
        self._reports_ahead = self.cfg.runtime.forward_ahead and self.is_first and not self.is_last
        self._unfinished.clear()

    def prefetch(self, sample_ids: list[int]) -> None:
        """Start reading a step's batch now (a stage that reads data, with `data.prefetch`):
        the step that takes it finds it read, or waits only for the rest."""
        if self._prefetch is not None and self.cfg.data.prefetch:
            self._prefetch.start(sample_ids)

    def run_step(self, step: int, sample_ids: list[int], capture_grads: bool = False,
                 next_sample_ids: list[int] | None = None) -> StepReport:
        """Issue one step's program and report it once the device has passed what the report
        reads and this stage's last backward. A first stage that runs ahead
        (`runtime.forward_ahead`) reports at once instead (`report_tail` brings the rest)
        and, with `next_sample_ids` (the next step's batch), first issues the next step's
        first forward: that forward runs right after this step's optimizer, however late
        the next call comes."""
        t_start = time.time()
        state = self._take_ahead(step, sample_ids) or self._begin(step, sample_ids)
        if next_sample_ids is not None and self._prefetch is not None and self.cfg.data.prefetch:
            self._prefetch.start(next_sample_ids)
        grad_norm, lr, grads = None, 0.0, None
        readback = None
        previous, self._late = self._late, None
        stall = 0.0
        where = f"stage {self.stage}: step {step}"
        for unit in self._units[len(state.marks):]:
            head = unit[0]
            host_wait.check(where)  # a recovery cancelled the step: stop issuing its work
            state.inflight.poll()
            # A compute's wait for its input is idle time, not the compute's: before its mark.
            self._await_input(state, head)
            if head.op not in (Op.F, Op.B):
                self._join()
            state.issued.append(time.time())
            begin = self.clock.mark()
            if head.op == Op.REDUCE_GRAD:
                state.inflight.finish(f"{where}: sends before the gradient reduction")
                self._move_expert_biases()
                if not self.is_first:
                    # The first stage ends the backward, so it reports the norm; the others
                    # report once their own backward is done and issue the next step while
                    # the norm's all-reduce waits for the first stage.
                    readback = self._read_back(state.losses, None)
                grad_norm, grads = self._reduce_grads(capture_grads)
            elif head.op == Op.STEP:
                readback = readback or self._read_back(state.losses, grad_norm)  # before the optimizer writes
                # The last snapshot's copies must be done before the optimizer writes: the
                # device waits for them, the host goes on queueing.
                stall += self.snapshot.fence()
                if self.recent is not None:
                    stall += self.recent.fence()
                lr = self.optimizer.step(step, grad_norm)
                c = self.cfg.checkpoint
                if c.ema_decay > 0 and (step + 1) % c.ema_every == 0:
                    stall += self.optimizer.update_ema(c.ema_decay)
            else:
                self._issue(state, unit)
            self._end_unit(state, head, begin)

        self._join()
        readback = readback or self._read_back(state.losses, grad_norm)
        # What the report measured on the host, before the next step's first unit resets it.
        peak_act = self.tracker.peak_bytes
        peak_device = torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0
        a2a = sum(m.stats.alltoall_bytes for m in self.moe_layers.values())
        a2a_s = sum(m.stats.alltoall_s for m in self.moe_layers.values())
        buckets, early = (self.optimizer.bucket_counts() if isinstance(self.optimizer, ShardedOptimizer)
                          else (0, 0))
        self.tracker.clear()
        state.release()
        if next_sample_ids is not None and self._runs_ahead:
            self._run_ahead(step + 1, next_sample_ids)
        marks = state.marks
        if self._reports_ahead:
            # At most one step ahead of its device, as a plain training loop.
            if self._step_end is not None:
                self.clock.wait(self._step_end, f"{where}: the step before")
            self._step_end = marks[-1][1] if marks else None
        else:
            # The report waits for what it reads, not for the optimizer: the next step is
            # issued while the optimizer's kernels still run.
            self.clock.wait(readback.mark, f"{where}: report")
        n_done = next((i for i, (_, e) in enumerate(marks) if not self.clock.passed(e)), len(marks))
        # Incomplete only while the device is behind: on CPU the step ran as it was issued.
        unfinished = self._reports_ahead and not (n_done == len(marks) and self.clock.passed(readback.mark))
        if unfinished:
            self._unfinished[step] = _Unfinished(marks[n_done:], self._program_units[n_done:], self.clock.anchor,
                                                 readback, state.last_backward)
        elif n_done < len(marks):
            self._late = (step, marks[n_done:], self.clock.anchor)
        times = self._seconds(marks[:n_done])
        late_step, late_times = None, []
        if previous is not None:
            late_step, late_marks, late_anchor = previous
            late_times = self._seconds(late_marks, late_anchor)
        compute = compute_seconds(times, self._program_units[:n_done])
        if unfinished:
            loss_values, norm, expert_tokens, dropped = [], None, {}, 0
            end_of_backward = t_start  # until its tail comes
        else:
            loss_values, norm, expert_tokens, dropped = readback.values()
            end_of_backward = self.clock.seconds(state.last_backward) if state.last_backward is not None else t_start
        reported = time.time()
        return StepReport(
            rank=self.rank, stage=self.stage, step=step, losses=loss_values, times=times,
            compute_s=compute,
            start=times[0] if times else t_start,
            end_of_backward=end_of_backward,
            wall_s=reported - t_start, called=t_start, reported=reported,
            peak_activation_bytes=peak_act, peak_device_bytes=peak_device,
            peak_live_microbatches=state.peak_live, released_outputs=state.released,
            expert_tokens=expert_tokens, tokens_dropped=dropped, alltoall_bytes=a2a, alltoall_s=a2a_s,
            grad_norm=norm, lr=lr, checkpoint_stall_s=stall, data_wait_s=state.data_wait_s,
            data_window_bytes=self.dataset.window.bytes if self._prefetch is not None else 0,
            optimizer_bytes=self._optimizer_bytes,
            buckets=buckets, buckets_early=early, microbatches=self._n_mb,
            # Each micro-batch's forward runs once per chunk this stage holds.
            graphed_microbatches=state.graphed_count // self.layout.n_chunks,
            overlapped_microbatches=state.graphed_count if self._streams is not None else 0,
            grads=grads, complete=not unfinished,
            pending_units=len(marks) - n_done, late_step=late_step, late_times=late_times, issued=state.issued,
        )

    def _begin(self, step: int, sample_ids: list[int]) -> "_StepState":
        """Load a step's batch and reset what a step measures."""
        n_mb = self._n_mb
        if n_mb == 0:
            raise ValueError(f"stage {self.stage}: no program to run (set_program was not called)")
        if len(sample_ids) % n_mb:
            raise ValueError(f"stage {self.stage}: {len(sample_ids)} samples do not split into {n_mb} micro-batches")
        tokens, labels, data_wait = self._load(sample_ids, n_mb)
        drop_weight_grads()  # a cancelled step's (nothing else is pending between steps)
        # Per-sample dropout seeds: the masks follow the sample, not the micro-batch or grid.
        seeds = (sample_seeds(self.cfg.train.seed, step, sample_ids, self.device).chunk(n_mb)
                 if self.cfg.model.dropout > 0 else None)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.tracker.clear()
        self.tracker.reset_peak()
        for moe in self.moe_layers.values():
            moe.stats.reset()
            # The step loss is the mean of the micro-batch losses: aux losses scale alike.
            moe.aux_scale = 1.0 / n_mb
        self.clock.start()
        # Shapes follow the step's program, so one worker group can run any schedule and count.
        # Sequence parallelism: stages send each tp worker's slice of the sequence.
        seq = self.cfg.data.seq_len // (self.grid.tp if self.cfg.parallel.sequence_parallel else 1)
        act_shape = (len(sample_ids) // n_mb, seq, self.cfg.model.dim)
        return _StepState(step, list(sample_ids), tokens, labels, seeds, act_shape,
                          Inflight(self.groups.channels, self.stage, self.groups.line, self.timeout),
                          data_wait_s=data_wait)

    def _issue(self, state: "_StepState", unit: tuple[Action, ...]) -> None:
        """Issue one unit that moves a step's tensors: an exchange, a forward, a backward or a release."""
        head = unit[0]
        if head.is_comm:
            self._exchange(state, unit)
        elif head.op == Op.F:
            state.outputs[head.key] = self._forward(state, head)
        elif head.op in (Op.B, Op.I):
            if head.op == Op.I:
                with weight_grads_deferred(head.key):
                    self._backward(state, head)
                self.tracker.hold_for_weights(head.key, pending_tensors(head.key))
            else:
                self._backward(state, head)
            if self.cfg.runtime.release:
                self._after_backward(state, head)
        elif head.op == Op.W:
            graph = state.awaiting_weights.pop(head.key, None)
            if graph is not None:
                graph.weights()
            else:
                compute_weight_grads(head.key)
            self.tracker.weights_done(head.key)
        elif head.op == Op.RELEASE_OUT:
            out = state.outputs[head.key]
            state.inflight.after_send(Op.SEND_F, head.key, lambda: self._release_output(state, out))
        elif head.op == Op.RELEASE_IN:
            state.inflight.after_send(Op.SEND_B, head.key,
                                      lambda key=head.key: self._forget(key, state.inputs, state.outputs))
        else:
            raise ValueError(f"stage {self.stage}: cannot execute {head}")

    def _release_output(self, state: "_StepState", out: torch.Tensor) -> None:
        """Free the data of a stage output once it is sent (its backward does not read it).
        On gloo a send is seen done only when waited for: at the bound on sends under way
        or before the reduction, maybe after the output's backward."""
        if _releasable(out):
            out.untyped_storage().resize_(0)
            state.released += 1

    def _await_input(self, state: "_StepState", head: Action) -> None:
        if head.op == Op.F:
            state.inflight.received(Op.RECV_F, head.key, f"stage {self.stage}: activation for {head}")
        elif head.op in (Op.B, Op.I):
            state.inflight.received(Op.RECV_B, head.key, f"stage {self.stage}: gradient for {head}")

    def _end_unit(self, state: "_StepState", head: Action, begin) -> None:
        end = self.clock.mark()
        if state.unit_marks is not None:  # it ran on a stream of its own: its marks are there
            (begin, end), state.unit_marks = state.unit_marks, None
        state.marks.append((begin, end))
        if head.op.is_backward:
            state.last_backward = end
        if head.op in (Op.F, Op.I) or head.is_comm:
            # Only a forward, a receive or an I (its output gradients wait for W) adds
            # activations: the peak follows one of them.
            self.tracker.sample()
            state.peak_live = max(state.peak_live, self.tracker.live_microbatches())

    def _run_ahead(self, step: int, sample_ids: list[int]) -> None:
        """Issue step `step`'s first unit (a forward, which talks to no peer) now; the call
        for that step goes on from there (`_take_ahead`)."""
        state = self._begin(step, sample_ids)
        head = self._units[0][0]
        host_wait.check(f"stage {self.stage}: step {step}")
        state.issued.append(time.time())
        begin = self.clock.mark()
        self._issue(state, self._units[0])
        self._end_unit(state, head, begin)
        self._ahead = state

    def _take_ahead(self, step: int, sample_ids: list[int]) -> "_StepState | None":
        """The step issued ahead, if it is this one; one issued for another batch is dropped."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.step == step and ahead.sample_ids == list(sample_ids):
            return ahead
        return None

    def _drop_ahead(self) -> None:
        """Forget a step issued ahead, and the captured graph: the weights or the program
        change before the next step runs."""
        self._ahead = None
        self._graphs = {}

    def report_tail(self, step: int) -> ReportTail:
        """Wait for the device to pass step `step`, reported ahead of it (`StepReport.complete`),
        and return what its report lacked. Runs beside the next step's `run_step`."""
        unfinished = self._unfinished.pop(step, None)
        if unfinished is None:
            raise ValueError(f"stage {self.stage}: no report of step {step} waits for its device "
                             f"(steps waiting: {sorted(self._unfinished)})")
        where = f"stage {self.stage}: step {step}'s report"
        self.clock.wait(unfinished.readback.mark, where)
        if unfinished.marks:
            self.clock.wait(unfinished.marks[-1][1], where)
        times = self._seconds(unfinished.marks, unfinished.anchor)
        compute = compute_seconds(times, unfinished.units)
        last_backward = unfinished.last_backward
        losses, norm, expert_tokens, dropped = unfinished.readback.values()
        return ReportTail(step, times, compute,
                          self.clock.seconds(last_backward, unfinished.anchor) if last_backward is not None else None,
                          losses, norm, expert_tokens, dropped)

    def late_units(self) -> tuple[int | None, list[float]]:
        """Wait for the units the last report did not have: (their step, their times), as a
        report's `late_step` and `late_times`; (None, []) when there are none."""
        if self._late is None:
            return None, []
        (step, marks, anchor), self._late = self._late, None
        self.clock.wait(marks[-1][1], f"stage {self.stage}: step {step}'s last units")
        return step, self._seconds(marks, anchor)

    def _seconds(self, marks: list[tuple[object, object]], anchor=None) -> list[float]:
        return [t for b, e in marks for t in (self.clock.seconds(b, anchor), self.clock.seconds(e, anchor))]

    def _read_back(self, losses: list[torch.Tensor], grad_norm: torch.Tensor | None) -> "ReadBack":
        """Start copying what the report needs to host, before the optimizer is issued."""
        # The tp workers of a cell route the same tokens: one of them counts them.
        moe = {layer: m.stats for layer, m in self.moe_layers.items()} if self.coord.tp == 0 else {}
        return ReadBack(
            losses=torch.stack(losses).float() if losses else None, grad_norm=grad_norm,
            routed={layer: s.routed for layer, s in moe.items() if s.routed is not None},
            dropped=[s.dropped for s in moe.values() if s.dropped is not None], clock=self.clock)

    def _move_expert_biases(self) -> None:
        """model.moe_bias_update_rate: move each MoE layer's routing biases by the rows its
        experts received in this step over every replica of the stage (dp x ep; the tp
        workers of a cell route the same tokens), on the device, before the next step routes."""
        layers = [m for m in self.moe_layers.values() if m.bias_rate > 0 and m.stats.routed is not None]
        if not layers:
            return
        counts = torch.stack([m.stats.routed for m in layers])
        all_reduce_([counts], self.groups.dense_grad, self.timeout)
        biases = torch.stack([m.expert_bias for m in layers])
        update_expert_bias(biases, counts, layers[0].bias_rate)
        for m, bias in zip(layers, biases):
            m.expert_bias.copy_(bias)

    def set_expert_biases(self, biases: dict[str, list[float]]) -> None:
        """Put the routing biases of this stage's MoE layers (by layer id) to `biases`, as the
        driver kept them for the step about to run; a layer not named goes back to zero."""
        for layer, m in self.moe_layers.items():
            values = biases.get(layer)
            if values is not None and len(values) != m.n_experts:
                raise ValueError(f"layer {layer}: {len(values)} expert biases for {m.n_experts} experts")
            m.expert_bias.copy_(torch.tensor(values if values is not None else [0.0] * m.n_experts,
                                             dtype=torch.float64))

    # -- actions -----------------------------------------------------------------------

    def close(self) -> None:
        """Stop what runs beside the steps (the data prefetch's thread) and drop the captured
        graphs. A graph that captured a collective holds its NCCL communicator: destroying
        the process groups while it lives hangs in ncclCommDestroy (pytorch#115388)."""
        if self._prefetch is not None:
            self._prefetch.close()
        # A graph still replaying is freed when its replay ends (cudaGraphExecDestroy); no
        # synchronize here, which would wait forever on a collective a lost peer left.
        self._ahead = None
        self._graphs = {}

    def _load(self, sample_ids: list[int], n_mb: int):
        """The step's batch on the device, in micro-batches, and the seconds the host waited for it."""
        if self._prefetch is None:
            return None, None, 0.0
        (x, y), waited = self._prefetch.take(sample_ids)
        x = x.to(self.device, non_blocking=True).chunk(n_mb)
        y = y.to(self.device, non_blocking=True).chunk(n_mb)
        return x, y, waited

    def _forward(self, state: "_StepState", action: Action) -> torch.Tensor:
        mb, chunk, key = action.mb, action.chunk, action.key
        self._mb = key
        source = self.layout.prev(self.stage, chunk)
        if source is None:
            x = state.tokens[mb]
            state.inputs[key] = x
        elif source[0] == self.stage:
            # Handed over from this stage's chunk before it: detached, so each chunk's
            # backward is its own unit; the earlier chunk's backward reads this input's gradient.
            x = state.outputs[source[1], mb].detach().requires_grad_(True)
            state.inputs[key] = x
        else:
            x = state.inputs[key]
        has_loss = self.layout.next(self.stage, chunk) is None
        target = state.labels[mb] if has_loss else None
        seeds = state.seeds[mb] if state.seeds is not None else None
        graph = self._graph_for(state, (x, target, seeds), action, has_loss)
        if graph is not None:
            self._weights_gathered()  # what the forward pre-hooks do eagerly
            with self._replaying(state, "F", mb):
                out = graph.forward((x, target, seeds))
            if self._streams is not None:
                out.record_stream(torch.cuda.current_stream())  # the step's loss is read here
            if has_loss:
                state.losses.append(out)
            state.graphed[key] = graph
            state.graphed_count += 1
            self.tracker.hold_graphed(key, graph.saved_bytes)
            return out
        self._join()
        with self.tracker.recording(key):
            if self.recompute == "stage":
                self.tracker.hold(key, x)
                out = checkpoint(self.model, x, target, seeds, chunk, use_reentrant=False)
            else:
                out = self.model(x, target, seeds, chunk)
        if has_loss:
            state.losses.append(out.detach())
            # The step's loss is the mean over micro-batches: scale each one's gradient.
            out = out / self._n_mb
        self.tracker.hold(key, out)
        return out

    def _graph_for(self, state: "_StepState", inputs, action: Action, has_loss: bool = True) -> MicroBatchGraph | None:
        """The CUDA graph the forward and backward of `action`'s micro-batch and chunk replay,
        captured first if need be; None to run them eagerly. Micro-batch `mb` replays its
        chunk's graph set `mb mod sets`: a set's activations stay until its micro-batch's
        backward, while later ones' run."""
        if self.graphs_blocked is not None:
            return None
        mb, chunk = action.mb, action.chunk
        sharded = isinstance(self.optimizer, ShardedOptimizer)
        if sharded and self.optimizer.overlaps_reduction() and mb == self._n_mb - 1:
            return None  # eager: its backward queues each bucket's reduction once the bucket is full
        key = graph_key(inputs, self._n_mb)
        sets = MicroBatchStreams.SETS if self._streams is not None else self._graph_sets[chunk]
        graphs = self._graphs.get(chunk, [])
        if len(graphs) == sets and graphs[0].key == key:
            return graphs[mb % sets]
        if mb != 0 or state.backwards:
            # Capture at the chunk's first forward of a step, before any backward: the
            # warm-up's gradients are zeroed after it.
            return None
        self._graphs.pop(chunk, None)  # their memory pools go before the next ones are made
        self._weights_gathered()
        graphs = []
        try:
            with self.optimizer.reductions_paused() if sharded else nullcontext():
                undo = self._undo_warm_up()
                for _ in range(sets):
                    graphs.append(MicroBatchGraph(self.model, inputs, self._n_mb, reset=undo,
                                                  counters=[m.stats for m in self.moe_layers.values()],
                                                  backward=self._whole_backward, has_loss=has_loss, chunk=chunk,
                                                  split=self._splits))
        except GraphCaptureError as e:
            if not graphs or self._streams is None:
                # Every rank runs the same ops, so every rank fails here and goes on eagerly.
                # (A pipeline stage's micro-batches need every set: each holds one live.)
                self._graphs, self._streams = {}, None
                self.graphs_blocked = self.overlap_blocked = f"capture failed: {e}"
                print(f"stage {self.stage} rank {self.rank}: CUDA graphs off for this program, {self.graphs_blocked}",
                      file=sys.stderr, flush=True)
                return None
            # The first set captured, so what failed is most likely the room for a second
            # micro-batch's activations: keep the graphs, one micro-batch after another. The
            # communicators stay as they are, so ranks that still overlap meet this one.
            graphs, self._streams = graphs[:1], None
            self.overlap_blocked = f"the second graph set failed to capture: {e}"
            self._say_one_after_another()
        self._graphs[chunk] = graphs
        return graphs[mb % len(graphs)]

    @contextmanager
    def _replaying(self, state: "_StepState", direction: str, mb: int) -> Iterator[None]:
        """Replay a graph on its micro-batch's stream when micro-batches overlap, timed there."""
        if self._streams is None:
            yield
            return
        with self._streams.on(direction, mb):
            begin = self.clock.mark()
            yield
            state.unit_marks = (begin, self.clock.mark())

    def _join(self) -> None:
        """Eager work (the reduction, the optimizer, an eager micro-batch) comes after every
        overlapped micro-batch's."""
        if self._streams is not None:
            self._streams.join()

    def _undo_warm_up(self) -> Callable[[], None]:
        """What undoes a graph's eager warm-up: the gradients it accumulated (the step has none
        yet) and what it added to the MoE counters (those of this step's earlier forwards stay)."""
        kept = [(m.stats, m.stats.saved()) for m in self.moe_layers.values()]

        def undo() -> None:
            self.optimizer.zero_grad()
            for stats, saved in kept:
                stats.restore(saved)
        return undo

    def _backward(self, state: "_StepState", action: Action) -> None:
        key = action.key
        state.backwards += 1
        target = self.layout.next(self.stage, action.chunk)
        if target is None:
            grad = None
        elif target[0] == self.stage:  # the next chunk is this stage's: its input's gradient
            grad = state.inputs[target[1], action.mb].grad
        else:
            grad = state.grad_out[key]
        graph = state.graphed.pop(key, None)
        if graph is not None:
            with self._replaying(state, "B", action.mb):
                input_grad = graph.backward(grad)
                if graph.split and action.op == Op.B:
                    graph.weights()
            if input_grad is not None:
                # What SEND_B sends, or the chunk before on this stage reads, as after an eager backward.
                state.inputs[key].grad = input_grad
            self.tracker.backward_done(key)
            if action.op == Op.I:
                state.awaiting_weights[key] = graph
                self.tracker.hold_graphed(key, graph.held_bytes)
            return
        self._join()
        out = state.outputs[key]
        if action.op == Op.B:
            self._whole_backward(out, grad)
        else:
            backward_from(out, grad)
        self.tracker.backward_done(key)

    def _whole_backward(self, out: torch.Tensor, grad: torch.Tensor | None) -> None:
        """B: with MoE or tp exchanges to overlap, each layer's weight gradients run while
        the next exchange travels (`runtime.moe_backward_overlap`, `runtime.tp_backward_overlap`),
        the last ones after backward."""
        if not self._overlaps_exchanges:
            backward_from(out, grad)
            return
        with weight_grads_deferred(_OVERLAPPED, overlap=True):
            backward_from(out, grad)
        compute_weight_grads(_OVERLAPPED)

    def _after_backward(self, state: "_StepState", action: Action) -> None:
        """Drop what a backward (B or I) was the last to read: the received output gradient;
        the tokens (a first chunk's input, which no send reads); and the hand-over from this
        stage's next chunk (its input, whose gradient this backward read, and its output)."""
        key = action.key
        state.grad_out.pop(key, None)
        if self.layout.prev(self.stage, action.chunk) is None:
            self._forget(key, state.inputs, state.outputs)
        target = self.layout.next(self.stage, action.chunk)
        if target is not None and target[0] == self.stage:
            self._forget((target[1], action.mb), state.inputs, state.outputs)

    def _exchange(self, state: "_StepState", unit: tuple[Action, ...]) -> None:
        """Post a unit's sends and receives; the computes that read what arrives wait for it."""
        inputs, outputs, grad_out = state.inputs, state.outputs, state.grad_out
        for a in unit:
            if a.op == Op.SEND_F:
                state.inflight.post(a, outputs[a.key])
            elif a.op == Op.SEND_B:
                state.inflight.post(a, inputs[a.key].grad)
            elif a.op == Op.RECV_F:
                buf = torch.empty(state.act_shape, dtype=self.act_dtype, device=self.device)
                inputs[a.key] = buf
                state.inflight.post(a, buf)
                buf.requires_grad_(True)
                self.tracker.hold(a.key, buf)
            elif a.op == Op.RECV_B:
                out = outputs[a.key]
                buf = torch.empty(out.shape, dtype=out.dtype, device=self.device)
                grad_out[a.key] = buf
                state.inflight.post(a, buf)
                self.tracker.hold(a.key, buf)

    def _forget(self, key: tuple[int, int], inputs, outputs) -> None:
        inputs.pop(key, None)
        outputs.pop(key, None)
        self.tracker.drop(key)

    def _reduce_grads(self, capture: bool):
        if isinstance(self.optimizer, ShardedOptimizer):
            # Each rank's share is a distinct part of the gradients: their squares sum to
            # the global norm's over the whole world.
            sq = self.optimizer.reduce_gradients(self.grid.data_parallel_size, self.groups.tp, self.grid.tp,
                                                 self.cfg.parallel.sequence_parallel).to(self.device)
            all_reduce_([sq], dist.group.WORLD if dist.get_world_size() > 1 else None, self.timeout)
        else:
            sq = self._all_reduce_grads()
        captured = None
        if capture:
            captured = {n: g.detach().float().cpu().clone() for n, g in self._whole(self.optimizer.named_grads()).items()}
        return sq.sqrt(), captured

    def _all_reduce_grads(self) -> torch.Tensor:
        """Every replica's whole gradients averaged in place; returns the squared norm."""
        dense, expert = self.optimizer.split_grads()
        # Each pipeline's loss is the mean over its own samples and the step's loss is the
        # mean over all dp x ep pipelines. Dense weights saw one pipeline's data: average
        # over dp x ep. An expert already summed the gradients of its ep group's pipelines
        # through the all-to-all: sum over dp, divide by dp x ep.
        all_reduce_(dense, self.groups.dense_grad, self.timeout, average=True)
        all_reduce_(expert, self.groups.expert_grad, self.timeout)
        if expert and self.grid.data_parallel_size > 1:
            torch._foreach_div_(expert, float(self.grid.data_parallel_size))
        if expert and self.cfg.parallel.sequence_parallel:
            # Each tp worker's experts saw the gradient of its slice of the MoE layer's output.
            all_reduce_(expert, self.groups.tp, self.timeout)
        # Dense gradients are equal on the ep ranks of a stage: count them once. So are those of
        # the parameters every tp rank holds whole (norms) on the tp ranks of a cell.
        if self._tp_whole:
            named = [(name, g) for (name, _), g in zip(self.optimizer.named_params, self.optimizer.grads())
                     if not is_expert_param(name)]
            whole = [g for name, g in named if name in self._tp_whole]
            sliced = [g for name, g in named if name not in self._tp_whole]
            if self.cfg.parallel.sequence_parallel:
                # Each tp worker saw its slice of the sequence: the norms' (and routers')
                # gradients are partial.
                all_reduce_(whole, self.groups.tp, self.timeout)
            dense_sq = self.optimizer.local_sq_norm(sliced) + self.optimizer.local_sq_norm(whole) / self.grid.tp
        else:
            dense_sq = self.optimizer.local_sq_norm(dense)
        # Experts are whole on every tp rank of a cell (split over ep only).
        sq = (dense_sq / self.grid.ep + self.optimizer.local_sq_norm(expert) / self.grid.tp).to(self.device)
        all_reduce_([sq], self.groups.replica, self.timeout)
        return sq

    # -- state ---------------------------------------------------------------------------

    def start_snapshot(self, step: int, save_optimizer: bool = True, save_master: bool = True) -> float:
        """Mark this worker's checkpoint share for copying to host memory; returns the stall.

        Every worker checks its peers over the world: GPU workers keep their processes
        after NCCL errors (GPU_ENV in actors/placement.py), so a collective the watchdog
        aborted may leave garbage without raising where it ran, and that must not be saved.
        The check is queued, not waited for: its sum is copied with the snapshot and read
        before the shard is written (`snapshot_for_writing`), so the host does not drain the
        device here. Then only the RNG states are taken; the copies are issued beside the
        next step (`StateSnapshot`), and its optimizer step waits for them.
        """
        t0 = time.perf_counter()
        self._weights_gathered()
        check = queue_world_check(self.device, self.timeout)

        emas = self.optimizer.ema_for_snapshot()

        def collect() -> dict[str, torch.Tensor]:
            tensors = state_tensors(self.model, self.optimizer, self.coord, self.rank, self.device,
                                    save_optimizer=save_optimizer, save_master=save_master, with_rng=False,
                                    emas=emas())
            return {**tensors, PEER_CHECK: check}

        self.snapshot.begin(step, collect, rng_states(self.rank, self.device), cuda=self.device.type == "cuda")
        return time.perf_counter() - t0

    def keep_recent(self, step: int, recent: RecentStates, send: Callable[[int], None] | None = None) -> float:
        """Copy all this worker holds after step `step` (its RNG too) into `recent`, beside the
        next step, whose optimizer waits for the copy on the device; `send` replicates it once
        whole (`RecentStates.begin`). The copy is valid once the driver has every worker's
        report of the step. Returns the stall."""
        t0 = time.perf_counter()
        self._weights_gathered()
        self.recent = recent
        emas = self.optimizer.ema_for_snapshot()

        def collect() -> dict[str, torch.Tensor]:
            return tp_named(state_tensors(self.model, self.optimizer, None, self.rank, self.device, with_rng=False,
                                          emas=emas()), self.optimizer.tp_slices)

        recent.begin(self.rank, step + 1, collect, rng_states(self.rank, self.device), self.device.type == "cuda",
                     send)
        return time.perf_counter() - t0

    def held_state(self) -> dict[str, torch.Tensor]:
        """All this worker holds (what `keep_recent` copies) and its RNG, as the live tensors:
        what a move to another cut keeps on the device (`raypar.runtime.state_move`)."""
        self.optimizer.settle_ema()
        tensors = state_tensors(self.model, self.optimizer, None, self.rank, self.device, with_rng=False)
        return {**tp_named(tensors, self.optimizer.tp_slices), **rng_states(self.rank, self.device)}

    def memory_layout(self):
        """Shape and dtype of what `keep_recent` copies (RNG states aside)."""
        return tp_named(state_layout(self.optimizer, None), self.optimizer.tp_slices)

    def state_bytes(self) -> int:
        """Bytes of all the state this worker holds (what `keep_recent` copies)."""
        return sum(shape.numel() * dtype.itemsize for shape, dtype in self.memory_layout().values())

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        return global_shapes(self.optimizer)

    def state_names(self) -> set[str]:
        """The tensors a load of this worker's state reads (and its RNG's)."""
        return names_to_load(self.optimizer) | set(rng_states(self.rank, self.device))

    def checkpoint_pieces(self, tensors: dict[str, torch.Tensor]):
        """A snapshot's tensors as `write_shard` pieces of the named tensors."""
        return checkpoint_pieces(self.optimizer, tensors)

    def snapshot_for_writing(self) -> dict[str, torch.Tensor]:
        """The last snapshot's tensors in host memory, once copied and its peer check passed."""
        tensors = dict(self.snapshot.host_tensors())
        check = tensors.pop(PEER_CHECK, None)
        why = None if check is None else world_check_failed(check)
        if why is not None:
            raise CollectiveTimeout(f"step {self.snapshot.step}'s snapshot is not saved: {why}")
        return tensors

    def load_checkpoint(self, read, names: set[str], same_grid: bool, read_flat=None,
                        own_slices: dict[str, torch.Tensor] | None = None) -> list[str]:
        """`own_slices`: tensors already cut to this worker's tp slice, by global name (`load_state`)."""
        self._drop_ahead()
        return load_state(self.optimizer, read, names, self.rank if same_grid else None, self.device,
                          read_flat=read_flat, own_slices=own_slices)

    @property
    def tp_slices(self) -> dict:
        """By parameter name, the tp slice this worker holds of it (none without tp)."""
        return self.optimizer.tp_slices

    def load_parameters(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Overwrite parameters by global name from whole tensors (a tp rank takes its slices)."""
        self._drop_ahead()
        return self.optimizer.load_(slice_whole(tensors, self._tp_sliced))

    def _whole(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Tensors by parameter name, tp slices gathered whole (a collective of the cell's tp ranks)."""
        return gather_whole(tensors, self._tp_sliced, self.groups.tp) if self._tp_sliced else tensors

    def forget_collectives(self) -> None:
        """Drop the collectives the optimizer queued and did not wait for (a failed step's)."""
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.forget_collectives()

    def _weights_gathered(self) -> None:
        """A sharded optimizer gathers the updated weights while the next step's forwards
        run: what copies them (a snapshot's side stream, the host) comes after this."""
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.wait_for_weights()

    def parameters_cpu(self) -> dict[str, torch.Tensor]:
        self._weights_gathered()
        return {n: t.detach().float().cpu().clone() for n, t in self._whole(dict(unstacked(self.model))).items()}
