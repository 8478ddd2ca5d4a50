"""Kernel dispatch on CPU: every op runs its torch reference, and the references match plain
torch formulas. The kernels themselves are checked against these references on the GPU
machine (tests/test_gpu_kernels.py)."""
import random

import pytest
import torch
import torch.nn.functional as F

from raypar import kernels
from raypar.kernels import residual_dropout as dropout_mod
from raypar.kernels import loader
from raypar.kernels.moe_permute import Permute, Unpermute, permute, unpermute


def _mix32_python(x: int) -> int:
    # The hash written out once more, on Python ints, as the kernel's C does it.
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


def test_torch_hash_is_the_32_bit_hash():
    rng = random.Random(0)
    values = [0, 1, 2**16, 2**31, 2**32 - 1] + [rng.randrange(2**32) for _ in range(2000)]
    got = dropout_mod.mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [_mix32_python(v) for v in values]


def test_keep_mask_rate_and_independence():
    seeds = kernels.sample_seeds(3, step=5, sample_ids=[0, 1, 2, 3])
    mask = kernels.keep_mask(seeds, 50_000, kernels.site_salt(0, 0), p=0.25)
    assert mask.shape == (4, 50_000)
    assert mask.float().mean().item() == pytest.approx(0.75, abs=0.01)
    # Different samples, sites and steps draw different masks; the same inputs the same one.
    assert (mask[0] != mask[1]).float().mean() > 0.3
    other_site = kernels.keep_mask(seeds, 50_000, kernels.site_salt(0, 1), p=0.25)
    assert (mask != other_site).float().mean() > 0.3
    assert torch.equal(mask, kernels.keep_mask(seeds.clone(), 50_000, kernels.site_salt(0, 0), p=0.25))
    later = kernels.sample_seeds(3, step=6, sample_ids=[0, 1, 2, 3])
    assert not torch.equal(seeds, later)
    # A sample's seed does not depend on its neighbours in the batch.
    assert kernels.sample_seeds(3, 5, [2])[0] == seeds[2]
    # A slice of each sample from element `first` on (odd too) draws its part of the whole mask.
    for first in (0, 7, 20_000):
        part = kernels.keep_mask(seeds, 1000, kernels.site_salt(0, 0), p=0.25, first=first)
        assert torch.equal(part, mask[:, first:first + 1000])
    x, res = torch.randn(4, 3, 8), torch.randn(4, 3, 8)
    whole = kernels.dropout_add(x, res, seeds, 0.25, 9)
    assert torch.equal(kernels.dropout_add(x[:, 1:], res[:, 1:], seeds, 0.25, 9, first=8), whole[:, 1:])


def test_dropout_add_reference_is_the_dropout_formula():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, requires_grad=True)
    residual = torch.randn(3, 5, 8, requires_grad=True)
    seeds = kernels.sample_seeds(0, 0, [7, 8, 9])
    p, salt = 0.3, kernels.site_salt(2, 1)
    out = kernels.dropout_add(x, residual, seeds, p, salt)
    mask = kernels.keep_mask(seeds, 40, salt, p).reshape(x.shape)
    # p is resolved to 1/65536; the scale is the exact inverse of the keep probability.
    threshold, scale = dropout_mod.threshold_and_scale(p)
    assert threshold == int(p * 65536) and scale == pytest.approx(1 / (1 - p), rel=1e-4)
    torch.testing.assert_close(out, residual + x * mask * scale)
    out.sum().backward()
    torch.testing.assert_close(x.grad, mask * scale)
    torch.testing.assert_close(residual.grad, torch.ones_like(residual))


def test_dropout_add_rejects_bad_input():
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="differ in shape"):
        kernels.dropout_add(x, torch.zeros(2, 5), torch.zeros(2, dtype=torch.int64), 0.1, 0)
    with pytest.raises(ValueError, match="one seed per sample"):
        kernels.dropout_add(x, x, torch.zeros(3, dtype=torch.int64), 0.1, 0)
    with pytest.raises(ValueError, match=r"must be in \[0, 1\)"):
        kernels.dropout_add(x, x, torch.zeros(2, dtype=torch.int64), 1.0, 0)
    assert torch.equal(kernels.dropout_add(x + 1, x, torch.zeros(2, dtype=torch.int64), 0.0, 0), x + 1)


def _routing(n: int, k: int, n_experts: int, drop_every: int, seed: int = 0):
    """token / slots / weights like MoE.forward builds them, with every drop_every-th choice dropped."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(n)] or
                          [torch.empty(0, k, dtype=torch.int64)]).reshape(n, k)
    keep = torch.ones(n * k, dtype=torch.bool)
    if drop_every:
        keep[::drop_every] = False
    kept = keep.nonzero().squeeze(1)
    kept = kept[torch.argsort(experts.flatten()[kept], stable=True)]
    slots = torch.full((n * k,), -1, dtype=torch.int64)
    slots[kept] = torch.arange(kept.numel())
    return kept // k, slots.view(n, k), torch.rand(kept.numel(), generator=g, dtype=torch.float64)


@pytest.mark.parametrize("n,k,drop_every", [(10, 2, 0), (10, 2, 3), (7, 1, 2), (0, 2, 0)])
def test_permute_references_are_gather_and_index_add(n, k, drop_every):
    token, slots, weight = _routing(n, k, n_experts=4, drop_every=drop_every)
    x = torch.randn(n, 6)
    y = permute(x, token, slots)
    torch.testing.assert_close(y, x[token])
    out = unpermute(y, weight.float(), token, slots)
    want = torch.zeros(n, 6).index_add(0, token, x[token] * weight.float().unsqueeze(1))
    torch.testing.assert_close(out, want)
    if drop_every == 0 and k == 2:
        # Dropless: every token gets its two rows back with their weights.
        assert (slots >= 0).all()


def test_permute_autograd_functions_have_exact_gradients():
    # The autograd functions the GPU path uses, run on CPU through the torch fallbacks of
    # their building blocks, against finite differences.
    token, slots, weight = _routing(6, 2, n_experts=3, drop_every=4)
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    w = weight.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: Permute.apply(x, token, slots), (x,))
    y = torch.randn(token.numel(), 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, w: Unpermute.apply(y, w, token, slots), (y, w))


def test_multi_tensor_references():
    torch.manual_seed(0)
    src = [torch.randn(3, 4), torch.randn(0), torch.randn(17).bfloat16()]
    dst = [torch.empty_like(t) for t in src]
    kernels.copy_(src, dst)
    assert all(torch.equal(s, d) for s, d in zip(src, dst))
    with pytest.raises(ValueError, match="does not match"):
        kernels.copy_([torch.zeros(3)], [torch.zeros(4)])
    emas = [torch.zeros(5), torch.ones(2, 2)]
    weights = [torch.ones(5).bfloat16(), torch.zeros(2, 2)]
    kernels.ema_update_(emas, weights, decay=0.9)
    torch.testing.assert_close(emas[0], torch.full((5,), 0.1))
    torch.testing.assert_close(emas[1], torch.full((2, 2), 0.9))
    with pytest.raises(ValueError, match="must be fp32"):
        kernels.ema_update_([torch.zeros(5).bfloat16()], [torch.zeros(5)], 0.9)


def test_switch_and_reasons():
    assert "need CUDA" in kernels.unavailable_reason(torch.zeros(1))
    kernels.set_enabled(False)
    try:
        assert "runtime.kernels=false" in kernels.unavailable_reason()
    finally:
        kernels.set_enabled(True)
    if not torch.cuda.is_available():
        assert all(v.startswith("torch reference") for v in kernels.load_all().values())


def test_fallback_is_said_once(capsys):
    loader._said.discard("test-key")
    loader.say_once("test-key", "falls back")
    loader.say_once("test-key", "falls back")
    assert capsys.readouterr().out.count("falls back") == 1


def test_swiglu_reference_is_silu_of_gate_times_up_and_checks_its_input():
    gu = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    gate, up = gu[..., :4], gu[..., 4:]
    torch.testing.assert_close(kernels.swiglu(gu), gate * torch.sigmoid(gate) * up)
    assert torch.autograd.gradcheck(kernels.swiglu, (gu,))
    with pytest.raises(ValueError, match="even size"):
        kernels.swiglu(torch.zeros(2, 7))


def test_swiglu_pair_is_the_unfused_formula_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        gate, up, grad = (torch.randn(3, 5, 8, generator=g).to(dtype) for _ in range(3))
        leaves = [t.clone().requires_grad_() for t in (gate, up, gate, up)]
        out = kernels.swiglu_pair(leaves[0], leaves[1])
        want = F.silu(leaves[2]) * leaves[3]
        assert torch.equal(out, want)
        out.backward(grad)
        want.backward(grad)
        assert torch.equal(leaves[0].grad, leaves[2].grad) and torch.equal(leaves[1].grad, leaves[3].grad)
    gate, up = (torch.randn(4, 6, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(kernels.swiglu_pair, (gate, up))
    assert torch.equal(kernels.swiglu_pair_reference(gate, up), F.silu(gate) * up)


@pytest.mark.parametrize("gate,up,match", [
    (torch.zeros(2, 8), torch.zeros(2, 7), r"one shape \[\.\.\., h\], got \(2, 8\) and \(2, 7\)"),
    (torch.zeros(2, 8), torch.zeros(8), "one shape"),
    (torch.zeros(()), torch.zeros(()), "one shape"),
    (torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.float64), "gate is torch.float32, up is torch.float64"),
])
def test_swiglu_pair_rejects_mismatched_inputs(gate, up, match):
    with pytest.raises(ValueError, match=match):
        kernels.swiglu_pair(gate, up)


def test_gradient_accumulation_reference_adds_in_fp32():
    main = torch.full((3, 5), 1.0)
    kernels.accumulate_(main, torch.full((3, 5), 2 ** -10, dtype=torch.bfloat16))
    assert main.dtype == torch.float32 and torch.equal(main, torch.full((3, 5), 1 + 2 ** -10))
    with pytest.raises(ValueError, match="does not match"):
        kernels.accumulate_(torch.zeros(4), torch.zeros(5))


def test_rope_is_rotate_half_with_plain_tables_and_has_exact_gradients():
    b, t, heads, hd, theta = 2, 5, 3, 8, 10000.0
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.outer(torch.arange(t + 2, dtype=torch.float64), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    signed = torch.cat((-sin[:, :hd // 2], sin[:, hd // 2:]), dim=-1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, t, heads, hd, dtype=torch.float64, generator=g, requires_grad=True)
    x1, x2 = x.chunk(2, dim=-1)
    want = x * cos[:t, None] + torch.cat((-x2, x1), dim=-1) * sin[:t, None]
    # Both table forms, longer than the sequence, give the rotation of the first t positions.
    torch.testing.assert_close(kernels.rope(x, cos, signed), want)
    torch.testing.assert_close(kernels.rope(x, cos[:, None], signed[:, None]), want)
    torch.testing.assert_close(kernels.rope_reference(x, cos[:t, None], signed[:t, None]), want)
    assert torch.autograd.gradcheck(lambda v: kernels.rope(v, cos, signed), (x,))


@pytest.mark.parametrize("x,table,match", [
    (torch.zeros(2, 3, 4), torch.zeros(3, 4), r"x must be \[b, t, heads, head_dim\]"),
    (torch.zeros(1, 3, 2, 7), torch.zeros(3, 7), "head_dim \\(7\\) must be even"),
    (torch.zeros(1, 3, 2, 8), torch.zeros(2, 8), r"cos must be \[T, 8\] or \[T, 1, 8\] with T >= t = 3"),
    (torch.zeros(1, 3, 2, 8), torch.zeros(3, 6), r"\[T, 8\] or \[T, 1, 8\]"),
    (torch.zeros(1, 3, 2, 8), torch.zeros(3, 2, 8), r"\[T, 8\] or \[T, 1, 8\]"),
])
def test_rope_rejects_bad_shapes(x, table, match):
    with pytest.raises(ValueError, match=match):
        kernels.rope(x, table, table)
