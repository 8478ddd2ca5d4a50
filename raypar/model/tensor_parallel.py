"""Tensor parallelism inside a stage: the pieces a layer split over `tp` ranks is made of.

Megatron's scheme, written for raypar's layers (issue 30). `Transformer(tp=TensorParallel(
rank, size))` builds a stage's slice; the grid's `tp` dimension runs one worker per slice
(`parallel.tp`); checkpoints hold each slice as a piece of its global tensor.

- a *column-parallel* linear holds a slice of the output features: its input must be the
  whole activation on every rank (`to_tensor_parallel`: identity forward, gradients summed
  over the ranks in backward), and its output is that rank's slice;
- a *row-parallel* linear holds the matching slice of the input features: its partial
  outputs are summed over the ranks (`from_tensor_parallel`: all-reduce forward, identity
  backward), which gives every rank the whole activation again;
- the vocabulary is split the same way: `vocab_parallel_cross_entropy` takes each rank's
  slice of the logits and returns the loss without ever holding all of them.

Attention splits by heads (query heads and key/value groups: column-parallel wq, wk, wv,
row-parallel wo) and the SwiGLU MLP is column- then row-parallel (w1, w3 then w2), so a
block costs two all-reduces forward and two backward.

Where tp does not divide a part's preferred dimension (heads, hidden units, vocabulary),
`split_parts` falls back to the model dimension, the other dimension of its weights: each
rank multiplies its slice of the input features, the partial products are summed, the part
runs whole on every rank between its linears, and the output's feature slices are
gathered (more traffic, the same memory saving). When tp divides neither, every rank holds
the part whole. The driver logs each fallback. Slices are named by the global tensor they
come from (`Slice`), so a checkpoint keeps pieces of the global tensors and loads on any tp.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from raypar.config import ModelConfig
from raypar.model.split_backward import run_while_exchanging


# Elements a piece of the MLP's hidden units starts at a multiple of: a bf16 row of a
# multiple of 8 is 16 bytes, what Hopper's GEMM kernels need of their operands' rows (a
# 5,464-wide MLP halved into 2,732-wide pieces ran cuBLAS's 4-byte-aligned sm80 kernels at
# half the speed; pieces of 2,728 and 2,736 run the Hopper ones).
ALIGN = 8


@dataclass(frozen=True)
class Slice:
    """Which part of a global tensor one tp rank holds: `dim` cut into `parts` pieces, this
    rank's is `index`; dim None: the whole tensor (replicated over tp). The pieces are equal,
    or with `align` > 1 start at multiples of `align` elements (where the dimension is a
    multiple of it): then they may differ by `align`."""
    dim: int | None
    index: int
    parts: int
    why_replicated: str = ""
    align: int = 1

    def bounds(self, size: int, index: int | None = None) -> tuple[int, int]:
        """Where piece `index` (default: this rank's) of a dimension of `size` starts and stops."""
        i = self.index if index is None else index
        step = self.align if size % self.align == 0 else 1
        units = size // step
        return step * (i * units // self.parts), step * ((i + 1) * units // self.parts)

    def lengths(self, size: int) -> list[int]:
        """Every piece's length along a dimension of `size`, by index."""
        return [stop - start for start, stop in (self.bounds(size, i) for i in range(self.parts))]

    def of(self, full: Tensor) -> Tensor:
        """This rank's piece of the global tensor `full` (a view)."""
        if self.dim is None:
            return full
        start, stop = self.bounds(full.shape[self.dim])
        return full.narrow(self.dim, start, stop - start)

    def offset(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Where this piece starts in a global tensor of `shape`, per dimension."""
        if self.dim is None:
            return (0,) * len(shape)
        return tuple(self.bounds(shape[d])[0] if d == self.dim else 0 for d in range(len(shape)))


# The parts of a stage tp splits, each by the model keys whose sizes it prefers to cut.
PREFERRED = {
    "attention": ("model.n_heads", "model.n_kv_heads"),
    "mlp": ("model.ffn_dim",),  # the dense MLPs (their hidden size): MoE layers are whole on every tp rank
    "vocabulary": ("model.vocab_size",),  # the embedding and the head
}


@dataclass(frozen=True)
class PartSplit:
    """How one part of the model is split over the tp ranks: `along` the model key whose
    size each rank holds a slice of (its first preferred key, or "model.dim" as the
    fallback), None when every rank holds the part whole; `why` when it is not the
    preferred split."""
    part: str
    along: str | None
    why: str = ""


def split_parts(cfg: ModelConfig, tp: int) -> dict[str, PartSplit]:
    """How `PREFERRED`'s parts split over `tp` ranks: along their preferred keys when tp
    divides all of them, else along model.dim when tp divides it, else whole."""
    sizes = {"model.n_heads": cfg.n_heads, "model.n_kv_heads": cfg.kv_heads, "model.ffn_dim": cfg.hidden_dim,
             "model.vocab_size": cfg.vocab_size}
    out = {}
    for part, keys in PREFERRED.items():
        odd = [f"{key}={sizes[key]}" for key in keys if sizes[key] % tp]
        if not odd:
            out[part] = PartSplit(part, keys[0])
        elif cfg.dim % tp == 0:
            out[part] = PartSplit(part, "model.dim", f"{' and '.join(odd)} {'is not a multiple' if len(odd) == 1 else 'are not multiples'} "
                                                     f"of parallel.tp={tp}: split along model.dim={cfg.dim} "
                                                     f"instead (its outputs are gathered)")
        else:
            out[part] = PartSplit(part, None, f"parallel.tp={tp} divides none of {', '.join(odd)}, model.dim={cfg.dim}: "
                                              f"every tp worker holds it whole")
    return out


def fallbacks(cfg: ModelConfig, tp: int) -> list[str]:
    """One line per part that does not split as preferred (what a plan says)."""
    return [f"tensor parallelism: {split.part}: {split.why}" for split in split_parts(cfg, tp).values() if split.why]


def _either(group, backward_group):
    """The group backward's collective runs on: `backward_group` where the runtime made one."""
    return group if backward_group is None else backward_group


class _ToTensorParallel(torch.autograd.Function):
    """Identity forward; backward sums the input gradients of the tp ranks (each rank's
    column slice contributed part of it) over `backward_group`."""

    @staticmethod
    def forward(ctx, x: Tensor, backward_group) -> Tensor:
        ctx.group = backward_group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        work = dist.all_reduce(grad, group=ctx.group, async_op=True)
        run_while_exchanging()
        work.wait()
        return grad, None


class _FromTensorParallel(torch.autograd.Function):
    """Sums the tp ranks' partial outputs forward; identity backward (every rank's slice
    needs the whole output gradient, which every rank has)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def to_tensor_parallel(x: Tensor, group, backward_group=None) -> Tensor:
    """The input of column-parallel layers (see the module). `backward_group`: the
    communicator over `group`'s ranks that backward's sum uses (`TensorParallel`); None: `group`."""
    return x if group is None else _ToTensorParallel.apply(x, _either(group, backward_group))


def from_tensor_parallel(x: Tensor, group) -> Tensor:
    """The sum of row-parallel layers' partial outputs (see the module)."""
    return x if group is None else _FromTensorParallel.apply(x, group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, first: int, group, ignore_index: int) -> Tensor:
        # logits [n, v_local] fp32: this rank's vocabulary first .. first + v_local - 1.
        local_max = logits.max(dim=-1).values
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        dist.all_reduce(total, group=group)
        v_local = logits.shape[-1]
        valid = labels != ignore_index
        mine = valid & (labels >= first) & (labels < first + v_local)
        index = torch.where(mine, labels - first, 0)
        target = torch.where(mine, shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1), 0.0)
        dist.all_reduce(target, group=group)
        count = valid.sum().clamp(min=1)
        per_token = torch.where(valid, total.log() - target, 0.0)
        ctx.save_for_backward(exp, total, index, mine, valid, count)
        return per_token.sum() / count

    @staticmethod
    def backward(ctx, grad: Tensor):
        exp, total, index, mine, valid, count = ctx.saved_tensors
        # d loss / d logit = softmax - one_hot(label), for valid tokens, over the token count.
        g = exp / total.unsqueeze(-1)
        g.scatter_add_(-1, index.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        g = g * (valid.to(g.dtype) / count).unsqueeze(-1) * grad
        return g, None, None, None, None


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, first: int, group,
                                 ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy over the tokens whose label is not `ignore_index`, from this rank's
    slice of the logits [n, v_local] (vocabulary ids first .. first + v_local - 1) and the
    labels [n]; every rank of `group` gets the same loss, and the gradient of its own slice.
    The same as `F.cross_entropy` on the gathered logits, which no rank holds."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"vocab_parallel_cross_entropy: logits [n, v_local] and labels [n], got "
                         f"{tuple(logits.shape)} and {tuple(labels.shape)}")
    if group is None:
        return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=ignore_index)
    return _VocabParallelCrossEntropy.apply(logits.float(), labels, first, group, ignore_index)


class TensorParallel:
    """This rank's place among the `size` ranks a stage's layers are split over: every split
    layer holds it, and the runtime sets `group` (their process group) once it exists.
    `sequence`: between the split layers (norms, residuals, the hidden states a stage sends)
    each rank holds a slice of the sequence instead of all of it (sequence parallelism)."""

    def __init__(self, rank: int, size: int, sequence: bool = False) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is not in 0..{size - 1}")
        self.rank, self.size, self.sequence = rank, size, sequence
        self.group = None
        # A second communicator over the same ranks for backward's collectives, set by the
        # runtime where a forward runs beside another micro-batch's backward
        # (`runtime.tp_microbatch_overlap`): each direction then reaches its collectives in
        # the same order on every rank. None: `group`.
        self.backward_group = None

    def enter(self, x: Tensor) -> Tensor:
        """The whole input of column-parallel layers from what the residual stream holds."""
        if self.sequence:
            return gather_sequence(x, self.group, self.backward_group)
        return to_tensor_parallel(x, self.group, self.backward_group)

    def leave(self, x: Tensor) -> Tensor:
        """Row-parallel layers' partial outputs summed into what the residual stream holds."""
        if self.sequence:
            return reduce_scatter_sequence(x, self.group, self.backward_group)
        return from_tensor_parallel(x, self.group)

    def part(self, cfg: ModelConfig, name: str) -> PartSplit:
        """How `name` (a key of `PREFERRED`) of a model of `cfg` splits over these ranks."""
        return split_parts(cfg, self.size)[name]

    # A part split along model.dim (see the module): its input's feature slice, the sum of
    # the partial products, the whole activation going into the next split linear, and its
    # output's feature slices gathered into what the residual stream holds.

    def feature_slice(self, x: Tensor) -> Tensor:
        return self.enter(x).chunk(self.size, dim=-1)[self.rank]

    def sum_partials(self, y: Tensor) -> Tensor:
        return from_tensor_parallel(y, self.group)

    def into_split(self, a: Tensor) -> Tensor:
        return to_tensor_parallel(a, self.group, self.backward_group)

    def gather_features(self, y: Tensor) -> Tensor:
        y = gather_from_tensor_parallel(y, self.group)
        return split_sequence(y, self.group, self.backward_group) if self.sequence else y

    # A part every rank holds whole. Under sequence parallelism it runs on the whole sequence
    # and keeps this rank's slice of its output: its weights' gradients are then partial, and
    # are summed over tp with the norms'.

    def whole_in(self, x: Tensor) -> Tensor:
        return gather_sequence(x, self.group, self.backward_group) if self.sequence else x

    def whole_out(self, y: Tensor) -> Tensor:
        return y.chunk(self.size, dim=1)[self.rank].contiguous() if self.sequence else y

    def piece(self, size: int, align: int = 1) -> int:
        """How much of a dimension of `size` this rank holds (`Slice.bounds`)."""
        start, stop = Slice(0, self.rank, self.size, align=align).bounds(size)
        return stop - start

    def mark(self, module: torch.nn.Module, param: str, global_shape: tuple[int, ...], dim: int,
             align: int = 1) -> None:
        """Record that `module`'s parameter `param` is this rank's slice along `dim` of a
        tensor of `global_shape` (what initialisation and checkpoints read back; on the module,
        which keeps it when a meta build's parameters are replaced)."""
        if not hasattr(module, "tp_slices"):
            module.tp_slices = {}
        module.tp_slices[param] = (Slice(dim, self.rank, self.size, align=align), tuple(global_shape))


def tp_slices(module: torch.nn.Module) -> dict[str, tuple[Slice, tuple[int, ...]]]:
    """Every tensor-parallel slice among `module`'s parameters, by parameter name."""
    return {f"{name}.{p}" if name else p: held for name, mod in module.named_modules()
            for p, held in getattr(mod, "tp_slices", {}).items()}


class _GatherFromTensorParallel(torch.autograd.Function):
    """Every rank's slice along the last dimension, concatenated; backward keeps this rank's."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.rank, ctx.size = dist.get_rank(group), dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


def gather_from_tensor_parallel(x: Tensor, group) -> Tensor:
    """The whole of a tensor split along its last dimension (e.g. logits by vocabulary)."""
    return x if group is None else _GatherFromTensorParallel.apply(x, group)


def vocab_parallel_embedding(tokens: Tensor, embed: torch.nn.Embedding, first: int, group,
                             sequence: bool = False, backward_group=None) -> Tensor:
    """Embedding rows of `tokens` from this rank's slice of the table, `embed` (vocabulary ids
    first .. first + rows - 1); the other ranks' rows come in the all-reduce, as zeros from
    here (`sequence`: a reduce-scatter, each rank keeping its slice of the sequence). The
    module is called, not its weight read: what runs before a module's forward (a sharded
    optimizer waiting for its weights' gather) runs here too."""
    if group is None:
        return embed(tokens)
    mine = (tokens >= first) & (tokens < first + embed.num_embeddings)
    rows = embed(torch.where(mine, tokens - first, 0))
    rows = rows * mine.unsqueeze(-1).to(rows.dtype)
    return reduce_scatter_sequence(rows, group, backward_group) if sequence else from_tensor_parallel(rows, group)


_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _gather_dim1(x: Tensor, group) -> Tensor:
    """[b, t/size, ...] slices into [b, t, ...]: gathered rank after rank as they are, then
    put in sequence order by one copy."""
    size = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather(out, x, group=group)
    blocks = out.view(size, *x.shape)  # [size, b, t/size, ...]
    return blocks.transpose(0, 1).reshape(x.shape[0], size * x.shape[1], *x.shape[2:])


def _reduce_scatter_dim1(x: Tensor, group, overlap: bool = False) -> Tensor:
    """[b, t, ...] partial sums into this rank's summed [b, t/size, ...]: one copy puts each
    rank's slice in a block of its own, which the reduce-scatter's output is as it lands.
    `overlap`: in backward, compute the weight gradients waiting so far while it travels."""
    size = dist.get_world_size(group)
    b, t = x.shape[:2]
    if t % size:
        raise ValueError(f"a sequence of {t} tokens does not split over {size} tensor-parallel ranks")
    blocks = x.reshape(b, size, t // size, *x.shape[2:]).transpose(0, 1).contiguous()  # [size, b, t/size, ...]
    out = torch.empty(blocks.shape[1:], dtype=x.dtype, device=x.device)
    work = _reduce_scatter(out, blocks.view(size * b, *blocks.shape[2:]), group=group, async_op=True)
    if overlap:
        run_while_exchanging()
    work.wait()
    return out


class _SequenceExchange(torch.autograd.Function):
    """Along the sequence (dim 1): forward all-gathers the ranks' slices (`gather`) or
    reduce-scatters their partial sums; backward does the other (over `backward_group`),
    each the other's adjoint."""

    @staticmethod
    def forward(ctx, x: Tensor, group, gather: bool, backward_group) -> Tensor:
        ctx.group, ctx.gather = backward_group, gather
        return (_gather_dim1 if gather else _reduce_scatter_dim1)(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        if ctx.gather:  # the input gradient of column-parallel layers: their weights' can run beside it
            return _reduce_scatter_dim1(grad, ctx.group, overlap=True), None, None, None
        return _gather_dim1(grad, ctx.group), None, None, None


class _SplitSequence(torch.autograd.Function):
    """This rank's slice of a sequence every rank holds whole (and the same on every rank);
    backward gathers the ranks' gradients of their slices into the whole one."""

    @staticmethod
    def forward(ctx, x: Tensor, group, backward_group) -> Tensor:
        ctx.group = backward_group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return x.chunk(size, dim=1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _gather_dim1(grad, ctx.group), None, None


def split_sequence(x: Tensor, group, backward_group=None) -> Tensor:
    """[b, t, ...], the same on every rank, to this rank's [b, t / tp, ...] slice.
    `backward_group` (here and below): see `to_tensor_parallel`."""
    return x if group is None else _SplitSequence.apply(x, group, _either(group, backward_group))


def gather_sequence(x: Tensor, group, backward_group=None) -> Tensor:
    """[b, t / tp, ...] slices of the sequence to [b, t, ...] on every rank (sequence parallelism)."""
    return x if group is None else _SequenceExchange.apply(x, group, True, _either(group, backward_group))


def reduce_scatter_sequence(x: Tensor, group, backward_group=None) -> Tensor:
    """[b, t, ...] partial sums to this rank's [b, t / tp, ...] slice of their sum."""
    return x if group is None else _SequenceExchange.apply(x, group, False, _either(group, backward_group))


def gather_whole(tensors: dict[str, Tensor], slices: dict[str, tuple[Slice, tuple[int, ...]]], group) -> dict[str, Tensor]:
    """`tensors` by global name, this rank's slices joined with the other tp ranks' into whole
    tensors (a collective over `group`: every rank calls it with the same names in the same
    order); tensors not in `slices` are whole already."""
    out = {}
    for name, t in tensors.items():
        held = slices.get(name)
        if held is None or held[0].dim is None or group is None:
            out[name] = t
            continue
        part, shape = held
        dim, sizes = part.dim, part.lengths(shape[part.dim])
        # Pieces may differ in size (aligned pieces): gathered padded to the largest.
        padded = list(t.shape)
        padded[dim] = max(sizes)
        mine = t.new_zeros(padded)
        mine.narrow(dim, 0, t.shape[dim]).copy_(t)
        parts = [torch.empty_like(mine) for _ in sizes]
        dist.all_gather(parts, mine, group=group)
        out[name] = torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)
    return out


def largest_piece(part: Slice, shape: tuple[int, ...]) -> int:
    """Elements of the largest of `part`'s sibling pieces of a global tensor of `shape`."""
    if part.dim is None:
        return math.prod(shape)
    return math.prod(shape) // shape[part.dim] * max(part.lengths(shape[part.dim]))


def slice_whole(tensors: dict[str, Tensor], slices: dict[str, tuple[Slice, tuple[int, ...]]]) -> dict[str, Tensor]:
    """Whole tensors by global name, cut to this rank's slices where it holds slices."""
    return {name: slices[name][0].of(t) if name in slices else t for name, t in tensors.items()}


# A tensor-parallel slice held in memory under its global tensor's name (a copy in memory,
# `elastic.memory_every`): `<name>#tp<dim>.<index>.<parts>[.<align>]`.
_TP_SEP = "#tp"


def tp_piece_name(name: str, part: Slice) -> str:
    align = f".{part.align}" if part.align > 1 else ""
    return f"{name}{_TP_SEP}{part.dim}.{part.index}.{part.parts}{align}"


def split_tp_piece_name(key: str) -> tuple[str, Slice | None]:
    """(global name, slice) of a `tp_piece_name`; (key, None) for a whole tensor's name."""
    name, sep, spec = key.rpartition(_TP_SEP)
    if not sep:
        return key, None
    dim, index, parts, *align = (int(v) for v in spec.split("."))
    return name, Slice(dim, index, parts, align=align[0] if align else 1)


def join_tp_pieces(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """`tensors` with every tensor held as tp slices (`tp_piece_name`) joined whole; a slice
    whose siblings are not all there is an error naming what is missing."""
    out: dict[str, Tensor] = {}
    pieces: dict[str, dict[int, tuple[Slice, Tensor]]] = {}
    for key, t in tensors.items():
        name, part = split_tp_piece_name(key)
        if part is None:
            out[key] = t
        else:
            pieces.setdefault(name, {})[part.index] = (part, t)
    for name, held in pieces.items():
        part = next(iter(held.values()))[0]
        missing = sorted(set(range(part.parts)) - set(held))
        if missing:
            raise KeyError(f"{name}: tensor-parallel slices {missing} of {part.parts} are not among the tensors given")
        out[name] = torch.cat([held[i][1] for i in range(part.parts)], dim=part.dim)
    return out
