"""The CUDA kernels against their torch references, on the GPU machine.

Fresh random inputs of several shapes (zero-token experts, dropped tokens, odd sizes that
take the scalar path, non-contiguous inputs); outputs land in memory poisoned with NaN
first, so an element a kernel forgot to write shows up.
"""
import pytest
import torch

from raypar import kernels
from raypar.kernels import loader
from raypar.kernels.moe_permute import permute, unpermute

pytestmark = pytest.mark.gpu

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-3),
       torch.float16: dict(rtol=1e-3, atol=1e-4)}


@pytest.fixture(autouse=True)
def _kernels_on():
    if torch.cuda.is_available() and loader.unavailable_reason() is not None:
        pytest.fail(f"the GPU machine should run the kernels: {loader.unavailable_reason()}")
    kernels.set_enabled(True)
    yield
    kernels.set_enabled(True)


def _poison(nbytes: int = 256 << 20) -> None:
    """Fill free memory of the caching allocator with NaN, so fresh outputs start as NaN."""
    torch.cuda.synchronize()
    junk = torch.full((nbytes // 4,), float("nan"), device="cuda")
    del junk


def _reference(fn):
    kernels.set_enabled(False)
    try:
        return fn()
    finally:
        kernels.set_enabled(True)


def _routing(n, k, n_experts, drop_every, skew, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(n, n_experts, device="cuda", generator=g)
    if skew:  # every token prefers the first experts: the others receive zero tokens
        logits[:, :k] += 100.0
    weights, experts = logits.softmax(-1).topk(k, dim=-1)
    keep = torch.ones(n * k, dtype=torch.bool, device="cuda")
    if drop_every:
        keep[::drop_every] = False
    kept = keep.nonzero().squeeze(1)
    kept = kept[torch.argsort(experts.flatten()[kept], stable=True)]
    slots = torch.full((n * k,), -1, dtype=torch.int64, device="cuda")
    slots[kept] = torch.arange(kept.numel(), device="cuda")
    return kept // k, slots.view(n, k), weights.flatten()[kept].float()


CASES = [  # n tokens, k, experts, d, dtype, drop every, skewed
    (4096, 2, 8, 1024, torch.bfloat16, 0, False),
    (1000, 2, 8, 512, torch.bfloat16, 3, True),
    (333, 1, 4, 33, torch.float32, 0, False),
    (257, 2, 16, 96, torch.float16, 5, True),
    (64, 2, 4, 7, torch.bfloat16, 0, False),
    (0, 2, 4, 64, torch.bfloat16, 0, False),
]


@pytest.mark.parametrize("n,k,n_experts,d,dtype,drop_every,skew", CASES)
def test_permute_unpermute_match_reference(n, k, n_experts, d, dtype, drop_every, skew):
    token, slots, weight = _routing(n, k, n_experts, drop_every, skew, seed=n + d)
    x = torch.randn(n, d, device="cuda", dtype=dtype)
    up = torch.randn(n, d, device="cuda", dtype=dtype)

    def run():
        xs = x.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        _poison()
        y = permute(xs, token, slots)
        y2 = y * 1.5  # stands in for the experts
        out = unpermute(y2, w, token, slots)
        out.backward(up)
        return y.detach(), out.detach(), xs.grad, w.grad

    got, want = run(), _reference(run)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # permute copies bits
    for name, g, r in zip(("unpermute", "grad x", "grad weight"), got[1:], want[1:]):
        assert not torch.isnan(g).any(), f"{name}: unwritten (NaN) elements"
        # The weight gradient is an fp32 dot product over d: summation order moves it by
        # a few fp32 ulps of the row's magnitude, not of the (often cancelling) result.
        tol = TOL[dtype] if name != "grad weight" else dict(rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(g, r, **tol, msg=lambda m: f"{name}: {m}")


def test_permute_handles_non_contiguous_rows():
    token, slots, weight = _routing(300, 2, 8, 0, False, seed=1)
    base = torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
    x = base[:, ::2]  # every other column: not contiguous
    got = permute(x, token, slots)
    torch.testing.assert_close(got, x[token], rtol=0, atol=0)
    y = torch.randn(token.numel(), 256, device="cuda", dtype=torch.bfloat16)[:, 1::2]
    got = unpermute(y, weight, token, slots)
    want = _reference(lambda: unpermute(y, weight, token, slots))
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("shape,dtype,p", [((4, 128, 512), torch.bfloat16, 0.1), ((3, 7, 33), torch.float32, 0.3),
                                           ((2, 5, 64), torch.float16, 0.5), ((1, 1, 8), torch.bfloat16, 0.2)])
def test_dropout_add_matches_reference(shape, dtype, p):
    seeds = kernels.sample_seeds(11, 3, list(range(shape[0])), "cuda")
    salt = kernels.site_salt(5, 1)
    # The kernel's mask is the reference's, bit for bit.
    _poison()
    ones = kernels.dropout_add(torch.ones(shape, device="cuda", dtype=dtype), torch.zeros(shape, device="cuda", dtype=dtype),
                               seeds, p, salt)
    mask = kernels.keep_mask(seeds, ones[0].numel(), salt, p).reshape(shape)
    assert torch.equal(ones != 0, mask)
    x = torch.randn(shape, device="cuda", dtype=dtype)
    res = torch.randn(shape, device="cuda", dtype=dtype)
    up = torch.randn(shape, device="cuda", dtype=dtype)

    def run():
        xs, rs = x.clone().requires_grad_(True), res.clone().requires_grad_(True)
        _poison()
        out = kernels.dropout_add(xs, rs, seeds, p, salt)
        out.backward(up)
        return out.detach(), xs.grad, rs.grad

    for name, g, r in zip(("out", "grad x", "grad residual"), run(), _reference(run)):
        assert not torch.isnan(g).any(), f"{name}: unwritten (NaN) elements"
        torch.testing.assert_close(g, r, **TOL[dtype], msg=lambda m: f"{name}: {m}")
    # A slice of the sequence (sequence parallelism) from an even and an odd element: its
    # part of the whole sample's mask, on the vector and the scalar path.
    for first in (2 * shape[-1], 3):
        part = kernels.dropout_add(torch.ones(shape, device="cuda", dtype=dtype),
                                   torch.zeros(shape, device="cuda", dtype=dtype), seeds, p, salt, first)
        want = kernels.keep_mask(seeds, ones[0].numel(), salt, p, first).reshape(shape)
        assert torch.equal(part != 0, want), first


def test_dropout_add_float64_falls_back_and_says_so(capsys):
    loader._said.discard(f"dropout_add/{torch.float64}")
    x = torch.randn(2, 8, device="cuda", dtype=torch.float64)
    seeds = kernels.sample_seeds(0, 0, [0, 1], "cuda")
    out = kernels.dropout_add(x, x, seeds, 0.5, 1)
    torch.testing.assert_close(out, kernels.dropout_add_reference(x, x, seeds, 0.5, 1))
    kernels.dropout_add(x, x, seeds, 0.5, 1)
    assert capsys.readouterr().out.count("would lose precision") == 1


def test_multi_tensor_copy_into_pinned_and_device_buffers():
    torch.manual_seed(0)
    big = torch.randn(1 << 20, device="cuda")
    sources = [torch.randn(1000, 33, device="cuda"), torch.randn(0, device="cuda"),
               torch.randn(5, device="cuda").bfloat16(), big[1:4099],  # unaligned start
               torch.randn(3 << 20, device="cuda").half(), torch.randint(0, 9, (77,), device="cuda")]
    for pinned in (True, False):
        dests = [torch.empty(s.shape, dtype=s.dtype, pin_memory=True) if pinned else torch.empty_like(s)
                 for s in sources]
        for d in dests:
            d.view(torch.uint8).fill_(0xFF) if d.numel() else None
        kernels.copy_(sources, dests)
        torch.cuda.synchronize()
        for s, d in zip(sources, dests):
            assert torch.equal(s.cpu(), d.cpu()), (s.shape, s.dtype, pinned)


def test_multi_tensor_ema_matches_reference():
    torch.manual_seed(0)
    weights = [torch.randn(4097, device="cuda").bfloat16(), torch.randn(300, 7, device="cuda"),
               torch.randn(1 << 20, device="cuda").half(), torch.randn(0, device="cuda")]
    emas = [torch.randn(w.shape, device="cuda") for w in weights]
    want = [e.clone() for e in emas]
    kernels.ema_update_(emas, weights, 0.99)
    _reference(lambda: kernels.ema_update_(want, weights, 0.99))
    for e, r in zip(emas, want):
        torch.testing.assert_close(e, r, rtol=1e-6, atol=1e-6)


def test_training_with_kernels_on_and_off_gives_the_same_losses(ray_session, tmp_path):
    from helpers import tiny_config
    from raypar.driver.trainer import Trainer

    losses = {}
    for on in (True, False):
        cfg = tiny_config(tmp_path / str(on), model={"dtype": "bfloat16", "n_experts": 4, "moe_top_k": 2,
                                                     "dropout": 0.1, "dim": 64},
                          parallel={"pp": 1}, train={"steps": 6, "lr": 3e-3},
                          runtime={"device": "cuda", "kernels": on})
        losses[on] = [r.loss for r in Trainer(cfg).fit().records]
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("rows,h,dtype", [(4099, 5464, torch.bfloat16), (300, 1536, torch.float32),
                                          (17, 7, torch.bfloat16), (64, 96, torch.float16), (0, 64, torch.bfloat16)])
def test_swiglu_matches_reference(rows, h, dtype):
    """Forward and both halves' gradients; h=7 takes the scalar path."""
    gu, grad, x, out = _packed_swiglu(rows, h, dtype, seed=rows + h)
    ref_x = gu.clone().requires_grad_()
    ref = _reference(lambda: kernels.swiglu(ref_x))
    ref.backward(grad)
    # The reference rounds silu(gate) before the product; the kernel rounds once.
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    torch.testing.assert_close(x.grad.float(), ref_x.grad.float(), **tol)


def _packed_swiglu(rows: int, h: int, dtype: torch.dtype, seed: int):
    """Random gate|up rows and an output gradient; the packed kernel's forward and backward
    into NaN-poisoned memory. Returns (gu, grad, x with its gradient, out)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    gu = (torch.randn(rows, 2 * h, device="cuda", generator=g) * 3).to(dtype)
    grad = torch.randn(rows, h, device="cuda", generator=g).to(dtype)
    _poison()
    x = gu.clone().requires_grad_()
    out = kernels.swiglu(x)
    out.backward(grad)
    return gu, grad, x, out


@pytest.mark.parametrize("n,dtype,offset", [(1 << 20, torch.bfloat16, 0), (4097, torch.bfloat16, 0),
                                            (4096, torch.bfloat16, 1), (333, torch.float32, 0),
                                            (1000, torch.float16, 0), (0, torch.bfloat16, 0)])
def test_gradient_accumulation_matches_reference(n, dtype, offset):
    """offset 1: unaligned views take the scalar path."""
    g = torch.Generator(device="cuda").manual_seed(n)
    main = torch.randn(n + offset, device="cuda", generator=g)[offset:]
    grad = torch.randn(n + offset, device="cuda", generator=g).to(dtype)[offset:]
    want = main.clone()
    kernels.accumulate_(main, grad)
    _reference(lambda: kernels.accumulate_(want, grad))
    torch.testing.assert_close(main, want, rtol=0, atol=0)



@pytest.mark.parametrize("b,t,heads,hd,table_len,dtype", [
    (4, 1024, 16, 128, 1024, torch.bfloat16), (2, 100, 3, 64, 128, torch.float32), (3, 17, 1, 128, 40, torch.bfloat16),
    (2, 9, 4, 6, 9, torch.bfloat16), (2, 9, 4, 6, 12, torch.float32), (1, 33, 2, 8, 33, torch.float16),
    (0, 4, 2, 64, 4, torch.bfloat16)])
def test_rope_matches_reference(b, t, heads, hd, table_len, dtype):
    """Forward and backward, both table forms; hd=6, and hd=8 in 16 bits, take the scalar path."""
    from raypar.model.layers import rope_tables

    cos, sin = (tab.to(dtype) for tab in rope_tables(hd, table_len, 10000.0, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(t * hd + heads)
    x = torch.randn(b, t, heads, hd, device="cuda", generator=g).to(dtype)
    grad = torch.randn(b, t, heads, hd, device="cuda", generator=g).to(dtype)

    def run(tables, wide=False):
        xs = (x.float() if wide else x).clone().requires_grad_()
        out = kernels.rope(xs, *(tab.float() if wide else tab for tab in tables))
        out.backward(grad.float() if wide else grad)
        return out.detach().to(dtype), xs.grad.to(dtype)

    for tables in ((cos, sin), (cos[:, None], sin[:, None])):
        _poison()
        got = run(tables)
        # The kernel rounds once: it is the fp32 rotation of the same inputs, rounded. The
        # reference in x's dtype also rounds both products (up to half an ulp of |x| each).
        exact = _reference(lambda: run(tables, wide=True))
        ref = _reference(lambda: run(tables))
        loose = TOL[dtype] if dtype == torch.float32 else dict(rtol=2e-2, atol=4e-2)
        for name, k, e, r in zip(("out", "grad x"), got, exact, ref):
            assert not torch.isnan(k).any(), f"{name}: unwritten (NaN) elements"
            torch.testing.assert_close(k, e, **TOL[dtype], msg=lambda m: f"{name} against fp32: {m}")
            torch.testing.assert_close(k, r, **loose, msg=lambda m: f"{name} against the reference: {m}")


def test_rope_takes_non_contiguous_x_and_falls_back_for_fp32_tables(capsys):
    from raypar.model.layers import rope_tables

    cos, sin = rope_tables(64, 32, 10000.0, device="cuda")
    x = torch.randn(2, 4, 32, 64, device="cuda").transpose(1, 2)  # [b, t, heads, hd] view of [b, heads, t, hd]
    want = _reference(lambda: kernels.rope(x, cos, sin))
    torch.testing.assert_close(kernels.rope(x, cos, sin), want, **TOL[torch.float32])
    loader._said.difference_update([k for k in loader._said if k.startswith("rope/")])
    out = kernels.rope(x.bfloat16(), cos, sin)  # fp32 tables: the reference, promoted to fp32 as before
    assert out.dtype == torch.float32 and "runs unfused" in capsys.readouterr().out


@pytest.mark.parametrize("shape,dtype,layout", [
    ((4, 1024, 5632), torch.bfloat16, "contiguous"), ((300, 1536), torch.float32, "contiguous"),
    ((2, 33, 96), torch.float16, "contiguous"), ((17, 7), torch.bfloat16, "contiguous"),
    ((33, 5), torch.float32, "contiguous"), ((9, 64), torch.bfloat16, "unaligned"),
    ((64, 96), torch.float16, "transposed"), ((0, 64), torch.bfloat16, "contiguous"),
    ((3, 0, 128), torch.float32, "contiguous")])
def test_swiglu_pair_matches_reference(shape, dtype, layout):
    """Forward and both gradients. h=7 and h=5 take the scalar path; so do inputs that start
    off a 16-byte boundary ("unaligned"); "transposed" inputs are copied contiguous first."""
    g = torch.Generator(device="cuda").manual_seed(sum(shape))

    def make(scale=1.0):
        n = torch.Size(shape).numel()
        if layout == "unaligned":
            return (torch.randn(n + 1, device="cuda", generator=g) * scale).to(dtype)[1:].view(shape)
        if layout == "transposed":
            return (torch.randn(shape[::-1], device="cuda", generator=g) * scale).to(dtype).t()
        return (torch.randn(shape, device="cuda", generator=g) * scale).to(dtype)

    gate, up, grad = make(3.0), make(), make()
    if layout == "unaligned":
        assert gate.is_contiguous() and gate.data_ptr() % 16
    if layout == "transposed":
        assert not gate.is_contiguous()

    def run():
        gs, us = gate.detach().requires_grad_(), up.detach().requires_grad_()  # not clone(): it would align
        _poison()
        out = kernels.swiglu_pair(gs, us)
        out.backward(grad)
        return out.detach(), gs.grad, us.grad

    got, want = run(), _reference(run)
    # The reference rounds silu(gate) before the product; the kernel rounds once.
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else TOL[dtype]
    for name, k, r in zip(("out", "grad gate", "grad up"), got, want):
        assert k.shape == r.shape and k.dtype == r.dtype, name
        assert not torch.isnan(k).any(), f"{name}: unwritten (NaN) elements"
        torch.testing.assert_close(k.float(), r.float(), **tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("rows,h,dtype", [(4099, 5464, torch.bfloat16), (300, 1536, torch.float32),
                                          (17, 7, torch.bfloat16), (64, 96, torch.float16), (0, 64, torch.bfloat16)])
def test_swiglu_packed_is_the_pair_kernel_on_its_halves(rows, h, dtype):
    """The packed layout (gate and up side by side, row stride 2h) against the separate one
    (stride h): one kernel body, so the same bits, every element written."""
    gu, grad, x, out = _packed_swiglu(rows, h, dtype, seed=rows * h)
    gate, up = (half.contiguous().requires_grad_() for half in gu.chunk(2, dim=-1))
    pair = kernels.swiglu_pair(gate, up)
    pair.backward(grad)
    assert not torch.isnan(out).any() and not torch.isnan(x.grad).any(), "unwritten (NaN) elements"
    torch.testing.assert_close(out, pair, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, torch.cat((gate.grad, up.grad), dim=-1), rtol=0, atol=0)
    ref = _reference(lambda: kernels.swiglu(gu))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), **tol)
