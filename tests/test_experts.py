"""Stacked experts and grouped GEMMs (no Ray): the grouped call against a loop over the
experts, the padded layout GPUs need against the unpadded one, per-expert names and
init whatever the expert split, and a checkpoint from when every expert was its own
module loading into the stacks."""
import json
from pathlib import Path

import pytest
import torch

import raypar.model.moe as moe_module
from raypar.checkpoint import CheckpointReader
from raypar.config import config_from_dict
from raypar.model import GroupedExperts, build_stage, load_unstacked, named_slices, unstacked
from raypar.model.experts import grouped_layout, grouped_linear
from raypar.optim import MasterOptimizer
from raypar.reference import ReferenceTrainer
from raypar.runtime.state import load_state, state_tensors

DATA = Path(__file__).parent / "data"
MOE = {"vocab_size": 64, "dim": 16, "n_layers": 2, "n_heads": 2, "n_experts": 4, "moe_top_k": 2,
       "moe_ffn_dim": 24, "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001, "max_seq_len": 16}


def _looped(x, w, sizes):
    return torch.cat([c @ w[i].t() for i, c in enumerate(x.split(sizes))])


@pytest.mark.parametrize("sizes,d_in,d_out", [
    ([3, 0, 7, 2], 8, 12),   # grouped_mm, an empty group in the middle
    ([0, 0, 5, 0], 8, 4),    # one group has every row
    ([2, 3, 1], 6, 5),       # no grouped kernel takes these widths: the loop
    ([0, 0, 0], 8, 8),       # no rows at all
])
def test_grouped_linear_matches_a_loop_over_experts(sizes, d_in, d_out):
    g = torch.Generator().manual_seed(sum(sizes) + d_in)
    x = torch.randn(sum(sizes), d_in, generator=g, requires_grad=True)
    w = torch.randn(len(sizes), d_out, d_in, generator=g, requires_grad=True)
    ends = torch.tensor(sizes).cumsum(0).to(torch.int32)
    y = grouped_linear(x, w, ends)
    seed = torch.randn(y.shape, generator=g)
    (y * seed).sum().backward()
    got = (y.detach(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    want = _looped(x, w, sizes)
    (want * seed).sum().backward()
    torch.testing.assert_close(got[0], want.detach())
    torch.testing.assert_close(got[1], x.grad)
    torch.testing.assert_close(got[2], w.grad)  # zero for experts without rows


@pytest.mark.parametrize("align", [1, 4, 8])
def test_grouped_layout_starts_every_group_aligned(align):
    counts = torch.tensor([3, 0, 9, 1])
    dropped = 2  # rows of no group, after the others
    group = torch.cat([torch.arange(4).repeat_interleave(counts), torch.full((dropped,), 4)])
    position, ends, total = grouped_layout(group, counts, align)
    r = group.numel()
    assert total == r + (5 * (align - 1) if align > 1 else 0) and int(ends[-1]) == total
    assert position.unique().numel() == r and int(position.max()) < total
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), ends[:-1]])
    assert all(int(s) % align == 0 for s in starts)
    for e in range(4):  # group e's rows sit inside [start, end), in order
        rows = position[group == e]
        assert bool((rows >= starts[e]).all() and (rows < ends[e]).all()) and bool((rows.diff() == 1).all())


@pytest.mark.parametrize("capacity", [0.0, 1.0])
def test_padded_expert_groups_compute_the_same_as_unpadded(monkeypatch, capacity):
    """A GPU pads each expert's rows to 16 bytes; the padding must change nothing, also
    with the capacity dropping tokens (their rows trail the groups)."""
    cfg = config_from_dict({"model": {**MOE, "moe_capacity_factor": capacity}, "data": {"seq_len": 16}})
    tokens = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(0))

    def run(align):
        monkeypatch.setattr(moe_module, "group_alignment", lambda x: align)
        model = build_stage(cfg.model, 0, 1, seed=0, device=torch.device("cpu"))
        loss = model(tokens, tokens)
        loss.backward()
        dropped = sum(int(m.stats.dropped) for m in model.modules()
                      if isinstance(m, moe_module.MoE) and m.stats.dropped is not None)
        assert (dropped > 0) == (capacity > 0)  # the capacity case has trailing rows to place
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss1, grads1 = run(1)
    loss8, grads8 = run(8)
    torch.testing.assert_close(loss8, loss1)
    for name in grads1:
        torch.testing.assert_close(grads8[name], grads1[name], msg=name)


def test_experts_are_named_and_initialised_per_expert_whatever_the_split():
    cfg = config_from_dict({"model": MOE, "data": {"seq_len": 16}})
    whole = dict(unstacked(build_stage(cfg.model, 0, 1, seed=3, device=torch.device("cpu"))))
    split = {}
    for rank in range(2):
        stage = build_stage(cfg.model, 0, 1, seed=3, device=torch.device("cpu"), ep_rank=rank, ep_size=2)
        experts = stage.layers["1"].mlp.experts
        assert isinstance(experts, GroupedExperts) and experts.w13.shape == (2, 48, 16)
        split.update(dict(unstacked(stage)))
    assert sorted(split) == sorted(whole)
    assert "layers.1.mlp.experts.3.w2.weight" in whole and whole["layers.1.mlp.experts.3.w2.weight"].shape == (16, 24)
    for name in whole:
        assert torch.equal(split[name], whole[name]), name


def test_load_unstacked_fills_the_stacks_and_names_what_is_missing():
    cfg = config_from_dict({"model": MOE, "data": {"seq_len": 16}})
    a = build_stage(cfg.model, 0, 1, seed=1, device=torch.device("cpu"))
    b = build_stage(cfg.model, 0, 1, seed=2, device=torch.device("cpu"))
    tensors = {n: t.clone() for n, t in unstacked(a)}
    load_unstacked(b, tensors)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    del tensors["layers.0.mlp.experts.2.w3.weight"]
    with pytest.raises(KeyError, match=r"layers\.0\.mlp\.experts\.2\.w3\.weight"):
        load_unstacked(b, tensors)
    assert [k for k, _ in named_slices(b)["layers.0.mlp.experts.w13"]][:2] == [
        "layers.0.mlp.experts.0.w1.weight", "layers.0.mlp.experts.0.w3.weight"]


def _old_checkpoint():
    meta = json.loads((DATA / "moe-checkpoint-v1.json").read_text())
    cfg = config_from_dict({"model": meta["model"], "train": meta["train"], "data": meta["data"]})
    return cfg, meta, CheckpointReader(DATA / "moe-checkpoint-v1")


def _batch(step: int) -> torch.Tensor:  # as make_moe_checkpoint.py draws them
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))


def test_a_checkpoint_from_per_expert_modules_trains_on_as_it_did():
    cfg, meta, reader = _old_checkpoint()
    ref = ReferenceTrainer(cfg)
    load_state(ref.optimizer, reader.read, set(reader.names()), None, torch.device("cpu"))
    losses = [ref.step(step, _batch(step), _batch(step))[0] for step in (2, 3)]
    assert losses == pytest.approx(meta["losses_after"], rel=1e-5)


def test_a_checkpoint_from_per_expert_modules_loads_on_an_expert_parallel_split():
    cfg, _, reader = _old_checkpoint()
    for rank in range(2):
        stage = build_stage(cfg.model, 0, 1, seed=0, device=torch.device("cpu"), ep_rank=rank, ep_size=2)
        optimizer = MasterOptimizer(stage, cfg.train)
        load_state(optimizer, reader.read, set(reader.names()), None, torch.device("cpu"))
        mine = state_tensors(stage, optimizer, None, 0, torch.device("cpu"), with_rng=False)
        experts = [n for n in mine if ".experts." in n and not n.startswith(("optim.step",))]
        assert len(experts) == 2 * 2 * 3 * 3  # layers x local experts x (w1, w2, w3) x (weight, 2 moments)
        assert all(f".experts.{2 * rank}." in n or f".experts.{2 * rank + 1}." in n for n in experts)
        for name, tensor in mine.items():
            torch.testing.assert_close(tensor, reader.read(name).reshape(tensor.shape), rtol=0, atol=0, msg=name)
