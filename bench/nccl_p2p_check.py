"""NCCL p2p between two processes, one GPU each, in the pipeline's message pattern.

Isolates the p2p layer from Ray: `--isolated` gives each process only its own GPU
(CUDA_VISIBLE_DEVICES, as Ray does for actors); without it both see both GPUs.
Prints OK or the failure for each variant; exits non-zero on failure.

    python -m bench.nccl_p2p_check [--isolated] [--messages 16] [--numel 4096]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch.multiprocessing as mp


def worker(rank: int, args, port: int, q) -> None:
    if args.isolated:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import torch
    import torch.distributed as dist

    dev = torch.device("cuda", 0 if args.isolated else rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=args.timeout))
    peer = 1 - rank
    t0 = time.time()
    try:
        # Forward-then-backward: rank 0 sends every forward, then receives every gradient.
        bufs = [torch.full((args.numel,), float(i), device=dev) for i in range(args.messages)]
        for i in range(args.messages):
            op = dist.isend if rank == 0 else dist.irecv
            for w in dist.batch_isend_irecv([dist.P2POp(op, bufs[i], peer)]):
                w.wait()
        for i in range(args.messages):
            op = dist.irecv if rank == 0 else dist.isend
            for w in dist.batch_isend_irecv([dist.P2POp(op, bufs[i], peer)]):
                w.wait()
        torch.cuda.synchronize()
        ok = all(float(b[0]) == i for i, b in enumerate(bufs))
        q.put((rank, "OK" if ok else "WRONG DATA", time.time() - t0))
    except Exception as e:  # noqa: BLE001 - report whatever NCCL raised
        q.put((rank, f"FAILED: {e!r}"[:300], time.time() - t0))
    finally:
        dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--isolated", action="store_true")
    ap.add_argument("--messages", type=int, default=16)
    ap.add_argument("--numel", type=int, default=4096)
    ap.add_argument("--timeout", type=float, default=20.0)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=worker, args=(r, args, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = []
    deadline = time.time() + args.timeout + 40
    while len(results) < 2 and time.time() < deadline:
        try:
            results.append(q.get(timeout=max(0.1, deadline - time.time())))
        except Exception:  # noqa: BLE001 - queue.Empty
            break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    label = f"isolated={args.isolated} messages={args.messages} numel={args.numel}"
    if len(results) < 2:
        print(f"{label}: HUNG (results so far {results})")
        return 1
    print(f"{label}: " + "; ".join(f"rank {r} {s} in {t:.1f}s" for r, s, t in sorted(results)))
    return 0 if all(s == "OK" for _, s, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
