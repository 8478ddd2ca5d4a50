"""CUDA graphs of a one-stage micro-batch (`runtime.cuda_graphs`).

A stage that is the whole model (pp=1) runs each micro-batch's forward and backward back
to back, one micro-batch live at a time. Both are captured once as CUDA graphs and
replayed for every micro-batch after: the host issues two graph launches per micro-batch
instead of every op. That matters for MoE layers, whose router, layout kernels, all-to-alls
and grouped GEMMs are ~60 small launches a layer and direction: eagerly, the host takes
longer to issue them than the device to run them, and an all-to-all then waits for the
slower peer's host rather than for its bytes.

What a replay relies on, and how the stage keeps it true:
- inputs, outputs and saved activations live at fixed addresses (the graph's memory pool):
  a micro-batch's tokens, labels and dropout seeds are copied into the captured inputs;
- parameters and the gradient buffers backward accumulates into are never reallocated
  (loads copy into them; the optimizers zero gradients in place);
- nothing in forward or backward reads the device from the host (the padded all-to-all);
- Python side effects of forward and backward happen once, at capture: MoE counters
  accumulate into device tensors inside the graph, and the all-to-all byte counts taken at
  capture are added per replay (`MoEStats.alltoall_bytes`).
"""
from __future__ import annotations

import traceback
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from raypar.config import Config
from raypar.schedule import Action, Op
from raypar.topology import Grid


class GraphCaptureError(RuntimeError):
    """Forward or backward did something a CUDA graph cannot capture (the same on every rank)."""


def graphs_blocked(cfg: Config, grid: Grid, program: Sequence[Action], device: torch.device) -> str | None:
    """Why this stage's program cannot run its micro-batches as CUDA graphs; None when it can."""
    if not cfg.runtime.cuda_graphs:
        return "runtime.cuda_graphs is off"
    if device.type != "cuda":
        return "the stage is not on a GPU"
    if grid.pp > 1:
        return "parallel.pp > 1: a pipeline stage holds several micro-batches' activations, a graph one"
    if cfg.runtime.recompute != "none":
        return "runtime.recompute is on"
    if cfg.model.n_experts and grid.ep > 1 and cfg.runtime.moe_alltoall != "padded":
        return "runtime.moe_alltoall=exact reads split sizes on the host"
    if any(a.op in (Op.I, Op.W) for a in program):
        return "the program splits backward into I and W"
    computes = [a for a in program if a.op.is_compute]
    pairs = list(zip(computes[0::2], computes[1::2]))
    if len(computes) % 2 or any((f.op, b.op) != (Op.F, Op.B) or f.mb != b.mb for f, b in pairs):
        return "the program does not run each micro-batch's backward right after its forward"
    return None


def overlap_blocked(cfg: Config, grid: Grid, has_moe: bool, n_microbatches: int,
                    has_backward_group: bool) -> str | None:
    """Why a stage whose micro-batches replay graphs runs them one after another rather than
    each forward beside the previous backward (`runtime.moe_microbatch_overlap`); None when
    it overlaps them. `has_backward_group`: the worker made the second ep communicator."""
    if not cfg.runtime.moe_microbatch_overlap:
        return "runtime.moe_microbatch_overlap is off"
    if not has_moe or grid.ep == 1:
        return "no all-to-all to hide: the stage has no MoE layers on parallel.ep > 1"
    if grid.tp > 1:
        return "parallel.tp > 1: the tp collectives of both directions share one communicator"
    if n_microbatches < 2:
        return "one micro-batch a step"
    if not has_backward_group:
        return "the worker has no second ep communicator (see wants_backward_ep_group)"
    return None


def wants_backward_ep_group(cfg: Config, grid: Grid, backend: str) -> bool:
    """Whether a worker makes the second ep communicator micro-batch overlap needs: on GPU
    (NCCL), for a one-stage MoE grid with ep > 1 and no tp, with graphs and overlap on."""
    r = cfg.runtime
    return (backend == "nccl" and r.cuda_graphs and r.moe_microbatch_overlap and cfg.model.n_experts > 0
            and grid.pp == 1 and grid.ep > 1 and grid.tp == 1)


class MicroBatchStreams:
    """Two streams on which consecutive micro-batches' graphs replay, so that each forward
    runs on the device beside the previous micro-batch's backward.

    Orders kept: forwards run one after another in micro-batch order, and so do backwards
    (each direction's collectives then reach their communicator in the same order on every
    rank, and backwards add into the gradients one at a time, as without overlap); a
    micro-batch's backward follows its forward on its stream (which also keeps its graph
    set's buffers until the micro-batch after next). The first replay after a `join` waits
    for what the current stream issued (the tokens, the last optimizer step); `join` makes
    the current stream wait for both.
    """

    SETS = 2  # graph sets, and streams: micro-batch i replays set i mod SETS on stream i mod SETS

    def __init__(self) -> None:
        self.streams = tuple(torch.cuda.Stream() for _ in range(self.SETS))
        self._last: dict[str, torch.cuda.Event | None] = {"F": None, "B": None}
        self._joined = True

    @contextmanager
    def on(self, direction: str, mb: int) -> Iterator[torch.cuda.Stream]:
        """Run the block's work (direction "F" or "B" of micro-batch `mb`) on its stream."""
        stream = self.streams[mb % self.SETS]
        if self._joined:
            for s in self.streams:
                s.wait_stream(torch.cuda.current_stream())
            self._joined = False
        last = self._last[direction]
        if last is not None:
            stream.wait_event(last)
        with torch.cuda.stream(stream):
            yield stream
            done = torch.cuda.Event()
            done.record()
        self._last[direction] = done

    def join(self) -> None:
        """The current stream waits for all work on the two streams."""
        if self._joined:
            return
        home = torch.cuda.current_stream()
        for s in self.streams:
            home.wait_stream(s)
        self._last = {"F": None, "B": None}
        self._joined = True


class MicroBatchGraph:
    """One micro-batch's forward (the stage loss) and backward through `model`, captured for
    inputs of one shape; backward starts from the loss divided by `micro_batches` (the step's
    loss is their mean).

    `reset` undoes what the eager warm-up left (accumulated gradients, MoE counters);
    `counters` are the MoE layers' stats, whose host-side byte counts a replay advances;
    `backward` runs a backward from the scaled loss (the stage's way: see
    `runtime.moe_backward_overlap`), by default `loss.backward()`.
    `saved_bytes`: what a forward keeps for its backward (parameters aside), as the
    activation tracker would count it."""

    def __init__(self, model: nn.Module, inputs: Sequence[Tensor | None], micro_batches: int,
                 reset: Callable[[], None], counters: Sequence[object] = (),
                 backward: Callable[[Tensor], None] = Tensor.backward):
        self.key = graph_key(inputs, micro_batches)
        self._counters = list(counters)
        self._static = [t.detach().clone() if t is not None else None for t in inputs]
        current = torch.cuda.current_stream()
        # Warm up on a side stream, as capture requires: libraries create their handles and
        # workspaces, NCCL its communicators, kernels load, all outside the graph.
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            backward(model(*self._static) / micro_batches)
        current.wait_stream(side)
        reset()
        before = self._bytes()
        try:
            self._forward = torch.cuda.CUDAGraph()
            # thread_local: the data prefetch thread may pin memory meanwhile.
            with _saved_bytes(model) as saved, torch.cuda.graph(self._forward, capture_error_mode="thread_local"):
                self._loss = model(*self._static)
                scaled = self._loss / micro_batches
            self.saved_bytes = sum(saved.values())
            middle = self._bytes()
            self._backward = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._backward, pool=self._forward.pool(), capture_error_mode="thread_local"):
                backward(scaled)
            after = self._bytes()
            # Let the captured autograd nodes go: eager forwards then make their own, on
            # their own stream (a kept AccumulateGrad node would tie them to the capture's).
            self._loss = self._loss.detach()
            del scaled
        except RuntimeError as e:  # an op that syncs with the host, or that capture does not support
            reset()
            for c, n in zip(self._counters, before):
                c.alltoall_bytes = n
            raise GraphCaptureError(f"{str(e).splitlines()[0]}{_where(e)}") from e
        self._forward_bytes = [m - b for m, b in zip(middle, before)]
        self._backward_bytes = [a - m for a, m in zip(after, middle)]
        for c, n in zip(self._counters, before):  # capture ran no exchange: replays count them
            c.alltoall_bytes = n

    def forward(self, inputs: Sequence[Tensor | None]) -> Tensor:
        """Replay the forward on `inputs`; returns the micro-batch's (unscaled) loss."""
        for static, t in zip(self._static, inputs):
            if static is not None:
                static.copy_(t, non_blocking=True)
        self._forward.replay()
        self._advance(self._forward_bytes)
        return self._loss.clone()  # the next replay overwrites the captured one

    def backward(self) -> None:
        """Replay the backward of the last forward: gradients accumulate where eager ones would."""
        self._backward.replay()
        self._advance(self._backward_bytes)

    def _bytes(self) -> list[int]:
        return [c.alltoall_bytes for c in self._counters]

    def _advance(self, deltas: list[int]) -> None:
        for c, n in zip(self._counters, deltas):
            c.alltoall_bytes += n


def graph_key(inputs: Sequence[Tensor | None], micro_batches: int) -> tuple:
    """What a captured graph is valid for: its inputs' shapes and dtypes, and the micro-batches
    per step (the loss's divisor, and the MoE aux losses' scale)."""
    return tuple((tuple(t.shape), t.dtype) if t is not None else None for t in inputs) + (micro_batches,)


def _where(e: BaseException) -> str:
    """ ' (file:line, code)' of the last frame outside installed packages: the op that failed."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "site-packages" not in f.filename]
    return f" ({frames[-1].filename}:{frames[-1].lineno}, {frames[-1].line})" if frames else ""


@contextmanager
def _saved_bytes(model: nn.Module) -> Iterator[dict[int, int]]:
    """Bytes of each storage autograd saves inside the block, parameters aside."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in params:
            seen[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen
