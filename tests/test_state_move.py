"""Planning a move of the state to another cut on the devices (`raypar.runtime.state_move`):
who sends what to whom. The moves themselves run in tests/test_schedule_switch.py."""
from __future__ import annotations

import pytest

from raypar.runtime.state_move import MoveFailed, moved_bytes, plan_move


def fp32(*shape: int) -> tuple[str, tuple[int, ...]]:
    return "float32", shape


def test_each_tensor_is_read_in_place_where_the_worker_holds_it():
    held = [{"a": fp32(4), "master.a": fp32(4), "rng.rank0.cpu": ("uint8", (8,))},
            {"b": fp32(2, 2), "rng.rank1.cpu": ("uint8", (8,))}]
    plan = plan_move(held, [{"a", "b", "rng.rank0.cpu"}, {"master.a", "rng.rank1.cpu"}])
    assert plan == [[("a", 0), ("b", 1), ("rng.rank0.cpu", 0)], [("master.a", 0), ("rng.rank1.cpu", 1)]]
    assert moved_bytes(plan, held) == (16 + 8 + 8, 16 + 16)


def test_replicas_share_the_sending_and_every_piece_of_a_tensor_goes():
    """Two dp replicas hold `w` whole; the third worker's new stage needs it and the
    optimizer shares' pieces of its moment (`@start`), held one by each replica."""
    held = [{"w": fp32(8), "optim.exp_avg.w@0": fp32(4), "x": fp32(8)},
            {"w": fp32(8), "optim.exp_avg.w@4": fp32(4), "x": fp32(8)},
            {}]
    plan = plan_move(held, [set(), set(), {"w", "x", "optim.exp_avg.w"}])
    assert plan[2] == [("optim.exp_avg.w@0", 0), ("optim.exp_avg.w@4", 1), ("w", 0), ("x", 1)]


def test_a_tensor_no_worker_holds_is_an_error_before_anything_moves():
    with pytest.raises(MoveFailed, match=r"worker 1's new stage needs 1 tensors no worker holds \(first: \['c'\]\)"):
        plan_move([{"a": fp32(1)}, {"b": fp32(1)}], [{"a"}, {"b", "c"}])
