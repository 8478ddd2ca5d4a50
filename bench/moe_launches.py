"""One MoE launch, diagnosed: step time per step, each worker's forward / backward / idle
seconds, the all-to-all's host time, MFU, and each worker's CPU affinity.

    python -m bench.moe_launches LABEL [--pin] [section.key=value ...]    # configs/moe-scale.yaml

Run it several times in one call to compare launches of the same code (BENCHMARKS.md, issue 24).
`--pin` gives every thread of worker r the cores 4 + 2r and 5 + 2r (`taskset -a`) before the
first step: a trial of whether the host's scheduling moves the step time.
"""
import os
import statistics
import subprocess
import sys

from raypar import Callback, Trainer, load_config


class Where(Callback):
    """Each worker's pid and CPU affinity once the workers are up (read from this node)."""

    def __init__(self, pin: bool):
        self.pin = pin

    def on_train_start(self, trainer):
        self.workers = []
        for i in trainer.group.info:
            if self.pin:
                first = 4 + 2 * i["rank"]
                subprocess.run(["taskset", "-a", "-cp", f"{first},{first + 1}", str(i["pid"])],
                               check=True, capture_output=True)
            try:
                cpus = sorted(os.sched_getaffinity(i["pid"]))
                aff = f"{cpus[0]}-{cpus[-1]} ({len(cpus)})"
            except OSError:
                aff = "?"
            self.workers.append(f"rank {i['rank']} pid {i['pid']} cpus {aff}")


def main() -> None:
    label, args = sys.argv[1], sys.argv[2:]
    where = Where(pin="--pin" in args)
    overrides = [a for a in args if a != "--pin"]
    s = Trainer(load_config("configs/moe-scale.yaml", overrides), callbacks=[where], log=lambda m: None).fit()
    steady = s.records[1:]
    per_worker = {}
    for r in steady:
        for t in r.stage_times:
            per_worker.setdefault((t.dp, t.ep), []).append((t.forward_s, t.backward_s, t.idle_s))
    print("RESULT", label, f"{s.tokens_per_s:,.0f} tok/s", f"step {s.step_time_s * 1000:.0f} ms",
          "steps", [round(r.step_time_s * 1000) for r in steady],
          f"a2a host {s.alltoall_s_per_step * 1000:.0f} ms", f"mfu {s.mfu:.3f}", flush=True)
    for key, rows in sorted(per_worker.items()):
        f, b, i = (statistics.fmean(x[k] for x in rows) * 1000 for k in range(3))
        print("  ", label, "dp,ep", key, f"F {f:.0f} B {b:.0f} idle {i:.0f} ms", flush=True)
    for w in where.workers:
        print("  ", label, w, flush=True)


if __name__ == "__main__":
    main()
