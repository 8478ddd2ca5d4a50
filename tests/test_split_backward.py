"""A backward split into input gradients (I) and weight gradients (W) at the linear layers
gives the whole backward's gradients, whatever runs between and in whichever order."""
import pytest
import torch

from raypar.config import ModelConfig, TrainConfig
from raypar.model import Transformer, init_weights
from raypar.model.split_backward import (compute_weight_grads, drop_weight_grads, pending_weight_grads,
                                         set_split_backward, weight_grads_deferred)
from raypar.optim import MasterOptimizer

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def model(split: bool, dtype: str = "float32", recompute: bool = False) -> Transformer:
    cfg = ModelConfig(**{**CFG.__dict__, "dtype": dtype})
    m = Transformer(cfg)
    init_weights(m, cfg, seed=3)
    m.recompute = recompute
    if split:
        assert set_split_backward(m, True) == 2 * 7 + 1  # q, k, v, o, w1, w2, w3 per layer; the head
    return m


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)) for _ in range(n)]


def grads(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recomputed"])
def test_input_then_weight_gradients_equal_the_whole_backward(recompute):
    whole, split = model(False, recompute=recompute), model(True, recompute=recompute)
    data = batches(2)
    for tokens, labels in data:
        whole(tokens, labels).backward()
    # I of both micro-batches, then W in the other order, as a zero-bubble stage may run them.
    for mb, (tokens, labels) in enumerate(data):
        with weight_grads_deferred(mb):
            split(tokens, labels).backward()
    held = grads(split)
    assert not any(n.endswith(("wq.weight", "w2.weight", "head.weight")) for n in held)  # all in W
    assert {"layers.0.attn_norm.weight", "embed.weight"} <= set(held)  # small ones in I
    assert pending_weight_grads(0) == pending_weight_grads(1) == 15
    assert compute_weight_grads(1) == 15 and compute_weight_grads(0) == 15 and pending_weight_grads(0) == 0
    want, got = grads(whole), grads(split)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)


def test_weight_gradients_reach_the_parameters_under_saved_tensor_hooks():
    """The runtime counts activations with saved-tensor hooks; a weight saved for backward
    comes back from them as another tensor object, and W must still reach the parameter."""
    from raypar.runtime.memory import ActivationTracker

    whole, split = model(False), model(True)
    (tokens, labels), = batches(1)
    whole(tokens, labels).backward()
    with ActivationTracker(list(split.parameters())).recording(0):
        loss = split(tokens, labels)
    with weight_grads_deferred(0):
        loss.backward()
    compute_weight_grads(0)
    want, got = grads(whole), grads(split)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)


def test_the_tracker_counts_what_waits_for_w():
    """Between I and W the deferred weight gradients hold each layer's input and output
    gradient: the activation count keeps the micro-batch live, with those bytes, until W."""
    from raypar.model.split_backward import pending_tensors
    from raypar.runtime.memory import ActivationTracker

    split = model(True)
    tracker = ActivationTracker(list(split.parameters()))
    (tokens, labels), = batches(1)
    key = (0, 0)
    with tracker.recording(key):
        loss = split(tokens, labels)
    after_forward = tracker.live_bytes()
    with weight_grads_deferred(key):
        loss.backward()
    tracker.backward_done(key)
    tracker.hold_for_weights(key, pending_tensors(key))
    waiting = tracker.live_bytes()
    # Each layer's input (saved by the forward) and its output's gradient (new in I).
    assert 0 < waiting and tracker.live_microbatches() == 1
    assert waiting >= sum(t.untyped_storage().nbytes() for t in pending_tensors(key)[1::2])  # the gradients
    assert after_forward > 0
    compute_weight_grads(key)
    tracker.weights_done(key)
    assert tracker.live_bytes() == 0 and tracker.live_microbatches() == 0


def test_a_whole_backward_of_a_split_model_is_unchanged():
    whole, split = model(False), model(True)
    (tokens, labels), = batches(1)
    whole(tokens, labels).backward()
    split(tokens, labels).backward()  # B: no deferral
    assert pending_weight_grads(None) == 0
    for name, g in grads(whole).items():
        torch.testing.assert_close(grads(split)[name], g, rtol=1e-6, atol=1e-7, msg=name)


def test_weight_gradients_reach_the_fp32_masters_through_their_hooks():
    """bf16 weights with fp32 masters: the optimizer's hooks move each gradient into its
    master as autograd accumulates it; a deferred W must go the same way."""
    whole, split = model(False, "bfloat16"), model(True, "bfloat16")
    opts = [MasterOptimizer(m, TrainConfig()) for m in (whole, split)]
    (tokens, labels), = batches(1)
    whole(tokens, labels).backward()
    with weight_grads_deferred("mb"):
        split(tokens, labels).backward()
    compute_weight_grads("mb")
    for (name, _), a, b in zip(whole.named_parameters(), opts[0].master, opts[1].master):
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_deferral_does_not_nest_and_can_be_dropped():
    split = model(True)
    (tokens, labels), = batches(1)
    with weight_grads_deferred("a"):
        with pytest.raises(RuntimeError, match="already deferred"):
            with weight_grads_deferred("b"):
                pass
        split(tokens, labels).backward()
    assert pending_weight_grads("a") == 15
    drop_weight_grads("a")
    assert pending_weight_grads("a") == 0 and compute_weight_grads("a") == 0


def test_stacked_experts_leave_their_weight_gradients_for_w():
    """The experts' grouped GEMMs split like the linear layers: W computes their gradients."""
    cfg = ModelConfig(**{**CFG.__dict__, "n_experts": 4, "moe_top_k": 2, "moe_ffn_dim": 16})
    whole, split = Transformer(cfg), Transformer(cfg)
    for m in (whole, split):
        init_weights(m, cfg, seed=3)
    # Modules: q, k, v, o, the router and the experts per layer; the head.
    assert set_split_backward(split, True) == 2 * 6 + 1
    (tokens, labels), = batches(1)
    whole(tokens, labels).backward()
    with weight_grads_deferred("mb"):
        split(tokens, labels).backward()
    assert not any(n.endswith(("experts.w13", "experts.w2")) for n in grads(split))
    assert compute_weight_grads("mb") == 2 * 7 + 1  # the experts' two stacks apart
    want, got = grads(whole), grads(split)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
