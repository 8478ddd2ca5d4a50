"""A backward from outputs and the gradients sent for them, straight into autograd's engine.

`torch.autograd.backward(out, grad)` first checks each gradient against its output in
Python (`_make_grads`), and that check imports torch's symbolic-shape machinery and sympy:
0.4 s of CPU in the first backward of every worker process that receives gradients, on the
critical path of a run's first step and of a recovery's (0.45 s first step on the CPU test
machine, against 0.01 s after). The engine checks the gradients' shapes itself, so this
calls it directly, as Megatron-Core's pipeline schedules do.
"""
from __future__ import annotations

import torch
from torch.autograd import Variable


def backward_from(outputs: torch.Tensor | tuple[torch.Tensor, ...],
                  grads: torch.Tensor | tuple[torch.Tensor, ...] | None) -> None:
    """`torch.autograd.backward(outputs, grads)`: gradients accumulate into the leaves, the
    graph is freed. `grads` None: `outputs` is a scalar loss."""
    if grads is None:
        torch.autograd.backward(outputs)  # a scalar's gradient is made without the check's import
        return
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    grads = (grads,) if isinstance(grads, torch.Tensor) else tuple(grads)
    if len(outputs) != len(grads):
        raise ValueError(f"{len(outputs)} outputs but {len(grads)} gradients")
    # (tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad)
    Variable._execution_engine.run_backward(outputs, grads, False, False, (), True, True)
