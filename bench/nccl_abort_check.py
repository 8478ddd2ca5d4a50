"""Does a survivor's NCCL communicator abort return while work waits on a lost peer?

Two processes, one GPU each (CUDA_VISIBLE_DEVICES, as Ray gives actors). Both connect a
p2p pair and the world's communicator, then rank 1 exits. Rank 0 posts a receive from it,
which never completes, and a launcher thread queues `--kernels` small kernels behind that
receive, as a stage queues its micro-batches' compute behind a pipeline receive. After 2 s
another thread aborts every process group (torch's `_abort_process_group()`, or raypar's
`abort_groups` with `concurrent`) and the check reports whether that returned, in how
long, and whether the launcher got out.

A variant is a base and flags, joined by '+' (e.g. `unbounded+3comms+lazy+concurrent`).
Bases:
  unbounded   the launcher queues every kernel at once (a stage's host running ahead)
  few         only 64 kernels behind the receive
  bounded     the launcher stays at most two chunks of kernels ahead of the GPU, waiting
              on events it polls, and stops when cancelled (raypar.host_wait)
  stage       raypar's own stage runtime instead of the launcher (configs/gpt-1b.yaml at
              pp=2, its process groups and 1F1B program): rank 1 exits after step 1 while
              rank 0 runs step 2; rank 0 cancels its step (host_wait) and aborts
Flags:
  send        the pending transfer is a send to the lost peer, not a receive
  big         16 MiB instead of 256 KiB
  3comms      a second communicator over both ranks (new_group), used once before
  lazy        no device_id: communicators are created at first use, as raypar's are
  soon        the peer exits at once and the abort comes 0.3 s after the transfer
  recv        (stage) rank 0 exits instead: the survivor waits to receive
  idle        (stage) no step in flight when the peer exits
  concurrent  every process group aborted at once (raypar.runtime.groups.abort_groups)
  nonblocking TORCH_NCCL_USE_COMM_NONBLOCKING=1
  aeh0        TORCH_NCCL_ASYNC_ERROR_HANDLING=0 instead of raypar's 2

A survivor whose stage abort does not return within 15 s writes every thread's stack
(Python, and native through gdb where it is installed) to --stacks.

    python -m bench.nccl_abort_check --variants unbounded,stage,stage+concurrent [--kernels 20000] \
        [--out FILE] [--stacks DIR]

Prints one JSON line per variant and writes them to --out if given.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from datetime import timedelta

import torch.multiprocessing as mp

CHUNK = 64  # kernels per chunk in the bounded launcher


def _env(rank: int, variant: str) -> None:
    from actors.placement import GPU_ENV

    os.environ.update(GPU_ENV)
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    if "nonblocking" in variant:
        os.environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] = "1"
    if "aeh0" in variant:
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"


def _dump_stacks(path: str | None) -> None:
    """Every thread's Python stack, then the native ones through gdb, into `path`."""
    import faulthandler
    import shutil
    import subprocess

    if path is None:
        return
    with open(path, "w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        f.flush()
        gdb = shutil.which("gdb")
        if gdb is None:
            f.write("\n(no gdb here: native stacks not taken)\n")
            return
        r = subprocess.run([gdb, "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt 30"],
                           capture_output=True, text=True, timeout=120)
        f.write("\n" + r.stdout[-200_000:] + r.stderr[-5_000:])


def _timed_abort(flags: set[str], wait_s: float) -> dict:
    """Cancel the step and abort every group, as `StageWorker.abort` does, on another thread;
    whether that returned within `wait_s` and how long it took."""
    import torch.distributed as dist

    from raypar import host_wait

    done = threading.Event()

    def abort() -> None:
        host_wait.cancel("the peer is lost")
        if "concurrent" in flags:
            from raypar.runtime.groups import abort_groups

            abort_groups()
        else:
            dist.distributed_c10d._abort_process_group()
        done.set()

    t0 = time.perf_counter()
    threading.Thread(target=abort, daemon=True).start()
    returned = done.wait(wait_s)
    return {"abort_returned": returned, "abort_s": round(time.perf_counter() - t0, 3)}


def stage_worker(rank: int, port: int, variant: str, data_path: str, stacks: str | None, q) -> None:
    _env(rank, variant)
    import torch

    from raypar.config import load_config
    from raypar.data import SampleOrder, TokenDataset
    from raypar.runtime.groups import build_groups, init_world
    from raypar.runtime.stage import StageRuntime
    from raypar.schedule import build_programs
    from raypar.topology import Grid

    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "gpt-1b.yaml"),
                      ["parallel.pp=2", f"data.path={data_path}"])
    grid = Grid(dp=1, pp=2, ep=1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    timeout = timedelta(seconds=cfg.runtime.collective_timeout_s)
    init_world("nccl", "127.0.0.1", port, rank, 2, timeout)
    groups = build_groups(grid, rank, timeout)
    runtime = StageRuntime(cfg, grid, rank, groups, dev, TokenDataset(data_path, cfg.data.seq_len))
    runtime.set_program(build_programs(cfg.parallel.schedule, 2, cfg.parallel.microbatches)[rank])
    order = SampleOrder(10**6, cfg.train.seed, shuffle=False)
    gbs = cfg.train.global_batch_size
    for step in range(2):
        runtime.run_step(step, order.indices(step * gbs, gbs))
    flags = set(variant.split("+"))
    lost = 0 if "recv" in flags else 1  # recv: the last stage survives, waiting to receive
    if rank == lost:
        os._exit(0)
    step_error: list[str] = []

    def step_two() -> None:
        try:
            runtime.run_step(2, order.indices(2 * gbs, gbs))
        except BaseException as e:  # noqa: BLE001 - how the step ended is the result
            step_error.append(f"{type(e).__name__}: {str(e)[:200]}")

    stepper = threading.Thread(target=step_two, daemon=True)
    if "idle" in flags:  # no step in flight when the peer is lost
        time.sleep(1.0)
    else:
        stepper.start()
        time.sleep(0.3)
    result = {"variant": variant, **_timed_abort(flags, 15.0)}
    if stepper.is_alive():
        stepper.join(5.0)
    result["step_out"] = not stepper.is_alive()
    result["step_error"] = step_error[0] if step_error else None
    if not result["abort_returned"]:
        _dump_stacks(stacks and os.path.join(stacks, f"{variant}.txt"))
    else:
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        result["drain_s"] = round(time.perf_counter() - t1, 3)
    q.put(result)
    q.close()
    q.join_thread()
    os._exit(0)


def worker(rank: int, port: int, variant: str, kernels: int, q) -> None:
    _env(rank, variant)
    import torch
    import torch.distributed as dist

    from raypar import host_wait

    flags = set(variant.split("+"))
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120), device_id=None if "lazy" in flags else dev)
    peer = 1 - rank
    one = torch.ones(1, device=dev)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, one, peer), dist.P2POp(dist.irecv, torch.empty_like(one), peer)]):
        w.wait()
    dist.all_reduce(one)
    if "3comms" in flags:  # a second communicator over the same ranks, as raypar's replica group
        dist.all_reduce(one, group=dist.new_group([0, 1]))
    torch.cuda.synchronize()
    if rank == 1:
        if "soon" not in flags:
            time.sleep(0.5)
        os._exit(0)

    buf = torch.zeros(4096, 1024 if "big" in flags else 16, device=dev)
    op = dist.isend if "send" in flags else dist.irecv
    for w in dist.batch_isend_irecv([dist.P2POp(op, buf, peer)]):
        w.wait()  # the compute stream now waits on the transfer
    launched = [0]
    launcher_error: list[str] = []
    n = 64 if "few" in flags else kernels

    def launch() -> None:
        x = buf
        events: list = []
        try:
            for i in range(n):
                x = x * 1.0001 + 1.0
                launched[0] = i + 1
                if "bounded" in flags and (i + 1) % CHUNK == 0:
                    ev = torch.cuda.Event()
                    ev.record()
                    events.append(ev)
                    if len(events) > 2:
                        host_wait.wait_for(events.pop(0), "bounded launcher")
        except host_wait.StepCancelled as e:
            launcher_error.append(str(e))

    launcher = threading.Thread(target=launch, daemon=True)
    launcher.start()
    time.sleep(0.3 if "soon" in flags else 2.0)
    queued = launched[0]
    result = {"variant": variant, "kernels": n, "queued_before_abort": queued, **_timed_abort(flags, 20.0)}
    launcher.join(5.0)
    result["launcher_out"] = not launcher.is_alive()
    result["launcher_cancelled"] = bool(launcher_error)
    result["launched"] = launched[0]
    if result["abort_returned"]:
        t1 = time.perf_counter()
        torch.cuda.synchronize()  # the aborted receive must let the queued kernels drain
        result["drain_s"] = round(time.perf_counter() - t1, 3)
    q.put(result)
    q.close()
    q.join_thread()
    os._exit(0)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def run_variant(variant: str, args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    if variant.startswith("stage"):
        procs = [ctx.Process(target=stage_worker, args=(r, port, variant, args.data, args.stacks, q)) for r in range(2)]
    else:
        procs = [ctx.Process(target=worker, args=(r, port, variant, args.kernels, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        result = q.get(timeout=240 if variant.startswith("stage") else 60)
    except Exception as e:  # noqa: BLE001 - a hung survivor is the result
        result = {"variant": variant, "error": f"no result ({type(e).__name__})"}
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            result["killed"] = True
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="unbounded+3comms+lazy,unbounded+3comms+lazy+concurrent,stage,stage+concurrent")
    ap.add_argument("--kernels", type=int, default=20000)
    ap.add_argument("--out", default=None)
    ap.add_argument("--stacks", default=None, help="folder for the stacks of a survivor whose abort hangs")
    ap.add_argument("--data", default="/tmp/nccl-abort-check.parquet", help="synthetic corpus (written if missing)")
    args = ap.parse_args()
    if any(v.startswith("stage") for v in args.variants.split(",")) and not os.path.exists(args.data):
        from raypar.config import load_config
        from raypar.data.synthetic import write_synthetic_corpus

        cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "gpt-1b.yaml"))
        write_synthetic_corpus(args.data, 4 * cfg.train.global_batch_size, cfg.data.seq_len, cfg.model.vocab_size,
                               seed=cfg.train.seed)
    if args.stacks:
        os.makedirs(args.stacks, exist_ok=True)
    results = []
    for variant in args.variants.split(","):
        r = run_variant(variant, args)
        print(json.dumps(r), flush=True)
        results.append(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
