"""Schedules of several model chunks per stage: layouts, the IR, generators and simulator."""
from __future__ import annotations

import pytest

from raypar.config import ConfigError, load_config
from raypar.driver.policies import plan_grid
from raypar.schedule import (Action, Layout, Op, ScheduleError, build_programs, compute_orders, format_program, lower,
                             parse_program, prepare, schedule_fits, schedule_layout, simulate)


def timed(schedule: str, p: int, m: int, chunks: int | None = None, t_w: float | None = None):
    """Simulated at a whole stage's F = 1, B = 2 (each chunk's unit 1 / v of it)."""
    layout = schedule_layout(schedule, p, chunks)
    v = layout.n_chunks
    programs = prepare(build_programs(schedule, p, m, chunks=chunks), layout)
    return simulate(programs, t_f=1 / v, t_b=2 / v, t_w=None if t_w is None else t_w / v)


def one_f_one_b(p: int, m: int):
    return simulate(build_programs("1f1b", p, m), t_f=1.0, t_b=2.0)


# --- layouts ------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", ["loop", "v"])
@pytest.mark.parametrize("p, v", [(1, 2), (2, 2), (3, 3), (4, 2)])
def test_layout_places_every_virtual_stage_once(placement, p, v):
    layout = Layout(p, v, placement)
    places = [layout.place(k) for k in range(p * v)]
    assert sorted(places) == [(a, c) for a in range(p) for c in range(v)]
    for k, (a, c) in enumerate(places):
        assert layout.virtual(a, c) == k
        assert layout.next(a, c) == (places[k + 1] if k + 1 < p * v else None)
        assert layout.prev(a, c) == (places[k - 1] if k else None)


def test_loop_and_v_placements():
    loop, v = Layout(4, 2, "loop"), Layout(4, 2, "v")
    assert [loop.place(k) for k in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)]
    assert [v.place(k) for k in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]
    # A loop wraps from the last stage to the first; a V turns on the last stage, in memory.
    assert loop.forward_links() == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert v.forward_links() == [(0, 1), (1, 2), (2, 3), (3, 2), (2, 1), (1, 0)]
    assert [s for s in range(4) if loop.holds_data(s)] == [0, 3] and [s for s in range(4) if v.holds_data(s)] == [0]
    with pytest.raises(ScheduleError, match="unknown chunk placement 'zigzag'"):
        Layout(2, 2, "zigzag")


def test_actions_name_their_chunk_and_print_it():
    text = "RECV_F0c1<-1 F0c1 I0c1 SEND_B0c1->1 W0c1 F1 SEND_F1->1 RELEASE_OUT1 REDUCE_GRAD STEP"
    program = parse_program(text)
    assert program[1] == Action(Op.F, 0, chunk=1) and program[1].key == (1, 0)
    assert program[0] == Action(Op.RECV_F, 0, 1, 1)
    assert format_program(program) == text
    with pytest.raises(ScheduleError, match="STEP is once per step for the whole stage and takes no chunk"):
        Action(Op.STEP, chunk=1)
    with pytest.raises(ScheduleError, match="chunk index >= 0"):
        Action(Op.F, 0, chunk=-1)


# --- generators against the formulas --------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_interleaved_bubble_is_a_vth_of_1f1bs(p, v, groups):
    """(p - 1) / (v m) of the work (Narayanan et al., SC'21), against 1F1B's (p - 1) / m."""
    m = p * groups
    result = timed("interleaved-1f1b", p, m, chunks=v)
    work = 3 * m
    assert (result.makespan - work) / work == pytest.approx((p - 1) / (v * m))
    assert (one_f_one_b(p, m).makespan - work) / work == pytest.approx((p - 1) / m)
    # Chunk micro-batches live at most: the warm-up's forwards plus the one in flight.
    assert max(result.peak_live) <= min(2 * (p - 1) + (v - 1) * p + 1, m * v)


@pytest.mark.parametrize("p", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16, 32])
def test_zb_v_holds_1f1bs_peak_with_a_smaller_bubble(p, m):
    result = timed("zb-v", p, m, t_w=1.0)  # F = I = W
    base = one_f_one_b(p, m)
    h1 = simulate(build_programs("zb-h1", p, m), t_f=1.0, t_b=2.0, t_w=1.0)
    # Two chunk micro-batches hold what one stage micro-batch does.
    assert max(result.peak_live) <= 2 * max(base.peak_live)
    assert result.makespan <= h1.makespan + 1e-9
    if p > 1 and m >= 2 * p:
        assert result.makespan - 3 * m <= 0.5 * (h1.makespan - 3 * m) + 1e-9  # at most half of ZB-H1's bubble


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [4, 8, 16, 32])
def test_zb_v_half_holds_about_half_of_1f1bs_peak(p, m):
    """(p + 1) / (2 p) of 1F1B's first stage's activations. The capped list scheduler beats
    1F1B's step where micro-batches are few against stages; with many more its steady state
    runs a little slower (at 2 stages and 32 micro-batches 6%)."""
    result = timed("zb-v-half", p, m, t_w=1.0)
    base = one_f_one_b(p, m)
    assert max(result.peak_live) <= p + 1  # chunk micro-batches, each half a stage micro-batch
    if p >= 3 and m <= 4 * p or m <= p:
        assert result.makespan < base.makespan
    assert result.makespan <= 1.07 * base.makespan


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v", "zb-v-half"])
@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 10, 15])
def test_chunked_programs_are_valid_and_complete(schedule, p, m):
    if schedule_fits(schedule, p, m, n_layers=64) is not None:
        with pytest.raises(ScheduleError, match="multiple of it"):
            build_programs(schedule, p, m)
        return
    layout = schedule_layout(schedule, p)
    programs = build_programs(schedule, p, m)  # validated: no deadlock, no misorder
    for s, program in enumerate(programs):
        for c in range(layout.n_chunks):
            forwards = [a.mb for a in program if a.op is Op.F and a.chunk == c]
            assert forwards == list(range(m)), (s, c)
        # A hand-over between chunks of one stage is never a send.
        assert all(a.peer != s for a in program if a.is_comm)


def test_zb_v_turns_in_memory_on_the_last_stage():
    last = build_programs("zb-v", 2, 2)[1]
    text = format_program(last)
    assert "F0 F0c1 SEND_F0c1->0" in text  # chunk 1 reads chunk 0's output without a receive
    assert "I0c1 I0 SEND_B0->0" in text  # and chunk 0's backward reads chunk 1's input gradient


def test_a_send_between_chunks_of_one_stage_is_rejected():
    layout = Layout(2, 2, "v")
    programs = lower(compute_orders("zb-v", layout, 1), layout=layout)
    programs[1].insert(programs[1].index(Action(Op.F, 0, chunk=1)), Action(Op.RECV_F, 0, 1, 1))
    with pytest.raises(ScheduleError, match="exchanges with chunk 0 of its own stage"):
        prepare(programs, layout)


def test_misordered_chunks_are_reported_in_context():
    layout = Layout(2, 2, "loop")
    orders = compute_orders("interleaved-1f1b", layout, 2)
    orders[0].remove(Action(Op.F, 0, chunk=1))
    orders[0].insert(0, Action(Op.F, 0, chunk=1))
    with pytest.raises(ScheduleError) as error:
        prepare(lower(orders, layout=layout), layout)
    message = str(error.value)
    assert "stage 0 sends F0 of virtual stage 2 to stage 1 as message #0 but stage 1 expects F0 of virtual stage 0" \
        in message
    assert "\n  stage 0: RECV_F0c1<-1 F0c1 SEND_F0c1->1" in message  # the programs, in context


# --- choosing the layout: errors that name what would work -----------------------------------


def test_schedule_layout_errors():
    with pytest.raises(ScheduleError, match="'1f1b' runs one model chunk per stage, not 2"):
        schedule_layout("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="'zb-v' runs exactly 2 model chunks per stage, not 3"):
        schedule_layout("zb-v", 2, 3)
    with pytest.raises(ScheduleError, match="at least 2 model chunks"):
        schedule_layout("interleaved-1f1b", 2, 1)
    assert schedule_layout("interleaved-1f1b", 2, 3) == Layout(2, 3, "loop")
    with pytest.raises(ScheduleError, match="microbatches=6 is not a multiple of it; use 4 or 8"):
        build_programs("interleaved-1f1b", 4, 6)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.schedule=1f1b", "parallel.chunks=2"], "runs one model chunk per stage"),
    (["parallel.schedule=interleaved-1f1b", "parallel.microbatches=3", "train.global_batch_size=12"],
     "groups of pp=2: 3 micro-batches is not a multiple"),
    (["parallel.schedule=zb-v", "parallel.pp=4"], "4 stages x 2 chunks = 8 virtual stages .* the model has 4 layers"),
    (["parallel.schedule=zb-v", "parallel.layers_per_stage=[2,2]"],
     r"layers_per_stage has 2 entries but parallel.pp=2 x 2 chunks = 4 virtual stages"),
])
def test_config_rejects_chunkings_that_cannot_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.yaml", overrides)


def test_elastic_plans_only_grids_the_schedule_can_run():
    """A shrink keeps interleaved 1F1B's micro-batches a multiple of the new pipeline depth."""
    cfg = load_config("configs/tiny.yaml", ["parallel.schedule=interleaved-1f1b", "parallel.pp=4", "parallel.dp=1",
                                             "model.n_layers=8", "parallel.microbatches=4",
                                             "train.global_batch_size=16"])
    plan = plan_grid(cfg, workers=3)
    assert plan is not None and plan.microbatches % plan.grid.pp == 0
    assert schedule_fits("interleaved-1f1b", plan.grid.pp, plan.microbatches, 8) is None


# --- what a user sees: raypar plan and timelines -----------------------------------------------


def test_plan_prints_every_cut_on_one_scale(capsys):
    from raypar.driver.cli import main as cli_main

    assert cli_main(["plan", "--config", "configs/tiny.yaml", "parallel.pp=2", "parallel.microbatches=8"]) == 0
    out = capsys.readouterr().out
    every = {"fthenb", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "zb-v-half"}
    rows = {line.split()[0]: float(line.split()[1]) for line in out.splitlines() if line.split()[:1]
            and line.split()[0] in every}
    assert set(rows) == every and min(rows.values()) == 1.0  # one scale: the fastest of all is 1.000
    assert sum("<- chosen" in line for line in out.splitlines()) == 1


def test_a_zb_v_run_shows_its_chunks_in_plan_and_timeline(ray_session, tmp_path, capsys):
    from raypar.driver.cli import main as cli_main
    from raypar.driver.trainer import Trainer
    from raypar.timeline import chrome_trace, load_step

    run = tmp_path / "run"
    cfg = load_config("configs/tiny.yaml", ["parallel.schedule=zb-v", "train.steps=3", f"runtime.run_dir={run}",
                                            "runtime.metrics=off", "runtime.cpus_per_worker=0.25"])
    Trainer(cfg, log=lambda m: None).fit()
    # From a run of two chunks per stage, every cut is predicted: its costs carried over to the others.
    assert cli_main(["plan", "--from-run", str(run)]) == 0
    out = capsys.readouterr().out
    assert "with zb-v" in out and "interleaved-1f1b" in out and "1f1b " in out and "<- chosen" in out
    events = chrome_trace(load_step(run, 2))["traceEvents"]
    chunks = {(e["pid"], e["args"]["chunk"]) for e in events if e.get("ph") == "X" and e["cat"] == "forward"}
    assert chunks == {(0, 0), (0, 1), (1, 0), (1, 1)}  # both stages run both chunks
    assert any(e["name"] == "F0c1" for e in events if e.get("ph") == "X")
