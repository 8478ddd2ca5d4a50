"""A rank's experts as stacked weights, run as one grouped GEMM per projection.

`GroupedExperts` holds expert `ids[j]` of a MoE layer in slice j of two parameters:
`w13` [n, 2 * hidden, dim] (gate rows, then up rows: one GEMM for both) and `w2`
[n, dim, hidden]. Rows arrive grouped by expert; `ends[g]` is where group g ends. On a
GPU the projections are torch's `grouped_mm` (one kernel for every expert,
whatever its row count, and no split sizes on the host); on the CPU the same grouped
calls with their gradients written out; unaligned shapes loop over the groups.

Checkpoints, the optimizer's named views and Hugging Face export still name every
expert's weights apart (`layers.<i>.mlp.experts.<j>.w1.weight`, w2, w3): `named_slices`
maps a stacked parameter to those names and the slices that hold them, so a checkpoint
does not depend on how many experts a rank stacks and loads on any expert-parallel grid.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raypar.kernels import swiglu
from raypar.model.split_backward import defer_weight_grad

# Grouped GEMM kernels read each group's rows with 16-byte aligned accesses.
ALIGN_BYTES = 16
# Public from torch 2.10; the same op before that.
_grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm


class GroupedExperts(nn.Module):
    """Experts `ids` of one MoE layer, each a SwiGLU MLP, in that order."""

    split_backward = False  # set by `split_backward.set_split_backward`

    def __init__(self, dim: int, hidden: int, ids: Sequence[int], dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.ids, self.count, self.hidden = list(ids), len(ids), hidden
        self.w13 = nn.Parameter(torch.empty(self.count, 2 * hidden, dim, dtype=dtype))
        self.w2 = nn.Parameter(torch.empty(self.count, dim, hidden, dtype=dtype))

    def forward(self, rows: Tensor, ends: Tensor) -> Tensor:
        """rows [r, dim] grouped by expert; ends int32 [count], cumulative. Rows past
        ends[-1] are not computed: their outputs are undefined and must not be read."""
        split = self.split_backward and torch.is_grad_enabled()
        return grouped_linear(swiglu(grouped_linear(rows, self.w13, ends, split)), self.w2, ends, split)

    def slices(self, prefix: str) -> dict[str, list[tuple[str, tuple]]]:
        """Checkpoint names of each expert's weights and where they sit in the stacks."""
        h = self.hidden
        w13, w2 = [], []
        for j in range(self.count):
            name = f"{prefix}.{self.ids[j]}"
            w13 += [(f"{name}.w1.weight", (j, slice(0, h))), (f"{name}.w3.weight", (j, slice(h, 2 * h)))]
            w2.append((f"{name}.w2.weight", (j,)))
        return {f"{prefix}.w13": w13, f"{prefix}.w2": w2}


def named_slices(module: nn.Module) -> dict[str, list[tuple[str, tuple]]]:
    """For each parameter of `module` (by its name there): the tensors a checkpoint keeps of
    it, as (checkpoint name, index into the parameter). Most parameters are one tensor under
    their own name (index `()`); stacked experts are one per expert and weight."""
    out = {name: [(name, ())] for name, _ in module.named_parameters()}
    for prefix, mod in module.named_modules():
        if isinstance(mod, GroupedExperts):
            out.update(mod.slices(prefix))
    return out


def unstacked(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """`module`'s parameters as checkpoints name them: views, one per expert for stacks."""
    slices = named_slices(module)
    for name, param in module.named_parameters():
        for key, index in slices[name]:
            yield key, param.detach()[index]  # no autograd node: see ShardedOptimizer._views


def load_unstacked(module: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Copy `tensors` (checkpoint names) into `module`'s parameters; every one must be there."""
    slices = named_slices(module)
    wanted = {key for keys in slices.values() for key, _ in keys}
    missing, unexpected = sorted(wanted - set(tensors)), sorted(set(tensors) - wanted)
    if missing or unexpected:
        raise KeyError(f"load_unstacked: missing {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, param in module.named_parameters():
            for key, index in slices[name]:
                param[index].copy_(tensors[key])


def group_alignment(x: Tensor) -> int:
    """Rows each group is padded to a multiple of, so a GPU grouped GEMM may read them."""
    return ALIGN_BYTES // x.element_size() if x.is_cuda else 1


def grouped_layout(group: Tensor, counts: Tensor, align: int) -> tuple[Tensor, Tensor, int]:
    """Where rows sorted by group go when each group starts at a multiple of `align`.

    group: each row's group, non-decreasing [r]; counts [g] rows per group (the rows of
    groups past the last count, e.g. dropped ones, sort after every group). Returns each
    row's position, the groups' int32 ends for `grouped_linear` (the last group runs up to
    the end, padding and trailing rows included: they get zero weight) and the padded row
    count, known on the host without reading the device.
    """
    r, g = group.numel(), counts.numel()
    if align == 1:
        return torch.arange(r, device=group.device), _last_is(counts.cumsum(0), r), r
    # One extra group holds the trailing rows; every group grows by at most align - 1.
    counts = torch.cat([counts, (r - counts.sum()).reshape(1)])
    padded = (counts + align - 1) // align * align
    shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)
    position = torch.arange(r, device=group.device) + shift[group.clamp(max=g)]
    total = r + (g + 1) * (align - 1)
    return position, _last_is(padded.cumsum(0)[:g], total), total


def _last_is(ends: Tensor, value: int) -> Tensor:
    # Not ends[-1] = value: setting one element from the host is a synchronous copy.
    return torch.cat([ends[:-1], ends.new_full((1,), value)]).to(torch.int32)


def grouped_linear(x: Tensor, w: Tensor, ends: Tensor, split: bool = False) -> Tensor:
    """Rows of group i times w[i].T: x [r, in] grouped, w [g, out, in], ends int32 [g].
    Rows past ends[-1] are not computed (their outputs are undefined). `split`: the weight's
    gradient may be deferred (`split_backward`); shapes that loop over groups stay whole."""
    if x.shape[0] == 0:
        return x @ w[0].t()  # empty, but on the graph: an all-to-all's backward must still run
    if _aligned(x, w):
        if x.is_cuda and x.dtype == torch.bfloat16 and not split:
            return _grouped_mm(x, w.transpose(-2, -1), offs=ends)
        if not x.is_cuda or x.dtype == torch.bfloat16:
            return _GroupedLinear.apply(x, w, ends)
    return _looped_linear(x, w, ends)


def _aligned(x: Tensor, w: Tensor) -> bool:
    step = ALIGN_BYTES // x.element_size()
    return x.shape[1] % step == 0 and w.shape[1] % step == 0


class _GroupedLinear(torch.autograd.Function):
    """The grouped GEMM with its two gradients as grouped GEMMs too: the CPU's grouped_mm has
    no backward of its own, and the weight's gradient may wait (`split_backward`)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
        ctx.save_for_backward(x, w, ends)
        ctx.parameter = w  # not the saved tensor: see split_backward._SplitLinear
        return _grouped_mm(x, w.transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, w, ends = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = _grouped_mm(grad, w, offs=ends) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return grad_x, None, None

        def weight_grad() -> Tensor:
            # [g, out, in] from the rows of each group: the weight's own layout, no copy.
            return _grouped_mm(grad.t(), x, offs=ends)

        if defer_weight_grad(ctx.parameter, weight_grad, (x, grad)):
            return grad_x, None, None
        return grad_x, weight_grad(), None


def _looped_linear(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    # Shapes no grouped kernel takes (or fp32 on a GPU): the host needs the ends.
    bounds = [0, *ends.tolist()]
    out = [x[a:b] @ w[i].t() for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    if bounds[-1] < x.shape[0]:  # rows past the last group, as grouped_mm leaves them
        out.append(x.new_zeros((x.shape[0] - bounds[-1], w.shape[1])))
    return torch.cat(out)
