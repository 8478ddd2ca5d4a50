"""A load's copies from host to GPU: `dst.copy_(src)` one tensor after another (loads before
`HostCopies`) against `HostCopies` with 1, 2, 4 and 8 stagers, alternating in one process.
The sources are views of a file in /dev/shm mapped afresh for every pass, as a standby
maps a lost worker's copies (or a load maps a checkpoint's bytes): every pass pays for the
page faults too. Torch runs `--torch-threads` intra-op threads: Ray sets a worker's
OMP_NUM_THREADS to its CPUs (`runtime.cpus_per_worker`, 2 in `configs/gpt-1b.yaml`).

    python -m bench.host_copies [--gib 8] [--rounds 2] [--torch-threads 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from raypar.runtime.host_copies import host_copies

# A state's tensors: a few large, many middling, more small (the 0.84B's run 1 MB to 400 MB).
SIZES_MIB = [64] * 96 + [8] * 200 + [1] * 400


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=8.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--file", default="/dev/shm/raypar-bench-host-copies.bin")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    scale = args.gib * 1024 / sum(SIZES_MIB)
    sizes = [max(1, int(m * scale)) << 20 for m in SIZES_MIB]
    total = sum(sizes)
    with open(args.file, "wb") as f:
        block = os.urandom(64 << 20)
        for at in range(0, total, len(block)):
            f.write(block[:min(len(block), total - at)])
    dst = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
    hows = ["plain"] + [f"staged-{n}" for n in (1, 2, 4, 8)]
    seconds: dict[str, list[float]] = {h: [] for h in hows}
    try:
        for r in range(args.rounds):
            for how in hows if r % 2 == 0 else hows[::-1]:
                flat = torch.from_file(args.file, shared=False, size=total, dtype=torch.uint8)
                src = list(torch.split(flat, sizes))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if how == "plain":
                    for d, s in zip(dst, src):
                        d.copy_(s)
                else:
                    with host_copies(torch.device("cuda"), threads=int(how.split("-")[1])) as copies:
                        for d, s in zip(dst, src):
                            copies.copy(d, s)
                    assert copies.staged_bytes == total
                torch.cuda.synchronize()
                seconds[how].append(time.perf_counter() - t0)
                assert torch.equal(dst[-1].cpu(), src[-1]), how
                del flat, src
    finally:
        os.unlink(args.file)
    gib = total / 2**30
    print(f"| {gib:.1f} GiB in {len(sizes)} tensors, from a fresh mapping of /dev/shm ({torch.cuda.get_device_name()}, "
          f"{args.torch_threads} torch threads) "
          f"| seconds (median of {args.rounds}) | GB/s | of plain |")
    print("|---|---|---|---|")
    plain = statistics.median(seconds["plain"])
    for how in hows:
        s = statistics.median(seconds[how])
        print(f"| {how} | {s:.3f} | {total / 1e9 / s:.1f} | {plain / s:.1f}x |")
    print(f"\nrounds: {({h: [round(x, 3) for x in v] for h, v in seconds.items()})}")


if __name__ == "__main__":
    main()
