"""MoE suite: the same mixture-of-experts model on expert parallelism (ep=2) and on a 2-stage
pipeline (pp=2), and the all-to-all's achieved bandwidth against the NCCL p2p bandwidth
between two GPU actors measured in the same run.
"""
from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.run import Context

TITLE = "mixture of experts (8 experts, top-2): ep=2 against pp=2, all-to-all against NCCL p2p"
NOTES = ("all-to-all bytes: sent to other ranks per step, forward and backward, summed over workers; "
         "host time: the slowest worker's time inside the exchanges (on GPU launch time plus the waits "
         "the split sizes force, not kernel time); achieved = bytes per worker / host time. "
         "p2p: 256 MiB NCCL send/recv between two Ray actors, one GPU each.")

MOE = ["model.n_experts=8", "model.moe_top_k=2", "model.moe_every=1", "train.global_batch_size=16"]
# GPU: ~1.4B parameters (8 layers of 8 experts of 1536 x 4096), so each of 2 GPUs holds ~0.8B.
GPU_MODEL = ["model.vocab_size=32000", "model.dim=1536", "model.n_layers=8", "model.n_heads=12",
             "model.max_seq_len=1024", "model.dtype=bfloat16", "data.seq_len=1024"]
# (label, dp, pp, ep, micro-batches): 2 sequences per micro-batch in both rows.
GRIDS = [("ep=2, grid (1,1,2)", 1, 1, 2, 4), ("pp=2, grid (1,2,1)", 1, 2, 1, 8)]
KERNELS_OFF = "ep=2, grid (1,1,2), kernels off (torch permute)"
P2P_BYTES = 256 * 2**20
P2P_ITERS = 10


def run(ctx: "Context") -> list[dict]:
    # The p2p pair first: it is cheap, and the all-to-all rows are read against it.
    if ctx.cpu:
        rows = [{"label": "NCCL p2p send/recv, 256 MiB",
                 "unavailable": "not available on CPU: NCCL needs 2 GPUs (run without --cpu)"}]
    else:
        rows = ctx.attempt("NCCL p2p send/recv, 256 MiB", p2p_row, min_time_s=15)
    grids = GRIDS[:1] if ctx.quick else GRIDS
    if not ctx.cpu:  # on CPU every op runs its torch reference anyway
        grids = [*grids, (KERNELS_OFF, *GRIDS[0][1:])]
    for label, dp, pp, ep, mb in grids:
        overrides = [*([] if ctx.cpu else GPU_MODEL), *MOE, f"parallel.dp={dp}", f"parallel.pp={pp}",
                     f"parallel.ep={ep}", f"parallel.microbatches={mb}", "parallel.schedule=1f1b",
                     f"runtime.kernels={'false' if label == KERNELS_OFF else 'true'}"]
        cfg = ctx.config(overrides, label)

        def one(label=label, cfg=cfg) -> dict:
            summary, reused = ctx.fit(cfg, label)
            return ctx.row(label, cfg, summary, reused, **alltoall_figures(summary, cfg))

        rows += ctx.attempt(label, one)
    p2p = next((r for r in rows if "p2p_gbps" in r), None)
    for r in rows:
        if p2p and r.get("alltoall_gbps"):
            r["alltoall_vs_p2p"] = r["alltoall_gbps"] / p2p["p2p_gbps"]
    return rows


def alltoall_figures(summary, cfg) -> dict:
    """Share of the step in all-to-all, and bytes per worker over host time."""
    p = cfg.parallel
    out = {"alltoall_share": summary.alltoall_s_per_step / summary.step_time_s if summary.step_time_s else 0.0,
           "alltoall_gbps": None}
    if p.ep > 1 and summary.alltoall_s_per_step > 0:
        per_worker = summary.alltoall_bytes_per_step / (p.dp * p.pp * p.ep)
        out["alltoall_gbps"] = per_worker / summary.alltoall_s_per_step / 1e9
    return out


# -- NCCL p2p between two GPU actors ---------------------------------------------------------


def p2p_row() -> dict:
    import ray

    from raypar.actors.placement import gpu_env

    if ray.cluster_resources().get("GPU", 0) < 2:
        return {"label": "NCCL p2p send/recv, 256 MiB", "unavailable": "needs 2 GPUs in the Ray cluster"}
    peer = ray.remote(num_gpus=1, num_cpus=1)(P2PPeer)
    peers = [peer.options(runtime_env={"env_vars": gpu_env()}).remote(rank) for rank in range(2)]
    try:
        port = ray.get(peers[0].free_port.remote(), timeout=120)
        ray.get([p.setup.remote(port) for p in peers], timeout=120)
        uni = ray.get([p.transfer.remote(P2P_BYTES, P2P_ITERS, both=False) for p in peers], timeout=120)
        bi = ray.get([p.transfer.remote(P2P_BYTES, P2P_ITERS, both=True) for p in peers], timeout=120)
    finally:
        for p in peers:
            ray.kill(p)
    uni_s, bi_s = max(uni), max(bi)
    return {"label": "NCCL p2p send/recv, 256 MiB", "bytes": P2P_BYTES, "iterations": P2P_ITERS,
            "p2p_gbps": P2P_BYTES * P2P_ITERS / uni_s / 1e9,
            "p2p_bidirectional_gbps_per_direction": P2P_BYTES * P2P_ITERS / bi_s / 1e9}


class P2PPeer:
    """One end of the pair: rank 0 sends, rank 1 receives (or both at once)."""

    def __init__(self, rank: int):
        import torch

        self.rank = rank
        self.device = torch.device("cuda", 0)  # Ray makes this actor's GPU the only visible one
        torch.cuda.set_device(self.device)

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def setup(self, port: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=self.rank, world_size=2,
                                timeout=timedelta(seconds=60))

    def transfer(self, nbytes: int, iters: int, both: bool) -> float:
        """Seconds for `iters` transfers of `nbytes`, after one warm-up transfer."""
        import torch
        import torch.distributed as dist

        send = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        recv = torch.empty_like(send)
        peer = 1 - self.rank

        def once() -> None:
            if both:
                ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
            else:
                ops = [dist.P2POp(dist.isend if self.rank == 0 else dist.irecv, send if self.rank == 0 else recv, peer)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

        once()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            once()
        torch.cuda.synchronize()
        return time.perf_counter() - t0


def table(rows: list[dict]) -> str:
    lines = ["| run | tokens/s | step ms | all-to-all MiB/step | all-to-all host ms/step | share of step | "
             "achieved GB/s per worker | vs p2p | p2p GB/s (one way / each way of both) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "p2p_gbps" in r:
            lines.append(f"| {r['label']} | | | | | | | | {r['p2p_gbps']:.1f} / "
                         f"{r['p2p_bidirectional_gbps_per_direction']:.1f} |")
            continue
        gbps = f"{r['alltoall_gbps']:.3g}" if r.get("alltoall_gbps") else "-"
        vs = f"{r['alltoall_vs_p2p']:.1%}" if r.get("alltoall_vs_p2p") else "-"
        lines.append(f"| {r['label']} ({r['microbatches']} mb) | {r['tokens_per_s']:,.0f} | "
                     f"{r['step_time_s'] * 1000:.1f} | {r['alltoall_bytes_per_step'] / 2**20:.1f} | "
                     f"{r['alltoall_s_per_step'] * 1000:.1f} | {r['alltoall_share']:.1%} | {gbps} | {vs} | |")
    return "\n".join(lines)
