"""Host time against device time of one MoE stage's micro-batch, on 2 GPUs (issue 24).

    python -m bench.moe_host OUT moe dense alltoall

`moe` / `dense`: two processes (NCCL, one GPU each) build the whole `configs/moe-scale.yaml`
model as one stage at ep=2 with padded all-to-alls (`dense`: the same model without
experts) and run forward and backward of one micro-batch of 2 x 1024 tokens: `host_ms` is
the time until the host has queued it, `wall_ms` until the device has run it (mean of 10
after 5 warm-ups). Rank 0 also writes a cProfile of the host (5 micro-batches) and a
torch.profiler table of 2 (CPU and CUDA time by op) to OUT/<mode>-0.json. When host_ms is
close to wall_ms, the host's launches set the pace. `alltoall`: all_to_all_single of 1-64 MB
per peer, and a device-to-device copy, for the bandwidth the MoE's bytes would need.
"""
import io
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))


def stage(rank: int, world: int, out: str, mode: str) -> None:
    import cProfile
    import dataclasses
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from raypar.config import load_config
    from raypar.model.moe import MoE
    from raypar.model.partition import build_stage

    _init(rank, world, 29533)
    cfg = load_config("configs/moe-scale.yaml", ["parallel.pp=1", f"parallel.ep={world}"]).model
    if mode == "dense":
        cfg = dataclasses.replace(cfg, n_experts=0)
    m = build_stage(cfg, 0, 1, device="cuda", ep_rank=rank, ep_size=world, seed=0)
    for mod in m.modules():
        if isinstance(mod, MoE):
            mod.ep_group = dist.group.WORLD
            mod.padded_alltoall = True
    x = torch.randint(0, cfg.vocab_size, (2, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(rank))

    def micro_batch():
        m(x, x).backward()

    for _ in range(5):
        micro_batch()
    torch.cuda.synchronize()
    dist.barrier()
    n, host = 10, []
    t = time.perf_counter()
    for _ in range(n):
        h0 = time.perf_counter()
        micro_batch()
        host.append(time.perf_counter() - h0)
    torch.cuda.synchronize()
    res = {"mode": mode, "rank": rank, "host_ms": sum(host) / n * 1e3, "wall_ms": (time.perf_counter() - t) / n * 1e3}
    prof_host = cProfile.Profile()
    prof_host.enable()
    for _ in range(5):
        micro_batch()
    torch.cuda.synchronize()
    prof_host.disable()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            micro_batch()
        torch.cuda.synchronize()
    if rank == 0:
        for key, order in (("cprofile", "tottime"), ("cprofile_cum", "cumtime")):
            text = io.StringIO()
            pstats.Stats(prof_host, stream=text).sort_stats(order).print_stats(60)
            res[key] = text.getvalue()
        res["cpu_top"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        res["cuda_top"] = prof.key_averages().table(sort_by="self_device_time_total", row_limit=30)
    with open(f"{out}/{mode}-{rank}.json", "w") as f:
        json.dump(res, f)
    print(mode, "rank", rank, f"host {res['host_ms']:.1f} ms, wall {res['wall_ms']:.1f} ms per micro-batch", flush=True)
    dist.destroy_process_group()


def alltoall(rank: int, world: int, out: str, mode: str) -> None:
    _init(rank, world, 29534)
    for mb in (1, 8, 16, 32, 64):
        x = torch.ones(mb * 2**20 // 2 * world, dtype=torch.bfloat16, device="cuda")
        y = torch.empty_like(x)
        for _ in range(3):
            dist.all_to_all_single(y, x)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10):
            dist.all_to_all_single(y, x)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / 10
        if rank == 0:
            print(f"all-to-all, {mb} MB per peer: {dt * 1e3:.3f} ms, {mb / 1024 / dt:.1f} GB/s per direction", flush=True)
    if rank == 0:
        a = torch.ones(2**28 // 2, dtype=torch.bfloat16, device="cuda:0")
        for _ in range(2):
            a.to("cuda:1")
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(5):
            a.to("cuda:1")
        torch.cuda.synchronize()
        print(f"device-to-device copy: {5 * 0.25 / (time.perf_counter() - t):.0f} GB/s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for mode in sys.argv[2:]:
        mp.spawn(alltoall if mode == "alltoall" else stage, args=(2, out, mode), nprocs=2)
