"""The optimizer sharded over data-parallel replicas (ZeRO-1) equals the single-process
reference, and its checkpoints load on any grid, sharded or not."""
import math
import random

import pytest
import torch

from raypar.checkpoint import FlatPieces, flat_range_boxes, piece_name
from raypar.data import SampleOrder
from raypar.reference import ReferenceTrainer

from helpers import assert_step_matches, start_group, synthetic_data, tiny_config
from tolerances import Tolerances


def test_a_flat_range_is_covered_by_its_boxes_exactly():
    rng = random.Random(0)
    for _ in range(300):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        numel = math.prod(shape)
        start = rng.randint(0, numel)
        stop = rng.randint(start, numel)
        full = torch.arange(numel).reshape(shape)
        got = [full[tuple(slice(o, o + s) for o, s in zip(offsets, box))].reshape(-1)
               for offsets, box in flat_range_boxes(shape, start, stop)]
        flat = torch.cat(got) if got else torch.empty(0, dtype=full.dtype)
        assert torch.equal(flat, torch.arange(start, stop)), (shape, start, stop)
        assert len(got) <= max(1, 2 * len(shape) - 1)
    with pytest.raises(ValueError, match="outside"):
        flat_range_boxes((2, 3), 4, 7)


def test_flat_pieces_read_back_any_range_and_say_what_is_missing():
    t = torch.arange(24.0).reshape(2, 3, 4)
    flat = t.reshape(-1)
    held = FlatPieces({piece_name("m", 0): flat[:10], piece_name("m", 10): flat[10:17], piece_name("m", 17): flat[17:],
                       "w": t})
    assert held.names == {"m", "w"}
    assert torch.equal(held.read_flat("m", 5, 20), flat[5:20])
    assert torch.equal(held.read("m"), flat) and torch.equal(held.read("w"), t)
    partial = FlatPieces({piece_name("m", 0): flat[:10]})
    with pytest.raises(Exception, match="10 of elements"):
        partial.read_flat("m", 0, 20)


MOE = {"n_layers": 2, "n_experts": 4, "moe_top_k": 2, "moe_aux_loss_coef": 0.01}
# (dp, pp, ep), the model, a bucket small enough to split the tiny model's gradients.
GRIDS = {
    "dp2-pp2-buckets": ((2, 2, 1), {}, 0.02),
    # Sizes that no power of two divides: every share ends in padding.
    "dp4-buckets": ((4, 1, 1), {"n_layers": 2, "vocab_size": 67, "dim": 40}, 0.01),
    "moe-dp2-ep2": ((2, 1, 2), MOE, 0.02),
}
# A program's first step learns how many gradients each bucket gets; its later steps queue a
# bucket's reduce-scatter from inside backward once they have arrived.
PLAN = [("1f1b", 2), ("1f1b", 2), ("zb-h1", 2), ("zb-h1", 2), ("fthenb", 1)]


@pytest.mark.parametrize("grid", list(GRIDS))
def test_sharded_optimizer_matches_single_process(ray_session, tmp_path, grid):
    (dp, pp, ep), model, bucket_mb = GRIDS[grid]
    cfg = tiny_config(tmp_path, model={"n_layers": 4, **model},
                      parallel={"dp": dp, "pp": pp, "ep": ep, "shard_optimizer": True, "grad_bucket_mb": bucket_mb,
                                "overlap_grad_reduce": True},
                      train={"global_batch_size": 16, "eps": 1e-6, "grad_clip": 0.5})
    dataset = synthetic_data(tmp_path, cfg)
    order = SampleOrder(len(dataset), seed=cfg.train.seed)
    ref = ReferenceTrainer(cfg)
    tol = Tolerances(ref)
    group = start_group(cfg, dataset)
    clipped = False
    try:
        for step, (schedule, m) in enumerate(PLAN):
            reports, ref_norm = assert_step_matches(group, ref, dataset, order, step, schedule, m, tol)
            clipped |= ref_norm > cfg.train.grad_clip
            where = f"step {step} ({schedule}, {m} micro-batches)"
            shared = [r for r in reports if r.buckets]
            assert shared, where  # every grid here has a family held by several ranks
            repeated = step > 0 and PLAN[step - 1] == PLAN[step]
            assert all((r.buckets_early > 0) == repeated for r in shared), (where, [(r.buckets, r.buckets_early)
                                                                                    for r in shared])
        assert clipped  # the global norm's clipping scaled some step's update
    finally:
        group.shutdown()


def test_resume_sharded_then_unsharded_then_sharded_on_other_grids_equals_an_uninterrupted_run(ray_session, tmp_path):
    from raypar.checkpoint import CheckpointReader, checkpoint_dir, latest
    from raypar.data import write_synthetic_corpus
    from raypar.driver.trainer import Trainer

    from helpers import run_config

    write_synthetic_corpus(tmp_path / "data.parquet", 256, 8, 64, seed=1)

    def run(name, grid, shard, resume=None, tp=1):
        cfg = run_config(tmp_path, name, grid, 9, checkpoint={"every": 3, "keep_last": 5, **({"resume": resume} if resume else {})},
                         parallel={"shard_optimizer": shard, "grad_bucket_mb": 0.02, "tp": tp})
        return Trainer(cfg).fit()

    full = run("full", (2, 1, 1), True)
    saved = checkpoint_dir(tmp_path / "full" / "ckpt", 3)
    with CheckpointReader(saved) as r:
        # Each of the two ranks wrote its own share of AdamW's moments, the weights one of them.
        moments = [n for n in r.names() if n.startswith("optim.exp_avg.")]
        assert len({p.file for n in moments for p in r.entry(n).pieces}) == 2
        assert len({p.file for p in r.entry("layers.0.attn.wq.weight").pieces}) == 1
    unsharded = run("unsharded", (1, 2, 1), False, resume=str(saved))
    # Sharded over dp=2 on each of tp=2 workers' slices: loads whole tensors cut to its
    # slices and shares, and saves its shares of slices where they lie in the whole tensors.
    wider = run("wider", (2, 1, 1), True, resume=str(checkpoint_dir(tmp_path / "unsharded" / "ckpt", 6)), tp=2)
    losses = {r.step: r.loss for r in full.records}
    assert [r.step for r in unsharded.records] == list(range(3, 9))
    for r in unsharded.records[:3] + wider.records:
        assert r.loss == pytest.approx(losses[r.step], rel=1e-5), r.step

    def state(path):
        with CheckpointReader(path) as r:
            return {n: r.read(n) for n in r.names() if not n.startswith("rng.")}

    a, b = state(latest(tmp_path / "full" / "ckpt")), state(latest(tmp_path / "wider" / "ckpt"))
    assert a.keys() == b.keys() and any(n.startswith("optim.exp_avg.") for n in a)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_the_benchmark_table_gives_the_ratios_the_issue_asks_for():
    from bench.sharded_optimizer import table

    def row(kind, tps, state, reduce_ms, r=0):
        return {"kind": kind, "gpus": 2 if kind == "dp1" else 4, "tokens_per_s": tps, "optimizer_bytes": [state, state],
                "peak_device_bytes": [1 << 30], "reduce_ms": reduce_ms, "optimizer_ms": 1.0, "round": r}

    text = table([row("dp1", 100.0, 12 << 20, 1.0), row("dp2", 190.0, 12 << 20, 4.0),
                  row("dp2-sharded", 195.0, 6 << 20, 1.0), row("dp2-sharded-no-overlap", 180.0, 6 << 20, 4.0)])
    sharded = next(line for line in text.splitlines() if line.startswith("| dp2-sharded |"))
    # vs dp2 195/190; scaling 195/(2 x 100); state 6/12.
    assert "| 1.026 | 0.975 | 6 | 0.500 |" in sharded
    assert "Overlap share (reduce-scatter time hidden inside backward): 75.0%" in text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_loaded_weight_sets_weights_and_masters_copying_each_once(dtype):
    """One replica: fp32 weights are their own masters, so a load copies them once; bf16
    weights take the value, and their fp32 masters take it too."""
    from raypar.config import ModelConfig, TrainConfig
    from raypar.model import Transformer, init_weights
    from raypar.sharded_optimizer import ShardedOptimizer

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16, dtype=dtype)
    model = Transformer(cfg)
    init_weights(model, cfg, seed=3)
    opt = ShardedOptimizer(model, TrainConfig(), {"dense": None})
    copies: list[torch.Tensor] = []

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        copies.append(dst)
        dst.copy_(src.reshape(dst.shape))

    key = "layers.0.attn.wq.weight"
    value = torch.randn(opt._views[key].shape)
    opt.set_weight(key, value, copy)
    segments = opt.segments_by_key()[key]
    assert len(copies) == 1 + (len(segments) if dtype == "bfloat16" else 0)
    torch.testing.assert_close(opt._views[key].float(), value.to(getattr(torch, dtype)).float())
    for family, seg, _ in segments:
        torch.testing.assert_close(seg.of(family.master), value.reshape(-1)[seg.start:seg.stop])
