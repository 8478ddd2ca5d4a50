"""Grouped expert GEMMs on a GPU: torch's grouped_mm (bf16) against an fp32 loop over the
experts, and a MoE layer on the GPU against the same layer on the CPU."""
import contextlib

import pytest
import torch

from raypar.config import config_from_dict
from raypar.model import build_stage
import raypar.model.experts as experts_module
from raypar.model.experts import group_alignment, grouped_layout, grouped_linear
from raypar.model.split_backward import compute_weight_grads, weight_grads_deferred

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


@pytest.mark.parametrize("backward", ["torch", "split", "deferred"])
@pytest.mark.parametrize("sizes", [[37, 0, 129, 5], [0, 0, 300, 0], [1, 1, 1, 1], [512, 512, 512, 512]])
def test_grouped_mm_matches_a_loop_in_fp32(sizes, backward):
    """Rows laid out as the MoE layer lays them out on a GPU (each group padded to 16 bytes).
    backward: torch's grouped_mm backward; raypar's own (`split`, the weight gradient a
    grouped GEMM over the rows), whole or deferred to W."""
    g = torch.Generator(device="cuda").manual_seed(sum(sizes))
    d_in, d_out, n = 256, 384, len(sizes)
    counts = torch.tensor(sizes, device="cuda")
    group = torch.arange(n, device="cuda").repeat_interleave(counts)
    x_rows = torch.randn(sum(sizes), d_in, device="cuda", generator=g)
    align = group_alignment(x_rows.bfloat16())
    assert align == 8
    position, ends, total = grouped_layout(group, counts, align)
    x = torch.zeros(total, d_in, device="cuda").index_copy_(0, position, x_rows).bfloat16().requires_grad_()
    w = (torch.randn(n, d_out, d_in, device="cuda", generator=g) / d_in ** 0.5).bfloat16().requires_grad_()
    y = grouped_linear(x, w, ends, split=backward != "torch")
    seed = torch.randn(y.shape, device="cuda", generator=g)
    with weight_grads_deferred("w") if backward == "deferred" else contextlib.nullcontext():
        (y.float()[position] * seed[position]).sum().backward()
    assert compute_weight_grads("w") == (backward == "deferred")

    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    bounds = [0, *ends.tolist()]
    want = torch.cat([xf[a:b] @ wf[i].t() for i, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    (want[position] * seed[position]).sum().backward()
    torch.testing.assert_close(y.float()[position], want[position], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(x.grad.float()[position], xf.grad[position], rtol=2e-2, atol=2e-2)
    scale = wf.grad.abs().max().clamp(min=1.0)
    torch.testing.assert_close(w.grad.float() / scale, wf.grad / scale, rtol=2e-2, atol=2e-2)


def _moe_cfg(capacity: float, dtype: str, n_layers: int = 2):
    return config_from_dict({"model": {"vocab_size": 256, "dim": 128, "n_layers": n_layers, "n_heads": 4,
                                       "n_experts": 8, "moe_top_k": 2, "moe_ffn_dim": 192, "dtype": dtype,
                                       "moe_capacity_factor": capacity, "max_seq_len": 64}, "data": {"seq_len": 64}})


def _loss_and_grads(cfg, device: str):
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0)).to(device)
    model = build_stage(cfg.model, 0, 1, seed=0, device=torch.device(device))
    loss = model(tokens, tokens)
    loss.backward()
    return loss.detach().float().cpu(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}


def _assert_close(got, want, tol):
    torch.testing.assert_close(got[0], want[0], rtol=tol / 10, atol=tol / 10)
    for name, g in want[1].items():
        scale = g.abs().max().clamp(min=1e-6)
        torch.testing.assert_close(got[1][name] / scale, g / scale, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("capacity", [0.0, 1.0])
def test_moe_layer_on_gpu_matches_the_cpu(capacity):
    """fp32: the padded layout and the capacity's trailing rows on the GPU."""
    cfg = _moe_cfg(capacity, "float32")
    _assert_close(_loss_and_grads(cfg, "cuda"), _loss_and_grads(cfg, "cpu"), 1e-3)


@pytest.mark.parametrize("capacity", [0.0, 1.0])
def test_bf16_moe_layer_with_grouped_mm_matches_a_loop_over_experts(monkeypatch, capacity):
    """bf16 on the GPU runs torch's grouped_mm; one MoE layer, so both route alike."""
    cfg = _moe_cfg(capacity, "bfloat16", n_layers=1)
    grouped = _loss_and_grads(cfg, "cuda")
    monkeypatch.setattr(experts_module, "_aligned", lambda x, w: False)
    _assert_close(grouped, _loss_and_grads(cfg, "cuda"), 3e-2)


@pytest.mark.parametrize("capacity", [0.0, 1.0])
def test_a_moe_model_step_never_waits_for_the_device(capacity):
    """No host wait in a bf16 MoE model's forward and backward (ep=1): every size is
    known on the host; torch raises on any synchronising call in "error" mode."""
    cfg = _moe_cfg(capacity, "bfloat16")
    tokens = torch.randint(0, 256, (4, 64), device="cuda")
    model = build_stage(cfg.model, 0, 1, seed=0, device=torch.device("cuda"))
    model(tokens, tokens).backward()  # warm-up: lazy initialisation may synchronise once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(tokens, tokens).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
