"""Switching schedules mid-run (`Trainer.switch_schedule`): the workers move to another cut
of the model, on their devices or through a checkpoint, and training goes on as if nothing
happened."""
from __future__ import annotations

import re

import pytest

from raypar.config import ConfigError
from raypar.driver.trainer import Trainer

from helpers import SwitchAt, assert_same_checkpoints, run_config


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    from raypar.data import write_synthetic_corpus

    tmp = tmp_path_factory.mktemp("switch")
    write_synthetic_corpus(tmp / "data.parquet", 256, 8, 64, seed=1)

    def run(name: str, callbacks=(), grid=(1, 2, 1), model=None, **sections):
        cfg = run_config(tmp, name, grid, 9, model=model or {"dropout": 0.1},
                         parallel={"microbatches": 4, **sections.pop("parallel", {})}, **sections)
        return Trainer(cfg, callbacks=list(callbacks), log=lambda m: None).fit(), tmp / name

    return run


@pytest.mark.parametrize("through", ["shared memory", "storage"])
def test_switching_cuts_mid_run_keeps_every_loss(runs, monkeypatch, through) -> None:
    """1F1B, then ZB-V (two chunks in a V) after step 2, then interleaved 1F1B with two chunks
    in a loop after step 5, through a checkpoint (parallel.move_through=checkpoint): each
    switch moves the workers once, and every loss is the fixed 1F1B run's. With the runtime
    sending a step ahead, the switch waits for the one in flight. Through a checkpoint of its
    step in shared memory (one node here) the move's checkpoint is not one of the run's
    (checkpoint.every=3 saves its own); through storage (as with no room in shared memory)
    with checkpoint.every=0 it is removed once loaded. On the devices: below."""
    if through == "storage":
        monkeypatch.setattr("raypar.actors.checkpoints.WorkerCheckpoints.make_scratch", lambda self, root, n: None)
    fixed, _ = runs("fixed", checkpoint={"every": 3})
    every = 0 if through == "storage" else 3
    switched, run_dir = runs(f"switched-{through.split()[0]}", [SwitchAt({2: ("zb-v",), 5: ("interleaved-1f1b", 2)})],
                             checkpoint={"every": every}, runtime={"steps_ahead": 1},
                             parallel={"move_through": "checkpoint"})
    assert [r.loss for r in switched.records] == pytest.approx([r.loss for r in fixed.records], rel=1e-5)
    schedules = [r.schedule for r in switched.records]
    # The step after the switch's was already sent (steps_ahead=1): the switch comes after it.
    assert schedules == ["1f1b"] * 4 + ["zb-v"] * 3 + ["interleaved-1f1b"] * 2, schedules
    assert [(m["schedule"], m["cut"], m["step"], m["through"]) for m in switched.moves] == [
        ("zb-v", "2 chunks per stage in a V", 4, through), ("interleaved-1f1b", "2 chunks per stage in a loop", 7, through)]
    assert all(m["total_s"] == pytest.approx(m["save_s"] + m["rebuild_s"] + m["load_s"]) for m in switched.moves)
    saves = [(c["step"], c["path"] is not None, c["error"]) for c in switched.checkpoints]
    assert saves == ([(3, True, None), (6, True, None), (9, True, None)] if every else
                     [(4, False, None), (7, False, None)])  # the moves', gone once loaded
    assert len(list((run_dir / "ckpt").glob("step-*"))) == (2 if every else 0)  # checkpoint.keep_last
    assert "moved to a new cut  2 chunks per stage in a V for zb-v at step 4" in switched.format()
    from raypar.runtime.scratch import PREFIX, SHM_ROOT

    assert not list(SHM_ROOT.glob(PREFIX + "*")), "a move left its checkpoint in shared memory"


@pytest.mark.parametrize("grid, parallel, checkpoint", [
    ((2, 2, 1), {"shard_optimizer": True}, {"ema_decay": 0.9}),
    ((1, 2, 1), {"tp": 2}, {}),
], ids=["dp2-sharded-ema", "tp2-moe"])
def test_moving_on_devices_keeps_every_loss_and_weight(runs, grid, parallel, checkpoint) -> None:
    """The same switches on the devices (the default): the state stays in the workers and the
    layers that change worker go point to point. With replicas, optimizer shares and an EMA
    (dp=2), and with tp slices of a MoE model (tp=2): the losses and the final checkpoint's
    weights, masters, moments and EMA are the fixed 1F1B run's."""
    model = {"n_experts": 4, "moe_top_k": 2} if parallel.get("tp") else {}
    sections = {"parallel": parallel, "checkpoint": {"every": 9, **checkpoint}}
    name = "-".join(map(str, grid))
    fixed, fixed_dir = runs(f"fixed-{name}", grid=grid, model={"dropout": 0.1, **model}, **sections)
    moved, moved_dir = runs(f"moved-{name}", [SwitchAt({2: ("zb-v",), 5: ("interleaved-1f1b", 2)})], grid=grid,
                            model={"dropout": 0.1, **model}, **sections)
    assert [(m["through"], m["step"]) for m in moved.moves] == [("devices", 4), ("devices", 7)]
    # 1F1B's stages hold layers 0-1 and 2-3 (and the head); the V's 0 and 3, 1 and 2; the loop's 0 and 2, 1 and 3.
    assert all(0 < m["sent_bytes"] < m["bytes"] for m in moved.moves), moved.moves
    assert [r.loss for r in moved.records] == pytest.approx([r.loss for r in fixed.records], rel=1e-5)
    names = assert_same_checkpoints(fixed_dir / "ckpt", moved_dir / "ckpt", 9)
    assert any(n.startswith("ema.") for n in names) == bool(checkpoint)


def test_a_switch_that_cannot_run_is_refused_at_once(tmp_path) -> None:
    """Checked when asked, not when the steps in flight are done: nothing is queued."""
    from helpers import tiny_config

    from raypar.driver.run_schedule import RunSchedule
    from raypar.topology import Grid

    cfg = tiny_config(tmp_path)  # pp=2, 4 micro-batches, 4 layers
    schedule = RunSchedule(log=lambda m: None)
    schedule.start(cfg, Grid(1, 2, 1))
    for args, error in ((("zb-x",), "unknown schedule 'zb-x'; valid schedules:"),
                        (("interleaved-1f1b", 3), "2 stages x 3 chunks = 6 virtual stages of at least one layer "
                                                  "each, but the model has 4 layers"),
                        (("zb-v", 3), "runs exactly 2 model chunks per stage, not 3")):
        with pytest.raises(ConfigError, match=re.escape(error)):
            schedule.request(*args)
    assert not schedule.due
    listed = tiny_config(tmp_path, parallel={"layers_per_stage": [3, 1]})
    schedule.start(listed, Grid(1, 2, 1))
    with pytest.raises(ConfigError, match=r"counts the layers of this cut of the model; zb-v cuts it otherwise"):
        schedule.request("zb-v")
    schedule.request("zb-h2")  # the same cut: fine
    assert schedule.due
    schedule.start(tiny_config(tmp_path, parallel={"schedule": "auto"}), Grid(1, 2, 1))
    with pytest.raises(ConfigError, match="parallel.schedule=auto chooses the schedule itself"):
        schedule.request("zb-v")
