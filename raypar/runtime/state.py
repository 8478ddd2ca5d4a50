"""A stage worker's training state as globally named tensors, for checkpoints.

Names are topology-free: `<param>` (weights in the model dtype), `master.<param>` (fp32
master weights, bf16 models only), `optim.exp_avg.<param>`, `optim.exp_avg_sq.<param>`,
`optim.step.<param>` (AdamW), `ema.<param>` (fp32 EMA of the masters, when kept),
`rng.rank<r>.cpu` / `rng.rank<r>.cuda`. Replicas hold equal copies; only one of them
writes each tensor: dp rank 0 writes experts, dp rank 0 and ep rank 0 write everything else.

A sharded optimizer (`parallel.shard_optimizer`) holds of each master, moment and EMA only
its rank's flat share: those are flat pieces (`piece_name`), each written by its holder
and saved as pieces of the named tensor, so either kind of run loads the other's state.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
import math

import torch

from raypar.checkpoint.pieces import FlatPieces, flat_range_boxes, piece_name, split_piece_name
from raypar.config import Config
from raypar.model import stage_param_shapes
from raypar.schedule import run_layout
from raypar.model.tensor_parallel import split_tp_piece_name, tp_piece_name
from raypar.optim import MasterOptimizer, is_expert_param
from raypar.runtime.host_copies import host_copies
from raypar.runtime.snapshot import Layout
from raypar.sharded_optimizer import ShardedOptimizer
from raypar.topology import Coord, Grid

ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")


def writes(coord: Coord, name: str, sliced: bool = False) -> bool:
    """Whether the worker at `coord` writes `name`: of replicas, one; of tensor-parallel
    slices (`sliced`), every tp worker its own; of what every tp worker holds whole, tp 0."""
    return coord.dp == 0 and (coord.ep == 0 or is_expert_param(name)) and (coord.tp == 0 or sliced)


def _pieces(optimizer: MasterOptimizer, emas: list[torch.Tensor] | None = None):
    """(checkpoint name, parameter, fp32 master, AdamW state, EMA or None) of each tensor a
    checkpoint names, as views: a stacked expert parameter is one piece per expert. `emas`:
    the EMA tensors to take the pieces of (default: the optimizer's live ones)."""
    emas = emas or optimizer.ema or [None] * len(optimizer.master)
    for (name, param), master, ema in zip(optimizer.named_params, optimizer.master, emas):
        state = optimizer.optimizer.state.get(master, {})
        for key, index in optimizer.slices[name]:
            # The step count is one scalar per parameter, shared by its experts.
            moments = {k: v if v.ndim == 0 else v[index] for k, v in state.items()}
            yield key, param.detach()[index], master[index], moments, None if ema is None else ema[index]


def _written(optimizer: MasterOptimizer, coord: Coord | None, emas: list[torch.Tensor] | None = None):
    """`_pieces` this worker writes (all when coord is None)."""
    for piece in _pieces(optimizer, emas):
        if coord is None or writes(coord, piece[0], piece[0] in optimizer.tp_slices):
            yield piece


def state_tensors(model: torch.nn.Module, optimizer: MasterOptimizer, coord: Coord | None, rank: int,
                  device: torch.device, save_optimizer: bool = True, save_master: bool = True,
                  with_rng: bool = True, emas: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """This worker's share of the state (all it holds when coord is None), as live tensors;
    the EMA's from `emas` when given (`MasterOptimizer.ema_for_snapshot`)."""
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.wait_for_weights()  # the last step's gathers still write the weights
        out = _sharded_tensors(optimizer, coord, save_optimizer, save_master, emas)
        if with_rng:
            out.update(rng_states(rank, device))
        return out
    out: dict[str, torch.Tensor] = {}
    for name, param, master, state, ema in _written(optimizer, coord, emas):
        out[name] = param.detach()
        if ema is not None:
            out[f"ema.{name}"] = ema
        if optimizer.mixed and save_master:
            out[f"master.{name}"] = master.detach()
        if save_optimizer:
            for key in ADAM_STATE:
                # The step count is one scalar for all of a sliced tensor: tp 0 writes it.
                if key in state and not (key == "step" and coord is not None and coord.tp > 0):
                    out[f"optim.{key}.{name}"] = state[key].detach().reshape(state[key].shape)
    if with_rng:
        out.update(rng_states(rank, device))
    return out


def _sharded_tensors(optimizer: ShardedOptimizer, coord: Coord | None, save_optimizer: bool, save_master: bool,
                     emas: list[torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """`state_tensors` of a sharded optimizer: whole weights by the usual writer, and every
    flat piece of this rank's share (no other rank holds it)."""
    sliced = optimizer.tp_slices
    out = {key: view.detach() for key, view in _named_views(optimizer)
           if coord is None or writes(coord, key, key in sliced)}
    emas = emas or optimizer.ema
    for family, seg, state in optimizer.segment_states():
        if coord is not None and coord.tp > 0 and seg.key not in sliced:
            continue  # every tp worker holds its share of what they all hold whole: tp 0 writes it
        if optimizer.mixed and save_master:
            out[piece_name(f"master.{seg.key}", seg.start)] = seg.of(family.master)
        if emas is not None:
            out[piece_name(f"ema.{seg.key}", seg.start)] = seg.of(emas[family.index])
        if save_optimizer:
            for key in ("exp_avg", "exp_avg_sq"):
                out[piece_name(f"optim.{key}.{seg.key}", seg.start)] = state[key]
            if seg.start == 0 and (coord is None or coord.tp == 0):
                # The step count is one scalar: its first element's holder writes it (of a
                # tp-sliced tensor, tp 0's).
                out[f"optim.step.{seg.key}"] = state["step"]
    return out


def global_shape(shapes: dict[str, torch.Size], name: str) -> tuple[int, ...]:
    """The shape of a tensor of the state by its name, from the weights' (`_key_shapes`)."""
    if name.startswith("optim.step."):
        return ()
    for prefix in ("master.", "ema.", "optim.exp_avg.", "optim.exp_avg_sq."):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    return tuple(shapes[name])


def _key_shapes(optimizer: MasterOptimizer) -> dict[str, torch.Size]:
    return {key: view.shape for key, view in _named_views(optimizer)}


def global_shapes(optimizer: MasterOptimizer) -> dict[str, tuple[int, ...]]:
    """The whole tensors' shapes of what this worker holds, by checkpoint name (of a tp
    slice, the tensor it is a slice of)."""
    return {key: tuple(optimizer.tp_slices[key][1]) if key in optimizer.tp_slices else tuple(shape)
            for key, shape in _key_shapes(optimizer).items()}


def _param_of(name: str) -> str | None:
    """The parameter a tensor of the state is shaped like (None: a step count, an RNG state)."""
    if name.startswith(("optim.step.", "rng.")):
        return None
    for prefix in ("master.", "ema.", "optim.exp_avg.", "optim.exp_avg_sq."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def checkpoint_pieces(optimizer: MasterOptimizer, tensors: dict[str, torch.Tensor]):
    """(name, tensor, offsets, global shape) of each tensor of a snapshot for `write_shard`:
    whole tensors at the origin, a tensor-parallel slice where it lies in the global tensor,
    a flat piece as the boxes its range covers."""
    pieces, shapes = [], _key_shapes(optimizer)
    for key, t in tensors.items():
        name, start = split_piece_name(key)
        held = optimizer.tp_slices.get(_param_of(name))
        if start is None and held is not None:
            part, whole = held
            pieces.append((name, t, part.offset(whole), whole))
            continue
        if start is None:
            pieces.append((name, t, (0,) * t.ndim, tuple(t.shape)))
            continue
        # A flat piece of this worker's tensor: of its tp slice, placed where the slice lies.
        shape = global_shape(shapes, name)
        origin, whole = (held[0].offset(held[1]), held[1]) if held is not None else ((0,) * len(shape), shape)
        flat, at = t.reshape(-1), 0
        for offsets, box in flat_range_boxes(shape, start, start + t.numel()):
            n = math.prod(box)
            pieces.append((name, flat[at:at + n].view(box), tuple(o + d for o, d in zip(offsets, origin)), whole))
            at += n
    return pieces


def rng_states(rank: int, device: torch.device) -> dict[str, torch.Tensor]:
    """This rank's generator states, as new CPU tensors."""
    out = {f"rng.rank{rank}.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        out[f"rng.rank{rank}.cuda"] = torch.cuda.get_rng_state(device)
    return out


def state_layout(optimizer: MasterOptimizer, coord: Coord | None, save_optimizer: bool = True,
                 save_master: bool = True) -> Layout:
    """Shape and dtype of the tensors `state_tensors` will return (RNG states aside), from
    the parameters alone: AdamW's moments are shaped like the masters."""
    if isinstance(optimizer, ShardedOptimizer):
        tensors = _sharded_tensors(optimizer, coord, save_optimizer, save_master, optimizer.ema)
        return {name: (t.shape, t.dtype) for name, t in tensors.items()}
    params = [(name, param.shape, param.dtype) for name, param, *_ in _written(optimizer, coord)]
    return params_layout(params, optimizer.mixed, save_optimizer, save_master, ema=optimizer.ema is not None)


def params_layout(params: Iterable[tuple[str, torch.Size, torch.dtype]], mixed: bool, save_optimizer: bool = True,
                  save_master: bool = True, ema: bool = False) -> Layout:
    """`state_layout` from parameters' (name, shape, dtype) alone (e.g. a meta-device stage's)."""
    out: Layout = {}
    for name, shape, dtype in params:
        out[name] = (shape, dtype)
        if ema:
            out[f"ema.{name}"] = (shape, torch.float32)
        master_dtype = torch.float32 if mixed else dtype  # mixed: fp32 masters; else the parameter is its master
        if mixed and save_master:
            out[f"master.{name}"] = (shape, master_dtype)
        if save_optimizer:
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"optim.{key}.{name}"] = (shape, master_dtype)
            # Fused AdamW counts steps in a float32 scalar on the parameter's device.
            out[f"optim.step.{name}"] = (torch.Size([]), torch.float32)
    return out


def names_to_load(optimizer: MasterOptimizer) -> set[str]:
    """The tensors a load of this worker's state reads: all it holds (a sharded share's
    pieces by their tensor's name), every weight's master (a sharded load reads it whole
    for the weight), and the step counts of its shares."""
    names = {split_piece_name(name)[0] for name in state_layout(optimizer, None)}
    if optimizer.mixed:
        names |= {f"master.{key}" for key, _ in _named_views(optimizer)}
    if isinstance(optimizer, ShardedOptimizer):
        # One rank holds each tensor's step count; every rank with a share of it reads it.
        names |= {f"optim.step.{seg.key}" for _, seg, _ in optimizer.segment_states()}
    return names


def takes_snapshots(cfg: Config) -> bool:
    """Whether a run copies state to host: checkpoint saves."""
    return cfg.checkpoint.every > 0


def snapshot_shapes_for_any_stage(cfg: Config, grid: Grid, everything: bool = False) -> list[tuple[torch.Size, torch.dtype]]:
    """Host buffers enough for the snapshot of whichever cell of `grid` a worker is given:
    each (shape, dtype) as often as the stage that needs it most, at dp and ep rank 0 (the
    ranks that write the most). A standby pins them while it waits. `everything`: a copy
    in memory's (elastic.memory_every), which holds the optimizer and masters whatever the
    checkpoint saves."""
    c = cfg.checkpoint
    optimizer, master = (True, True) if everything else (c.save_optimizer, c.save_master)
    # A sharded optimizer's pieces are shaped by the rank's share: only the weights are known.
    sharded = cfg.parallel.shard_optimizer
    most: Counter = Counter()
    layout = run_layout(cfg.parallel.schedule, grid.pp, cfg.parallel.chunks)
    for stage in range(grid.pp):
        params = stage_param_shapes(cfg.model, stage, grid.pp, cfg.parallel.layers_per_stage, 0, grid.ep, layout)
        mixed = any(dtype != torch.float32 for _, _, dtype in params)
        most |= Counter(params_layout(params, mixed, optimizer and not sharded, master and not sharded,
                                      c.ema_decay > 0 and not sharded).values())
    return list(most.elements())


def load_state(optimizer: MasterOptimizer, read, names: set[str], rank: int | None, device: torch.device,
               threads: int = 8, read_flat=None, own_slices: dict[str, torch.Tensor] | None = None) -> list[str]:
    """Fill parameters, masters and AdamW state from `read(name) -> Tensor`.

    `names` is what the checkpoint holds. Masters come from `master.<p>` when saved, else
    from the weights; an EMA (when kept) from `ema.<p>`, else it restarts from the
    weights. `rank` restores this rank's RNG (same grid only; None skips it).
    `read` runs on `threads` threads, in order, ahead of the copies (`read_ahead`).
    Returns the parameters that had no saved AdamW state (a checkpoint saved without it).
    A sharded optimizer also needs `read_flat(name, start, stop)`: a range of a tensor's
    elements in row-major order (`CheckpointReader.read_flat`, `FlatPieces.read_flat`).
    `own_slices`: tensors already cut to this worker's tp slice (by global name), read as they
    are rather than through `read`.
    """
    optimizer.settle_ema()
    if optimizer.tp_slices:
        read = _slice_reads(read, optimizer.tp_slices, own_slices)
    if isinstance(optimizer, ShardedOptimizer):
        missing = _load_sharded(optimizer, read, read_flat, names, threads)
        _load_rng(read, names, rank, device)
        return missing
    missing_optim, plan = [], []
    pieces = list(_pieces(optimizer))
    for name, _, _, _, ema in pieces:
        if name not in names:
            raise KeyError(name)
        plan.append(f"master.{name}" if optimizer.mixed and f"master.{name}" in names else name)
        if ema is not None and f"ema.{name}" in names:
            plan.append(f"ema.{name}")
        if f"optim.exp_avg.{name}" in names:
            plan += [f"optim.{key}.{name}" for key in ADAM_STATE]
        else:
            missing_optim.append(name)
    values = read_ahead(read, plan, threads)
    with host_copies(device) as copies:
        for name, _, master, state, ema in pieces:
            copies.copy(master, next(values))
            if ema is not None and f"ema.{name}" in names:
                copies.copy(ema, next(values))
            if name not in missing_optim:
                for key in ADAM_STATE:
                    # Into the tensors the optimizer made at start (a checkpoint keeps step counts as [1]).
                    copies.copy(state[key], next(values))
    with torch.no_grad():  # what is made from the masters, once they are in
        for name, param, master, state, ema in pieces:
            if optimizer.mixed:
                param.copy_(master)
            if ema is not None and f"ema.{name}" not in names:
                ema.copy_(master)
            if name in missing_optim:
                for t in state.values():
                    t.zero_()  # AdamW starts fresh, on a live worker too
    _load_rng(read, names, rank, device)
    return missing_optim


def tp_named(tensors: dict, slices: dict) -> dict:
    """`tensors` (or a layout) of a worker's whole state with each tensor-parallel slice
    named as such (`tp_piece_name`; a sharded optimizer's flat piece of one as
    `piece_name(tp_piece_name(...), start)`): a copy in memory holds every tp worker's slices
    of one tensor side by side, and a restore joins them (`whole_slices`, `join_tp_pieces`)."""
    if not slices:
        return tensors
    out = {}
    for key, value in tensors.items():
        name, start = split_piece_name(key)
        held = slices.get(_param_of(name))
        if held is None:
            out[key] = value
            continue
        sliced = tp_piece_name(name, held[0])
        out[sliced if start is None else piece_name(sliced, start)] = value
    return out


def whole_slices(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """`tensors` from copies in memory with the flat pieces of each tp slice (several dp
    ranks' shares of it) put together into the slice, shaped by its tensor's global shape in
    `shapes` (by parameter name); the rest as they are. A piece missing is an error."""
    out, flat = {}, {}
    for key, t in tensors.items():
        name, start = split_piece_name(key)
        (flat if start is not None and split_tp_piece_name(name)[1] is not None else out)[key] = t
    pieces = FlatPieces(flat)
    for name in pieces.names:
        tensor, part = split_tp_piece_name(name)
        shape = list(shapes[_param_of(tensor)])
        start, stop = part.bounds(shape[part.dim])
        shape[part.dim] = stop - start
        out[name] = pieces.read(name).reshape(shape)
    return out


def own_slice_keys(names: Iterable[str], slices: dict) -> dict[str, str]:
    """Of `names` (global names), those this worker holds a tensor-parallel slice of, mapped to
    the key a copy in memory names that very slice by (`tp_named`)."""
    out = {}
    for name in names:
        held = slices.get(_param_of(name))
        if held is not None:
            out[name] = tp_piece_name(name, held[0])
    return out


def split_own_slices(tensors: dict[str, torch.Tensor], slices: dict) -> tuple[dict[str, torch.Tensor],
                                                                              dict[str, torch.Tensor]]:
    """(own, rest): the tp slices in `tensors` that are this worker's own slice (by global name:
    loaded as they are, no other tp rank's needed), and the rest, without other slices of those."""
    own = {}
    for key, t in tensors.items():
        name, part = split_tp_piece_name(key)
        held = slices.get(_param_of(name)) if part is not None else None
        if held is not None and key == tp_piece_name(name, held[0]):
            own[name] = t
    rest = {key: t for key, t in tensors.items() if split_tp_piece_name(key)[0] not in own}
    return own, rest


def _slice_reads(read, slices: dict, own: dict[str, torch.Tensor] | None = None) -> Callable[[str], torch.Tensor]:
    """`read` whole tensors, cut to this worker's tensor-parallel slice where it holds one
    (a checkpoint of any tp loads: it stores the global tensors); `own`: tensors already
    cut to this worker's slice, by global name."""
    own = own or {}

    def read_slice(name: str) -> torch.Tensor:
        if name in own:
            return own[name]
        held = slices.get(_param_of(name))
        return read(name) if held is None else held[0].of(read(name))

    return read_slice


def _load_rng(read, names: set[str], rank: int | None, device: torch.device) -> None:
    if rank is not None and f"rng.rank{rank}.cpu" in names:
        torch.set_rng_state(read(f"rng.rank{rank}.cpu"))
        if device.type == "cuda" and f"rng.rank{rank}.cuda" in names:
            torch.cuda.set_rng_state(read(f"rng.rank{rank}.cuda"), device)


def _load_sharded(optimizer: ShardedOptimizer, read, read_flat, names: set[str], threads: int) -> list[str]:
    """`load_state` for a sharded optimizer: every weight whole (its masters' share sliced
    from it), this rank's ranges of the moments and EMA."""
    optimizer.wait_for_weights()  # no gather may write the weights after the load
    shapes = _key_shapes(optimizer)

    def range_of(name: str, seg) -> torch.Tensor:
        """A segment's elements of `name`: a range of this worker's tp slice (read whole,
        through `read`, which cuts it), else a range of the global tensor."""
        if _param_of(name) in optimizer.tp_slices:
            return read(name).reshape(-1)[seg.start:seg.stop]
        return read_flat(name, seg.start, seg.stop)

    by_key = optimizer.segments_by_key()
    keys = list(shapes)
    reads, missing = [], []
    for key in keys:
        if key not in names:
            raise KeyError(key)
        source = f"master.{key}" if optimizer.mixed and f"master.{key}" in names else key
        reads.append(lambda source=source: read(source))
        for _, seg, _ in by_key.get(key, []):
            for name in (f"ema.{key}" if optimizer.ema is not None else None,
                         f"optim.exp_avg.{key}", f"optim.exp_avg_sq.{key}"):
                if name in names:
                    reads.append(lambda name=name, seg=seg: range_of(name, seg))
            if f"optim.exp_avg.{key}" in names:
                reads.append(lambda key=key: read(f"optim.step.{key}"))
            elif key not in missing:
                missing.append(key)
    values = read_ahead(lambda call: call(), reads, threads)
    device = optimizer.master[0].device if optimizer.master else torch.device("cpu")
    with host_copies(device) as copies:
        for key in keys:
            # The weight is read whole: the masters' share is a slice of it.
            optimizer.set_weight(key, next(values).reshape(shapes[key]), copies.copy)
            for family, seg, state in by_key.get(key, []):
                if optimizer.ema is not None and f"ema.{key}" in names:
                    copies.copy(seg.of(optimizer.ema[family.index]), next(values))
                if f"optim.exp_avg.{key}" in names:
                    for name in ADAM_STATE:
                        copies.copy(state[name], next(values))
    with torch.no_grad():  # what is made from the masters, once they are in
        for key in keys:
            for family, seg, state in by_key.get(key, []):
                if optimizer.ema is not None and f"ema.{key}" not in names:
                    seg.of(optimizer.ema[family.index]).copy_(seg.of(family.master))
                if f"optim.exp_avg.{key}" not in names:
                    for t in state.values():
                        t.zero_()
    return missing


def _named_views(optimizer: MasterOptimizer):
    for name, param in optimizer.named_params:
        for key, index in optimizer.slices[name]:
            yield key, param.detach()[index]


def read_ahead(read: Callable[[str], torch.Tensor], names: list[str], threads: int) -> Iterator[torch.Tensor]:
    """`read(name)` for each of `names`, in order, with up to 2 x `threads` reads in flight.

    A load waits on reading and checking the checkpoint's bytes (CRC32 releases the GIL),
    not on copying them to the device: in parallel it takes a fraction of the time.
    """
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="checkpoint-read") as pool:
        queue = iter(names)
        pending = deque(pool.submit(read, n) for _, n in zip(range(2 * threads), queue))
        while pending:
            value = pending.popleft().result()
            nxt = next(queue, None)
            if nxt is not None:
                pending.append(pool.submit(read, nxt))
            yield value
