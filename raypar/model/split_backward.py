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

Only layers built in split mode (`set_split_backward(model, True)`) take part; a whole
backward (B) of such a layer computes both gradients at once, as usual. Norm weights and
other small parameters get their gradients in I.
"""
from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Weight gradients waiting for W, by key: (weight, layer input, output gradient). A module
# global, not thread-local: on a GPU, autograd runs backward on its own device threads.
_pending: dict[Hashable, list[tuple[Tensor, Tensor, Tensor]]] = {}
_deferring: list[Hashable] = []  # the key I is running under (at most one)
_lock = threading.Lock()


class Linear(nn.Linear):
    """`nn.Linear` whose backward can leave its weight gradient for later (see the module)."""

    split_backward = False  # set by `set_split_backward`

    def forward(self, x: Tensor) -> Tensor:
        if self.split_backward and torch.is_grad_enabled():  # set only on layers without a bias
            return _SplitLinear.apply(x, self.weight)
        return F.linear(x, self.weight, self.bias)


def set_split_backward(module: nn.Module, on: bool) -> int:
    """Build `module`'s linear layers' graphs so that I and W can run apart (or not);
    returns how many layers take part. Layers with a bias are left whole."""
    n = 0
    for m in module.modules():
        if isinstance(m, Linear) and m.bias is None:
            m.split_backward = on
            n += 1
    return n


@contextmanager
def weight_grads_deferred(key: Hashable) -> Iterator[None]:
    """Backward run inside leaves split layers' weight gradients under `key` (I)."""
    with _lock:
        if _deferring:
            raise RuntimeError(f"weight gradients are already deferred under {_deferring[0]!r}; "
                               f"an input-gradient backward cannot nest in another")
        _deferring.append(key)
    try:
        yield
    finally:
        with _lock:
            _deferring.clear()


def pending_weight_grads(key: Hashable) -> int:
    """How many layers' weight gradients wait under `key`."""
    with _lock:
        return len(_pending.get(key, ()))


def pending_tensors(key: Hashable) -> list[Tensor]:
    """What the weight gradients waiting under `key` hold: each layer's input and output gradient."""
    with _lock:
        return [t for _, x, grad_out in _pending.get(key, ()) for t in (x, grad_out)]


def compute_weight_grads(key: Hashable) -> int:
    """W: compute every weight gradient left under `key` and add it to its weight's gradient;
    returns how many."""
    with _lock:
        work = _pending.pop(key, [])
    for weight, x, grad_out in work:
        with torch.no_grad():
            grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        # Through autograd's accumulation into the leaf (a view's backward is the identity):
        # parameter hooks run as they do for a whole backward.
        with torch.enable_grad():
            torch.autograd.backward(weight.view_as(weight), grad_w)
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
        with _lock:
            key = _deferring[0] if _deferring else None
            if key is not None:
                _pending.setdefault(key, []).append((ctx.parameter, x, grad_out))
        if key is not None:
            return grad_x, None
        grad_w = grad_out.reshape(-1, grad_out.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w
