"""Node loss and return on a two-node Ray cluster simulated on this machine.

Run by tests/test_elastic.py in its own process (it needs its own Ray cluster):
    python tests/elastic_nodes.py TMP_DIR
Prints SHRANK when the run re-planned onto the surviving node (FROM MEMORY when that
recovery restored the lost node's ranks from the replicas on the other node, redoing at
most two steps) and GREW when it moved back to the configured grid after a node was added
(ON THE SAME PROCESSES when the grown grid took the smaller grid's workers rather than
starting them again); exits non-zero on any failure.
"""
import json
import sys
import time
from pathlib import Path

import ray
from ray.cluster_utils import Cluster

sys.path.insert(0, str(Path(__file__).resolve().parent))

from raypar.driver.callbacks import Callback  # noqa: E402
from raypar.config import config_from_dict  # noqa: E402
from raypar.data import write_synthetic_corpus  # noqa: E402
from raypar.driver.trainer import Trainer  # noqa: E402
from raypar.runtime.shared_copies import SHM_ROOT, process_running, run_key  # noqa: E402


EVERY = 3  # checkpoint.every


class NodeChaos(Callback):
    LAST_TRY = 8  # later, the run might end before the node comes back and it grows

    def __init__(self, cluster, doomed):
        self.cluster, self.doomed, self.grids = cluster, doomed, []
        self.removed_at: int | None = None
        self.pids: list[list[int]] = []  # the workers' processes at each (re)start

    def on_train_start(self, trainer):
        self.pids.append([i["pid"] for i in trainer.group.info])

    def on_step_end(self, trainer, record):
        self.grids.append(str(trainer.grid))
        if self.doomed is not None and record.step >= 3:
            # Once the other node holds the doomed node's newest copies: its ranks can come back
            # from those replicas. Under load a step's copies may not be replicated (the last
            # ones still on their way): then the run goes on and a later step tries again.
            # No older than this step (at most it and the one in flight are redone) nor the
            # newest checkpoint (or the recovery would take that instead).
            if record.memory_replicated and self.replicas_whole(trainer, oldest=max(record.step,
                                                                                    (record.step + 1) // EVERY * EVERY)):
                print(f"removing a node after step {record.step}", flush=True)
                pids = [i["pid"] for i in trainer.group.info if i["node_id"] == self.doomed.node_id]
                self.cluster.remove_node(self.doomed, allow_graceful=False)
                # Its workers outlive their raylet a moment: steps sent meanwhile would run on,
                # and a save among them commit a state newer than the copies (the driver, held
                # here, begins no save until they are gone: the step in flight's then fails).
                deadline = time.monotonic() + 30.0
                while any(process_running(p) for p in pids) and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.doomed, self.removed_at = None, record.step
            elif record.step >= self.LAST_TRY:
                raise TimeoutError(f"the workers off the doomed node held no whole state by step {record.step}")
        elif self.removed_at is not None and record.step >= self.removed_at + 2 and len(self.cluster.list_all_nodes()) == 2:
            print("adding a node", flush=True)
            self.cluster.add_node(num_cpus=1)
            # Steps take a fraction of a second: without waiting, a node that registers
            # slowly (a loaded machine) can miss every checkpoint left to grow at. Registered
            # is not enough: its CPUs reach `ray.available_resources` (what the controller
            # plans from) a moment later.
            self.cluster.wait_for_nodes()
            deadline = time.monotonic() + 20.0
            while trainer._controller._grow_plan() is None:
                if time.monotonic() > deadline:
                    print(f"NO ROOM TO GROW 20 s after a node was added: available {ray.available_resources()}",
                          flush=True)
                    return
                time.sleep(0.2)
            print(f"room to grow after step {record.step}", flush=True)

    def replicas_whole(self, trainer, oldest: int, wait_s: float = 10.0) -> bool:
        """Whether, within `wait_s`, the workers off the doomed node hold a whole state (every
        rank's, own copies and replicas) of step `oldest` or later: the recovery must then
        restore from memory, whatever the timing of the steps in flight."""
        workers, info = trainer.group.workers, trainer.group.info
        doomed = {r for r, i in enumerate(info) if i["node_id"] == self.doomed.node_id}
        kept = [w for r, w in enumerate(workers) if r not in doomed]
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            held = {entry for w in kept for entry in ray.get(w.memory_inventory.remote())}
            # A step the driver saw copied (its reports are back), or it would not ask for it.
            seen = trainer._controller._memory_steps
            if any(all((r, step) in held for r in range(len(workers))) for _, step in held
                   if step >= oldest and step in seen):
                return True
            time.sleep(0.05)
        return False


# How soon the GCS marks a removed node dead: a check a second, three failed in a row (a
# killed raylet fails each at once; a live one has health_check_timeout_ms, 10 s, to answer
# each). Ray's defaults (3 s, 5) hold the run ~15 s after a removal: growing waits for the
# lost node to be marked dead (`wait_for_nodes`) before it plans on the new one.
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}


def main(tmp: Path) -> int:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                            "_system_config": HEALTH_CHECKS})
    cluster.add_node(num_cpus=1)
    doomed = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        data = write_synthetic_corpus(tmp / "nodes-data.parquet", 256, 8, 64, seed=1)
        cfg = config_from_dict({
            "model": {"vocab_size": 64, "dim": 32, "n_layers": 4, "n_heads": 4, "max_seq_len": 16},
            "parallel": {"dp": 2, "pp": 2, "microbatches": 2},
            "train": {"steps": 15, "global_batch_size": 8},
            "data": {"path": str(data), "seq_len": 8},
            "runtime": {"run_dir": str(tmp / "nodes-run"), "device": "cpu", "cpus_per_worker": 0.5,
                        "collective_timeout_s": 30.0, "placement_timeout_s": 30.0},
            # The node goes once the other one holds a whole copy as new as the newest
            # checkpoint, and no save begins before its workers are gone (`NodeChaos`): the
            # recovery restores from the copies whatever the timing.
            "checkpoint": {"every": EVERY},
            "elastic": {"enabled": True, "resource_timeout_s": 30.0},
        })
        chaos = NodeChaos(cluster, doomed)
        summary = Trainer(cfg, callbacks=[chaos]).fit()
        print("grids per step:", chaos.grids, flush=True)
        print("recoveries:", summary.recoveries, flush=True)
        print("states:", summary.controller_states, flush=True)
        assert sorted({r.step for r in summary.records}) == list(range(15))
        shrank = [r for r in summary.recoveries if r["grid"] == "dp=1 x pp=2 x ep=1"]
        if shrank:
            print("SHRANK")
            # The lost node's ranks came back from the replicas on the other node.
            # At most the step whose copy was not whole yet and the one in flight: this
            # callback holds the driver while the workers run on (sends no longer wait).
            if shrank[0]["source"] == "memory" and shrank[0]["steps_lost"] <= 2:
                print("FROM MEMORY")
        if "GROWING" in summary.controller_states and chaos.grids[-1] == "dp=2 x pp=2 x ep=1":
            print("GREW")
            print("worker processes at each start:", chaos.pids, flush=True)
            if set(chaos.pids[-2]) <= set(chaos.pids[-1]):
                print("ON THE SAME PROCESSES")
        # The lost node's copies in shared memory (one machine: its /dev/shm is still here) go
        # too once its processes have ended.
        left = SHM_ROOT / run_key(cfg.runtime.run_dir)
        if left.exists():
            print("LEFT IN SHARED MEMORY:", sorted(str(p.relative_to(left)) for p in left.rglob("*")))
        return 0
    finally:
        # Every state change with its cause: what a failed recovery attempt ran into.
        log = tmp / "nodes-run" / "controller.jsonl"
        if log.exists():
            print("state changes:", [(c["state"], c["why"][:300]) for c in map(json.loads, log.read_text().splitlines())
                                     if c["state"] in ("RECOVERING", "FAILED")], flush=True)
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
