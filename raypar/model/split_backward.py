"""Backward split at the source into input gradients (I) and weight gradients (W).

Zero-bubble pipeline schedules run a micro-batch's backward in two parts: I, the gradient
of the stage's input, which the previous stage waits for, and W, the gradients of the
weights, which can wait for a bubble. Walking the autograd graph to split it is slow and
breaks on custom autograd functions; instead every linear layer of the model (`Linear`)
splits its own backward. While a stage runs I inside `weight_grads_deferred(key)`, each
linear layer computes only its input's gradient and leaves what its weight's gradient needs
(its input and its output's gradient, already held for backward) under `key`;
`compute_weight_grads(key)` is W. Nothing is computed twice, and the gradients equal the
whole backward's: the same products, added to the weights' gradients the same way (through
autograd's accumulation, so hooks on the parameters, e.g. a master copy's, still run).

Only layers built in split mode (`set_split_backward(model, True)`) take part: `Linear` and
the stacked experts' grouped GEMMs (`experts.GroupedExperts`). A whole backward (B) of such
a layer computes both gradients at once, as usual. Norm weights and other small parameters
get their gradients in I. A `Linear` whose weight has an fp32 main gradient attached
(`main_grad`) adds its weight gradient into it, at B or at W, rather than through autograd.

The same split hides an MoE layer's all-to-alls in a whole backward
(`weight_grads_deferred(key, overlap=True)`): the weight gradients wait only until the next
exchange leaves, which then computes them (`run_while_exchanging`) while its rows travel.
Backward otherwise waits for every exchange right after queueing it: nothing it still has
to do is independent of the rows in flight, except the weight gradients.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from raypar.model import main_grad
from raypar.model.backward import backward_from

# Weight gradients waiting for W, by key: (weight, what computes its gradient, the tensors
# that holds: the layer's input and output gradient). A module global, not thread-local: on
# a GPU, autograd runs backward on its own device threads.
_pending: dict[Hashable, list[tuple[Tensor, Callable[[], Tensor], tuple[Tensor, ...]]]] = {}
_deferring: list[tuple[Hashable, bool]] = []  # (the key I is running under, overlap), at most one
_lock = threading.Lock()


class Linear(nn.Linear):
    """`nn.Linear` whose backward can leave its weight gradient for later (see the module)."""

    split_backward = False  # set by `set_split_backward`

    def forward(self, x: Tensor) -> Tensor:
        own_backward = self.split_backward or (self.bias is None and main_grad.attached(self.weight))
        if own_backward and torch.is_grad_enabled():  # split mode is set only on layers without a bias
            return _SplitLinear.apply(x, self.weight)
        return F.linear(x, self.weight, self.bias)


def set_split_backward(module: nn.Module, on: bool) -> int:
    """Build `module`'s split layers' graphs so that I and W can run apart (or not); returns
    how many layers take part. A layer takes part when its class has a `split_backward` flag
    (`Linear`, `experts.GroupedExperts`); layers with a bias are left whole."""
    n = 0
    for m in module.modules():
        if hasattr(type(m), "split_backward") and getattr(m, "bias", None) is None:
            m.split_backward = on
            n += 1
    return n


@contextmanager
def weight_grads_deferred(key: Hashable, overlap: bool = False) -> Iterator[None]:
    """Backward run inside leaves split layers' weight gradients under `key` (I). With
    `overlap`, every exchange that leaves during it computes those waiting so far
    (`run_while_exchanging`); the caller computes the rest after backward."""
    with _lock:
        if _deferring:
            raise RuntimeError(f"weight gradients are already deferred under {_deferring[0][0]!r}; "
                               f"an input-gradient backward cannot nest in another")
        _deferring.append((key, overlap))
    try:
        yield
    finally:
        with _lock:
            _deferring.clear()


def run_while_exchanging() -> int:
    """Called by an exchange that has just left in backward: under an overlapped deferral,
    compute the weight gradients waiting so far (on the GPU they run while the exchange's
    rows travel on the communicator's stream); returns how many."""
    with _lock:
        key, overlap = _deferring[0] if _deferring else (None, False)
    return compute_weight_grads(key) if overlap else 0


def defer_weight_grad(parameter: Tensor, compute: Callable[[], Tensor | None], held: tuple[Tensor, ...]) -> bool:
    """For a split layer's backward: leave `parameter`'s gradient (`compute()`, which reads
    `held`, and returns the gradient or None where it added it itself) for W when a deferral
    is on; False when not (compute it now)."""
    with _lock:
        if not _deferring:
            return False
        _pending.setdefault(_deferring[0][0], []).append((parameter, compute, held))
    return True


def pending_weight_grads(key: Hashable) -> int:
    """How many layers' weight gradients wait under `key`."""
    with _lock:
        return len(_pending.get(key, ()))


def pending_tensors(key: Hashable) -> list[Tensor]:
    """What the weight gradients waiting under `key` hold: each layer's input and output gradient."""
    with _lock:
        return [t for _, _, held in _pending.get(key, ()) for t in held]


def compute_weight_grads(key: Hashable) -> int:
    """W: compute every weight gradient left under `key` and add it to its weight's gradient;
    returns how many."""
    with _lock:
        work = _pending.pop(key, [])
    for weight, compute, _ in work:
        with torch.no_grad():
            grad_w = compute()
        if grad_w is None:  # added into the weight's main gradient already
            continue
        # Through autograd's accumulation into the leaf (a view's backward is the identity):
        # parameter hooks run as they do for a whole backward.
        with torch.enable_grad():
            backward_from(weight.view_as(weight), grad_w)
    return len(work)


def drop_weight_grads(key: Hashable | None = None) -> None:
    """Forget pending weight gradients (of `key`, or all): after a failed step."""
    with _lock:
        if key is None:
            _pending.clear()
        else:
            _pending.pop(key, None)


class _SplitLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        # The parameter itself for W: a saved tensor unpacked under saved-tensor hooks (the
        # runtime counts activations with them) is another tensor object, and an
        # accumulation into it did not reach the parameter's gradient.
        ctx.parameter = weight
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return grad_x, None
        weight = ctx.parameter
        if main_grad.attached(weight):
            def compute() -> None:
                main_grad.add_linear_weight_grad(weight, x, grad_out)
        else:
            def compute() -> Tensor:
                return _linear_weight_grad(x, grad_out)
        if defer_weight_grad(weight, compute, (x, grad_out)):
            return grad_x, None
        return grad_x, compute()


def _linear_weight_grad(x: Tensor, grad_out: Tensor) -> Tensor:
    return grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
