"""The padded all-to-all's layout kernels against their torch references, exactly."""
import pytest
import torch

from raypar.kernels import moe_layout

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _routing(tokens: int, k: int, ep: int, local: int, drop: float, seed: int):
    """What MoE.forward hands the sender: slots sorted by expert, dropped ones (expert E) last."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_experts = ep * local
    skew = torch.rand(n_experts, device="cuda", generator=g) ** 4  # some experts get (almost) nothing
    expert = torch.multinomial(skew + 1e-6, tokens * k, replacement=True, generator=g)
    dropped = torch.rand(tokens * k, device="cuda", generator=g) < drop
    expert = torch.where(dropped, n_experts, expert)
    weight = torch.where(dropped, 0.0, torch.rand(tokens * k, device="cuda", generator=g))
    order = torch.argsort(expert, stable=True)
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device="cuda").scatter_add_(
        0, expert, torch.ones_like(expert))[:n_experts]
    return expert[order], order, counts.view(ep, local), weight


@pytest.mark.parametrize("tokens,k,ep,local,drop,extra", [
    (64, 2, 2, 4, 0.0, 0), (64, 2, 2, 4, 0.3, 1), (33, 1, 4, 2, 0.1, 2), (100, 4, 8, 1, 0.0, 1),
    (7, 2, 2, 8, 0.5, 0), (1, 1, 2, 1, 1.0, 1),
])
def test_send_layout_kernel_matches_reference(tokens, k, ep, local, drop, extra):
    """`extra`: rows past the slots in each rank's block (where the exchange puts counts)."""
    sorted_expert, order, send_counts, weight = _routing(tokens, k, ep, local, drop, seed=tokens * 7 + ep)
    assert moe_layout._kernel_reason(order, ep * local) is None, "the GPU machine should run the layout kernels"
    block = tokens * k + extra
    got = moe_layout.padded_send_layout(sorted_expert, order, send_counts, weight, k, block)
    want = moe_layout._send_reference(sorted_expert, order, send_counts, weight, k, block)
    assert got[1].numel() == ep * block
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("ep,local,n,align", [
    (2, 4, 128, 8), (2, 4, 128, 1), (4, 2, 37, 8), (8, 1, 5, 8), (2, 8, 3, 8), (2, 1, 1, 8),
])
def test_recv_layout_kernel_matches_reference(ep, local, n, align):
    g = torch.Generator(device="cuda").manual_seed(ep * 100 + n)
    # Each source sends at most n rows; some blocks full, some empty, some experts with none.
    share = torch.rand(ep, local, device="cuda", generator=g) ** 3
    fill = torch.rand(ep, 1, device="cuda", generator=g)
    fill[0] = 1.0
    if ep > 1:
        fill[1] = 0.0
    recv_counts = (share / share.sum(dim=1, keepdim=True) * fill * n).floor().long()
    got = moe_layout.padded_recv_layout(recv_counts, n, align)
    want = moe_layout._recv_reference(recv_counts, n, align, got[-1])
    assert got[-1] == ep * n + local * (align - 1)
    for name, a, b in zip(["position", "ends", "source", "back"], got, want):
        assert torch.equal(a, b), name


def test_layout_kernels_never_wait_for_the_device():
    sorted_expert, order, send_counts, weight = _routing(256, 2, 2, 4, 0.1, seed=3)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_layout.padded_send_layout(sorted_expert, order, send_counts, weight, 2)
        moe_layout.padded_recv_layout(send_counts, 512, 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
