"""Elastic training: lose workers and nodes mid-run, finish with the uninterrupted result."""
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray

from raypar.driver.callbacks import Callback
from raypar.config import config_from_dict
from raypar.driver.policies import Plan, plan_grid
from raypar.driver.states import State, StateMachine
from raypar.resources import ResourceError
from raypar.topology import Grid
from raypar.driver.trainer import Trainer

from actors.placement import slot_key
from helpers import KillWorker, last_loss_per_step, run_config

# Routing biases that move each step (model.moe_bias_update_rate): a run restored from memory
# routes as the uninterrupted one only with the biases the driver kept for that step.
MOE = {"n_layers": 2, "n_experts": 4, "moe_top_k": 2, "moe_bias_update_rate": 0.02}
ROOT = Path(__file__).resolve().parent.parent


def elastic_config(tmp_path, name, grid, model=None, steps=8, parallel=None, **elastic):
    return run_config(tmp_path, name, grid, steps, model, checkpoint={"every": 2}, parallel=parallel or {},
                      elastic={"enabled": True, "resource_timeout_s": 10.0, **elastic})


@pytest.fixture
def data(tmp_path):
    from raypar.data import write_synthetic_corpus

    write_synthetic_corpus(tmp_path / "data.parquet", 256, 8, 64, seed=1)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The same run without failures, once per grid (the data is the same in every test)."""
    from raypar.data import write_synthetic_corpus

    runs = {}

    def run(grid, model):
        key = (grid, str(model))
        if key not in runs:
            tmp = tmp_path_factory.mktemp("uninterrupted")
            write_synthetic_corpus(tmp / "data.parquet", 256, 8, 64, seed=1)
            runs[key] = Trainer(elastic_config(tmp, "reference", grid, model)).fit()
        return runs[key]

    return run


class KillWorkerAndWait(KillWorker):
    """KillWorker that returns once the worker is gone (`ray.kill` does not wait): what the
    driver does next (auto moving the model to another cut) meets a dead worker, every time."""

    def on_step_end(self, trainer, record):
        worker = trainer.group.workers[self.rank] if record.step == self.at and self.killed_at is None else None
        super().on_step_end(trainer, record)
        if worker is not None:
            wait_gone(worker)


def wait_gone(worker, timeout_s: float = 30.0) -> None:
    """Return once a killed actor no longer answers (`ray.kill` does not wait), or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(worker.address.remote(), timeout=5)
            time.sleep(0.05)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return


class KillAndWatchActors(KillWorker):
    """KillWorker that records the workers' actor ids before the kill and once recovered.

    With `when_copied`, the kill comes after the first step from `at` on whose state every
    rank holds in memory: on a loaded machine a copy may still be under way a step later (the
    driver then asks for none), and a checkpoint as new as the newest whole copy would serve
    the recovery instead."""

    def __init__(self, at: int, rank: int, when_copied: bool = False):
        super().__init__(at, rank)
        self.when_copied, self.killed_after = when_copied, None

    def on_step_end(self, trainer, record):
        if self.killed_at is not None or record.step < self.at:
            return
        if self.when_copied and not (record.memory_copied and self.copied(trainer, record.step + 1)):
            if record.step >= self.at + 2:
                raise TimeoutError(f"no step from {self.at} to {record.step} was copied whole by every rank")
            return
        self.before = [w._actor_id.hex() for w in trainer.group.workers]
        self.killed_after, self.killed_at = record.step, time.time()
        ray.kill(trainer.group.workers[self.rank])

    @staticmethod
    def copied(trainer, steps_done: int, wait_s: float = 10.0) -> bool:
        group = trainer.group
        deadline = time.monotonic() + wait_s
        while True:
            held = {entry for inventory in ray.get([w.memory_inventory.remote() for w in group.workers])
                    for entry in inventory}
            if all((r, steps_done) in held for r in range(group.grid.size)):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)

    def on_recovery(self, trainer, event):
        self.after = [w._actor_id.hex() for w in trainer.group.workers]


@pytest.mark.parametrize("grid, model, at, rank, memory_every, sharded, schedule", [
    # With the optimizer sharded: the lost rank's share comes back from its peer's replica,
    # in flat pieces, and its data-parallel peer, waiting in a reduce-scatter, is kept.
    ((2, 2, 1), None, 3, 1, 1, True, "1f1b"),
    # parallel.schedule=auto: chosen at the start and again after the recovery, each time
    # from steps timed with zb-h1; the losses stay the 1F1B reference's.
    ((2, 2, 1), None, 5, 0, 0, False, "auto"),
    ((1, 2, 2), MOE, 4, 2, 1, False, "1f1b"),
    # Two chunks per stage in a V: the new worker holds the lost one's two runs of layers,
    # restored by name from its peer's replica; the losses stay the 1F1B reference's.
    ((2, 2, 1), None, 4, 3, 1, False, "zb-v"),
], ids=["dense-dp2pp2-sharded-step3-memory", "dense-dp2pp2-step5-storage-auto", "moe-pp2ep2-step4-memory",
        "dense-dp2pp2-step4-memory-zb-v"])
def test_killed_worker_recovers_to_the_uninterrupted_result(ray_session, tmp_path, data, grid, model, at, rank,
                                                            memory_every, sharded, schedule, uninterrupted):
    reference = uninterrupted(grid, model)
    watch = KillAndWatchActors(at, rank, when_copied=memory_every > 0)
    summary = Trainer(elastic_config(tmp_path, "killed", grid, model, memory_every=memory_every,
                                     parallel={"shard_optimizer": sharded, "schedule": schedule}),
                      callbacks=[watch]).fit()
    assert len(summary.recoveries) == 1
    event = summary.recoveries[0]
    # One worker lost: the other three actors carry on (same actor ids and ranks), one is new.
    assert event["workers_kept"] == 3 and event["workers_started"] == 1
    assert [a == b for a, b in zip(watch.before, watch.after)] == [r != rank for r in range(4)]
    # Setup's phases, each the longest over the workers, happen within "workers up".
    assert set(event["setup_s"]) == {"arrival", "groups", "data_kernels", "build", "connect"}
    assert max(event["setup_s"].values()) <= event["workers_s"] <= event["recovery_s"]
    print(f"\nrecovery: detected in {event['detection_s']:.2f}s, recovered in {event['recovery_s']:.2f}s, "
          f"{event['steps_lost']} steps redone, grid {event['failed_grid']} -> {event['grid']}, from {event['source']}")
    if memory_every:
        # The state after every step is in memory, the lost rank's in its peer's replica,
        # which may lag its own newest copy by one step: at most one step is redone.
        assert event["source"] == "memory" and event["steps_lost"] <= 1, event
        # Steps done at the kill: killed_after + 1, or one more where the step in flight (sent
        # before the kill) finished and was copied while the callback waited for the copies.
        assert watch.killed_after + 1 <= event["resumed_step"] <= watch.killed_after + 2
    else:
        # The last committed checkpoint: a save that began right before the kill is lost with it.
        assert event["source"] == "storage" and event["resumed_step"] % 2 == 0
        assert at - 3 <= event["resumed_step"] <= at + 1
    got, want = last_loss_per_step(summary), last_loss_per_step(reference)
    assert sorted(got) == list(range(8))
    assert [got[s] for s in range(8)] == pytest.approx([want[s] for s in range(8)], rel=1e-5)
    assert summary.consumed_samples == reference.consumed_samples == 8 * 8
    assert "RECOVERING" in summary.controller_states and summary.controller_states[-1] == "FINISHED"
    if schedule == "auto":
        assert_auto_chose_on_each_grid_run(summary, event["resumed_step"])


def assert_auto_chose_on_each_grid_run(summary, resumed_step: int) -> None:
    """Each grid run (the start, and after the recovery) chooses afresh: its steps follow the
    chooser's states (timing, trying the finalists, the choice) from its first step."""
    from test_schedule_choice import assert_steps_follow_the_choice

    # The records of each grid run: the second's first is the last record of the resumed step
    # (from memory with no step redone, the step numbers do not go back).
    records = summary.records
    second = max(i for i, r in enumerate(records) if r.step == resumed_step)
    runs = [records[:second], records[second:]]
    assert records[0].step == 0 and [r.step for r in runs[1]] == list(range(resumed_step, 8))
    assert summary.schedule_choices, "no grid run got as far as choosing"
    for run in runs:
        # A run cut short by the kill may not have chosen yet.
        choice = next((c for c in summary.schedule_choices if c["steps"][0] == run[0].step), None)
        assert_steps_follow_the_choice([r.schedule for r in run], choice)
    assert summary.schedule.startswith("auto: ")


def test_a_worker_lost_on_another_cut_recovers_from_memory(ray_session, tmp_path, data, uninterrupted, monkeypatch):
    """parallel.schedule=auto moved the workers to ZB-V's cut before a worker is lost: the
    states kept in memory are of that cut, and the recovery (back on one chunk per stage, to
    choose again) gathers each worker's by name; the losses stay the uninterrupted 1F1B run's."""
    from raypar.schedule import Layout

    monkeypatch.setattr("raypar.driver.run_schedule.candidate_layouts",
                        lambda pp, *args, **kwargs: {"zb-h1": Layout(pp), "zb-v": Layout(pp, 2, "v")})
    monkeypatch.setattr("raypar.schedule.choice.MEASURE_WITHIN", 100.0)  # zb-v is tried whatever the costs
    reference = uninterrupted((2, 2, 1), None)
    summary = Trainer(elastic_config(tmp_path, "killed", (2, 2, 1), memory_every=1, parallel={"schedule": "auto"}),
                      callbacks=[KillWorkerAndWait(3, 1)]).fit()
    (event,) = summary.recoveries
    assert event["source"] == "memory" and 3 <= event["resumed_step"] <= 4, event
    first = summary.schedule_choices[0]
    # Steps 0 and 1 time zb-h1; the move to the V comes before step 2 (through step 2's checkpoint).
    assert [(m["cut"], m["step"]) for m in first["moves"]][:1] == [("2 chunks per stage in a V", 2)]
    assert [r.schedule for r in summary.records][2:4] == ["zb-v", "zb-v"]
    got, want = last_loss_per_step(summary), last_loss_per_step(reference)
    assert [got[s] for s in range(8)] == pytest.approx([want[s] for s in range(8)], rel=1e-5)
    assert_auto_chose_on_each_grid_run(summary, event["resumed_step"])


def test_a_worker_lost_while_the_model_moves_on_the_devices_recovers(ray_session, tmp_path, data, uninterrupted,
                                                                     monkeypatch):
    """A switch to ZB-V after step 2 moves the workers on their devices; a worker is killed once
    the others hold their state beside their new, empty stages: the move fails (`MoveFailed`),
    and the recovery restores every rank from the states kept in memory, with the
    uninterrupted run's losses."""
    from raypar.actors.worker_group import WorkerGroup

    move_state = WorkerGroup.move_state

    def killed_first(group, held):
        ray.kill(group.workers[1])
        wait_gone(group.workers[1])
        return move_state(group, held)

    monkeypatch.setattr(WorkerGroup, "move_state", killed_first)

    class SwitchAfter2(Callback):
        # Once: where the kill came before step 2's copy in memory was whole, the recovery
        # redoes step 2, whose end would ask for the switch (and the kill) again.
        switched = False

        def on_step_end(self, trainer, record):
            if record.step == 2 and not self.switched:
                self.switched = True
                trainer.switch_schedule("zb-v")

    reference = uninterrupted((1, 2, 1), None)
    summary = Trainer(elastic_config(tmp_path, "moving", (1, 2, 1), memory_every=1),
                      callbacks=[SwitchAfter2()]).fit()
    (event,) = summary.recoveries
    assert (event["source"], event["error"]) == ("memory", "MoveFailed"), event
    got, want = last_loss_per_step(summary), last_loss_per_step(reference)
    assert [got[s] for s in range(8)] == pytest.approx([want[s] for s in range(8)], rel=1e-5)


def test_recovery_before_any_checkpoint_starts_over_initialised(ray_session, tmp_path, data, uninterrupted):
    """No checkpoint and no state in memory to go back to: the kept and the new workers build initialised stages
    (a recovery with a checkpoint skips that, since the load fills them) and the run starts
    over at step 0 with the uninterrupted run's result."""
    reference = uninterrupted((1, 2, 1), None)
    cfg = run_config(tmp_path, "no-checkpoint", (1, 2, 1), 8, None, checkpoint={"every": 0},
                     elastic={"enabled": True, "resource_timeout_s": 10.0, "memory_every": 0})
    summary = Trainer(cfg, callbacks=[KillWorker(2, 1)]).fit()
    event = summary.recoveries[0]
    assert event["resumed_step"] == 0 and event["workers_kept"] == 1
    got, want = last_loss_per_step(summary), last_loss_per_step(reference)
    assert [got[s] for s in range(8)] == pytest.approx([want[s] for s in range(8)], rel=1e-5)


class KillWithStandby(Callback):
    """Kills rank 1 after step 2 and rank 0 after step 5, each time once the standby answers;
    records which standby each recovery should have used, and the grid's workers after it."""

    def __init__(self):
        self.kills = {2: 1, 5: 0}
        self.standby_ids: list[str] = []
        self.grids_after: list[list[str]] = []
        self.slots_before: list[list] = []
        self.slots_after: list[list] = []

    def on_step_end(self, trainer, record):
        rank = self.kills.pop(record.step, None)
        if rank is None:
            return
        standby = trainer.group.reserve.standbys[0][0]
        ray.get(standby.address.remote(), timeout=60)  # the refilled one may still be starting
        self.standby_ids.append(standby._actor_id.hex())
        self.slots_before.append([slot_key(s) for s in trainer.group.slots])
        ray.kill(trainer.group.workers[rank])

    def on_recovery(self, trainer, event):
        assert len(trainer.group.reserve.standbys) == 1  # refilled from the lost worker's resources
        self.grids_after.append([w._actor_id.hex() for w in trainer.group.workers])
        self.slots_after.append([slot_key(s) for s in trainer.group.slots])


@pytest.mark.parametrize("standby_gpu", ["own", "borrow"])
def test_standby_worker_replaces_lost_workers(ray_session, tmp_path, data, uninterrupted, standby_gpu):
    """elastic.standby_workers=1: each recovery puts the started standby in the lost worker's
    place (no worker is started) and starts a new standby; the result is the uninterrupted one.
    A standby that borrows (it holds CPUs only) runs in the lost worker's bundle, on its GPU
    where there is one, and its own bundle takes the next standby."""
    reference = uninterrupted((1, 2, 1), None)
    kills = KillWithStandby()
    cfg = elastic_config(tmp_path, "standby", (1, 2, 1), standby_workers=1, standby_gpu=standby_gpu)
    trainer = Trainer(cfg, callbacks=[kills])
    summary = trainer.fit()
    # Each standby kept its own bundle and took the lost rank's place; one that borrows ran on the
    # lost worker's GPU (on GPU runs), whose bundle then hosted the next standby.
    for lost, before, after in zip((1, 0), kills.slots_before, kills.slots_after):
        assert after[lost] != before[lost] and after[1 - lost] == before[1 - lost]
    assert len(summary.recoveries) == 2 and len(kills.standby_ids) == 2
    for event in summary.recoveries:
        print(f"\nrecovery with a standby: recovered in {event['recovery_s']:.2f}s (workers up "
              f"{event['workers_s']:.2f}s), {event['workers_kept']} kept, {event['workers_started']} started, "
              f"{event['workers_from_standby']} from the standby")
        assert (event["workers_kept"], event["workers_started"], event["workers_from_standby"]) == (1, 0, 1)
    # The lost ranks went to the standbys: rank 1 after the first kill, rank 0 after the second.
    assert [grid[rank] for grid, rank in zip(kills.grids_after, (1, 0))] == kills.standby_ids
    got, want = last_loss_per_step(summary), last_loss_per_step(reference)
    assert [got[s] for s in range(8)] == pytest.approx([want[s] for s in range(8)], rel=1e-5)
    assert summary.consumed_samples == reference.consumed_samples


def test_a_standby_replaces_the_only_worker(ray_session, tmp_path, data, uninterrupted):
    """A one-worker grid: no worker survives the kill, and the standby takes its rank (on the
    lost worker's GPU where there is one), restoring from the copies the lost process left
    in shared memory. Before, a recovery with no survivor dropped the standby with the group
    and started a new worker."""
    reference = uninterrupted((1, 1, 1), None)
    kills = KillWithStandby()
    kills.kills = {3: 0}
    cfg = elastic_config(tmp_path, "alone", (1, 1, 1), standby_workers=1, standby_gpu="borrow")
    summary = Trainer(cfg, callbacks=[kills]).fit()
    (event,) = summary.recoveries
    assert (event["workers_kept"], event["workers_started"], event["workers_from_standby"]) == (0, 0, 1), event
    assert event["source"] == "memory" and event["steps_lost"] <= 1, event
    assert kills.grids_after == [kills.standby_ids]
    got, want = last_loss_per_step(summary), last_loss_per_step(reference)
    assert [got[s] for s in range(8)] == pytest.approx([want[s] for s in range(8)], rel=1e-5)


def test_standby_workers_need_a_recovery_that_keeps_survivors(tmp_path):
    from raypar.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="elastic.standby_workers=1 replaces lost workers"):
        load_config(None, ["elastic.standby_workers=1"])
    with pytest.raises(ConfigError, match="elastic.standby_workers=-1 >= 0"):
        load_config(None, ["elastic.enabled=true", "elastic.standby_workers=-1"])
    with pytest.raises(ConfigError, match="elastic.standby_gpu=borrow .* elastic.standby_workers=0 starts none"):
        load_config(None, ["elastic.enabled=true", "elastic.standby_gpu=borrow"])


class KillAgainAfterRecovery(KillWorker):
    """Kills a worker, then kills a new one as soon as the recovered grid has started."""

    def __init__(self, at, rank):
        super().__init__(at, rank)
        self.starts = 0

    def on_train_start(self, trainer):
        self.starts += 1
        if self.starts == 2:
            ray.kill(trainer.group.workers[0])


def test_worker_killed_during_recovery(ray_session, tmp_path, data):
    summary = Trainer(elastic_config(tmp_path, "run", (1, 2, 1)), callbacks=[KillAgainAfterRecovery(3, 1)]).fit()
    assert summary.restarts == 2
    assert len(summary.recoveries) == 1 and summary.recoveries[0]["attempts"] == 2
    assert sorted({r.step for r in summary.records}) == list(range(8))


def test_a_worker_lost_while_the_recovery_sets_up_leaves_the_survivor_kept(ray_session, tmp_path, data, uninterrupted,
                                                                          monkeypatch):
    """The new worker dies before it joins the recovery's rendezvous. The survivor waiting
    there for it gives up when the driver aborts, so the next salvage keeps it, instead of
    killing it once elastic.survivor_timeout_s has passed."""
    from raypar.actors.worker_group import WorkerGroup

    set_up, lost = WorkerGroup.setup, []

    def setup_losing_the_new_worker(group, fresh, init_weights):
        if not fresh and not lost:
            lost.append(group.workers[1])
            ray.kill(group.workers[1])
            wait_gone(group.workers[1])
        return set_up(group, fresh, init_weights)

    monkeypatch.setattr(WorkerGroup, "setup", setup_losing_the_new_worker)
    watch = KillAndWatchActors(3, 1)
    summary = Trainer(elastic_config(tmp_path, "run", (1, 2, 1), memory_every=1, survivor_timeout_s=60.0),
                      callbacks=[watch]).fit()
    event = summary.recoveries[0]
    assert len(summary.recoveries) == 1 and event["attempts"] == 2
    # Rank 0 went through both attempts in the same process; rank 1 is the third of its rank.
    assert event["workers_kept"] == 1 and event["workers_started"] == 2
    assert watch.after[0] == watch.before[0] and watch.after[1] not in (watch.before[1], lost[0]._actor_id.hex())
    got, want = last_loss_per_step(summary), last_loss_per_step(uninterrupted((1, 2, 1), None))
    assert [got[s] for s in range(8)] == pytest.approx([want[s] for s in range(8)], rel=1e-5)


def test_more_than_the_cluster_can_ever_give_fails_clearly(ray_session, tmp_path, data):
    cfg = elastic_config(tmp_path, "big", (1, 2, 1), min_workers=2, resource_timeout_s=2.0)
    cfg.runtime.cpus_per_worker = 6.0  # the test cluster has 8 CPUs: one worker fits, min is 2
    start = time.monotonic()
    with pytest.raises(ResourceError, match=r"no grid of at least elastic.min_workers=2 workers fits.*room for 1"):
        Trainer(cfg).fit()
    assert time.monotonic() - start < 30


def test_without_elastic_a_lost_worker_fails_the_run(ray_session, tmp_path, data):
    cfg = elastic_config(tmp_path, "plain", (1, 2, 1))
    cfg.elastic.enabled = False
    with pytest.raises(ray.exceptions.RayActorError):
        Trainer(cfg, callbacks=[KillWorker(1, 1)]).fit()


def test_plan_shrinks_dp_first_then_resplits():
    cfg = config_from_dict({"model": {"n_layers": 4, "n_experts": 4}, "parallel": {"dp": 2, "pp": 2, "ep": 2},
                            "train": {"global_batch_size": 16}})
    assert plan_grid(cfg, 8) == Plan(Grid(2, 2, 2), 1)
    assert plan_grid(cfg, 7) == Plan(Grid(1, 2, 2), 2)  # dp halves, micro-batches double
    assert plan_grid(cfg, 3) == Plan(Grid(1, 3, 1), 2) or plan_grid(cfg, 3).grid.size == 3
    assert plan_grid(cfg, 1) == Plan(Grid(1, 1, 1), 16 // cfg.microbatch_size)
    assert plan_grid(cfg, 3, min_workers=4) is None


def test_plan_keeps_tp_while_a_grid_with_it_fits_and_a_node_holds_a_cell():
    from raypar.driver.policies import with_plan

    cfg = config_from_dict({"model": {"n_layers": 4, "n_heads": 4}, "parallel": {"dp": 2, "pp": 2, "tp": 2,
                                                                                  "sequence_parallel": True},
                            "data": {"seq_len": 8}, "train": {"global_batch_size": 16}})
    assert plan_grid(cfg, 8) == Plan(Grid(2, 2, 1, 2), 1)
    assert plan_grid(cfg, 7) == Plan(Grid(1, 2, 1, 2), 2)  # dp halves first, tp and pp kept
    assert plan_grid(cfg, 3).grid == Grid(1, 1, 1, 2)  # pp re-split before tp changes
    # One worker left, or nodes of one worker each: tp=1, and sequence parallelism goes with it.
    assert plan_grid(cfg, 1).grid == Grid(1, 1, 1, 1)
    small_nodes = plan_grid(cfg, 8, node_room=1)
    assert small_nodes.grid == Grid(2, 4, 1, 1)  # the pipeline takes the workers tp gave up
    parallel = with_plan(cfg, small_nodes).parallel
    assert (parallel.tp, parallel.pp, parallel.sequence_parallel) == (1, 4, False)
    assert with_plan(cfg, plan_grid(cfg, 8, node_room=3)).parallel.sequence_parallel
    # Sequence parallelism needs data.seq_len a multiple of tp: tp=3 (nodes of 3) is passed over.
    three = config_from_dict({**cfg.to_dict(), "parallel": {**cfg.to_dict()["parallel"], "tp": 4}})
    assert plan_grid(three, 16, node_room=3).grid.tp == 2


def test_state_machine_rejects_impossible_transitions():
    m = StateMachine()
    m.to(State.STARTING)
    m.to(State.RUNNING)
    with pytest.raises(RuntimeError, match="cannot go from RUNNING to STARTING"):
        m.to(State.STARTING)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_node_loss_shrinks_and_node_return_grows(tmp_path, data):
    """A two-node cluster on this machine: lose a node mid-run (its ranks come back from the
    replicas of their states on the other node), get one back later and grow onto it,
    keeping the workers the smaller grid ran on."""
    script = ROOT / "tests" / "elastic_nodes.py"
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                         timeout=380, cwd=ROOT)
    # The driver's lines, without the raylets' logs of the nodes coming and going.
    said = "\n".join(line for line in out.stdout.splitlines() if line[:1].isalpha() and "(raylet)" not in line)
    assert out.returncode == 0, said[-6000:] + out.stderr[-3000:]
    assert "SHRANK" in out.stdout and "FROM MEMORY" in out.stdout, said[-6000:]
    assert "LEFT IN SHARED MEMORY" not in out.stdout, said[-6000:]
    assert "GREW" in out.stdout, said[-6000:]
    # Growing hands the smaller grid's workers to the larger one (`worker_pool`).
    assert "ON THE SAME PROCESSES" in out.stdout, said[-6000:]


def test_a_bundle_counts_as_free_room_while_nothing_runs_in_it(ray_session):
    """Room to grow that the group already holds: a bundle without a worker counts (as a lost
    node's does once Ray places it again), one with a worker or of a removed group does not."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actors.placement import bundle_free

    @ray.remote(num_cpus=0.01)
    class Holder:
        def ping(self) -> int:
            return 1

    def free(pg) -> list[bool]:
        return [bundle_free((pg, i), ray.available_resources()) for i in range(2)]

    def settles(pg, want: list[bool]) -> bool:
        deadline = time.monotonic() + 10.0  # Ray's resource view follows a moment later
        while free(pg) != want and time.monotonic() < deadline:
            time.sleep(0.05)
        return free(pg) == want

    pg = placement_group([{"CPU": 0.01}] * 2)
    ray.get(pg.ready(), timeout=30)
    holder = Holder.options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)).remote()
    try:
        ray.get(holder.ping.remote(), timeout=30)
        assert settles(pg, [False, True]), free(pg)
    finally:
        ray.kill(holder)
    assert settles(pg, [True, True]), free(pg)
    remove_placement_group(pg)
    assert settles(pg, [False, False]), free(pg)
