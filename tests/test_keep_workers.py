"""runtime.keep_workers: a finished run leaves its workers for the next run of the driver
process, which takes them instead of starting processes, and trains as fresh workers do."""
import time

import pytest
import ray

from raypar import Callback, Trainer
from raypar.actors import worker_pool
from raypar.runtime.shared_copies import process_running

from helpers import last_loss_per_step, run_config, start_group, synthetic_data, tiny_config


class WorkerPids(Callback):
    """The process id of each rank's worker when the run starts."""

    def on_train_start(self, trainer):
        self.pids = [info["pid"] for info in trainer.group.info]


def ended(pids: list[int], timeout_s: float = 10.0) -> bool:
    """Whether every process of `pids` ends within the timeout (Ray's kills are asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while any(process_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(process_running(p) for p in pids)


@pytest.fixture
def data(tmp_path):
    synthetic_data(tmp_path, run_config(tmp_path, "probe", (1, 2, 1), 1))


def fit(tmp_path, name: str, keep: bool, **sections):
    cfg = run_config(tmp_path, name, (1, 2, 1), 4, runtime={**sections.pop("runtime", {}), "keep_workers": keep},
                     **sections)
    pids = WorkerPids()
    summary = Trainer(cfg, callbacks=[pids]).fit()
    return summary, pids.pids


def test_a_second_run_takes_the_first_runs_workers_and_trains_as_fresh_workers(ray_session, tmp_path, data):
    worker_pool.release()
    fresh, fresh_pids = fit(tmp_path, "fresh", keep=False)
    assert worker_pool.kept_workers() == 0 and ended(fresh_pids)

    first, first_pids = fit(tmp_path, "first", keep=True, model={"dropout": 0.1})
    assert worker_pool.kept_workers() == 2 and all(process_running(p) for p in first_pids)
    # Another model (dropout) and run directory, with checkpoints and copies in memory: none
    # of the first run's state may leak into it.
    second, second_pids = fit(tmp_path, "second", keep=True, checkpoint={"every": 2},
                              elastic={"enabled": True, "memory_every": 1})
    assert second_pids == first_pids
    assert last_loss_per_step(second) == last_loss_per_step(fresh)
    assert last_loss_per_step(first) != last_loss_per_step(fresh)  # dropout: another model

    assert Trainer.release_kept_workers() == 2 and worker_pool.kept_workers() == 0
    assert ended(second_pids)


def _kill_and_wait(worker, timeout_s: float = 30.0) -> None:
    """Kill an actor and return once it no longer answers: `ray.kill` only asks, and a ping
    sent before the kill lands is still answered (the pool would then take the group whole
    and replace the worker when its set-up fails, another path than the one tested)."""
    ray.kill(worker)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(worker.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            continue
        time.sleep(0.1)
    raise AssertionError(f"the killed worker still answers after {timeout_s:.0f} s")


def test_kept_groups_serve_smaller_and_larger_grids_a_dead_one_is_replaced_other_shapes_go(ray_session, tmp_path):
    worker_pool.release()
    cfg2 = tiny_config(tmp_path, parallel={"pp": 2})
    dataset = synthetic_data(tmp_path, cfg2)
    group = start_group(cfg2, dataset)
    pair = [info["pid"] for info in group.info]
    group.shutdown()
    assert worker_pool.kept_workers() == 2

    # A 4-worker grid takes the kept pair and places two more; both placement groups are
    # kept whole after it, and a 2-worker grid takes one of them.
    cfg4 = tiny_config(tmp_path, parallel={"pp": 2, "dp": 2}, train={"global_batch_size": 16})
    group = start_group(cfg4, dataset)
    four = [info["pid"] for info in group.info]
    group.shutdown()
    assert four[:2] == pair and worker_pool.kept_workers() == 4
    group = start_group(cfg2, dataset)
    try:
        assert {info["pid"] for info in group.info} <= set(four) and worker_pool.kept_workers() == 0
    finally:
        group.shutdown()

    # A kept worker dies while it waits: its placement group goes whole, and the next group
    # starts its own workers.
    kept = [info["pid"] for info in group.info]
    _kill_and_wait(worker_pool._kept[0].workers[1])
    group = start_group(cfg2, dataset)
    try:
        assert not {info["pid"] for info in group.info} & set(kept)
    finally:
        group.shutdown()

    # One worker of another size (CPUs per worker): the kept two do not fit it and go.
    pids = [info["pid"] for info in group.info]
    other = tiny_config(tmp_path, parallel={"pp": 1}, runtime={"cpus_per_worker": 0.5, "keep_workers": True})
    group = start_group(other, dataset)
    try:
        assert group.info[0]["pid"] not in pids and worker_pool.kept_workers() == 0
    finally:
        group.shutdown(keep_workers=False)
    assert worker_pool.kept_workers() == 0 and ended(pids)
