"""Linear layers add their weight gradients straight into the fp32 main gradients
(`runtime.grad_accumulation_fusion`): the same gradients as autograd plus the optimizer's
hook, for whole and split backwards, plain and sharded optimizers."""
import pytest
import torch

from raypar.config import ModelConfig, TrainConfig
from raypar.model import Transformer, init_weights, main_grad
from raypar.model.split_backward import compute_weight_grads, set_split_backward, weight_grads_deferred
from raypar.optim import MasterOptimizer
from raypar.sharded_optimizer import ShardedOptimizer

CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16, dtype="bfloat16")
LINEAR = ("wq.weight", "wk.weight", "wv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight", "head.weight")


def bf16_model(split: bool = False, recompute: bool = False) -> Transformer:
    m = Transformer(CFG)
    init_weights(m, CFG, seed=3)
    set_split_backward(m, split)
    m.recompute = recompute
    return m


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)) for _ in range(n)]


def master_grads(opt: MasterOptimizer) -> dict[str, torch.Tensor]:
    return {n: g.clone() for n, g in opt.named_grads().items()}


@pytest.mark.parametrize("split, recompute", [(False, False), (True, False), (False, True)],
                         ids=["whole-backward", "input-then-weight", "recomputed"])
def test_fused_accumulation_gives_the_hooks_gradients(split, recompute):
    """Two micro-batches summed into the fp32 gradients: fused (on CPU the layer computes the
    bf16 gradient and adds it) against autograd and the hook."""
    hooked, fused = bf16_model(split, recompute), bf16_model(split, recompute)
    opts = [MasterOptimizer(hooked, TrainConfig(), fuse_grad_accumulation=False),
            MasterOptimizer(fused, TrainConfig(), fuse_grad_accumulation=True)]
    for mb, (tokens, labels) in enumerate(batches(2)):
        for m in (hooked, fused):
            if split:
                with weight_grads_deferred(mb):
                    m(tokens, labels).backward()
                compute_weight_grads(mb)
            else:
                m(tokens, labels).backward()
    want, got = master_grads(opts[0]), master_grads(opts[1])
    assert set(got) == set(want)
    for name in want:
        assert want[name].abs().sum() > 0, name
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)
    # The linear layers' bf16 parameters never held a gradient: it went into the fp32 one.
    assert all(p.grad is None for n, p in fused.named_parameters())
    attached = {n for n, p in fused.named_parameters() if main_grad.attached(p)}
    assert attached == {n for n, _ in fused.named_parameters()}
    assert {n for n in attached if n.endswith(LINEAR)} and not any(main_grad.attached(p) for p in hooked.parameters())


def test_each_weight_gradient_arrives_once_per_microbatch():
    m = bf16_model()
    arrivals: dict[str, int] = {}
    for name, p in m.named_parameters():
        if name.endswith(LINEAR):
            main_grad.attach(p, torch.zeros(p.shape), lambda name=name: arrivals.__setitem__(name, arrivals.get(name, 0) + 1))
    for tokens, labels in batches(3):
        m(tokens, labels).backward()
    assert arrivals and set(arrivals.values()) == {3}
    assert len(arrivals) == 2 * 7 + 1  # q, k, v, o, w1, w2, w3 per layer; the head


def test_the_sharded_optimizer_takes_fused_gradients_into_its_buffers():
    """One replica (no group): the flat fp32 buffers hold what the hooks would put there."""
    hooked, fused = bf16_model(), bf16_model()
    opts = [ShardedOptimizer(hooked, TrainConfig(), {"dense": None}, fuse_grad_accumulation=False),
            ShardedOptimizer(fused, TrainConfig(), {"dense": None}, fuse_grad_accumulation=True)]
    for tokens, labels in batches(2):
        for m in (hooked, fused):
            m(tokens, labels).backward()
    want, got = (torch.cat([f.full_grads() for f in opt.families]) for opt in opts)
    assert want.abs().sum() > 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_a_main_gradient_of_the_wrong_kind_is_refused():
    w = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="fp32 of the weight's shape \\(4, 3\\)"):
        main_grad.attach(w, torch.zeros(4, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="got torch.float32 \\(3, 4\\)"):
        main_grad.attach(w, torch.zeros(3, 4))
    assert not main_grad.attached(w)


@pytest.mark.gpu
def test_on_the_gpu_the_weight_gemm_adds_into_fp32_without_rounding_to_bf16():
    """bf16 on CUDA: the fused path runs (this torch adds a bf16 GEMM into fp32 in place),
    its gradients are within bf16 rounding of the hooked path's and no further from the fp32
    model's gradients."""
    assert main_grad.fused_on(torch.device("cuda", torch.cuda.current_device()))
    cfg32 = ModelConfig(**{**CFG.__dict__, "dtype": "float32"})
    exact = Transformer(cfg32).cuda()
    init_weights(exact, cfg32, seed=3)
    hooked, fused = bf16_model().cuda(), bf16_model().cuda()
    opts = [MasterOptimizer(hooked, TrainConfig(), fuse_grad_accumulation=False),
            MasterOptimizer(fused, TrainConfig(), fuse_grad_accumulation=True)]
    for tokens, labels in batches(4):
        for m in (exact, hooked, fused):
            m(tokens.cuda(), labels.cuda()).backward()
    want = {n: p.grad for n, p in exact.named_parameters()}
    got_hooked, got_fused = master_grads(opts[0]), master_grads(opts[1])
    for name in (n for n in want if n.endswith(LINEAR)):
        torch.testing.assert_close(got_fused[name], got_hooked[name], rtol=2e-2, atol=2e-3, msg=name)
        off_fused = (got_fused[name] - want[name]).norm()
        off_hooked = (got_hooked[name] - want[name]).norm()
        assert off_fused <= off_hooked * 1.05, (name, float(off_fused), float(off_hooked))
