"""Host snapshots of a worker's state: buffers reserved ahead from the expected layout are
the ones the first save copies into, and later saves reuse them."""
import threading

import pytest
import torch
from torch import nn

from raypar.config import TrainConfig
from raypar.optim import MasterOptimizer
from raypar.runtime.snapshot import StateSnapshot
from raypar.runtime.state import load_state, rng_states, state_layout, state_tensors
from raypar.topology import Grid


class TwoLayers(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.a = nn.Linear(6, 5, dtype=dtype)
        self.b = nn.Linear(5, 3, bias=False, dtype=dtype)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def trained(dtype: torch.dtype) -> tuple[nn.Module, MasterOptimizer]:
    torch.manual_seed(0)
    model = TwoLayers(dtype)
    opt = MasterOptimizer(model, TrainConfig(lr=1e-2, warmup_steps=0))
    model(torch.randn(4, 6, dtype=dtype)).float().pow(2).mean().backward()
    opt.step(0, total_norm=1.0)
    return model, opt


def layout_before_first_step(dtype: torch.dtype, **options):
    torch.manual_seed(0)
    model = TwoLayers(dtype)
    return state_layout(MasterOptimizer(model, TrainConfig()), Grid(1, 1, 1).coord(0), **options)


def test_layout_known_before_the_first_step_matches_the_state_after_it():
    for dtype in (torch.bfloat16, torch.float32):
        for options in ({}, {"save_optimizer": False}, {"save_master": False}):
            model, opt = trained(dtype)
            state = state_tensors(model, opt, Grid(1, 1, 1).coord(0), 0, torch.device("cpu"), **options)
            expected = {n: (t.shape, t.dtype) for n, t in state.items() if not n.startswith("rng.")}
            assert layout_before_first_step(dtype, **options) == expected, (dtype, options)


def test_state_made_at_start_updates_as_adamws_own():
    """AdamW's moments are made when the optimizer is (not at its first step): three steps
    give the same weights, moments and step counts as torch.optim.AdamW(fused=True) making
    them itself at its first step."""
    for dtype in (torch.bfloat16, torch.float32):
        model, opt = trained(dtype)
        assert all(len(opt.optimizer.state[m]) == 3 for m in opt.master)
        torch.manual_seed(0)
        ref = TwoLayers(dtype)
        cfg = TrainConfig(lr=1e-2, warmup_steps=0)
        ref_opt = MasterOptimizer(ref, cfg)
        ref_opt.optimizer = torch.optim.AdamW(
            [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in ref_opt.optimizer.param_groups],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)
        torch.manual_seed(0)
        TwoLayers(dtype)  # the same draws as trained()'s model
        ref(torch.randn(4, 6, dtype=dtype)).float().pow(2).mean().backward()
        ref_opt.step(0, total_norm=1.0)
        for step in (1, 2):
            x = torch.randn(4, 6, dtype=dtype)
            for m, o in ((model, opt), (ref, ref_opt)):
                m(x).float().pow(2).mean().backward()
                o.step(step, total_norm=1.0)
        for m, r in zip(opt.master, ref_opt.master):
            assert torch.equal(m, r)
            for key, value in opt.optimizer.state[m].items():
                assert torch.equal(value, ref_opt.optimizer.state[r][key]), key
        assert float(opt.optimizer.state[opt.master[0]]["step"]) == 3


def test_a_load_without_optimizer_state_starts_adamw_fresh():
    model, opt = trained(torch.bfloat16)
    saved = state_tensors(model, opt, None, 0, torch.device("cpu"), save_optimizer=False)
    missing = load_state(opt, saved.__getitem__, set(saved), None, torch.device("cpu"), threads=1)
    assert missing == [n for n, _ in opt.named_params]
    for m in opt.master:
        assert all(not t.any() for t in opt.optimizer.state[m].values())


def take(snap: StateSnapshot, step: int, model, opt, **options) -> dict[str, torch.Tensor]:
    """A snapshot as a stage takes it; returns what it should hold (clones of the state now)."""
    coord = Grid(1, 1, 1).coord(0)
    collect = lambda: state_tensors(model, opt, coord, 0, torch.device("cpu"), with_rng=False, **options)  # noqa: E731
    snap.begin(step, collect, rng_states(0, torch.device("cpu")), cuda=False)
    return {n: t.clone() for n, t in state_tensors(model, opt, coord, 0, torch.device("cpu"), **options).items()}


def test_reserved_buffers_are_used_and_kept_across_snapshots():
    model, opt = trained(torch.bfloat16)
    snap = StateSnapshot()
    snap.reserve(state_layout(opt, Grid(1, 1, 1).coord(0)), pin=False)
    expected = take(snap, 1, model, opt)
    got = snap.host_tensors()
    reserved = {n: b.data_ptr() for n, b in snap._buffers.items() if not n.startswith("rng.")}
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(got[name], t), name
    assert all(got[n].data_ptr() == reserved[n] for n in reserved)
    # A weights-only snapshot (an EMA update) holds fewer tensors and leaves the others'
    # buffers for the next full save.
    weights = take(snap, 2, model, opt, save_optimizer=False, save_master=False)
    assert snap.host_tensors().keys() == weights.keys()
    take(snap, 3, model, opt)
    snap.wait()
    assert {n: b.data_ptr() for n, b in snap._buffers.items() if n in reserved} == reserved


def test_copies_issued_by_the_export_or_the_next_optimizer_step_hold_the_marked_state():
    model, opt = trained(torch.float32)
    snap = StateSnapshot()
    # Issued by the next step's optimizer (no export came first): before it writes.
    expected = take(snap, 1, model, opt)
    snap.wait()
    model(torch.randn(4, 6)).pow(2).mean().backward()
    opt.step(1, total_norm=1.0)
    got = snap.host_tensors()
    for name, t in expected.items():
        assert torch.equal(got[name], t), name
    # Issued by the export thread while the step thread waits to write.
    expected = take(snap, 2, model, opt)
    exported: dict = {}
    thread = threading.Thread(target=lambda: exported.update(snap.host_tensors()))
    thread.start()
    snap.wait()
    opt.step(2, total_norm=1.0)
    thread.join()
    for name, t in expected.items():
        assert torch.equal(exported[name], t), name
    assert not torch.equal(exported["a.weight"], model.a.weight.detach())  # the step did move on


def test_released_buffers_serve_the_next_stage_of_the_process():
    """A worker kept after a failure hands its pinned buffers to its next stage: those whose
    name, shape and dtype match are used again, the others are dropped."""
    model, opt = trained(torch.bfloat16)
    coord = Grid(1, 1, 1).coord(0)
    layout = state_layout(opt, coord)
    old = StateSnapshot()
    old.reserve(layout, pin=False)
    take(old, 1, model, opt)
    old.wait()
    kept = {n: b.data_ptr() for n, b in old._buffers.items() if n in layout}
    released = old.release()
    assert old._buffers == {} and set(kept) <= set(released)
    # The next stage saves no optimizer state: its layout is a part of the old one.
    smaller = state_layout(opt, coord, save_optimizer=False)
    new = StateSnapshot(released)
    new.reserve(smaller, pin=False)
    expected = take(new, 2, model, opt, save_optimizer=False)
    got = new.host_tensors()
    assert set(new._buffers) == set(smaller) | {n for n in got if n.startswith("rng.")}
    for name in smaller:
        assert got[name].data_ptr() == kept[name] and torch.equal(got[name], expected[name]), name


def test_read_ahead_keeps_the_order_and_raises_what_a_read_raised():
    from raypar.runtime.state import read_ahead

    def read(name: str) -> torch.Tensor:
        if name == "bad":
            raise KeyError(name)
        return torch.full((2,), float(name))

    names = [str(i) for i in range(40)]
    assert [float(t[0]) for t in read_ahead(read, names, threads=4)] == [float(n) for n in names]
    values = read_ahead(read, ["1", "bad", "3"], threads=2)
    assert float(next(values)[0]) == 1.0
    with pytest.raises(KeyError):
        next(values)


@pytest.mark.parametrize("moe", [False, True])
def test_a_standbys_buffers_serve_whichever_stage_it_takes_over(tmp_path, moe):
    """A standby pins buffers before it knows its stage (`snapshot_shapes_for_any_stage`):
    every stage's layout is then served by them, by shape and dtype, with nothing allocated,
    and they hold less than the whole model's state."""
    from helpers import tiny_config

    from raypar.model import build_stage
    from raypar.runtime.snapshot import pinned_buffers
    from raypar.runtime.state import snapshot_shapes_for_any_stage

    model_cfg = {"dtype": "bfloat16", "n_layers": 5}
    if moe:
        model_cfg.update(n_experts=4, moe_every=2)
    cfg = tiny_config(tmp_path, model=model_cfg, parallel={"pp": 3, "ep": 2 if moe else 1})
    grid = Grid(1, 3, cfg.parallel.ep)
    shapes = snapshot_shapes_for_any_stage(cfg, grid)
    whole = 0
    for stage in range(grid.pp):
        rank = next(r for r in range(grid.size) if grid.coord(r).pp == stage and grid.coord(r).ep == 0)
        model = build_stage(cfg.model, stage, grid.pp, ep_rank=0, ep_size=grid.ep)
        layout = state_layout(MasterOptimizer(model, cfg.train), grid.coord(rank))
        whole += len(layout)
        spares = pinned_buffers(shapes, pin=False)
        snap = StateSnapshot(spares)
        snap.reserve(layout, pin=False)
        snap._reserving.join()
        assert {n: (b.shape, b.dtype) for n, b in snap._buffers.items()} == layout
        assert {b.data_ptr() for b in snap._buffers.values()} <= {b.data_ptr() for b in spares.values()}
    assert len(shapes) < whole
