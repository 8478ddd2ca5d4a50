"""Tensor-parallel pieces (issue 30) over gloo: a SwiGLU MLP split column- then
row-parallel, and the vocabulary-parallel cross-entropy, each equal to the whole layer on
one process (output, input gradient, every weight's gradient as slices of the whole one's);
where tp does not divide a part, its fallbacks (the model dimension, or whole), equal too."""
import functools
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from raypar.model.tensor_parallel import (PartSplit, Slice, fallbacks, from_tensor_parallel, split_parts,
                                          to_tensor_parallel, vocab_parallel_cross_entropy)

from ports import free_port

TP = 2


def test_a_part_tp_does_not_divide_splits_the_model_dimension_else_is_whole_and_says_why():
    from raypar.config import ModelConfig

    even = ModelConfig(vocab_size=64, dim=32, n_heads=4, n_kv_heads=2)
    assert split_parts(even, 2) == {"attention": PartSplit("attention", "model.n_heads"),
                                    "mlp": PartSplit("mlp", "model.ffn_dim"),
                                    "vocabulary": PartSplit("vocabulary", "model.vocab_size")}
    assert fallbacks(even, 2) == []
    # Two key/value heads over tp=4; a vocabulary of 50257 (odd): both split the model dimension.
    odd = ModelConfig(vocab_size=50257, dim=64, n_heads=4, n_kv_heads=2)
    parts = split_parts(odd, 4)
    assert (parts["attention"].along, parts["mlp"].along, parts["vocabulary"].along) == ("model.dim",
                                                                                         "model.ffn_dim", "model.dim")
    assert parts["attention"].why == ("model.n_kv_heads=2 is not a multiple of parallel.tp=4: split along "
                                      "model.dim=64 instead (its outputs are gathered)")
    # tp=3 divides neither the heads nor the model dimension: attention is whole on every rank.
    whole = split_parts(ModelConfig(vocab_size=64, dim=32, n_heads=4, ffn_dim=96), 3)
    assert whole["attention"] == PartSplit("attention", None, "parallel.tp=3 divides none of model.n_heads=4, "
                                                              "model.n_kv_heads=4, model.dim=32: every tp worker "
                                                              "holds it whole")
    assert whole["mlp"].along == "model.ffn_dim" and whole["vocabulary"].along is None
    assert fallbacks(ModelConfig(vocab_size=64, dim=32, n_heads=4, ffn_dim=96), 3) == [
        f"tensor parallelism: {part}: {whole[part].why}" for part in ("attention", "vocabulary")]
    piece = Slice(0, 3, 4)
    assert piece.offset((8, 4)) == (6, 0) and torch.equal(piece.of(torch.arange(32).view(8, 4)),
                                                           torch.arange(24, 32).view(2, 4))


def test_mlp_pieces_start_at_multiples_of_eight_elements_and_join_whole():
    """The MLP's hidden units split where a bf16 row stays 16-byte aligned (Hopper's GEMMs
    need it): the 1B config's 5,464 over tp=2 into 2,728 and 2,736, not 2,732 each; an
    aligned equal split is unchanged. Pieces name their alignment in memory, slice and join
    back to the global tensor, and every rank's sharded-optimizer buffers make room for the
    largest piece."""
    from raypar.config import ModelConfig
    from raypar.model import Transformer
    from raypar.model.tensor_parallel import (ALIGN, TensorParallel, join_tp_pieces, largest_piece,
                                              split_tp_piece_name, tp_piece_name, tp_slices)

    assert [Slice(0, i, 2, align=ALIGN).bounds(5464) for i in range(2)] == [(0, 2728), (2728, 5464)]
    assert [Slice(0, i, 4, align=ALIGN).bounds(88) for i in range(4)] == [(0, 16), (16, 40), (40, 64), (64, 88)]
    assert [Slice(0, i, 2, align=ALIGN).bounds(96) for i in range(2)] == [(0, 48), (48, 96)]
    assert [Slice(0, i, 2, align=ALIGN).bounds(90) for i in range(2)] == [(0, 45), (45, 90)]  # 90 is no multiple of 8

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4)  # hidden size 88: 44 a rank is misaligned
    whole = torch.arange(88 * 32, dtype=torch.float32).view(88, 32)
    pieces = {}
    for rank in range(2):
        with torch.device("meta"):
            model = Transformer(cfg, tp=TensorParallel(rank, 2))
        part, shape = tp_slices(model)["layers.0.mlp.w1.weight"]
        assert model.get_parameter("layers.0.mlp.w1.weight").shape == ((40, 32), (48, 32))[rank]
        assert part.offset(shape) == ((0, 0), (40, 0))[rank] and largest_piece(part, shape) == 48 * 32
        key = tp_piece_name("w1", part)
        assert split_tp_piece_name(key) == ("w1", part)
        pieces[key] = part.of(whole)
    assert torch.equal(join_tp_pieces(pieces)["w1"], whole)


def _plain(obj):
    """Tensors as numpy arrays, for the queue: a tensor sent as shared memory is gone once
    its process exits."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_plain(v) for v in obj)
    return obj


def _tensors(obj):
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_tensors(v) for v in obj)
    return obj


def _mlp_and_loss(rank: int, group) -> dict:
    g = torch.Generator().manual_seed(0)
    dim, hidden, vocab, n = 8, 12, 10, 6
    w1, w3 = torch.randn(hidden, dim, generator=g), torch.randn(hidden, dim, generator=g)
    w2, head = torch.randn(dim, hidden, generator=g), torch.randn(vocab, dim, generator=g)
    x = torch.randn(n, dim, generator=g)
    labels = torch.tensor([0, 9, 4, 5, -100, 7])  # both ranks' vocabulary halves, and an ignored token

    # The whole layer on this process: the reference.
    full = {k: t.clone().requires_grad_() for k, t in dict(w1=w1, w3=w3, w2=w2, head=head, x=x).items()}
    h = full["x"] + (F.silu(full["x"] @ full["w1"].t()) * (full["x"] @ full["w3"].t())) @ full["w2"].t()
    want_loss = F.cross_entropy(h @ full["head"].t(), labels)
    want_loss.backward()

    # The same split over the tp ranks: w1, w3 and head by output rows, w2 by input columns.
    cols, rows, vocab_slice = Slice(0, rank, TP), Slice(1, rank, TP), Slice(0, rank, TP)
    mine = {"w1": cols.of(w1), "w3": cols.of(w3), "w2": rows.of(w2), "head": vocab_slice.of(head), "x": x}
    mine = {k: t.clone().requires_grad_() for k, t in mine.items()}
    xin = to_tensor_parallel(mine["x"], group)
    partial = (F.silu(xin @ mine["w1"].t()) * (xin @ mine["w3"].t())) @ mine["w2"].t()
    h_tp = mine["x"] + from_tensor_parallel(partial, group)
    logits = to_tensor_parallel(h_tp, group) @ mine["head"].t()
    loss = vocab_parallel_cross_entropy(logits, labels, vocab_slice.offset((vocab, dim))[0], group)
    loss.backward()
    slices = {"w1": cols, "w3": cols, "w2": rows, "head": vocab_slice}
    return {"loss": (loss.item(), want_loss.item()), "h": (h_tp.detach(), h.detach()),
            **{k: (mine[k].grad, slices[k].of(full[k].grad) if k in slices else full[k].grad) for k in mine}}


def _worker(rank: int, size: int, port: int, queue, compute) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        queue.put((rank, _plain(compute(rank, dist.group.WORLD))))
    finally:
        dist.destroy_process_group()


def _on_tp_ranks(compute, size: int = TP) -> dict:
    """`compute(rank, group)` on `size` processes of one gloo group; each rank's result."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, size, port, queue, compute)) for r in range(size)]
    for p in procs:
        p.start()
    results = {r: _tensors(out) for r, out in (queue.get(timeout=180) for _ in procs)}
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


def test_column_then_row_parallel_mlp_and_vocab_parallel_loss_equal_the_whole_layer():
    results = _on_tp_ranks(_mlp_and_loss)
    for rank, got in results.items():
        loss, want = got.pop("loss")
        assert loss == pytest.approx(want, rel=1e-5), f"rank {rank}: loss"
        for name, (mine, reference) in got.items():
            torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5, msg=f"rank {rank}: {name}")


def test_vocab_parallel_loss_without_a_group_is_cross_entropy():
    logits, labels = torch.randn(5, 7), torch.tensor([1, -100, 6, 0, 3])
    torch.testing.assert_close(vocab_parallel_cross_entropy(logits, labels, 0, None), F.cross_entropy(logits, labels))
    with pytest.raises(ValueError, match=r"logits \[n, v_local\] and labels \[n\]"):
        vocab_parallel_cross_entropy(logits, labels[:3], 0, None)


def _whole_and_split_models(rank: int, group) -> dict:
    from raypar.config import ModelConfig
    from raypar.kernels import sample_seeds
    from raypar.model import Transformer, init_weights
    from raypar.model.tensor_parallel import TensorParallel, tp_slices

    # Grouped-query attention (4 query heads, 2 key/value heads) and dropout on.
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, dropout=0.1)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    labels[0, :3] = -100
    seeds = sample_seeds(0, 0, [0, 1])
    out = {}
    tp = TensorParallel(rank, TP)
    tp.group = group
    recomputed = Transformer(cfg, tp=tp)
    recomputed.recompute = True  # each block's forward again in backward, all-reduces included
    for name, model in (("whole", Transformer(cfg)), ("tp", Transformer(cfg, tp=tp)), ("tp-recompute", recomputed)):
        init_weights(model, cfg, seed=3)
        loss = model(tokens, labels, seeds)
        loss.backward()
        with torch.no_grad():
            logits = model.eval()(tokens)
        grads = {n: p.grad for n, p in model.named_parameters()}
        out[name] = (loss.item(), logits, grads, {n: piece for n, (piece, _) in tp_slices(model).items()})
    return out


def test_a_transformer_split_over_two_tensor_parallel_ranks_equals_the_whole_model():
    """Loss, logits (gathered) and every parameter's gradient, as this rank's slice of the
    whole model's; GQA, dropout, ignored labels and block recompute included."""
    results = _on_tp_ranks(_whole_and_split_models)
    for (rank, out), run in ((item, run) for item in results.items() for run in ("tp", "tp-recompute")):
        (want_loss, want_logits, want_grads, _), (loss, logits, grads, slices) = out["whole"], out[run]
        assert loss == pytest.approx(want_loss, rel=1e-5), f"rank {rank}, {run}"
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        assert set(grads) == set(want_grads)
        assert {n.rsplit(".", 2)[-2] for n in slices} == {"embed", "wq", "wk", "wv", "wo", "w1", "w2", "w3", "head"}
        for name, g in grads.items():
            want = slices[name].of(want_grads[name]) if name in slices else want_grads[name]
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, {run}: {name}")


def _overlapped_backward(rank: int, group) -> dict:
    """A tp model's gradients from a plain backward, and from one whose split linear layers'
    weight gradients run while the next sum of input gradients over tp travels (what the
    stage does with `runtime.tp_backward_overlap`): how many ran in each exchange. Without
    and with sequence parallelism (all-reduces, reduce-scatters)."""
    import raypar.model.tensor_parallel as tpm
    from raypar.config import ModelConfig
    from raypar.model import Transformer, init_weights
    from raypar.model.split_backward import compute_weight_grads, set_split_backward, weight_grads_deferred
    from raypar.model.tensor_parallel import TensorParallel

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)
    tokens = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    out = {}
    for sequence in (False, True):
        tp = TensorParallel(rank, 2, sequence)
        tp.group = group
        model = Transformer(cfg, tp=tp)
        init_weights(model, cfg, seed=3)
        model(tokens, labels).backward()
        plain = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        linears = set_split_backward(model, True)
        ran, exchange = [], tpm.run_while_exchanging
        tpm.run_while_exchanging = lambda: ran.append(exchange()) or ran[-1]
        try:
            with weight_grads_deferred("whole", overlap=True):
                model(tokens, labels).backward()
        finally:
            tpm.run_while_exchanging = exchange
        after = compute_weight_grads("whole")
        out[sequence] = {"plain": plain, "overlapped": {n: p.grad for n, p in model.named_parameters()},
                         "counts": (linears, torch.tensor(ran), after)}
    return out


def test_weight_gradients_run_while_the_tp_exchanges_travel_and_equal_a_plain_backward():
    results = _on_tp_ranks(_overlapped_backward)
    for (rank, by_mode), sequence in ((item, s) for item in results.items() for s in (False, True)):
        out = by_mode[sequence]
        linears, ran, after = out["counts"]
        # Every split layer's weight gradient ran beside an exchange, none was left: the
        # head's beside the one at its input, each MLP's three beside the one at its input,
        # and each attention's four (wo, wq, wk, wv) beside the one at the attention's input.
        assert (int(ran.sum()), after) == (linears, 0), (rank, sequence, ran.tolist(), after)
        assert ran.tolist() == [1, 3, 4, 3, 4], (rank, sequence, ran.tolist())
        for name, g in out["overlapped"].items():
            torch.testing.assert_close(g, out["plain"][name], rtol=1e-6, atol=1e-7,
                                       msg=f"rank {rank}, sequence parallel {sequence}: {name}")


def _backward_on_a_second_communicator(rank: int, group) -> dict:
    """Which group each tp collective ran on, forward and backward, with `backward_group` a
    second communicator over the same ranks (what a stage whose micro-batches overlap sets,
    `runtime.tp_microbatch_overlap`); and the gradients against the same model on one group.
    Preferred splits and the model-dimension fallback, without and with sequence parallelism."""
    import raypar.model.tensor_parallel as tpm
    from raypar.config import ModelConfig
    from raypar.model import Transformer, init_weights
    from raypar.model.tensor_parallel import TensorParallel

    backward_group = dist.new_group([0, 1])
    tokens = torch.randint(0, 63, (2, 6), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, 63, (2, 6), generator=torch.Generator().manual_seed(2))
    used: list[tuple[str, str]] = []
    phase = ["F"]

    def recorded(collective):
        def run(*args, group=None, **kwargs):
            used.append((phase[0], "forward" if group is group_ else "backward" if group is backward_group else "other"))
            return collective(*args, group=group, **kwargs)
        return run

    group_ = group
    originals = {"all_reduce": tpm.dist.all_reduce, "all_gather": tpm.dist.all_gather}
    out = {}
    for name, model_cfg in (("preferred", dict(vocab_size=64, dim=32, n_heads=4)),
                            ("model-dim", dict(vocab_size=63, dim=24, n_heads=3, ffn_dim=45))):
        cfg = ModelConfig(n_layers=2, max_seq_len=16, **model_cfg)
        for sequence in (False, True):
            grads = {}
            for second in (False, True):
                tp = TensorParallel(rank, 2, sequence)
                tp.group, tp.backward_group = group, (backward_group if second else None)
                model = Transformer(cfg, tp=tp)
                init_weights(model, cfg, seed=3)
                used.clear()
                saved = tpm._all_gather, tpm._reduce_scatter
                tpm._all_gather, tpm._reduce_scatter = recorded(saved[0]), recorded(saved[1])
                for key, collective in originals.items():
                    setattr(tpm.dist, key, recorded(collective))
                try:
                    phase[0] = "F"
                    loss = model(tokens, labels)
                    phase[0] = "B"
                    loss.backward()
                finally:
                    tpm._all_gather, tpm._reduce_scatter = saved
                    for key, collective in originals.items():
                        setattr(tpm.dist, key, collective)
                grads[second] = {n: p.grad for n, p in model.named_parameters()}
                if second:
                    out[f"{name}, sequence {sequence}"] = {"used": sorted(set(used)), "count": len(used),
                                                           "grads": grads}
    return out


def test_backward_tp_collectives_run_on_their_own_communicator_and_give_the_same_gradients():
    """With `TensorParallel.backward_group` set, every collective of backward runs on it and
    every one of forward on `group` (so a forward beside another micro-batch's backward meets
    its peers in the same order on both communicators), and the gradients are the same."""
    results = _on_tp_ranks(_backward_on_a_second_communicator)
    for rank, runs in results.items():
        assert len(runs) == 4
        for run, out in runs.items():
            assert out["used"] == [("B", "backward"), ("F", "forward")], (rank, run, out["used"])
            one, two = out["grads"][False], out["grads"][True]
            for name, g in one.items():
                torch.testing.assert_close(two[name], g, rtol=0, atol=0, msg=f"rank {rank}, {run}: {name}")


# Where tp does not divide a part: (tp, sequence parallel, model), each against the whole model.
FALLBACKS = {
    # Three heads, an MLP of 45 and a vocabulary of 63 over tp=2: all three split the model
    # dimension; with dropout.
    "model-dim": (2, False, dict(vocab_size=63, dim=24, n_heads=3, ffn_dim=45, dropout=0.1)),
    "model-dim-sequence-parallel": (2, True, dict(vocab_size=63, dim=24, n_heads=3, ffn_dim=45, dropout=0.1)),
    # tp=3 divides neither the 4 heads nor dim=32: attention, embedding and head whole on
    # every rank, the MLP (96) split by hidden units.
    "whole-sequence-parallel": (3, True, dict(vocab_size=64, dim=32, n_heads=4, ffn_dim=96, dropout=0.1)),
    # MoE layers are whole on every tp rank (experts split over ep only): on the same tokens,
    # or under sequence parallelism on the gathered sequence; with capacity drops, aux and z losses.
    **{name: (2, sequence, dict(vocab_size=64, dim=32, n_heads=4, ffn_dim=64, dropout=0.1, n_experts=4, moe_top_k=2,
                                moe_every=2, moe_capacity_factor=1.0, moe_aux_loss_coef=0.05, moe_z_loss_coef=0.01))
       for name, sequence in (("moe", False), ("moe-sequence-parallel", True))},
}
# How each fallback cuts the weights it splits: by the names' module, the dimension cut.
BY_MODEL_DIM = {"embed": 1, "wq": 1, "wk": 1, "wv": 1, "wo": 0, "w1": 1, "w3": 1, "w2": 0, "head": 1}
PREFERRED_CUTS = {"embed": 0, "wq": 0, "wk": 0, "wv": 0, "wo": 1, "w1": 0, "w3": 0, "w2": 1, "head": 0}
FALLBACK_CUTS = {"model-dim": BY_MODEL_DIM, "model-dim-sequence-parallel": BY_MODEL_DIM,
                 "whole-sequence-parallel": {"w1": 0, "w3": 0, "w2": 1},  # attention, embedding and head whole
                 "moe": PREFERRED_CUTS, "moe-sequence-parallel": PREFERRED_CUTS}


def _whole_and_fallback_models(name: str, rank: int, group) -> dict:
    from raypar.config import ModelConfig
    from raypar.kernels import sample_seeds
    from raypar.model import Transformer, init_weights
    from raypar.model.tensor_parallel import TensorParallel, tp_slices

    size, sequence, model = FALLBACKS[name]
    cfg = ModelConfig(n_layers=2, max_seq_len=16, **model)
    tokens = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    labels[0, :3] = -100
    seeds = sample_seeds(0, 0, [0, 1])
    tp = TensorParallel(rank, size, sequence)
    tp.group = group
    out = {}
    for run, model in (("whole", Transformer(cfg)), ("tp", Transformer(cfg, tp=tp))):
        init_weights(model, cfg, seed=3)
        model(tokens, labels, seeds).backward()
        sliced = tp_slices(model) if run == "tp" else {}
        grads = {n: p.grad for n, p in model.named_parameters()}
        if sequence and run == "tp":
            # What the stage worker does: the whole-held weights saw this rank's tokens only.
            for n, g in grads.items():
                if n not in sliced:
                    dist.all_reduce(g, group=group)
        with torch.no_grad():
            loss, logits = model(tokens, labels, seeds).item(), model.eval()(tokens)
        out[run] = (loss, logits, grads, {n: piece for n, (piece, _) in sliced.items()})
    return out


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_a_part_tp_does_not_divide_trains_as_the_whole_model(name):
    """Loss, logits and every gradient (as this rank's slice) equal the whole model's when
    parts fall back to splitting the model dimension, or to being whole on every rank (as
    MoE layers are)."""
    size = FALLBACKS[name][0]
    results = _on_tp_ranks(functools.partial(_whole_and_fallback_models, name), size)
    for rank, out in results.items():
        (want_loss, want_logits, want_grads, _), (loss, logits, grads, slices) = out["whole"], out["tp"]
        assert loss == pytest.approx(want_loss, rel=1e-5), f"rank {rank}"
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        for name_, g in grads.items():
            want = slices[name_].of(want_grads[name_]) if name_ in slices else want_grads[name_]
            torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name_}")
        assert {n.rsplit(".", 2)[-2]: piece.dim for n, piece in slices.items()} == FALLBACK_CUTS[name]


def test_a_slice_built_on_the_meta_device_initialises_as_the_whole_models_slice():
    from raypar.config import ModelConfig
    from raypar.model import Transformer, init_weights
    from raypar.model.tensor_parallel import TensorParallel, tp_slices

    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, max_seq_len=16)
    whole = Transformer(cfg)
    init_weights(whole, cfg, seed=3)
    with torch.device("meta"):
        part = Transformer(cfg, tp=TensorParallel(1, 2))
    part.to_empty(device="cpu")
    init_weights(part, cfg, seed=3)
    cut = tp_slices(part)
    full = dict(whole.named_parameters())
    for name, p in part.named_parameters():
        want = cut[name][0].of(full[name]) if name in cut else full[name]
        assert torch.equal(p, want), name


# -- the grid's tp dimension: stage workers holding slices, against the single process --------

TP_PLAN = [("zb-h1", 4), ("1f1b", 2)]  # the split backward, then whole backwards on the state after it
TP_GRIDS = {
    "pp2-tp2-gqa": dict(model={"n_layers": 4, "n_kv_heads": 2}, parallel={"pp": 2, "tp": 2}),
    # Dropout inside the split layers and around them, whole-block recompute; the sharded
    # optimizer (ZeRO-1) over dp=2 on each tp rank's slices, the norms and MoE layers (whole on
    # both tp workers, gradients partial under sequence parallelism) shared alike; small
    # buckets, so parameters span several. Expert biases moved by the rows of both replicas,
    # counted once over the recompute.
    "dp2-tp2-sharded-moe-sequence-parallel-dropout-recompute": dict(
        model={"n_layers": 2, "dropout": 0.2, "n_experts": 4, "moe_top_k": 2, "moe_every": 2, "moe_aux_loss_coef": 0.01,
               "moe_bias_update_rate": 0.05},
        parallel={"dp": 2, "tp": 2, "sequence_parallel": True, "shard_optimizer": True, "grad_bucket_mb": 0.01},
        train={"global_batch_size": 16, "eps": 1e-6}, runtime={"recompute": "block"}),
    # Sequence parallelism: norms, residuals and the hidden states between stages hold each
    # tp rank's half of the sequence (and take that half of each sample's dropout mask).
    "pp2-tp2-sequence-parallel-dropout-recompute": dict(model={"n_layers": 4, "dropout": 0.2},
                                                        parallel={"pp": 2, "tp": 2, "sequence_parallel": True},
                                                        runtime={"recompute": "block"}),
    # Three heads, an MLP of 45 and a vocabulary of 63: tp=2 divides none of them, so every
    # part splits the model dimension instead; with sequence parallelism.
    "pp2-tp2-model-dim-sequence-parallel": dict(model={"n_layers": 4, "vocab_size": 63, "dim": 24, "n_heads": 3,
                                                       "ffn_dim": 45},
                                                parallel={"pp": 2, "tp": 2, "sequence_parallel": True}),
    # Attention split over tp=2, every other layer's MLP too; the MoE layers whole on each tp
    # rank, their experts split over ep=2; under sequence parallelism (the MoE layers on the
    # gathered sequence; without it: the model-level tests above); expert biases moving.
    "ep2-tp2-moe-sequence-parallel": dict(model={"n_layers": 2, "n_experts": 4, "moe_top_k": 2, "moe_every": 2,
                                                 "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001,
                                                 "moe_bias_update_rate": 0.05},
                                          parallel={"ep": 2, "tp": 2, "sequence_parallel": True},
                                          train={"global_batch_size": 16, "eps": 1e-6}),
}


@pytest.mark.parametrize("grid", list(TP_GRIDS))
def test_tensor_parallel_stages_match_single_process(ray_session, tmp_path, grid):
    """Each stage cell split over tp=2 workers: the loss, every gradient (gathered whole), the
    gradient norm and the weights after each step equal the single-process model's, over the
    split backward of ZB-H1 and then 1F1B."""
    from test_pipeline_equivalence import run_plan

    def holds_slices(group, ref):
        # A cell's tp workers are a placement group of their own, kept on one node: placed
        # STRICT_PACK, or kept from an earlier group (`runtime.keep_workers`) whose bundles share a node.
        import ray

        cells = [group.slots[r][0].id.hex() for r in range(0, group.grid.size, 2)]
        assert [s[0].id.hex() for s in group.slots] == [c for c in cells for _ in range(2)]
        for slot in group.slots:
            table = ray.util.placement_group_table(slot[0])
            assert table["strategy"] == "STRICT_PACK" or len(set(table["bundles_to_node_id"].values())) == 1
        # Each replica's tp workers hold the model once, but for the norms every one holds
        # whole: not a copy of their stage each. (ep > 1: the dense parts are on every ep rank;
        # MoE layers are whole on every tp rank.)
        if group.grid.ep > 1 or group.cfg.model.n_experts:
            return
        whole = ref.parameters()
        norms = sum(t.numel() for name, t in whole.items() if "norm" in name)
        held = [i["parameters"] for r, i in enumerate(group.info) if group.grid.coord(r).dp == 0]
        assert str(group.grid).endswith(" x tp=2") and len(held) == group.grid.pp * 2
        assert sum(held) == sum(t.numel() for t in whole.values()) + norms

    run_plan(tmp_path, TP_GRIDS[grid], TP_PLAN, check_group=holds_slices)


def test_tensor_parallel_config_names_what_is_not_built(tmp_path):
    from raypar.config import ConfigError, load_config

    # Two key/value heads over tp=4: attention splits the model dimension instead (no error).
    assert load_config(None, ["model.n_heads=4", "model.n_kv_heads=2", "model.dim=64", "parallel.tp=4"]).parallel.tp == 4
    assert load_config(None, ["model.n_heads=4", "parallel.tp=2", "parallel.shard_optimizer=true",
                              "elastic.enabled=true"]).parallel.shard_optimizer
    with pytest.raises(ConfigError, match=r"parallel.tp=0 must be at least 1"):
        load_config(None, ["parallel.tp=0"])
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel=true splits the sequence .* parallel.tp=1"):
        load_config(None, ["parallel.sequence_parallel=true"])


@pytest.mark.slow
def test_a_run_split_over_tp_trains_as_the_run_without_and_its_checkpoint_loads_on_any_tp(ray_session, tmp_path):
    """The whole job (driver, schedule, records, saves) on dp=1 x pp=2 x tp=2 against pp=2
    alone: the same losses step by step. Its checkpoint after step 2 holds the global
    tensors, each tp worker's slices as pieces of them: resumed on tp=1 and on tp=4, the run
    goes on as the uninterrupted one."""
    from raypar.checkpoint import CheckpointReader
    from raypar.data import write_synthetic_corpus
    from raypar.driver.trainer import Trainer

    from helpers import last_loss_per_step, run_config

    write_synthetic_corpus(tmp_path / "data.parquet", 256, 8, 64, seed=1)

    def config(name, tp, **checkpoint):
        return run_config(tmp_path, name, (1, 2, 1), 4, {"n_layers": 4}, parallel={"tp": tp},
                          checkpoint={"every": 2, **checkpoint})

    runs = {tp: Trainer(config(f"tp{tp}", tp)).fit() for tp in (1, 2)}
    assert runs[2].grid == "dp=1 x pp=2 x ep=1 x tp=2"
    got, want = last_loss_per_step(runs[2]), last_loss_per_step(runs[1])
    assert [got[s] for s in range(4)] == pytest.approx([want[s] for s in range(4)], rel=1e-5)

    saved = tmp_path / "tp2" / "ckpt" / "step-000000002"
    with CheckpointReader(saved) as split, CheckpointReader(tmp_path / "tp1" / "ckpt" / "step-000000002") as whole:
        state = lambda reader: {n for n in reader.names() if not n.startswith("rng.")}  # noqa: E731
        assert state(split) == state(whole)  # the same global tensors; RNG states by rank
        for name in whole.names():
            if not name.startswith("rng."):
                # fp32 sums in another order, through two AdamW steps: ~1e-6 of weights ~0.1.
                torch.testing.assert_close(split.read(name), whole.read(name), rtol=1e-4, atol=1e-5, msg=name)
    for tp in (1, 4):
        resumed = Trainer(config(f"resumed-tp{tp}", tp, resume=str(saved))).fit()
        got = last_loss_per_step(resumed)
        assert sorted(got) == [2, 3]
        assert [got[s] for s in (2, 3)] == pytest.approx([want[s] for s in (2, 3)], rel=1e-5), tp


def test_a_killed_tensor_parallel_worker_comes_back_from_memory_as_the_uninterrupted_run(ray_session, tmp_path):
    """elastic with dp=2 x tp=2 and the sharded optimizer: a tp worker killed after step 3
    comes back from the states in memory (its own copy in shared memory, every tp slice and
    every dp rank's flat share of one named as such, put together and joined on load), at
    most one step redone, and the run ends with the uninterrupted one's losses. (tp=2 x pp=2
    without sharding: the test below.)"""
    from raypar.data import write_synthetic_corpus
    from raypar.driver.trainer import Trainer

    from helpers import KillWorker, last_loss_per_step, run_config

    write_synthetic_corpus(tmp_path / "data.parquet", 256, 8, 64, seed=1)

    def config(name):
        return run_config(tmp_path, name, (2, 1, 1), 6, {"n_layers": 4},
                          parallel={"tp": 2, "shard_optimizer": True, "grad_bucket_mb": 0.02},
                          elastic={"enabled": True, "resource_timeout_s": 10.0, "memory_every": 1})

    reference = Trainer(config("reference")).fit()
    trainer = Trainer(config("killed"), callbacks=[KillWorker(3, 1)])
    summary = trainer.fit()
    event = summary.recoveries[0]
    assert (event["source"], event["grid"]) == ("memory", "dp=2 x pp=1 x ep=1 x tp=2"), event
    assert event["steps_lost"] <= 1 and event["workers_kept"] == 3, event
    # Each worker fetched the states of its own tp rank (its slices' flat shares are spread
    # over the two dp ranks), not its tp peer's: 2 of the 4 offered.
    assert [load["states"] for load in trainer.loaded] == [2, 2, 2, 2], trainer.loaded
    got, want = last_loss_per_step(summary), last_loss_per_step(reference)
    assert [got[s] for s in range(6)] == pytest.approx([want[s] for s in range(6)], rel=1e-5)


def test_a_recovery_where_no_node_holds_a_cell_goes_on_at_a_smaller_tp(ray_session, tmp_path, monkeypatch):
    """tp=2 x pp=2 loses a worker, and (as when the only node with room for a cell is gone) no
    live node holds two workers: the planner drops tp to 1 (pp takes the workers), the copies
    in memory, tp slices of the old grid, are joined and restored whole, and the run ends with
    the uninterrupted one's losses. One node here: the nodes' room is what the test sets."""
    from raypar.data import write_synthetic_corpus
    from raypar.driver.controller import Controller
    from raypar.driver.trainer import Trainer

    from helpers import KillWorker, last_loss_per_step, run_config

    write_synthetic_corpus(tmp_path / "data.parquet", 256, 8, 64, seed=1)

    def config(name):
        return run_config(tmp_path, name, (1, 2, 1), 6, {"n_layers": 4}, parallel={"tp": 2},
                          elastic={"enabled": True, "resource_timeout_s": 10.0, "memory_every": 1, "grow": False})

    reference = Trainer(config("reference")).fit()
    kill = KillWorker(3, 1)
    monkeypatch.setattr(Controller, "_node_room", lambda self: 1 if kill.killed_at is not None else None)
    summary = Trainer(config("killed"), callbacks=[kill]).fit()
    event = summary.recoveries[0]
    assert (event["failed_grid"], event["grid"]) == ("dp=1 x pp=2 x ep=1 x tp=2", "dp=1 x pp=4 x ep=1"), event
    assert event["source"] == "memory" and event["steps_lost"] <= 1, event
    got, want = last_loss_per_step(summary), last_loss_per_step(reference)
    assert [got[s] for s in range(6)] == pytest.approx([want[s] for s in range(6)], rel=1e-5)


def test_a_cell_whose_tp_workers_span_nodes_is_found():
    from raypar.topology import Coord, Grid, cells_across_nodes

    grid = Grid(dp=1, pp=2, ep=1, tp=2)
    assert cells_across_nodes(grid, ["a", "a", "b", "b"]) == {}
    assert cells_across_nodes(grid, ["a", "a", "a", "b"]) == {Coord(0, 1, 0, 0): ["a", "b"]}
    assert cells_across_nodes(Grid(dp=2), ["a", "b"]) == {}  # tp=1: a cell is one worker
