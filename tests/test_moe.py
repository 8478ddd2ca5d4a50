"""Expert parallelism on the dp x pp x ep grid equals the single-process MoE model."""
import pytest
import torch

from raypar.config import ConfigError, load_config
from raypar.data import SampleOrder
from raypar.model.moe import MoE
from raypar.reference import ReferenceTrainer
from raypar.driver.trainer import Trainer

from helpers import assert_same, start_group, step_both, synthetic_data, tiny_config
from tolerances import Tolerances

MOE = {"n_layers": 2, "n_experts": 4, "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001}
# The zero-bubble step runs each backward as I and W (the experts' weight gradients in W too).
PLAN = [("1f1b", 2), ("fthenb", 1), ("1f1b", 4), ("zb-h1", 2), ("1f1b", 1)]
RTOL = 1e-5  # between two Trainer runs; runs against the reference use tests/tolerances.py
# Adam divides by sqrt(v): where a gradient is ~0 (an expert that saw a token or two), an
# fp32-rounding difference in it is amplified up to 1/eps in that weight's update. A larger
# Adam eps (1e-6 instead of 1e-8) damps updates of such near-zero gradients, so the derived
# weight bounds stay tight.
ADAM_EPS = 1e-6


def moe_config(tmp_path, grid, top_k, alltoall="padded", **model):
    dp, pp, ep = grid
    return tiny_config(tmp_path, model={**MOE, "moe_top_k": top_k, **model},
                       parallel={"dp": dp, "pp": pp, "ep": ep, "microbatches": 1},
                       train={"global_batch_size": 16, "eps": ADAM_EPS}, runtime={"moe_alltoall": alltoall})


def run_against_reference(cfg, tmp_path, plan, setup=None):
    dataset = synthetic_data(tmp_path, cfg)
    order = SampleOrder(len(dataset), seed=cfg.train.seed)
    ref = ReferenceTrainer(cfg)
    group = start_group(cfg, dataset)
    history = []
    try:
        if setup is not None:
            setup(group, ref)
        tol = Tolerances(ref)  # after setup: the probe starts from the weights it loaded
        for step, (schedule, m) in enumerate(plan):
            loss, grads, ref_loss, ref_grads, reports = step_both(group, ref, dataset, order, step, schedule, m,
                                                                  tol=tol)
            where = f"step {step} ({schedule}, {m} micro-batches)"
            assert abs(loss - ref_loss) <= tol.loss, f"{where}: loss {loss} vs {ref_loss}"
            assert_same(grads, ref_grads, tol.grads, where)
            history.append((loss, reports, ref))
            tol.check_weights(group.parameters(), ref.parameters(), where)
    finally:
        group.shutdown()
    return history


GRIDS = [(1, 1, 2), (1, 2, 2), (2, 2, 1), (2, 1, 2)]


# Every grid, top-1 and top-2 by turns (each routing path on an ep=2 grid with and without pp
# or dp); the eight-worker grid (the slowest to start on two cores) with top-2.
@pytest.mark.parametrize("grid, top_k", [(g, 1 + i % 2) for i, g in enumerate(GRIDS)] + [((2, 2, 2), 2)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else f"top{v}")
def test_expert_parallel_matches_single_process(ray_session, tmp_path, grid, top_k):
    run_against_reference(moe_config(tmp_path, grid, top_k), tmp_path, PLAN)


@pytest.mark.parametrize("grid", [(1, 2, 2), (2, 1, 2)], ids=lambda g: "x".join(map(str, g)))
def test_exact_split_sizes_match_single_process(ray_session, tmp_path, grid):
    """runtime.moe_alltoall=exact: the host reads the split sizes and sends routed rows only."""
    run_against_reference(moe_config(tmp_path, grid, 2, alltoall="exact"), tmp_path, PLAN[:3])


@pytest.mark.parametrize("alltoall", ["padded", "exact"])
def test_zero_tokens_for_some_experts_and_a_whole_ep_rank(ray_session, tmp_path, alltoall):
    cfg = moe_config(tmp_path, (1, 1, 2), top_k=1, alltoall=alltoall)

    def starve_rank_1(group, ref):
        # Router rows v, -v, 0, 0: every token prefers expert 0 or 1 (ep rank 0), so
        # experts 2 and 3, and with them all of ep rank 1, receive nothing.
        v = torch.randn(cfg.model.dim, generator=torch.Generator().manual_seed(3))
        router = torch.stack([v, -v, torch.zeros_like(v), torch.zeros_like(v)])
        tensors = {f"layers.{i}.mlp.router.weight": router for i in range(cfg.model.n_layers)}
        group.load_parameters(tensors)
        assert sorted(ref.optimizer.load_(tensors)) == sorted(tensors)

    history = run_against_reference(cfg, tmp_path, [("1f1b", 2)], setup=starve_rank_1)
    _, reports, _ = history[0]
    for layer in ("0", "1"):
        routed = [sum(r.expert_tokens[layer][e] for r in reports) for e in range(4)]
        assert routed[2] == routed[3] == 0 and sum(routed) == cfg.train.global_batch_size * cfg.data.seq_len


@pytest.mark.parametrize("alltoall", ["padded", "exact"])
def test_capacity_drops_the_same_tokens_as_the_reference(ray_session, tmp_path, alltoall):
    cfg = moe_config(tmp_path, (1, 2, 2), top_k=2, alltoall=alltoall, moe_capacity_factor=1.0)
    history = run_against_reference(cfg, tmp_path, PLAN[:2])
    ref = history[0][2]
    ref_dropped = 0
    for m in ref.model.modules():
        if isinstance(m, MoE):
            ref_dropped += int(m.stats.dropped)  # accumulated over both reference steps
    dropped = sum(r.tokens_dropped for _, reports, _ in history for r in reports)
    assert dropped > 0 and dropped == ref_dropped


@pytest.mark.slow
def test_same_losses_on_one_worker_and_on_eight(ray_session, tmp_path):
    def losses(grid):
        cfg = moe_config(tmp_path / "-".join(map(str, grid)), grid, top_k=2)
        cfg.train.steps = 5
        cfg.data.path = str(synthetic_data(tmp_path, cfg).path)
        return [r.loss for r in Trainer(cfg).fit().records]

    one, eight = losses((1, 1, 1)), losses((2, 2, 2))
    assert one == pytest.approx(eight, rel=RTOL)


@pytest.mark.parametrize("overrides, message", [
    (["model.n_experts=6", "parallel.ep=4"], r"n_experts=6 is not divisible by parallel.ep=4; parallel.ep=3 would work"),
    (["parallel.ep=2"], r"parallel.ep=2 splits experts, but model.n_experts=0"),
    (["model.n_experts=4", "model.moe_top_k=5"], r"moe_top_k=5 must be between 1 and model.n_experts=4"),
    (["model.n_experts=4", "parallel.ep=2", "parallel.dp=2", "train.global_batch_size=6"],
     r"not divisible by parallel.dp \* parallel.ep \* parallel.microbatches = 2 \* 2 \* 1 = 4"),
    (["model.moe_bias_update_rate=0.01"], r"above 0 only with experts \(model.n_experts=0\)"),
    (["model.n_experts=4", "model.moe_bias_update_rate=-1"], r"moe_bias_update_rate=-1.0 must be >= 0"),
])
def test_invalid_grids_say_what_would_work(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


@pytest.mark.parametrize("grid", [(1, 2, 2), (2, 1, 2)], ids=lambda g: "x".join(map(str, g)))
def test_expert_biases_move_as_in_the_single_process_run(ray_session, tmp_path, grid):
    """model.moe_bias_update_rate: every replica's workers move the biases by the rows of the
    whole step, as the reference does; a bias that moved otherwise routes otherwise."""
    cfg = moe_config(tmp_path, grid, 2, moe_bias_update_rate=0.05)
    history = run_against_reference(cfg, tmp_path, PLAN[:4])
    ref = history[-1][2]
    assert torch.stack([m.expert_bias for m in ref.moe_layers]).sum(dim=-1).abs().max() < 1e-12
    # The same steps without biases: their losses differ once a bias has changed a choice.
    unbiased = ReferenceTrainer(moe_config(tmp_path / "unbiased", grid, 2))
    dataset = synthetic_data(tmp_path, cfg)
    order = SampleOrder(len(dataset), seed=cfg.train.seed)
    gbs = cfg.train.global_batch_size
    losses = []
    for step in range(len(history)):
        batch = order.indices(step * gbs, gbs)
        tokens, labels = dataset.get(batch)
        losses.append(unbiased.step(step, tokens, labels, sample_ids=batch)[0])
    assert losses != pytest.approx([loss for loss, _, _ in history], rel=1e-6), "the biases changed no routing"
