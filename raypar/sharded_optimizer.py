"""AdamW whose fp32 state is split evenly over the replicas of the parameters (ZeRO stage 1).

The parameters a group of workers all hold (a stage's dense weights over its dp x ep
workers, its experts over dp) form a family, laid end to end in flat buffers: the weights
(the module's parameters become views of that buffer) and their fp32 gradients, in full;
and only this rank's share of the fp32 masters, AdamW's moments and the EMA. The family is
cut into buckets of whole parameters, each padded and split evenly over the group, wherever
parameters begin and end: a rank's share is its slice of every bucket. A step
reduce-scatters each bucket's gradients into the share (`reduce_gradients`), runs AdamW on
the share, and all-gathers the updated weights in place.

Checkpoints see a share as flat pieces of the named tensors (`Segment`), so a sharded run's
state loads on any grid, sharded or not, and an unsharded one loads here.
"""
from __future__ import annotations

from collections.abc import Callable
import math
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from raypar.adamw import FusedAdamW
from raypar.config import TrainConfig
from raypar.kernels import accumulate_
from raypar.model import main_grad
from raypar.model.experts import named_slices
from raypar.model.tensor_parallel import largest_piece, tp_slices
from raypar.optim import MasterOptimizer, decays, is_expert_param, lr_at
from raypar.runtime.comm import all_reduce_, wait_for

# Every parameter starts at a multiple of this many elements in the flat buffer (grouped
# GEMMs read 16-byte aligned rows; 128 bytes keeps vector loads whole), and every rank's
# slice of a bucket is a multiple of it.
ALIGN = 64
# torch 2.14 renames the flat collectives; 2.11 (the GPU image) has only the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Segment:
    """Elements [start, stop) of checkpoint tensor `key` (row-major), held at
    [at, at + stop - start) of this rank's share."""

    key: str
    start: int
    stop: int
    at: int

    def of(self, share: torch.Tensor) -> torch.Tensor:
        """This segment's elements of a share-sized buffer (masters, moments, EMA, gradients)."""
        return share[self.at:self.at + self.stop - self.start]


@dataclass(frozen=True)
class Bucket:
    start: int  # in the family's flat buffer
    size: int  # padded: a multiple of group size x ALIGN
    share_at: int  # where this rank's slice sits in its share

    def slice_of(self, rank: int, ranks: int) -> tuple[int, int]:
        n = self.size // ranks
        return self.start + rank * n, self.start + (rank + 1) * n


class Family:
    """Parameters replicated over one group, in flat buffers, with this rank's share."""

    def __init__(self, index: int, params: list[tuple[str, nn.Parameter]], slices: dict[str, list[tuple[str, tuple]]],
                 group, bucket_numel: int, mixed: bool, overlap: bool = True, room: dict[str, int] | None = None) -> None:
        """`index`: the family's place in its optimizer's (and its EMA's) lists. `room`: the
        elements to lay out for a parameter where that is more than it holds (a tp slice
        smaller than another tp worker's: every tp worker's buffers then line up)."""
        self.index, self.group, self.mixed, self.overlap = index, group, mixed, overlap
        self.ranks = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.params = params
        device, dtype = params[0][1].device, params[0][1].dtype
        room = room or {}
        sizes = [_round_up(max(p.numel(), room.get(n, 0)), ALIGN) for n, p in params]
        # Backward produces the last parameters' gradients first: they fill the first
        # buckets, which are then the first complete. A bucket holds whole parameters.
        members: list[list[int]] = [[]]
        filled = 0
        for i in reversed(range(len(params))):
            if members[-1] and filled + sizes[i] > bucket_numel:
                members.append([])
                filled = 0
            members[-1].append(i)
            filled += sizes[i]
        self.offsets = [0] * len(params)
        self.buckets: list[Bucket] = []
        start = share = 0
        for bucket in members:
            at = start
            for i in bucket:
                self.offsets[i] = at
                at += sizes[i]
            size = _round_up(at - start, self.ranks * ALIGN)
            self.buckets.append(Bucket(start, size, share))
            start, share = start + size, share + size // self.ranks
        self.numel = sum(b.size for b in self.buckets)
        self.share_numel = self.numel // self.ranks

        self.weights = torch.zeros(self.numel, dtype=dtype, device=device)
        self.grads = torch.zeros(self.numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for (_, p), off in zip(params, self.offsets):
                view = self.weights[off:off + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
        # With one rank the share is the whole buffer: no copies of it.
        self.grad_share = self.grads if self.ranks == 1 else torch.zeros(self.share_numel, dtype=torch.float32,
                                                                          device=device)
        if self.ranks == 1 and not mixed:
            self.master = self.weights
        else:
            self.master = torch.zeros(self.share_numel, dtype=torch.float32, device=device)
            self._share_of(self.weights, self.master)
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.segments = self._segments(slices)
        self.restart_counts(relearn=True)
        self._gathers: list = [None] * len(self.buckets)
        self.bucket_of = [next(k for k, b in enumerate(self.buckets) if b.start <= off < b.start + b.size)
                          for off in self.offsets]
        self.early = 0  # buckets of the last step queued from inside backward
        self.decays = {key: decays(name, p) for name, p in params for key, _ in slices[name]}

    def _share_of(self, full: torch.Tensor, share: torch.Tensor) -> None:
        """Copy this rank's slices of `full` into `share`."""
        for b in self.buckets:
            lo, hi = b.slice_of(self.rank, self.ranks)
            share[b.share_at:b.share_at + hi - lo].copy_(full[lo:hi])

    def _segments(self, slices: dict[str, list[tuple[str, tuple]]]) -> list[Segment]:
        """Where each named tensor's elements in this rank's share sit."""
        out = []
        for (name, p), off in zip(self.params, self.offsets):
            for key, index in slices[name]:
                view = p[index]
                if not view.is_contiguous():
                    raise ValueError(f"{key}: a checkpoint tensor must be a contiguous part of {name}")
                k0 = off + view.storage_offset() - p.storage_offset()
                for b in self.buckets:
                    lo, hi = b.slice_of(self.rank, self.ranks)
                    a, z = max(lo, k0), min(hi, k0 + view.numel())
                    if a < z:
                        out.append(Segment(key, a - k0, z - k0, b.share_at + a - lo))
        return out

    # -- gradient reduction, bucket by bucket ---------------------------------------------
    #
    # With `overlap`, a bucket's reduce-scatter is queued from inside backward, as soon as
    # its parameters have received as many gradients this step as they did the step before
    # (a stage's program fixes that count; the first step of a program learns it). At the
    # step's REDUCE_GRAD every bucket not queued yet is, and one that received more than
    # expected is queued again: a reduce-scatter only reads the gradients, so the second one
    # sees them all and overwrites the share. Every rank of the group queues the same
    # buckets in the same order: they run the same program on the same layers.

    def _issue(self, b: int) -> None:
        bucket = self.buckets[b]
        n = bucket.size // self.ranks
        self._works[b] = _reduce_scatter(self.grad_share[bucket.share_at:bucket.share_at + n],
                                         self.grads[bucket.start:bucket.start + bucket.size],
                                         group=self.group, async_op=True)

    def restart_counts(self, relearn: bool = False) -> None:
        """Forget this step's arrivals (a new step, or one cancelled); `relearn` also forgets
        the expected counts (a new program)."""
        self._arrived = [0] * len(self.buckets)
        self._works: list = [None] * len(self.buckets)
        self._late = [False] * len(self.buckets)
        if relearn:
            self._expected = None

    def reduce_scatter(self) -> list:
        """Queue what is not queued yet of each bucket's sum over the group into this rank's
        share; returns every bucket's work of this step, in order."""
        if self.ranks == 1:
            return []
        self.early = sum(1 for b, w in enumerate(self._works) if w is not None and not self._late[b])
        for b in range(len(self.buckets)):
            if self._works[b] is None or self._late[b]:
                self._issue(b)
        works = self._works
        self._expected = self._arrived if self.overlap else None
        self.restart_counts()
        return works

    def all_gather_weights(self) -> None:
        """Write the updated share into the weights and queue the gather of every rank's;
        `wait_gathers` before anything reads the bucket's weights."""
        if self.master is not self.weights:
            for b in self.buckets:
                lo, hi = b.slice_of(self.rank, self.ranks)
                self.weights[lo:hi].copy_(self.master[b.share_at:b.share_at + hi - lo])
        if self.ranks == 1:
            return
        for k, b in enumerate(self.buckets):
            lo, hi = b.slice_of(self.rank, self.ranks)
            self._gathers[k] = _all_gather(self.weights[b.start:b.start + b.size], self.weights[lo:hi],
                                           group=self.group, async_op=True)

    def wait_gathers(self, buckets=None, timeout: timedelta = timedelta(minutes=10)) -> None:
        """Order what runs next after the gathers of these buckets (all by default): on a
        GPU the stream waits, the host does not."""
        for k in range(len(self.buckets)) if buckets is None else buckets:
            work, self._gathers[k] = self._gathers[k], None
            if work is not None:
                wait_for(work, timeout, "weight all-gather")

    def full_grads(self) -> torch.Tensor:
        """Every rank's reduced share gathered into one flat buffer (tests compare gradients)."""
        if self.ranks == 1:
            return self.grads
        full = torch.zeros_like(self.grads)
        for b in self.buckets:
            n = b.size // self.ranks
            _all_gather(full[b.start:b.start + b.size], self.grad_share[b.share_at:b.share_at + n], group=self.group)
        return full

    def grad_of(self, i: int) -> torch.Tensor:
        """Parameter i's fp32 gradient: a view of the family's flat gradient buffer."""
        p = self.params[i][1]
        return self.grads[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)

    def accumulate_hook(self, i: int):
        into, arrived = self.grad_of(i), self.arrival(i)

        def hook(param: torch.Tensor) -> None:
            if param.grad is None:  # a backward that left this weight's gradient for later (split_backward)
                return
            accumulate_(into, param.grad)
            param.grad = None
            arrived()

        return hook

    def arrival(self, i: int) -> Callable[[], None]:
        """What runs once parameter i's gradient of a micro-batch is in: under the overlap, the
        bucket's reduce-scatter leaves with its last parameter of the last micro-batch."""
        b = self.bucket_of[i]

        def arrived() -> None:
            if self.ranks == 1 or not self.overlap:
                return
            self._arrived[b] += 1
            if self._works[b] is not None:
                self._late[b] = True
            elif self._expected is not None and self._arrived[b] == self._expected[b]:
                self._issue(b)

        return arrived


class ShardedOptimizer(MasterOptimizer):
    """`MasterOptimizer`'s AdamW (clipping, schedule, EMA) on this rank's share of each family.

    `groups`: the group each family's parameters are replicated over ("dense", "expert"),
    None for a family no other worker holds.
    """

    def __init__(self, module: nn.Module, cfg: TrainConfig, groups: dict[str, object | None],
                 bucket_numel: int = 50_000_000, overlap: bool = True, timeout: timedelta = timedelta(minutes=10),
                 fuse_grad_accumulation: bool = True):
        self.cfg, self.timeout = cfg, timeout
        self.named_params = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.slices = named_slices(module)
        # With tp each tp worker shards its own slices (its families' groups are its dp x ep
        # peers of the same tp rank); the parameters every tp worker holds whole are shared too.
        self.tp_slices = tp_slices(module)
        self.mixed = any(p.dtype != torch.float32 for _, p in self.named_params)
        by_family: dict[str, list[tuple[str, nn.Parameter]]] = {}
        for n, p in self.named_params:
            by_family.setdefault("expert" if is_expert_param(n) else "dense", []).append((n, p))
        # tp slices may differ in size (aligned pieces); the whole-held parameters' gradients
        # are summed over tp share by share, so every tp worker lays out its largest.
        room = {name: largest_piece(*held) for name, held in self.tp_slices.items()}
        self.families = [Family(i, params, self.slices, groups.get(f), bucket_numel, self.mixed, overlap, room)
                         for i, (f, params) in enumerate(sorted(by_family.items()))]
        # Views of the detached weights: a view of the parameter itself would keep its
        # AccumulateGrad node alive, tied to this stream, and a CUDA graph's backward
        # captured on another stream would then fail.
        self._views = {key: p.detach()[index] for name, p in self.named_params for key, index in self.slices[name]}
        for family in self.families:
            for i, (_, p) in enumerate(family.params):
                p.register_post_accumulate_grad_hook(family.accumulate_hook(i))
                if fuse_grad_accumulation and self.mixed:
                    main_grad.attach(p, family.grad_of(i), family.arrival(i))
        self._wait_before_forwards(module)
        # The shares' gradients of tp slices and of what every tp worker holds whole (views,
        # made once: the norm and the sum over tp read them every step).
        self._tp_sliced_grads, self._tp_whole_grads = [], []
        for family in self.families:
            for seg in family.segments:
                (self._tp_sliced_grads if seg.key in self.tp_slices else self._tp_whole_grads).append(
                    seg.of(family.grad_share))
        # The base class's EMA works on `master`: here one share per family.
        self.master = [f.master for f in self.families]
        self.ema = None
        self._host_ema = None
        decay, no_decay = [], []
        self._state_of: dict[int, tuple[Family, Segment]] = {}
        for family in self.families:
            for seg in family.segments:
                view = seg.of(family.master)
                view.grad = seg.of(family.grad_share)
                (decay if family.decays[seg.key] else no_decay).append(view)
                self._state_of[id(view)] = (family, seg)
        groups_ = [{"params": ps, "weight_decay": wd} for ps, wd in ((decay, cfg.weight_decay), (no_decay, 0.0)) if ps]
        # A rank whose share holds nothing (more ranks than elements) still takes part in
        # the collectives; it just has no AdamW to run.
        self.optimizer = FusedAdamW(groups_, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps) if groups_ else None
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                for view in group["params"]:
                    family, seg = self._state_of[id(view)]
                    self.optimizer.init_state(view, seg.of(family.exp_avg), seg.of(family.exp_avg_sq))

    # -- the updated weights' all-gather, waited for where they are read ----------------
    #
    # A step queues every bucket's all-gather and returns. The next step's forwards wait,
    # module by module, for the buckets of their own parameters (a module's forward pre-hook),
    # so the first layers run while the rest are gathered; anything else that reads the
    # weights (a snapshot, a load, a parameter dump) waits for all of them first.

    def _wait_before_forwards(self, module: nn.Module) -> None:
        """A forward pre-hook on each top-level part of the stage (the embedding, every block
        of a module container, the head...) for the buckets of the parameters under it: a
        few hooks per forward, not one per layer."""
        where = {id(p): (f, f.bucket_of[i]) for f in self.families for i, (_, p) in enumerate(f.params)}
        parts = []
        for child in module.children():
            parts += list(child.children()) if isinstance(child, (nn.ModuleDict, nn.ModuleList)) else [child]
        covered = set()
        for part in parts:
            ids = {id(p) for p in part.parameters()} & where.keys()
            covered |= ids
            if ids:
                part.register_forward_pre_hook(self._waiter(sorted({where[i] for i in ids}, key=self._order)))
        rest = where.keys() - covered  # parameters of the stage module itself: before its forward
        if rest:
            module.register_forward_pre_hook(self._waiter(sorted({where[i] for i in rest}, key=self._order)))

    @staticmethod
    def _order(pair) -> tuple[int, int]:
        return pair[0].index, pair[1]

    def _waiter(self, pairs):
        def hook(module, args) -> None:
            for family, b in pairs:
                if family._gathers[b] is not None:
                    family.wait_gathers([b], self.timeout)

        return hook

    def forget_collectives(self) -> None:
        """Drop every queued collective and the groups themselves without waiting (the step
        failed and the groups go away; this optimizer is not stepped again). A gloo group
        that something still refers to keeps its connections open when its process leaves
        it, and a peer waiting on this rank would hang until the collective timeout."""
        for f in self.families:
            f.restart_counts()
            f._gathers = [None] * len(f.buckets)
            f.group = None

    @contextmanager
    def reductions_paused(self):
        """Backward inside this block accumulates gradients and queues no reduction, nor
        counts what arrived (a CUDA graph's warm-up and capture: a collective captured there
        would run at every replay)."""
        overlaps = [f.overlap for f in self.families]
        for f in self.families:
            f.overlap = False
        try:
            yield
        finally:
            for f, on in zip(self.families, overlaps):
                f.overlap = on

    def overlaps_reduction(self) -> bool:
        """Whether the last backward of a step queues gradient reductions from inside it."""
        return any(f.overlap and f.ranks > 1 for f in self.families)

    def wait_for_weights(self) -> None:
        """Order what runs next after every pending gather of the weights."""
        for f in self.families:
            f.wait_gathers(timeout=self.timeout)

    def bucket_counts(self) -> tuple[int, int]:
        """(buckets reduced over other ranks, those of them queued from inside backward) in
        the last reduction."""
        shared = [f for f in self.families if f.ranks > 1]
        return sum(len(f.buckets) for f in shared), sum(f.early for f in shared)

    def program_changed(self) -> None:
        """A new stage program: how many gradients each bucket gets per step is learnt anew."""
        for f in self.families:
            f.restart_counts(relearn=True)

    # -- what a checkpoint and the stage read ------------------------------------------

    def segment_states(self):
        """(family, segment, its AdamW state) of every segment of this rank's share."""
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            for view in group["params"]:
                family, seg = self._state_of[id(view)]
                yield family, seg, self.optimizer.state[view]

    def state_bytes(self) -> int:
        """Bytes of this rank's share: AdamW's moments, and fp32 masters where they are not
        the weights themselves (bf16 weights, or fp32 ones split over several ranks)."""
        return sum(4 * f.share_numel * (2 + (f.master is not f.weights)) for f in self.families)

    def grads(self) -> list[torch.Tensor]:
        return [f.grad_share for f in self.families]

    def named_grads(self) -> dict[str, torch.Tensor]:
        """Every gradient, whole (each rank's reduced share gathered): for tests."""
        out = {}
        for family in self.families:
            full = family.full_grads()
            for (name, p), off in zip(family.params, family.offsets):
                grad = full[off:off + p.numel()].view(p.shape)
                for key, index in self.slices[name]:
                    out[key] = grad[index]
        return out

    def reduce_gradients(self, replicas: int, tp_group=None, tp: int = 1, sequence_parallel: bool = False) -> torch.Tensor:
        """Sum every family's gradients over its group into this rank's share, divided by
        `replicas` (the pipelines of the grid, dp x ep: each one's loss is a mean over its
        own samples; an expert's all-to-all already summed its ep group's pipelines), as
        the unsharded all-reduce does. Returns the share's squared norm: summed over the
        world's ranks, the global norm's square.

        With `tp` workers per stage cell, what every one of them holds whole (norms, MoE
        layers) is in each one's share alike (the same layout on every tp rank): counted
        1 / tp in the norm, and with `sequence_parallel` (each saw its slice of the tokens)
        first summed over `tp_group`."""
        for work in [w for f in self.families for w in f.reduce_scatter()]:
            wait_for(work, self.timeout, "gradient reduce-scatter")
        if replicas > 1:
            torch._foreach_div_([f.grad_share for f in self.families], float(replicas))
        if tp == 1:
            return self.local_sq_norm()
        if sequence_parallel:
            all_reduce_(self._tp_whole_grads, tp_group, self.timeout)
        return self.local_sq_norm(self._tp_sliced_grads) + self.local_sq_norm(self._tp_whole_grads) / tp

    # -- the step ----------------------------------------------------------------------

    def step(self, step: int, total_norm: torch.Tensor | float) -> float:
        """Clip by the global norm, update this rank's share, queue the gathers of every
        rank's weights (`wait_for_weights`), zero the gradients. Nothing here reads the norm
        on the host."""
        lr = lr_at(self.cfg, step)
        self.wait_for_weights()  # the last step's gathers still write the weights the update copies into
        if self.optimizer is not None:
            if self.cfg.grad_clip > 0:
                norm = torch.as_tensor(total_norm, dtype=torch.float32, device=self.families[0].master.device)
                self.optimizer.grad_scale = torch.clamp((norm + 1e-6) / self.cfg.grad_clip, min=1.0)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            if self._host_ema is not None:
                self._host_ema.fence()
            self.optimizer.step()
            self.optimizer.grad_scale = None
        for f in self.families:
            f.all_gather_weights()
        self.zero_grad()
        return lr

    def zero_grad(self) -> None:
        for f in self.families:
            f.grads.zero_()
            if f.grad_share is not f.grads:
                f.grad_share.zero_()

    def set_weight(self, key: str, whole: torch.Tensor,
                   copy: Callable[[torch.Tensor, torch.Tensor], None] | None = None) -> None:
        """Set checkpoint tensor `key` from its whole value: the weights, and this rank's
        share of its masters (the EMA is the caller's). `copy(dst, src)` does the copies
        (a load's `HostCopies.copy`; default `dst.copy_(src)`)."""
        copy = copy or (lambda dst, src: dst.copy_(src.reshape(dst.shape)))
        copy(self._views[key], whole)
        flat = whole.reshape(-1)
        for family, seg, _ in self.segments_by_key().get(key, []):
            if family.master is not family.weights:  # fp32 on one rank: the copy above set them
                copy(seg.of(family.master), flat[seg.start:seg.stop])

    def segments_by_key(self) -> dict[str, list]:
        """`segment_states` by checkpoint name."""
        out: dict[str, list] = {}
        for family, seg, state in self.segment_states():
            out.setdefault(seg.key, []).append((family, seg, state))
        return out

    def load_(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """Overwrite parameters (and this rank's masters) by checkpoint name; new weights
        restart the EMA. Returns the names set."""
        self.settle_ema()
        self.wait_for_weights()
        done = [key for key in self._views if key in tensors]
        by_key = self.segments_by_key()
        with torch.no_grad():
            for key in done:
                self.set_weight(key, tensors[key])
                if self.ema is not None:
                    for family, seg, _ in by_key.get(key, []):
                        seg.of(self.ema[family.index]).copy_(seg.of(family.master))
        return done


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, math.ceil(n / multiple) * multiple)
