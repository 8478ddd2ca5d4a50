"""raypar's fused AdamW runs torch.optim.AdamW(fused=True)'s kernel (the same updates, bit for bit), and a
stage worker starts without torch's compiler stack, which torch.optim and meta-device builds pulled in."""
import json
import subprocess
import sys

import pytest
import torch

from raypar.adamw import FusedAdamW

from helpers import ROOT


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_updates_equal_torch_fused_adamw_bit_for_bit(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 4, 2), (1000, 300)]
    ours = [torch.randn(s, generator=gen).to(device) for s in shapes]
    theirs = [p.clone() for p in ours]
    groups = lambda ps: [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]  # noqa: E731
    mine = FusedAdamW(groups(ours), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for p in ours:
        mine.init_state(p)
    ref = torch.optim.AdamW(groups(theirs), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    for step in range(4):
        grads = [torch.randn(s, generator=gen).to(device) for s in shapes]
        for p, q, g in zip(ours, theirs, grads):
            p.grad, q.grad = g.clone(), g.clone()
        lr = 1e-2 / (step + 1)
        for group in mine.param_groups + ref.param_groups:
            group["lr"] = lr
        # Clipping as the optimizers apply it: every gradient divided by a scale (1 = no clip).
        scale = torch.tensor(1.0 if step % 2 else 3.0, device=device)
        mine.grad_scale, ref.grad_scale = scale, scale
        mine.step()
        ref.step()
        for p, q in zip(ours, theirs):
            assert torch.equal(p, q)
            assert torch.equal(mine.state[p]["exp_avg"], ref.state[q]["exp_avg"])
            assert torch.equal(mine.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
            assert torch.equal(mine.state[p]["step"], ref.state[q]["step"])


def test_a_stage_and_its_optimizer_start_without_torchs_compiler_stack() -> None:
    """What a worker's start costs: building a stage on the meta device and stepping its
    optimizer must not import dynamo or sympy (over a second of CPU per process)."""
    code = """
import sys, torch
from raypar.config import config_from_dict
from raypar.model import build_stage
from raypar.optim import MasterOptimizer
cfg = config_from_dict({"model": {"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 16,
                                  "n_experts": 4, "moe_top_k": 2}, "data": {"seq_len": 8}})
model = build_stage(cfg.model, 0, 1, seed=0, device="cpu")
opt = MasterOptimizer(model, cfg.train)
model(torch.randint(0, 64, (2, 8))).float().sum().backward()
opt.step(0, 1.0)
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_a_real_stage_worker_starts_without_torchs_compiler_stack(tmp_path) -> None:
    """bench/worker_start.py on CPU, one launch: a stage worker placed by Ray, set up and
    stepped once, has not imported dynamo, inductor or sympy (the harness also stays runnable)."""
    out = subprocess.run([sys.executable, "-m", "bench.worker_start", "--out", str(tmp_path), "--cpu", "--rounds", "1"],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    (row,) = json.loads((tmp_path / "worker_start.json").read_text())
    assert row["tree"] == "this checkout" and row["heavy_modules"] == []
    assert row["start_s"] > 0 and row["first_step_s"] > 0 and set(row["setup_s"]) >= {"build", "connect"}
    assert "| this checkout | 1 |" in (tmp_path / "worker_start.md").read_text()
