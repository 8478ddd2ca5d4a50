"""The padded all-to-all, whole and split into overlapping pieces, computes what the exact
exchange (split sizes read on the host) does: outputs and every gradient, the router's
included (its gradient through the weighted sum of returned rows, not only the aux loss);
so does a backward whose expert weight gradients run while the next exchange travels
(`runtime.moe_backward_overlap`)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raypar.config import ModelConfig
from raypar.model import moe_exchange
from raypar.model.moe import MoE
from raypar.model.split_backward import compute_weight_grads, set_split_backward, weight_grads_deferred

from ports import free_port

EP = 2


EXACT = 0  # "pieces" of the exact exchange, the reference
OVERLAPPED = 10  # pieces + OVERLAPPED: the padded exchange in pieces, weight gradients overlapped


def _worker(rank: int, port: int, capacity_factor: float, chunks: tuple[int, ...], cuda: bool, queue) -> None:
    out = {}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=EP)
    try:
        cfg = ModelConfig(dim=16, n_heads=2, n_experts=4, moe_top_k=2, moe_ffn_dim=32,
                          moe_capacity_factor=capacity_factor)
        for c in chunks:
            torch.manual_seed(0)
            layer = MoE(cfg, 0, ep_rank=rank, ep_size=EP).to(device)
            for p in layer.parameters():
                torch.nn.init.normal_(p, std=0.3)
            layer.ep_group, layer.padded_alltoall, layer.chunks = dist.group.WORLD, c != EXACT, max(c % OVERLAPPED, 1)
            x = torch.randn(2, 7, 16, generator=torch.Generator().manual_seed(1 + rank)).to(device).requires_grad_()
            if c > OVERLAPPED:
                set_split_backward(layer, True)
                y = layer(x)
                while_exchanging = []
                real = moe_exchange.run_while_exchanging
                moe_exchange.run_while_exchanging = lambda: while_exchanging.append(real()) or while_exchanging[-1]
                try:
                    with weight_grads_deferred("mb", overlap=True):
                        y.square().sum().backward()
                finally:
                    moe_exchange.run_while_exchanging = real
                # Each piece's expert weights (w13, w2) go while its rows' gradient travels
                # (fp32 on a GPU loops over the experts, whole); the router's, left after
                # the last exchange, after backward.
                assert sum(while_exchanging) == (0 if cuda else 2 * (c - OVERLAPPED)), while_exchanging
                assert compute_weight_grads("mb") == 1
            else:
                y = layer(x)
                y.square().sum().backward()
            out[(rank, c)] = [t.cpu().numpy() for t in (y.detach(), x.grad, *(p.grad for p in layer.parameters()))]
    finally:
        dist.destroy_process_group()
    queue.put(out)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0], ids=["dropless", "capacity"])
def test_padded_exchange_in_pieces_equals_exact(capacity_factor):
    _check_chunks(capacity_factor, cuda=False)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < EP, reason=f"needs {EP} GPUs")
def test_padded_exchange_in_pieces_equals_exact_on_gpus():
    """NCCL and the layout kernels: the pieces' exchanges run on the communicator's stream."""
    _check_chunks(1.0, cuda=True)


def _check_chunks(capacity_factor: float, cuda: bool) -> None:
    chunks = (EXACT, 1, 2, 3, OVERLAPPED + 1, OVERLAPPED + 2)  # 14 tokens: 3 pieces of unequal size
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, capacity_factor, chunks, cuda, queue)) for r in range(EP)]
    for p in procs:
        p.start()
    results: dict = {}
    for _ in procs:
        results.update(queue.get(timeout=120))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    names = ["output", "input grad", "router grad", "w13 grad", "w2 grad"]
    for rank in range(EP):
        exact = results[(rank, EXACT)]
        assert abs(exact[2]).max() > 0
        for c in chunks[1:]:
            for name, a, b in zip(names, exact, results[(rank, c)]):
                assert torch.allclose(torch.from_numpy(a), torch.from_numpy(b), atol=1e-5, rtol=1e-5), \
                    f"rank {rank}, padded in {c % OVERLAPPED} pieces{' overlapped' * (c > OVERLAPPED)}: " \
                    f"{name} differs from the exact exchange's"
