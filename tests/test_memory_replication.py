"""States in memory (elastic.memory_every): a worker lost while its newest replica is still
on its way to its peer comes back from the newest step whose replica was whole (or from
storage), and the run ends with the uninterrupted run's result."""
import asyncio
import time

import pytest
import ray

from raypar.actors.memory import peer_of
from raypar.driver.callbacks import Callback
from raypar.driver.trainer import Trainer

from helpers import KillWorker, last_loss_per_step, run_config

STEPS = 8
VICTIM = 1
BLOCK_AT = 3  # from this record step on, the first replicated step's replica is the victim's last
GATE_TIMEOUT_S = 240.0  # the block ends by itself after this, so that nothing waits forever


def replication_config(tmp_path, name):
    # steps_ahead=0: no step is in flight while a hook runs, so what each worker holds when the
    # hooks look (and when the victim dies) does not depend on timing.
    # memory_shared=False: the victim's own copies die with its process; only its replicas remain.
    # No checkpoints: the recovery restores from memory or starts over.
    return run_config(tmp_path, name, (2, 2, 1), STEPS, checkpoint={"every": 0}, runtime={"steps_ahead": 0},
                      elastic={"enabled": True, "resource_timeout_s": 10.0, "memory_every": 1,
                               "memory_shared": False})


@pytest.fixture
def data(tmp_path):
    from raypar.data import write_synthetic_corpus

    write_synthetic_corpus(tmp_path / "data.parquet", 256, 8, 64, seed=1)


@ray.remote(num_cpus=0)
class Gate:
    """An object that is not there until `release` (or `timeout_s`): what the blocked call waits on."""

    def __init__(self):
        self.event = asyncio.Event()
        self.timed_out = False

    async def wait(self, timeout_s: float):
        try:
            await asyncio.wait_for(self.event.wait(), timeout_s)
        except asyncio.TimeoutError:
            self.timed_out = True
        return None  # not a packed state: the blocked keep_replica fails before it keeps anything

    async def release(self) -> bool:
        self.event.set()
        return self.timed_out


def replica_steps(worker, rank: int) -> list[int]:
    return [s for r, s in ray.get(worker.memory_inventory.remote(), timeout=60) if r == rank]


class BlockReplicationThenKill(Callback):
    """After the first step from `BLOCK_AT` on whose copy was replicated (replicas go at their
    own pace: not every step's is), once the victim's replica of it is kept by its peer,
    occupies the peer's "memory" concurrency group (one call at a time) with a keep_replica
    that waits on `gate`: the victim's later replicas queue behind it and are never kept.
    After the next step kills the victim."""

    def __init__(self, gate):
        self.gate = gate
        self.blocked = None  # the blocking call's ref
        self.blocked_after: int | None = None  # steps done when the block came
        self.peer = None
        self.replica_before_block: list[int] = []
        self.replica_at_kill: list[int] | None = None
        self.killed = False

    def on_step_end(self, trainer, record):
        workers = trainer.group.workers
        if record.step >= BLOCK_AT and self.blocked is None and record.memory_replicated:
            self.peer = peer_of(VICTIM, [i["node_id"] for i in trainer.group.info])
            assert self.peer == (VICTIM + 1) % len(workers)  # one node
            # The copy of the state after this step is sent beside the loop: wait until the
            # peer holds it, so that the block comes after it and before the next.
            self.blocked_after = record.step + 1
            deadline = time.monotonic() + 60
            while self.blocked_after not in (held := replica_steps(workers[self.peer], VICTIM)):
                assert time.monotonic() < deadline, f"the peer never kept step {self.blocked_after}'s replica: {held}"
                time.sleep(0.01)
            self.replica_before_block = held
            # Steps -1: were it ever kept, it is older than every real step (it is not: see Gate.wait).
            self.blocked = workers[self.peer].keep_replica.remote(VICTIM, -1, [self.gate.wait.remote(GATE_TIMEOUT_S)], -1)
        elif self.blocked is not None and record.step == self.blocked_after and not self.killed:
            # The victim has made its copy of the state after one more step; a replica of it
            # would wait behind the blocked call: the newest the peer holds is still the one before.
            self.replica_at_kill = replica_steps(workers[self.peer], VICTIM)
            self.killed = True
            ray.kill(workers[VICTIM])

    def release(self) -> bool | None:
        """Let the blocked call return (it then fails: no state came); whether the gate had timed out."""
        if self.blocked is None:
            return None
        timed_out = ray.get(self.gate.release.remote(), timeout=60)
        try:
            ray.get(self.blocked, timeout=60)
        except Exception:  # noqa: BLE001 - expected: the peer is gone, or it got no state
            pass
        return timed_out


def test_worker_killed_while_its_replica_is_sent_resumes_from_the_last_whole_replica(ray_session, tmp_path, data):
    """memory_every=1, memory_shared=false: every step's state is copied, and sent to the next
    rank whenever the last replica has arrived. The victim is killed one step after a
    replicated step R whose replica was kept, with nothing newer kept (held back by the
    block). The newest step every rank has in memory is then R: the survivors hold their own
    copies of it (a replica's source stays held until the next replica arrives), the victim's
    peer its replica; not the newest step done, whose replica never arrived. The recovery
    restores from memory, redoes one step and ends as the uninterrupted run."""
    reference = Trainer(replication_config(tmp_path, "reference")).fit()
    gate = Gate.remote()
    hook = BlockReplicationThenKill(gate)
    try:
        summary = Trainer(replication_config(tmp_path, "killed"), callbacks=[hook]).fit()
    finally:
        timed_out = hook.release()
        ray.kill(gate)
    assert timed_out is False, "the block ended by itself before the test released it"
    # The block came after the replica of R steps was kept, and held back the next one.
    # The peer keeps the victim's two newest replicas: nothing newer than R arrived.
    replicated = hook.blocked_after
    assert replicated is not None and max(hook.replica_before_block) == replicated
    assert hook.killed and max(hook.replica_at_kill) == replicated, hook.replica_at_kill

    assert len(summary.recoveries) == 1
    event = summary.recoveries[0]
    print(f"\nrecovery: {event['source']} at step {event['resumed_step']}, {event['steps_lost']} steps redone, "
          f"recovered in {event['recovery_s']:.2f}s")
    assert event["workers_kept"] == 3 and event["workers_started"] == 1
    # Not step R + 1 (done by every worker, but the victim's replica of it never arrived): the
    # last step whose replica was whole.
    assert (event["source"], event["resumed_step"], event["steps_lost"]) == ("memory", replicated, 1), event

    got, want = last_loss_per_step(summary), last_loss_per_step(reference)
    assert sorted(got) == list(range(STEPS))
    assert [got[s] for s in range(STEPS)] == pytest.approx([want[s] for s in range(STEPS)], rel=1e-5)
    # The redone step ran twice; the records after the resume start at the resumed step.
    assert [r.step for r in summary.records].count(replicated) == 2
    assert summary.consumed_samples == reference.consumed_samples == STEPS * 8
    assert summary.controller_states[-1] == "FINISHED"


def test_workers_all_started_again_restore_from_the_copies_their_processes_left(ray_session, tmp_path, data):
    """elastic.memory_shared (the default): the copies live in the node's shared memory. A
    worker is killed and, with keep_survivors=false, every other one too; the new processes
    find every rank's copies the old ones left on the node and restore from them: one step
    redone at most, the uninterrupted run's result, and no file left once the run ends."""
    from raypar.runtime.shared_copies import SHM_ROOT, run_key

    def config(name):
        return run_config(tmp_path, name, (1, 2, 1), STEPS, checkpoint={"every": 4},
                          elastic={"enabled": True, "resource_timeout_s": 10.0, "memory_every": 1,
                                   "keep_survivors": False})

    reference = Trainer(config("reference")).fit()
    # One node, copies in shared memory: no worker has a peer, so no step asks for replicas.
    assert any(r.memory_copied for r in reference.records)
    assert not any(r.memory_replicated for r in reference.records)
    cfg = config("killed")
    summary = Trainer(cfg, callbacks=[KillWorker(5, 1)]).fit()
    event = summary.recoveries[0]
    print(f"\nrecovery: {event['source']} at step {event['resumed_step']}, {event['steps_lost']} steps redone, "
          f"recovered in {event['recovery_s']:.2f}s")
    assert (event["workers_kept"], event["source"]) == (0, "memory"), event
    # Not the checkpoint of step 4: the state after step 5 or 6 (the copy under way when the
    # worker died).
    assert event["resumed_step"] in (5, 6) and event["steps_lost"] <= 1, event
    got, want = last_loss_per_step(summary), last_loss_per_step(reference)
    assert [got[s] for s in range(STEPS)] == pytest.approx([want[s] for s in range(STEPS)], rel=1e-5)
    assert summary.consumed_samples == reference.consumed_samples
    assert not (SHM_ROOT / run_key(cfg.runtime.run_dir)).exists()
