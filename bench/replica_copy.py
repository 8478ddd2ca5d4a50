"""The receiving side of a state's replica (`StageWorker.keep_replica`): copied into fresh
memory, as before, against into the buffers of the replica it replaces
(`RecentStates.replica_buffers`), alternating in one process. Host memory only: this is the
part of a replica's path after the object store hands it over, not the whole of it.

    python -m bench.replica_copy [--gib 2] [--tensors 200] [--rounds 6]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from raypar.runtime.recent_states import REPLICAS_KEPT, RecentStates, pack, unpack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    per = int(args.gib * 2**30 / 4 / args.tensors)
    state = {f"t{i}": torch.randn(per) for i in range(args.tensors)}
    packed = pack(state)  # what ray.get hands the peer: raw bytes, read in place
    recent = RecentStates()
    for step in range(-REPLICAS_KEPT - 1, 0):  # as in a run: replicas kept already, one to replace
        recent.keep_replica(1, step, unpack(packed), generation=0)
    fresh_s, reused_s = [], []
    for r in range(args.rounds):
        for how in ("fresh", "reused") if r % 2 == 0 else ("reused", "fresh"):
            t0 = time.perf_counter()
            if how == "fresh":
                kept = unpack(packed)  # a new allocation per replica
            else:
                incoming = unpack(packed, copy=False)
                kept = recent.replica_buffers(1, incoming)
                for name, t in incoming.items():
                    kept[name].copy_(t)
            (fresh_s if how == "fresh" else reused_s).append(time.perf_counter() - t0)
            recent.keep_replica(1, 2 * r + (how == "reused"), kept, generation=0)
    gib = args.gib
    print(f"| receiving a {gib:g} GiB replica ({args.tensors} tensors, torch threads {torch.get_num_threads()}) "
          f"| fresh memory | buffers reused |")
    print("|---|---|---|")
    print(f"| seconds, median of {args.rounds} | {statistics.median(fresh_s):.3f} | {statistics.median(reused_s):.3f} |")
    print(f"| GiB/s | {gib / statistics.median(fresh_s):.2f} | {gib / statistics.median(reused_s):.2f} |")
    print(f"\nreused / fresh time: {statistics.median(reused_s) / statistics.median(fresh_s):.3f} "
          f"(rounds: fresh {[round(s, 3) for s in fresh_s]}, reused {[round(s, 3) for s in reused_s]})")


if __name__ == "__main__":
    main()
