"""Model and pipeline partitioning: shapes, names, topology-free init, stage equivalence."""
from __future__ import annotations

import math
import re

import pytest
import torch

from raypar.config import ModelConfig
from raypar.model.moe import MoE
from raypar.model.partition import balanced_halves, layer_parts, stage_halves, stage_sizes
from raypar.model import (
    PartitionError,
    RMSNorm,
    Transformer,
    apply_rope,
    build_stage,
    flops_per_token,
    init_weights,
    num_params,
    rope_tables,
    split_layers,
    stage_param_names,
)

from helpers import tiny_config

B, T = 2, 8


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, max_seq_len=16, ffn_dim=48)
    base.update(kw)
    return ModelConfig(**base)


def tokens(cfg: ModelConfig, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def full_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    return build_stage(cfg, 0, 1, seed=seed)


# (3, "auto") cuts inside layer 1: [0, 1.attn] | [1.mlp, 2] | [3].
SPLITS = [(1, None), (2, None), (3, None), (4, None), (3, [1, 2, 1]), (2, [3, 1]), (3, "auto"), (2, [1.5, 2.5]),
          (3, [0.5, 2, 1.5])]


# ---------------------------------------------------------------------------------------
# Whole model


def test_forward_shapes_and_initial_loss():
    cfg = tiny()
    model = full_model(cfg)
    x, y = tokens(cfg)
    logits = model(x)
    assert logits.shape == (B, T, cfg.vocab_size)
    loss = model(x, labels=y)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert torch.isfinite(loss)
    # Small init -> near-uniform predictions.
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1

    stage = Transformer(cfg, layer_ids=[0, 1], has_embed=True, has_head=False)
    assert stage(x).shape == (B, T, cfg.dim)


def test_parameter_names():
    cfg = tiny()
    names = [n for n, _ in full_model(cfg).named_parameters()]
    pattern = re.compile(
        r"embed\.weight|norm\.weight|head\.weight|"
        r"layers\.\d+\.(attn\.w[qkvo]|mlp\.w[123]|attn_norm|mlp_norm)\.weight"
    )
    assert all(pattern.fullmatch(n) for n in names), names
    assert {"embed.weight", "norm.weight", "head.weight", "layers.3.attn.wq.weight",
            "layers.3.mlp.w1.weight", "layers.0.attn_norm.weight", "layers.0.mlp_norm.weight"} <= set(names)
    assert len(names) == 3 + cfg.n_layers * 9
    # Untied head, no rope tables among state.
    model = full_model(cfg)
    assert model.head.weight.data_ptr() != model.embed.weight.data_ptr()
    assert "rope_cos" not in model.state_dict()


@pytest.mark.parametrize("pp,lps", SPLITS)
def test_stage_names_partition_full_model(pp, lps):
    cfg = tiny()
    full = [n for n, _ in full_model(cfg).named_parameters()]
    per_stage = [stage_param_names(cfg, s, pp, lps) for s in range(pp)]
    flat = [n for names in per_stage for n in names]
    assert sorted(flat) == sorted(full)
    assert len(flat) == len(set(flat))
    assert "embed.weight" in per_stage[0] and "head.weight" in per_stage[-1]
    # Meta-built names match the names of a real stage.
    assert per_stage[-1] == [n for n, _ in build_stage(cfg, pp - 1, pp, lps).named_parameters()]


# ---------------------------------------------------------------------------------------
# Topology-free initialisation


@pytest.mark.parametrize("pp,lps", SPLITS)
def test_stage_init_matches_full_model_bitwise(pp, lps):
    cfg = tiny()
    full = dict(full_model(cfg, seed=3).named_parameters())
    for s in range(pp):
        for name, p in build_stage(cfg, s, pp, lps, seed=3).named_parameters():
            assert torch.equal(p, full[name]), name


def test_init_values_and_seed():
    cfg = tiny()
    a, b = full_model(cfg, seed=0), full_model(cfg, seed=1)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for name in pa:
        if name.endswith("norm.weight"):
            assert torch.equal(pa[name], torch.ones_like(pa[name]))
        else:
            assert not torch.equal(pa[name], pb[name]), name
    # Different parameters of the same shape get different streams.
    assert not torch.equal(pa["layers.0.attn.wq.weight"], pa["layers.1.attn.wq.weight"])
    # Residual output projections use the depth-scaled std.
    big = tiny(dim=128, ffn_dim=256, vocab_size=256)
    m = full_model(big)
    scaled = big.init_std / math.sqrt(2 * big.n_layers)
    assert m.layers["0"].attn.wo.weight.std().item() == pytest.approx(scaled, rel=0.1)
    assert m.layers["0"].mlp.w2.weight.std().item() == pytest.approx(scaled, rel=0.1)
    assert m.layers["0"].attn.wq.weight.std().item() == pytest.approx(big.init_std, rel=0.1)
    assert m.embed.weight.std().item() == pytest.approx(big.init_std, rel=0.1)


def test_init_ignores_global_rng_and_eager_build():
    cfg = tiny()
    torch.manual_seed(123)
    eager = Transformer(cfg)  # built with real tensors and default init first
    init_weights(eager, cfg, seed=5)
    torch.manual_seed(999)
    ref = full_model(cfg, seed=5)
    for (n, p), (_, q) in zip(eager.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n


# ---------------------------------------------------------------------------------------
# Stage chain equals the whole model


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("pp,lps", SPLITS[1:])
def test_stage_chain_matches_full_model(pp, lps):
    cfg = tiny()
    x, y = tokens(cfg)
    full = full_model(cfg, seed=7)
    ref_loss = full(x, labels=y)
    ref_loss.backward()
    ref_grads = _grads(full)

    stages = [build_stage(cfg, s, pp, lps, seed=7) for s in range(pp)]
    # Forward as a pipeline does: each stage's input is a detached leaf.
    inputs, outputs = [], []
    h: torch.Tensor = x
    for s, stage in enumerate(stages):
        inp = h if s == 0 else h.detach().requires_grad_()
        out = stage(inp, labels=y if s == pp - 1 else None)
        inputs.append(inp)
        outputs.append(out)
        h = out
    loss = outputs[-1]
    assert torch.equal(loss, ref_loss)

    # Backward stage by stage, sending input gradients upstream.
    grad = None
    for s in reversed(range(pp)):
        torch.autograd.backward(outputs[s], grad_tensors=grad)
        grad = inputs[s].grad if s > 0 else None

    got = {n: g for stage in stages for n, g in _grads(stage).items()}
    assert got.keys() == ref_grads.keys()
    for name, g in got.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------
# Activation recompute


def test_recompute_matches_and_reports_block_inputs():
    cfg = tiny()
    x, y = tokens(cfg)
    plain = full_model(cfg, seed=2)
    loss = plain(x, labels=y)
    loss.backward()

    rec = full_model(cfg, seed=2)
    rec.recompute = True
    seen: list[torch.Size] = []
    rec.on_block_input = lambda t: seen.append(t.shape)
    rec_loss = rec(x, labels=y)
    assert len(seen) == cfg.n_layers and all(s == (B, T, cfg.dim) for s in seen)
    rec_loss.backward()
    assert len(seen) == cfg.n_layers  # recomputation in backward does not report again
    torch.testing.assert_close(rec_loss, loss, rtol=0, atol=0)
    for (n, p), (_, q) in zip(rec.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=n)

    # No grad, no recompute: the hook stays quiet.
    seen.clear()
    with torch.no_grad():
        rec(x)
    assert seen == []


def test_recompute_counts_each_routed_row_once():
    """The MoE counters (the reports' expert_tokens, the expert biases' counts) see a forward
    recomputed in the backward as the rows it already counted."""
    cfg = tiny(n_experts=4, moe_top_k=2)
    x, y = tokens(cfg)
    counts = []
    for recompute in (False, True):
        model = full_model(cfg, seed=2)
        model.recompute = recompute
        model(x, labels=y).backward()
        counts.append([m.stats.routed.tolist() for m in model.modules() if isinstance(m, MoE)])
    assert counts[0] == counts[1] and all(sum(c) == B * T * 2 for c in counts[0])


def test_recompute_on_middle_stage():
    cfg = tiny()
    stage = build_stage(cfg, 1, 3)
    stage.recompute = True
    calls = []
    stage.on_block_input = calls.append
    h = torch.randn(B, T, cfg.dim, requires_grad=True)
    stage(h).sum().backward()
    assert len(calls) == len(stage.layers) and calls[0] is h
    assert h.grad is not None


# ---------------------------------------------------------------------------------------
# Variants and helpers


def test_gqa():
    cfg = tiny(n_heads=4, n_kv_heads=2)
    model = full_model(cfg)
    assert model.layers["0"].attn.wk.weight.shape == (2 * 8, cfg.dim)
    x, y = tokens(cfg)
    loss = model(x, labels=y)
    loss.backward()
    assert torch.isfinite(loss) and model.layers["0"].attn.wk.weight.grad is not None


def test_bfloat16():
    cfg = tiny(dtype="bfloat16")
    model = full_model(cfg)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    x, y = tokens(cfg)
    assert model(x).dtype == torch.bfloat16
    loss = model(x, labels=y)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    # bf16 parameters are the fp32 init rounded once.
    ref = dict(full_model(tiny(), seed=0).named_parameters())
    for n, p in model.named_parameters():
        assert torch.equal(p, ref[n].to(torch.bfloat16)), n


def test_causal():
    cfg = tiny()
    model = full_model(cfg)
    x, _ = tokens(cfg)
    x2 = x.clone()
    x2[:, -1] = (x2[:, -1] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(x2)
    assert torch.equal(a[:, :-1], b[:, :-1])
    assert not torch.equal(a[:, -1], b[:, -1])


def test_rope_relative_positions():
    cos, sin = rope_tables(8, 16, 10000.0)
    assert cos.shape == (16, 8) and torch.equal(cos[0], torch.ones(8)) and torch.equal(sin[0], torch.zeros(8))
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, generator=g), torch.randn(8, generator=g)

    def score(i: int, j: int) -> torch.Tensor:
        qi = apply_rope(q.view(1, 1, 1, 8), cos[i:i + 1], sin[i:i + 1])
        kj = apply_rope(k.view(1, 1, 1, 8), cos[j:j + 1], sin[j:j + 1])
        return (qi * kj).sum()

    torch.testing.assert_close(score(5, 3), score(9, 7))
    torch.testing.assert_close(apply_rope(q.view(1, 1, 1, 8), cos[3:4], sin[3:4]).norm(), q.norm())


def test_rope_is_rotate_half_with_the_sign_in_the_table():
    """apply_rope's roll against the signed sin table gives Llama's rotate_half rotation."""
    hd, t = 8, 6
    theta = 10000.0
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.outer(torch.arange(t).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    x = torch.randn(2, 3, t, hd, generator=torch.Generator().manual_seed(1))
    x1, x2 = x.chunk(2, dim=-1)
    expected = x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()
    cos, sin = rope_tables(hd, t, theta)
    assert torch.equal(apply_rope(x, cos, sin), expected)


def test_rmsnorm_normalises_bf16_in_fp32():
    norm = RMSNorm(16, eps=1e-5, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 16))
    x = (torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(2)) * 40).to(torch.bfloat16)
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.float()).to(torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_meta_build_and_reset_buffers():
    cfg = tiny()
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.rope_cos.is_meta
    model.to_empty(device="cpu")
    model.reset_buffers()
    init_weights(model, cfg, seed=0)
    ref = full_model(cfg, seed=0)
    assert torch.equal(model.rope_cos, ref.rope_cos) and torch.equal(model.rope_sin, ref.rope_sin)
    x, y = tokens(cfg)
    assert torch.equal(model(x, labels=y), ref(x, labels=y))


def test_flops_and_num_params():
    cfg = tiny()
    model = full_model(cfg)
    n = num_params(model)
    assert n == sum(p.numel() for p in model.parameters())
    matmul = n - cfg.vocab_size * cfg.dim - (2 * cfg.n_layers + 1) * cfg.dim  # minus embed and norms
    assert flops_per_token(cfg, 8) == 6 * matmul + 12 * cfg.n_layers * cfg.dim * 8


def test_stage_input_errors():
    cfg = tiny()
    middle = build_stage(cfg, 1, 3)
    with pytest.raises(ValueError, match="hidden states"):
        middle(torch.zeros(B, T, dtype=torch.long))
    with pytest.raises(ValueError, match="outside"):
        Transformer(cfg, layer_ids=[4])
    with pytest.raises(PartitionError, match="stage 3 does not exist"):
        build_stage(cfg, 3, 3)


# ---------------------------------------------------------------------------------------
# split_layers


def _counts(ranges: list[range]) -> list[int]:
    return [len(r) for r in ranges]


def test_split_even_and_contiguous():
    ranges = split_layers(8, 4)
    assert ranges == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert split_layers(4, 1) == [range(0, 4)]


@pytest.mark.parametrize(
    "n_layers,n_stages,expected",
    [(10, 4, [2, 3, 3, 2]), (7, 3, [2, 3, 2]), (5, 2, [3, 2]), (11, 4, [3, 3, 3, 2]),
     (8, 5, [1, 2, 2, 2, 1]), (9, 5, [2, 2, 2, 2, 1]), (3, 3, [1, 1, 1])],
)
def test_split_uneven(n_layers, n_stages, expected):
    ranges = split_layers(n_layers, n_stages)
    assert _counts(ranges) == expected
    assert [i for r in ranges for i in r] == list(range(n_layers))


def _stage_costs(cfg, counts):
    """Modelled cost of each stage holding `counts` half layers."""
    from raypar.model.transformer import HALVES, head_flops, layer_flops

    costs, start = [], 0
    for c in counts:
        costs.append(sum(layer_flops(cfg, u // 2, cfg.max_seq_len, HALVES[u % 2]) for u in range(start, start + c)))
        start += c
    costs[-1] += head_flops(cfg)
    return costs


def _compositions(n, k):
    if k == 1:
        yield [n]
        return
    for first in range(1, n - k + 2):
        for rest in _compositions(n - first, k - 1):
            yield [first, *rest]


@pytest.mark.parametrize("model, n_stages", [
    ({"n_layers": 4, "vocab_size": 512}, 2), ({"n_layers": 7, "vocab_size": 2048}, 3), ({"n_layers": 6}, 4),
    ({"n_layers": 8, "vocab_size": 1024, "n_experts": 4, "moe_every": 2}, 3), ({"n_layers": 5}, 5),
], ids=["head-heavy", "head-heavier", "tiny-head", "moe-every-2", "one-each"])
def test_auto_split_makes_the_costliest_stage_as_cheap_as_any_split(tmp_path, model, n_stages):
    """Against every contiguous split of half layers (brute force), by the same cost model."""
    cfg = tiny_config(tmp_path, model=model, parallel={"pp": n_stages}).model
    auto = balanced_halves(cfg, n_stages)
    assert len(auto) == n_stages and sum(auto) == 2 * cfg.n_layers and min(auto) >= 1
    best = min(max(_stage_costs(cfg, c)) for c in _compositions(2 * cfg.n_layers, n_stages))
    assert max(_stage_costs(cfg, auto)) == best


def test_auto_split_of_the_1b_config_cuts_inside_a_layer_off_the_head_stage():
    from raypar.config import load_config

    cfg = load_config("configs/gpt-1b.yaml", []).model
    assert (balanced_halves(cfg, 2), balanced_halves(cfg, 4)) == ([15, 13], [7, 8, 8, 5])
    even, whole = max(_stage_costs(cfg, [14, 14])), max(_stage_costs(cfg, [16, 12]))  # 7 | 7 and 8 | 6 layers
    assert max(_stage_costs(cfg, [15, 13])) < whole < even


def test_auto_split_of_the_equivalence_grid(tmp_path):
    """tests/test_pipeline_equivalence.py's pp2-auto grid is uneven and cuts inside layer 2."""
    cfg = tiny_config(tmp_path, model={"n_layers": 4, "vocab_size": 512}).model
    assert balanced_halves(cfg, 2) == [5, 3]
    assert [layer_parts(r) for r in stage_halves(cfg, 2, "auto")] == [[0, 1, (2, "attn")], [(2, "mlp"), 3]]


def test_a_stage_holding_both_halves_of_a_layer_in_two_chunks_runs_them_apart():
    """A V schedule's middle stage may end one chunk with a layer's attention and start its
    next chunk with that layer's MLP: one block, each half run by its own chunk."""
    from raypar.model.transformer import Transformer

    cfg = tiny()
    full = full_model(cfg, seed=5)
    stage = Transformer(cfg, chunks=[[0, (1, "attn")], [(1, "mlp"), 2]], embed_chunk=0, head_chunk=None)
    stage.load_state_dict({n: p for n, p in full.state_dict().items() if n in stage.state_dict()})
    assert sorted(stage.layers["1"].halves) == ["attn", "mlp"]
    x, _ = tokens(cfg)
    h = full.embed(x)
    cos, sin = full._rope(x.shape[1], h.dtype)
    for i in range(3):
        h = full.layers[str(i)](h, cos, sin)
    torch.testing.assert_close(stage(stage(x, chunk=0), chunk=1), h, rtol=0, atol=0)
    with pytest.raises(ValueError, match="layer 1's attn half is given twice"):
        Transformer(cfg, layer_ids=[1, (1, "attn")])


def test_split_explicit():
    assert split_layers(6, 3, [1, 4, 1]) == [range(0, 1), range(1, 5), range(5, 6)]


def test_a_listed_cut_may_fall_inside_a_layer():
    """A count ending in .5 cuts between a layer's attention and its MLP: [1.5, 2.5] holds
    layer 0 and layer 1's attention on stage 0, layer 1's MLP and layers 2-3 on stage 1;
    whole counts cut as `split_layers` does."""
    cfg = tiny()
    assert stage_halves(cfg, 2, [1.5, 2.5]) == [range(0, 3), range(3, 8)]
    assert [layer_parts(h) for h in stage_halves(cfg, 2, [1.5, 2.5])] == [[0, (1, "attn")], [(1, "mlp"), 2, 3]]
    assert [layer_parts(h) for h in stage_halves(cfg, 3, [0.5, 2, 1.5])] == [
        [(0, "attn")], [(0, "mlp"), 1, (2, "attn")], [(2, "mlp"), 3]]
    assert stage_halves(cfg, 2, [3, 1]) == [range(0, 6), range(6, 8)]
    assert stage_sizes(cfg, 2, [1.5, 2.5]) == [1.5, 2.5]


@pytest.mark.parametrize("counts, message", [
    ([1.25, 2.75], "each count is whole or ends in .5"),
    ([0, 4], "every stage needs at least half a layer"),
    ([1.5, 2], "sums to 3.5 but the model has 4 layers"),
    ([1.5], "has 1 entries but there are 2 pipeline stages"),
    ([True, 3], "each count is whole or ends in .5"),
])
def test_a_listed_cut_that_cannot_work_names_what_would(counts, message):
    with pytest.raises(PartitionError, match=re.escape(message)):
        stage_halves(tiny(), 2, counts)


@pytest.mark.parametrize(
    "args,message",
    [
        ((3, 4, None), "cannot split 3 layers into 4 pipeline stages: each stage needs at least one layer; use at most 3 stages"),
        ((3, 0, None), "use at least 1 stage"),
        ((0, 1, None), "at least one layer"),
        ((6, 3, [2, 4]), "has 2 entries but there are 3 pipeline stages"),
        ((6, 3, [3, 3, 0]), "every stage needs at least one layer"),
        ((6, 3, [2, 2, 3]), "sums to 7 but the model has 6 layers"),
        ((6, 2, [3.0, 3]), "must hold integers"),
    ],
)
def test_split_errors(args, message):
    with pytest.raises(PartitionError) as info:
        split_layers(*args)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)
