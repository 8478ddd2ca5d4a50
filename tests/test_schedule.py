"""Tests for raypar.schedule: generators, lowering, and the NCCL-semantics simulator."""
from __future__ import annotations

import pytest

from raypar.schedule import (
    SCHEDULES,
    Action,
    Op,
    ScheduleError,
    build_programs,
    comm_groups,
    format_program,
    get_schedule,
    lower,
    one_f_one_b,
    parse_program,
    simulate,
    validate,
)

STAGES = [1, 2, 3, 4, 8]
MICROBATCHES = [1, 2, 4, 8, 16]
SCHEDULE_NAMES = ["fthenb", "1f1b"]


def programs_of(*texts: str) -> list[list[Action]]:
    return [parse_program(t) for t in texts]


# --- bubble and memory -------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_bubble_and_peak_live(schedule: str, p: int, m: int) -> None:
    programs = build_programs(schedule, p, m)
    for t_b in (2.0, 1.0):
        result = simulate(programs, t_f=1.0, t_b=t_b)
        assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert result.makespan == pytest.approx((m + p - 1) * (1.0 + t_b))
        assert result.busy == pytest.approx([m * (1.0 + t_b)] * p)
    expected_live = [m] * p if schedule == "fthenb" else [min(p - s, m) for s in range(p)]
    assert result.peak_live == expected_live


def test_heterogeneous_durations_timing() -> None:
    # Worked by hand: stage 1 is twice as slow; stage 0's B0 waits for stage 1's SEND_B0 at t=9.
    programs = build_programs("fthenb", 2, 2)
    result = simulate(programs, t_f=[1.0, 2.0], t_b=[2.0, 4.0])
    assert result.makespan == pytest.approx(15.0)
    assert result.busy == pytest.approx([6.0, 12.0])
    assert result.stage_bubble == pytest.approx([1 - 6 / 15, 1 - 12 / 15])
    assert result.bubble_fraction == pytest.approx(1 - 18 / 30)
    b0 = [(start, end) for a, start, end in result.timeline[0] if a == Action(Op.B, 0)]
    assert b0 == [(9.0, 11.0)]


def test_comm_time_lengthens_makespan() -> None:
    programs = build_programs("1f1b", 4, 8)
    assert simulate(programs, t_comm=0.5).makespan > simulate(programs).makespan
    with pytest.raises(ScheduleError, match="t_f has 2 per-stage durations for 4 stages"):
        simulate(programs, t_f=[1.0, 1.0])


# --- program shape -----------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
@pytest.mark.parametrize("p,m", [(1, 3), (2, 1), (3, 4), (4, 8), (8, 3)])
def test_program_shape(schedule: str, p: int, m: int) -> None:
    programs = build_programs(schedule, p, m)
    assert len(programs) == p
    for s, program in enumerate(programs):
        for op in (Op.F, Op.B):
            assert sorted(a.mb for a in program if a.op is op) == list(range(m))
        assert program[-2:] == [Action(Op.REDUCE_GRAD), Action(Op.STEP)]
        assert sum(a.op in (Op.REDUCE_GRAD, Op.STEP) for a in program) == 2
        for a in program:
            if a.op in (Op.SEND_F, Op.RECV_B):
                assert a.peer == s + 1
            elif a.op in (Op.RECV_F, Op.SEND_B):
                assert a.peer == s - 1


def test_1f1b_steady_state_pairs_send_f_with_recv_b() -> None:
    programs = build_programs("1f1b", 4, 8)
    for s in range(3):  # every stage that sends activations
        groups = [g for g in comm_groups(programs[s]) if g[0].is_comm]
        paired = [g for g in groups if {a.op for a in g} == {Op.SEND_F, Op.RECV_B}]
        # Every forward after the warmup pairs its send with the next backward's receive.
        assert len(paired) == 8 - (4 - 1 - s)
    # Middle stages also pair the gradient send with the next activation receive.
    middle = [g for g in comm_groups(programs[1]) if {a.op for a in g} == {Op.SEND_B, Op.RECV_F}]
    assert middle


def test_comm_groups_batches_only_adjacent_comm() -> None:
    program = parse_program("F0 SEND_F0->1 RECV_B0<-1 RELEASE_OUT0 B0 STEP")
    assert comm_groups(program) == [
        (Action(Op.F, 0),),
        (Action(Op.SEND_F, 0, 1), Action(Op.RECV_B, 0, 1)),
        (Action(Op.RELEASE_OUT, 0),),
        (Action(Op.B, 0),),
        (Action(Op.STEP),),
    ]


@pytest.mark.parametrize("schedule", SCHEDULE_NAMES)
def test_releases(schedule: str) -> None:
    p, m = 4, 6
    with_release = build_programs(schedule, p, m, release=True)
    without = build_programs(schedule, p, m, release=False)
    for s in range(p):
        assert not any(a.is_release for a in without[s])
        program = with_release[s]
        outs = sorted(a.mb for a in program if a.op is Op.RELEASE_OUT)
        ins = sorted(a.mb for a in program if a.op is Op.RELEASE_IN)
        assert outs == (list(range(m)) if s < p - 1 else [])
        assert ins == (list(range(m)) if s > 0 else [])
        # Removing releases gives back the release-free program, so they only add.
        assert [a for a in program if not a.is_release] == without[s]
        for i, a in enumerate(program):
            if a.is_release:
                # Never inside a comm run (it would split one batched p2p call in two) ...
                assert not (program[i - 1].is_comm and program[i + 1].is_comm)
                # ... but right after the run holding its send (other releases may sit between).
                j = i - 1
                while program[j].is_release:
                    j -= 1
                run = []
                while j >= 0 and program[j].is_comm:
                    run.append(program[j])
                    j -= 1
                send = Op.SEND_F if a.op is Op.RELEASE_OUT else Op.SEND_B
                assert any(c.op is send and c.mb == a.mb for c in run), (s, i, format_program(program))
    assert not any(a.is_release for a in build_programs(schedule, 1, 4)[0])


def test_generators() -> None:
    assert format_program(one_f_one_b(3, 4)[0]) == "F0 F1 F2 B0 F3 B1 B2 B3"
    assert format_program(one_f_one_b(3, 4)[2]) == "F0 B0 F1 B1 F2 B2 F3 B3"
    assert format_program(get_schedule("fthenb")(2, 2)[1]) == "F0 F1 B0 B1"
    assert set(SCHEDULES) == {"fthenb", "1f1b", "zb-h1", "zb-h2"}
    for bad in [(0, 4), (2, 0), (-1, 1)]:
        with pytest.raises(ScheduleError, match=">= 1"):
            one_f_one_b(*bad)
    with pytest.raises(ScheduleError, match="compute-only"):
        lower([[Action(Op.F, 0), Action(Op.STEP)]])


def test_parse_program_round_trips() -> None:
    text = format_program(build_programs("1f1b", 3, 3)[1])
    assert format_program(parse_program(text)) == text
    with pytest.raises(ScheduleError, match="cannot parse"):
        parse_program("F0 SEND_F0<-1")
    with pytest.raises(ScheduleError, match="peer"):
        Action(Op.SEND_F, 0)


# --- rejections --------------------------------------------------------------------------


def test_unknown_schedule_lists_valid_names() -> None:
    with pytest.raises(ScheduleError, match="unknown schedule 'zb'") as err:
        build_programs("zb", 2, 2)
    assert "1f1b" in str(err.value) and "fthenb" in str(err.value)


def test_rejects_forward_before_its_receive() -> None:
    programs = programs_of(
        "F0 SEND_F0->1 RECV_B0<-1 B0",
        "F0 RECV_F0<-0 B0 SEND_B0->0",
    )
    with pytest.raises(ScheduleError, match=r"stage 1: F0 \(action #0\) runs before RECV_F0<-0") as err:
        validate(programs)
    assert "F0 RECV_F0<-0 B0 SEND_B0->0" in str(err.value)  # shows the program


def test_a_send_holds_up_no_compute_and_channels_are_independent() -> None:
    # Each stage posts a lone send that the other matches only after its own lone send. With
    # one communicator for both directions (sends and receives in one queue) this deadlocks;
    # each direction of a link has a communicator of its own, and a send waits in its channel
    # while the stage computes on: the same timing as the batched programs.
    lone = programs_of(
        "F0 SEND_F0->1 RELEASE_OUT0 F1 SEND_F1->1 RELEASE_OUT1 RECV_B0<-1 B0 RECV_B1<-1 B1",
        "RECV_F0<-0 F0 B0 SEND_B0->0 RELEASE_IN0 RECV_F1<-0 F1 B1 SEND_B1->0 RELEASE_IN1",
    )
    batched = programs_of(
        "F0 SEND_F0->1 RELEASE_OUT0 F1 SEND_F1->1 RECV_B0<-1 RELEASE_OUT1 B0 RECV_B1<-1 B1",
        "RECV_F0<-0 F0 B0 SEND_B0->0 RECV_F1<-0 RELEASE_IN0 F1 B1 SEND_B1->0 RELEASE_IN1",
    )
    assert validate(lone).makespan == pytest.approx(validate(batched).makespan)
    # Stage 0 runs F1 while its send of F0 waits for stage 1 to post the receive.
    late = programs_of("F0 SEND_F0->1 F1 SEND_F1->1 RECV_B0<-1 B0 RECV_B1<-1 B1",
                       "RECV_F0<-0 F0 B0 SEND_B0->0 RECV_F1<-0 F1 B1 SEND_B1->0")
    f1 = [start for a, start, _ in simulate(late).timeline[0] if a == Action(Op.F, 1)]
    assert f1 == [1.0]


def test_rejects_a_cycle_of_waits() -> None:
    # Stage 0 waits for a gradient before it sends the activation stage 1 needs to make it.
    programs = programs_of(
        "F0 RECV_B0<-1 B0 SEND_F0->1",
        "RECV_F0<-0 F0 B0 SEND_B0->0",
    )
    with pytest.raises(ScheduleError) as err:
        validate(programs)
    message = str(err.value)
    assert "deadlock: stage 0 waits at B0 for RECV_B0<-1, stage 1 waits at F0 for RECV_F0<-0" in message
    assert "stage 0: F0 RECV_B0<-1 B0 SEND_F0->1" in message  # shows the programs


def test_rejects_channel_order_mismatch() -> None:
    programs = programs_of(
        "F0 F1 SEND_F1->1 SEND_F0->1 RECV_B0<-1 B0 RECV_B1<-1 B1",
        "RECV_F0<-0 F0 RECV_F1<-0 F1 B0 SEND_B0->0 B1 SEND_B1->0",
    )
    expected = "stage 0 sends F1 to stage 1 as message #0 but stage 1 expects F0"
    with pytest.raises(ScheduleError, match=expected):
        validate(programs)


def test_rejects_unmatched_send() -> None:
    programs = programs_of(
        "F0 SEND_F0->1 F1 SEND_F1->1 RECV_B0<-1 B0 RECV_B1<-1 B1",
        "RECV_F0<-0 F0 B0 SEND_B0->0",
    )
    expected = "stage 0 sends F1 to stage 1 as message #1 but stage 1 posts only 1 F receive"
    with pytest.raises(ScheduleError, match=expected):
        validate(programs)


TWO_STAGE_OK = ("F0 SEND_F0->1 RECV_B0<-1 B0", "RECV_F0<-0 F0 B0 SEND_B0->0")


@pytest.mark.parametrize(
    "programs, expected",
    [
        (["F0 B0 B0"], r"stage 0: B0 \(action #2\) appears twice"),
        (["F0 F1 B0"], "stage 0: F1 .* has no matching B1"),
        (["B0 F0"], "stage 0: B0 .* runs before F0"),
        (["F0 STEP B0"], "stage 0: B0 .* comes after STEP"),
        (["F0 REDUCE_GRAD B0"], "stage 0: B0 .* runs after REDUCE_GRAD"),
        (["F0 B0 RECV_B0<-1 SEND_F0->1", TWO_STAGE_OK[1]], "stage 0: B0 .* runs before RECV_B0<-1"),
        (["SEND_F0->1 F0 RECV_B0<-1 B0", TWO_STAGE_OK[1]], "stage 0: SEND_F0->1 .* runs before F0"),
        ([TWO_STAGE_OK[0], "RECV_F0<-0 F0 SEND_B0->0 B0"], "stage 1: SEND_B0->0 .* runs before B0"),
        (
            ["F0 RELEASE_OUT0 SEND_F0->1 RECV_B0<-1 B0", TWO_STAGE_OK[1]],
            "stage 0: RELEASE_OUT0 .* runs before SEND_F0->1",
        ),
        (["F0 B0 RELEASE_IN0"], "stage 0: RELEASE_IN0 .* first stage"),
        (
            ["F0 SEND_F0->2 B0", "RECV_F0<-0 F0 B0"],
            r"stage 0: SEND_F0->2 .* peer stage 2, but programs were given for 2 stage\(s\)",
        ),
        (["RECV_F0<-0 F0 B0", "F0 B0"], "stage 0: RECV_F0<-0 .* previous stage, but stage 0 has none"),
        (
            [TWO_STAGE_OK[0] + " REDUCE_GRAD", TWO_STAGE_OK[1]],
            r"REDUCE_GRAD is collective over all stages, but stage\(s\) \[1\] lack it",
        ),
    ],
)
def test_rejects_local_ordering_errors(programs: list[str], expected: str) -> None:
    with pytest.raises(ScheduleError, match=expected):
        validate(programs_of(*programs))


def test_reduce_grad_is_a_barrier() -> None:
    # Stage 1 reduces before sending its last gradient: stage 0 can never reach REDUCE_GRAD.
    programs = programs_of(
        "F0 SEND_F0->1 RECV_B0<-1 B0 REDUCE_GRAD STEP",
        "RECV_F0<-0 F0 B0 REDUCE_GRAD SEND_B0->0 STEP",
    )
    with pytest.raises(ScheduleError) as err:
        validate(programs)
    message = str(err.value)
    assert "deadlock: stage 0 waits at B0 for RECV_B0<-1, stage 1 waits at REDUCE_GRAD" in message
    assert "REDUCE_GRAD needs stage(s) 0 to reach it" in message


# --- zero-bubble schedules (backward split into I and W) ---------------------------------


@pytest.mark.parametrize("schedule,cap", [("zb-h1", lambda p: p), ("zb-h2", lambda p: 2 * p - 1)])
@pytest.mark.parametrize("p", STAGES)
@pytest.mark.parametrize("m", MICROBATCHES)
def test_zero_bubble_programs(schedule: str, cap, p: int, m: int) -> None:
    programs = build_programs(schedule, p, m)
    for program in programs:
        assert not [a for a in program if a.op is Op.B]
        for op in (Op.F, Op.I, Op.W):
            assert sorted(a.mb for a in program if a.op is op) == list(range(m))
        for mb in range(m):  # W after its I, both before the reduction
            i, w = program.index(Action(Op.I, mb)), program.index(Action(Op.W, mb))
            assert i < w < program.index(Action(Op.REDUCE_GRAD))
    result = simulate(programs, t_f=1.0, t_b=2.0)  # F = I = W
    one_f_one_b_bubble = simulate(build_programs("1f1b", p, m), t_f=1.0, t_b=2.0).bubble_fraction
    assert max(result.peak_live) <= cap(p)
    assert result.bubble_fraction <= one_f_one_b_bubble + 1e-9
    if p > 1 and m >= 2 * p:
        assert result.bubble_fraction < 0.7 * one_f_one_b_bubble


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [8, 16, 32])
def test_zb_h1_has_a_third_of_1f1bs_bubble(p: int, m: int) -> None:
    """At F = I = W and m >= p every stage of ZB-H1 idles p - 1 units, against 1F1B's
    3 (p - 1) (Qi et al., ICLR 2024), and holds at most p micro-batches, as 1F1B's first."""
    h1 = simulate(build_programs("zb-h1", p, m), t_f=1.0, t_b=2.0, t_w=1.0)
    one_f_one_b = simulate(build_programs("1f1b", p, m), t_f=1.0, t_b=2.0)
    assert h1.makespan - 3 * m == pytest.approx(p - 1)
    assert one_f_one_b.makespan - 3 * m == pytest.approx(3 * (p - 1))
    assert max(h1.peak_live) == p


def test_zero_bubble_timing_by_hand() -> None:
    # Two stages, two micro-batches, F = I = W = 1. Stage 1: F0 1-2, I0 2-3 (its gradient
    # leaves at 3, not after a whole backward at 4), F1 3-4, I1 4-5, then W0 and W1 while
    # stage 0 runs I0 3-4, W0 4-5 (waiting for I1's gradient), I1 5-6, W1 6-7. 1F1B: 9.
    programs = build_programs("zb-h1", 2, 2)
    assert format_program(programs[1]) == ("RECV_F0<-0 F0 I0 SEND_B0->0 RECV_F1<-0 RELEASE_IN0 F1 I1 "
                                           "SEND_B1->0 RELEASE_IN1 W0 W1 REDUCE_GRAD STEP")
    result = simulate(programs, t_f=1.0, t_b=2.0, t_w=1.0)
    assert result.makespan == pytest.approx(7.0)
    assert simulate(build_programs("1f1b", 2, 2), t_f=1.0, t_b=2.0).makespan == pytest.approx(9.0)
    stage0 = [(str(a), start, end) for a, start, end in result.timeline[0] if a.is_compute]
    assert stage0 == [("F0", 0, 1), ("F1", 1, 2), ("I0", 3, 4), ("W0", 4, 5), ("I1", 5, 6), ("W1", 6, 7)]


def test_split_backward_rules() -> None:
    with pytest.raises(ScheduleError, match=r"W0 \(action #1\) runs before I0"):
        validate(programs_of("F0 W0 I0"))
    with pytest.raises(ScheduleError, match="has no matching B0 \\(or I0 and W0\\)"):
        validate(programs_of("F0 I0"))
    with pytest.raises(ScheduleError, match="B0 .* whole backward of a micro-batch whose backward also runs split"):
        validate(programs_of("F0 I0 B0 W0"))
    with pytest.raises(ScheduleError, match="W0 .* runs after REDUCE_GRAD"):
        validate(programs_of("F0 I0 REDUCE_GRAD W0"))
    assert parse_program("F0 I0 W0") == [Action(Op.F, 0), Action(Op.I, 0), Action(Op.W, 0)]
