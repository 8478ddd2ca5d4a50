"""Expert placement (`parallel.expert_placement`, `parallel.rebalance_experts_every`): which
ep worker holds which experts changes where rows go, never a result."""
from __future__ import annotations

import random

import pytest

from raypar.config import ConfigError, load_config
from raypar.expert_placement import balanced_placement, busiest, identity, moved_experts, worker_loads

from helpers import run_config
from test_moe import PLAN, moe_config, run_against_reference


def test_balancing_evens_the_busiest_worker_and_moves_few_experts() -> None:
    loads = [[10, 50, 30, 20, 5, 60, 25, 40],  # workers get 110 and 130 of 240 as placed
             [9, 1, 1, 1, 1, 1, 1, 1],  # already even as it can be: 12 and 4 (expert 0 alone is 9)
             [0] * 8]
    current = identity_of(3, 8)
    placed = balanced_placement(loads, 2, current)
    assert worker_loads(placed[0], loads[0], 2) == [120, 120]
    assert placed[1] == current[1] and placed[2] == current[2]  # nothing to gain: nothing moves
    assert moved_experts(current, placed, 2) == 2  # one swap evens layer 0
    # Experts that stay keep their slots.
    assert [e for e in placed[0][:4] if e in range(4)] == [e for e in range(4) if placed[0].index(e) == e]
    rng = random.Random(1)
    for _ in range(200):
        n, ep = rng.choice([(4, 2), (8, 2), (8, 4), (16, 4)])
        layer = [[rng.randint(0, 100) for _ in range(n)]]
        start = [rng.sample(range(n), n)]
        new = balanced_placement(layer, ep, start)
        assert sorted(new[0]) == list(range(n))
        assert busiest(new, layer, ep) <= busiest(start, layer, ep)
        # No swap of two experts between the busiest worker and another lowers it further.
        loads_now = worker_loads(new[0], layer[0], ep)
        local, h = n // ep, loads_now.index(max(loads_now))
        for w in range(ep):
            for a in new[0][h * local:(h + 1) * local]:
                for b in new[0][w * local:(w + 1) * local] if w != h else ():
                    d = layer[0][a] - layer[0][b]
                    assert max(loads_now[h] - d, loads_now[w] + d) >= loads_now[h]


def identity_of(layers: int, experts: int) -> list[list[int]]:
    return [list(range(experts)) for _ in range(layers)]


@pytest.mark.parametrize("overrides, message", [
    (["parallel.expert_placement=[[1,0,2,3]]"], r"the model has no MoE layers \(model.n_experts=0\)"),
    (["model.n_experts=4", "model.n_layers=2", "parallel.expert_placement=[[1,0,2,3]]"],
     r"lists 1 layers; the model has 2 MoE layers \(\[0, 1\]\): give one list of the 4 expert ids per MoE layer"),
    (["model.n_experts=4", "model.n_layers=2", "parallel.expert_placement=[[1,0,2,3],[0,0,1,2]]"],
     r"entry 1 \(layer 1\) is \[0, 0, 1, 2\], not an order of the expert ids 0..3"),
    (["parallel.rebalance_experts_every=-1"], r"parallel.rebalance_experts_every=-1 must be >= 0 \(0: never\)"),
])
def test_a_placement_that_does_not_fit_says_why(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize("grid, top_k, alltoall, capacity", [
    ((1, 2, 2), 2, "padded", 0.0), ((2, 1, 2), 1, "exact", 1.0),
], ids=["pp2-ep2-padded", "dp2-ep2-exact-capacity"])
def test_placed_experts_match_single_process(ray_session, tmp_path, grid, top_k, alltoall, capacity) -> None:
    """Experts on other workers than by default, the padded and the exact exchange, with
    dropless routing and with a capacity: losses, gradients and weights are the reference's."""
    cfg = moe_config(tmp_path, grid, top_k, alltoall=alltoall, moe_capacity_factor=capacity)
    cfg.parallel.expert_placement = [[3, 1, 0, 2], [2, 0, 3, 1]]
    run_against_reference(cfg, tmp_path, PLAN[:3])


def test_rebalancing_moves_experts_mid_run_and_changes_nothing_else(ray_session, tmp_path) -> None:
    """Every 2 steps the driver looks at the rows each worker's experts received and moves
    experts where that evens them out: the losses and the final checkpoint (weights, masters,
    moments, under the experts' own names) are those of the run that never moves them."""
    import torch

    from raypar.checkpoint import CheckpointReader, checkpoint_dir
    from raypar.data import write_synthetic_corpus
    from raypar.driver.trainer import Trainer

    write_synthetic_corpus(tmp_path / "data.parquet", 256, 8, 64, seed=1)
    model = {"n_experts": 4, "moe_top_k": 2, "n_layers": 2}

    def run(name: str, every: int):
        cfg = run_config(tmp_path, name, (1, 1, 2), 6, model=model, checkpoint={"every": 6},
                         parallel={"rebalance_experts_every": every})
        return Trainer(cfg, log=lambda m: None).fit()

    fixed, rebalanced = run("fixed", 0), run("rebalanced", 2)
    assert fixed.expert_moves == []
    assert rebalanced.expert_moves, "the tiny model's untrained router sends more rows to some experts"
    first = rebalanced.expert_moves[0]
    assert first["step"] in (2, 4) and first["through"] == "devices" and first["experts_moved"] > 0
    assert first["busiest_after"] <= 0.98 * first["busiest_before"]
    assert 0 < first["sent_bytes"] < first["bytes"]
    assert "experts moved" in rebalanced.format()
    assert [r.loss for r in rebalanced.records] == pytest.approx([r.loss for r in fixed.records], rel=1e-5)
    with CheckpointReader(checkpoint_dir(tmp_path / "fixed" / "ckpt", 6)) as a, \
            CheckpointReader(checkpoint_dir(tmp_path / "rebalanced" / "ckpt", 6)) as b:
        names = sorted(n for n in a.names() if not n.startswith("rng."))
        assert names == sorted(n for n in b.names() if not n.startswith("rng."))
        for n in names:
            torch.testing.assert_close(b.read(n), a.read(n), rtol=1e-5, atol=1e-6, msg=n)
