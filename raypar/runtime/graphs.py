"""CUDA graphs of a stage's micro-batch (`runtime.cuda_graphs`).

A stage's forward and backward of one micro-batch are captured once as CUDA graphs and
replayed for every micro-batch after: the host issues two graph launches per micro-batch
instead of every op. That matters wherever the host is slower to issue a micro-batch than
the device to run it: MoE layers, whose router, layout kernels, all-to-alls and grouped
GEMMs are ~60 small launches a layer and direction (an all-to-all then waits for the slower
peer's host rather than for its bytes), and a stage split by tp, whose device time halves
while its host ops do not.

A stage keeps as many graph sets as its program holds micro-batches live (one at pp=1
under 1F1B; up to pp - stage on a pipeline stage): micro-batch `i` replays set
`i mod sets`, whose buffers the micro-batch `sets` earlier has left by then, since
forwards and backwards each run in micro-batch order. A pipeline stage's forward starts
from the received activation (copied into the captured input), and its backward from the
received output gradient (the last stage's from its loss); what is sent (the output, the
input's gradient) is a copy, so a send in flight never reads a buffer the next replay writes.
A stage with several model chunks keeps sets per chunk. Where the schedule splits backward
(zero-bubble: I, then W later), backward is two graphs, and a micro-batch holds its set
until its W.

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
from typing import Callable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from raypar.config import Config
from raypar.model.split_backward import compute_weight_grads, drop_weight_grads, pending_tensors, weight_grads_deferred
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
    if cfg.runtime.recompute != "none":
        return "runtime.recompute is on"
    if cfg.model.n_experts and grid.ep > 1 and cfg.runtime.moe_alltoall != "padded":
        return "runtime.moe_alltoall=exact reads split sizes on the host"
    if any(live_microbatches(program, c) is None for c in {a.chunk for a in program if a.op.is_compute}):
        return "the program runs a chunk's forwards or backwards out of micro-batch order"
    return None


def live_microbatches(program: Sequence[Action], chunk: int = 0) -> int | None:
    """The most micro-batches of model chunk `chunk` live at once, from their forward to the
    end of their backward (B, or W when backward is split): the graph sets the chunk needs.
    None when its forwards, backwards' starts (B or I) or ends (B or W) do not each run in
    micro-batch order (the set a micro-batch replays would then still be held by another)."""
    program = [a for a in program if a.chunk == chunk]
    forwards = [a.mb for a in program if a.op == Op.F]
    starts = [a.mb for a in program if a.op in (Op.B, Op.I)]
    ends = [a.mb for a in program if a.op in (Op.B, Op.W)]
    if any(order != sorted(order) for order in (forwards, starts, ends)) or not sorted(forwards) == starts == ends:
        return None
    live = most = 0
    for a in program:
        live += (a.op == Op.F) - (a.op in (Op.B, Op.W))
        most = max(most, live)
    return most


def overlap_switches(cfg: Config, grid: Grid, has_moe: bool) -> list[str]:
    """The `runtime.*_microbatch_overlap` switches that apply to a stage of this grid: what
    it would hide (MoE all-to-alls at ep > 1, tp collectives at tp > 1), on or off."""
    return ((["moe_microbatch_overlap"] if has_moe and grid.ep > 1 else [])
            + (["tp_microbatch_overlap"] if grid.tp > 1 else []))


def overlap_wanted(cfg: Config, grid: Grid, has_moe: bool) -> bool:
    """Whether a switch of `overlap_switches` that applies is on."""
    return any(getattr(cfg.runtime, s) for s in overlap_switches(cfg, grid, has_moe))


def overlap_blocked(cfg: Config, grid: Grid, has_moe: bool, program: Sequence[Action],
                    has_backward_groups: bool) -> str | None:
    """Why a stage whose micro-batches replay graphs runs them one after another rather than
    each forward beside the previous backward (`runtime.moe_microbatch_overlap`,
    `runtime.tp_microbatch_overlap`); None when it overlaps them. `has_backward_groups`:
    the worker made the second communicators (see `wants_backward_groups`)."""
    switches = overlap_switches(cfg, grid, has_moe)
    if not switches:
        return "no collective to hide: the stage has no MoE layers on parallel.ep > 1 and parallel.tp is 1"
    if not overlap_wanted(cfg, grid, has_moe):
        return " and ".join(f"runtime.{s}" for s in switches) + " off"
    if grid.pp > 1:
        return "parallel.pp > 1: a pipeline stage's units wait on its neighbours, not on each other"
    if len({a.mb for a in program if a.op == Op.F}) < 2:
        return "one micro-batch a step"
    if live_microbatches(program) != 1:
        return "the schedule holds several micro-batches live (each backward does not follow its forward)"
    if not has_backward_groups:
        return "the worker has no second ep or tp communicator for backward (see wants_backward_groups)"
    return None


def wants_backward_groups(cfg: Config, grid: Grid, backend: str) -> bool:
    """Whether a worker makes the second ep and tp communicators micro-batch overlap needs:
    on GPU (NCCL), for a one-stage grid with MoE layers at ep > 1 or with tp > 1, with graphs
    and the switch of either on. Both directions of every collective the stage runs then
    have a communicator of their own."""
    return (backend == "nccl" and cfg.runtime.cuda_graphs and grid.pp == 1
            and overlap_wanted(cfg, grid, cfg.model.n_experts > 0))


# Hardware queues (CUDA_DEVICE_MAX_CONNECTIONS; CUDA's default is 8) a process needs for its
# micro-batches to overlap. A replayed graph runs its branches on streams of its own (an MoE
# backward graph at ep=2 on 17), and streams beyond the queues share them: with 8, a forward
# waited behind the backward it was to run beside (docs/operations.md). GPU workers start
# with this many (`actors/placement.py`).
OVERLAP_HARDWARE_QUEUES = 32


def few_hardware_queues(environ: Mapping[str, str]) -> str | None:
    """Why micro-batches overlapped in a process with this environment would mostly run one
    after another (too few hardware queues), or None."""
    value = environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "")
    try:
        queues = int(value) if value else 8
    except ValueError:
        queues = 8  # CUDA ignores what it cannot read
    if queues >= OVERLAP_HARDWARE_QUEUES:
        return None
    setting = f"CUDA_DEVICE_MAX_CONNECTIONS={value}" if value else "CUDA_DEVICE_MAX_CONNECTIONS unset (8)"
    return (f"{setting} in this worker: its streams share {queues} hardware queue(s), so a forward waits behind the "
            f"backward it should run beside (on 2 x H200, MoE at ep=2 ran 1.04x the tokens/s with 32 than with 8). "
            f"raypar starts GPU workers with {OVERLAP_HARDWARE_QUEUES} unless the driver's environment sets the "
            f"variable: unset it there, or set it to {OVERLAP_HARDWARE_QUEUES}")


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
    """One micro-batch's forward and backward through `model`, captured for inputs of one
    shape. On the stage with the loss (`has_loss`) backward starts from the loss divided by
    `micro_batches` (the step's loss is their mean); on a stage before it, from an output
    gradient passed to `backward`.

    `reset` undoes what the eager warm-up left (accumulated gradients, MoE counters);
    `counters` are the MoE layers' stats, whose host-side byte counts a replay advances;
    `backward` runs a backward from a root and its gradient (the stage's way: see
    `runtime.moe_backward_overlap`), by default `Tensor.backward`.
    `saved_bytes`: what a forward keeps for its backward (parameters aside), as the
    activation tracker would count it.

    With `split` (a program that runs backward as I then W), backward is captured as two
    graphs: I, the input's gradient, with the split layers' weight gradients left for later
    (`split_backward`), and W, which computes them from what I left in the graph's pool
    (`held_bytes`)."""

    def __init__(self, model: nn.Module, inputs: Sequence[Tensor | None], micro_batches: int,
                 reset: Callable[[], None], counters: Sequence[object] = (),
                 backward: Callable[[Tensor, Tensor | None], None] = Tensor.backward, has_loss: bool = True,
                 chunk: int = 0, split: bool = False):
        self.key = graph_key(inputs, micro_batches)
        self.split = split
        self.held_bytes = 0
        self._weights: torch.cuda.CUDAGraph | None = None
        deferred = ("graph", id(self))  # the key this graph's I leaves its weight gradients under

        def input_grad_backward(start: Tensor, grad: Tensor | None) -> None:
            if not split:
                backward(start, grad)
                return
            with weight_grads_deferred(deferred):
                backward(start, grad)

        self._counters = list(counters)
        # A received activation's gradient is what the stage sends back: the captured input keeps it.
        self._static = [t.detach().clone().requires_grad_(t.requires_grad) if t is not None else None for t in inputs]
        x = self._static[0]

        def root(out: Tensor) -> Tensor:
            return out / micro_batches if has_loss else out

        current = torch.cuda.current_stream()
        # Warm up on a side stream, as capture requires: libraries create their handles and
        # workspaces, NCCL its communicators, kernels load, all outside the graph.
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            out = model(*self._static, chunk)
            self._grad = None if has_loss else torch.zeros_like(out)  # the received output gradient goes here
            input_grad_backward(root(out), self._grad)
            if split:
                compute_weight_grads(deferred)
            del out
        current.wait_stream(side)
        reset()
        x.grad = None  # so that the captured backward writes the input's gradient, not adds to it
        before = self._bytes()
        try:
            self._forward = torch.cuda.CUDAGraph()
            # thread_local: the data prefetch thread may pin memory meanwhile.
            with _saved_bytes(model) as saved, torch.cuda.graph(self._forward, capture_error_mode="thread_local"):
                self._out = model(*self._static, chunk)
                start = root(self._out)
            self.saved_bytes = sum(saved.values())
            middle = self._bytes()
            self._backward = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._backward, pool=self._forward.pool(), capture_error_mode="thread_local"):
                input_grad_backward(start, self._grad)
            after = self._bytes()
            if split:
                self.held_bytes = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                                       for t in pending_tensors(deferred)}.values())
                self._weights = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self._weights, pool=self._forward.pool(), capture_error_mode="thread_local"):
                    compute_weight_grads(deferred)
            self._input_grad = x.grad
            # Let the captured autograd nodes go: eager forwards then make their own, on
            # their own stream (a kept AccumulateGrad node would tie them to the capture's).
            self._out = self._out.detach()
            del start
        except RuntimeError as e:  # an op that syncs with the host, or that capture does not support
            drop_weight_grads(deferred)
            reset()
            for c, n in zip(self._counters, before):
                c.alltoall_bytes = n
            raise GraphCaptureError(f"{str(e).splitlines()[0]}{_where(e)}") from e
        self._forward_bytes = [m - b for m, b in zip(middle, before)]
        self._backward_bytes = [a - m for a, m in zip(after, middle)]
        for c, n in zip(self._counters, before):  # capture ran no exchange: replays count them
            c.alltoall_bytes = n

    def forward(self, inputs: Sequence[Tensor | None]) -> Tensor:
        """Replay the forward on `inputs`; returns a copy of the output (the micro-batch's
        unscaled loss on the stage with the loss): the next replay overwrites the captured one."""
        with torch.no_grad():  # the captured input is a leaf that requires grad on a pipeline stage
            for static, t in zip(self._static, inputs):
                if static is not None:
                    static.copy_(t, non_blocking=True)
        self._forward.replay()
        self._advance(self._forward_bytes)
        return self._out.clone()

    def backward(self, grad: Tensor | None = None) -> Tensor | None:
        """Replay the backward of the last forward from the output gradient `grad` (None on
        the stage with the loss): parameter gradients accumulate where eager ones would (with
        `split`, those of the split layers at `weights`). Returns a copy of the input's
        gradient, None where the input is tokens."""
        if self._grad is not None:
            self._grad.copy_(grad, non_blocking=True)
        self._backward.replay()
        self._advance(self._backward_bytes)
        return self._input_grad.clone() if self._input_grad is not None else None

    def weights(self) -> None:
        """W (with `split`): replay the weight gradients the last backward left."""
        if self._weights is None:
            raise RuntimeError("this graph's backward is whole (captured without split): it has no W to replay")
        self._weights.replay()

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
