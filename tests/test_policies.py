"""The controller's policies decide from plain values: no Ray, no workers."""
import pytest

from raypar.config import config_from_dict
from raypar.driver.policies import Decision, FailurePolicy, SavePolicy, grow_plan, worker_slots
from raypar.driver.records import Recovery
from raypar.topology import Grid


def config(**sections):
    raw = {"model": {"vocab_size": 64, "dim": 32, "n_layers": 4, "n_heads": 4, "max_seq_len": 16},
           "parallel": {"dp": 2, "pp": 2, "microbatches": 2},
           "train": {"steps": 10, "global_batch_size": 8},
           "data": {"seq_len": 8}}
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


@pytest.mark.parametrize("enabled, restarts, lost, decision", [
    (True, 0, True, Decision.RECOVER),
    (True, 2, True, Decision.RECOVER),
    (True, 3, True, Decision.FAIL),  # out of restarts
    (True, 0, False, Decision.FAIL),  # a bug in a worker would only repeat
    (False, 0, True, Decision.FAIL),
])
def test_failure_policy(enabled, restarts, lost, decision):
    policy = FailurePolicy(config(elastic={"enabled": enabled, "max_restarts": 3}).elastic)
    got, why = policy.decide(lost_worker=lost, restarts=restarts)
    assert got is decision, why
    if restarts == 3:
        assert "elastic.max_restarts=3" in why


def test_save_policy_saves_every_n_and_at_the_end():
    policy = SavePolicy(config(checkpoint={"every": 4}).checkpoint, total_steps=10)
    assert [n for n in range(1, 11) if policy.save_due(n)] == [4, 8, 10]
    never = SavePolicy(config(checkpoint={"every": 0}).checkpoint, total_steps=10)
    assert not any(never.save_due(n) for n in range(1, 11))
    assert policy.snapshot_options() == {"save_optimizer": True, "save_master": True}
    lean = SavePolicy(config(checkpoint={"every": 4, "save_optimizer": False}).checkpoint, total_steps=10)
    assert lean.snapshot_options() == {"save_optimizer": False, "save_master": True}


def test_worker_slots_count_cpus_and_gpus():
    assert worker_slots({"CPU": 2.0}, 0.25, "cpu") == 8
    assert worker_slots({"CPU": 2.0, "GPU": 3.0}, 0.25, "cuda") == 3
    assert worker_slots({"CPU": 0.7}, 0.25, "cpu") == 2
    assert worker_slots({}, 0.25, "cuda") == 0


def test_grow_plan_only_below_the_configured_grid_and_when_more_fit():
    cfg = config(elastic={"enabled": True, "grow": True})
    shrunk = Grid(1, 2, 1)
    assert grow_plan(cfg, shrunk, slots=2) is None  # nothing larger fits
    plan = grow_plan(cfg, shrunk, slots=4)
    assert plan is not None and plan.grid == Grid(2, 2, 1)
    assert grow_plan(cfg, Grid(2, 2, 1), slots=8) is None  # already at the configured grid
    assert grow_plan(config(elastic={"enabled": True, "grow": False}), shrunk, slots=4) is None


def test_a_recovery_record_times_its_phases():
    recovery = Recovery(restart=1, error="RayActorError", failed_grid="dp=2 x pp=2 x ep=1", detection_s=0.5,
                        salvage_s=0.25, steps_done=7, detected_at=100.0)
    recovery.workers_placed(kept=3, started=1, from_standby=0)
    recovery.resumed("dp=1 x pp=2 x ep=1", step=4, workers_s=1.5, setup_s={"build": 1.0}, load_s=0.5, now=103.0)
    recovery.finished(now=104.5)
    assert (recovery.recovery_s, recovery.first_step_s, recovery.steps_lost) == (4.5, 1.5, 3)
    d = recovery.to_dict()
    assert d["workers_kept"] == 3 and d["resumed_step"] == 4 and d["grid"] == "dp=1 x pp=2 x ep=1"
    assert not {"detected_at", "running_at", "steps_done"} & set(d)  # clock readings stay inside


def test_a_listed_split_keeps_its_depth_and_auto_splits_any():
    """Re-planning on 1 worker slot needs pp=1: a listed layers_per_stage belongs to pp=2,
    "auto" balances whatever depth the plan takes."""
    from raypar.driver.policies import plan_grid

    assert plan_grid(config(parallel={"dp": 1, "pp": 2, "layers_per_stage": [3, 1]}), workers=1) is None
    plan = plan_grid(config(parallel={"dp": 1, "pp": 2, "layers_per_stage": "auto"}), workers=1)
    assert plan is not None and plan.grid == Grid(1, 1, 1)
