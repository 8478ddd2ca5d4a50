"""Choosing a schedule from unit costs (parallel.schedule=auto, `raypar plan`)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from raypar.driver.cli import main as cli_main
from raypar.schedule import Op, ScheduleError
from raypar.schedule.choice import (MEASURE_WITHIN, Prediction, UnitCosts, candidate_layouts, choose, finalists,
                                    format_table, measured_costs, modelled_costs, on_layout, predict, predict_all)
from raypar.schedule.layout import Layout

MIB = 2**20
# The runtime's peak activation bytes over the predicted bound may exceed it by this much
# (the per-micro-batch bytes are a floor division of one step's peak).
PEAK_SLACK = 0.02


def even(p: int, f: float = 1.0, i: float = 1.0, w: float = 1.0, **kw) -> UnitCosts:
    return UnitCosts([f] * p, [i] * p, [w] * p, **kw)


@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_predictions_follow_the_known_formulas(p: int, m: int) -> None:
    one_f_one_b = predict("1f1b", m, even(p))
    assert one_f_one_b.bubble == pytest.approx((p - 1) / (m + p - 1))
    assert one_f_one_b.step_s == pytest.approx((m + p - 1) * 3)
    assert one_f_one_b.peak_live == [min(p - s, m) for s in range(p)]
    assert predict("fthenb", m, even(p)).peak_live == [m] * p
    # ZB-H1 at F = I = W: each stage idles p - 1 units, a third of 1F1B's 3 (p - 1), holding
    # no more than 1F1B's first stage.
    h1 = predict("zb-h1", m, even(p))
    assert h1.step_s == pytest.approx(3 * m + (p - 1))
    assert max(h1.peak_live) == p


def test_peak_bytes_are_fixed_plus_live_times_per_microbatch() -> None:
    costs = even(2, activation_bytes=[10 * MIB, 20 * MIB], fixed_bytes=[100 * MIB, 50 * MIB])
    pred = predict("1f1b", 4, costs)
    assert pred.peak_live == [2, 1]
    assert pred.peak_bytes == [120 * MIB, 70 * MIB]
    assert predict("fthenb", 4, costs).peak_bytes == [140 * MIB, 130 * MIB]


def test_the_fastest_that_fits_the_budget_is_chosen() -> None:
    # I twice F and W: ZB-H2 (35 units) beats ZB-H1 (38), which beats 1F1B (44).
    costs = even(4, i=2.0, activation_bytes=[MIB] * 4, fixed_bytes=[0] * 4)
    predictions = predict_all(8, costs)
    assert [p.step_s for p in predictions] == sorted(p.step_s for p in predictions)
    chosen, why = choose(predictions)
    assert chosen.schedule == "zb-h2" and why.startswith("fastest predicted")
    # ZB-H2 holds 7 micro-batches per stage, ZB-H1 4: a budget of 5 leaves ZB-H1.
    chosen, why = choose(predictions, budget_bytes=5 * MIB)
    assert chosen.schedule == "zb-h1"
    assert "over the memory budget of 5.0 MiB: " in why and "zb-h2" in why and "fthenb" in why
    table = format_table(predictions, chosen, 5 * MIB)
    assert "zb-h1" in table.splitlines()[2] and "<- chosen" in table.splitlines()[2]
    assert "(over budget)" in next(line for line in table.splitlines() if line.startswith("zb-h2"))


def test_no_schedule_fitting_is_a_clear_error() -> None:
    predictions = predict_all(8, even(2, activation_bytes=[MIB] * 2, fixed_bytes=[0] * 2))
    with pytest.raises(ScheduleError, match=r"no schedule fits the memory budget of 1\.0 MiB: the least, 1f1b, "
                                            r"needs 2\.0 MiB.*parallel\.memory_budget_gb"):
        choose(predictions, budget_bytes=MIB)


def test_ties_go_to_the_least_memory_then_the_simplest() -> None:
    # One stage: every schedule takes the same time; 1F1B holds one micro-batch, fthenb all.
    chosen, why = choose(predict_all(4, even(1)))
    assert chosen.schedule == "1f1b" and "least memory" in why


def test_finalists_are_run_and_the_fastest_measured_wins() -> None:
    predictions = predict_all(8, even(4, activation_bytes=[MIB] * 4, fixed_bytes=[0] * 4))
    fastest = min(p.step_s for p in predictions)
    finals = finalists(predictions)
    assert [p.schedule for p in finals] == [p.schedule for p in predictions if p.step_s <= fastest * (1 + MEASURE_WITHIN)]
    # At F = I = W both zero-bubble orders take 27 units, 1F1B 33: those two are run.
    assert sorted(p.schedule for p in finals) == ["zb-h1", "zb-h2"]
    # Measured, zb-h1 beats the predicted fastest: the measurement decides.
    chosen, why = choose(predictions, measured={"zb-h2": 0.30, "zb-h1": 0.25})
    assert chosen.schedule == "zb-h1" and why.startswith("fastest measured") and "zb-h1 250.0 ms, zb-h2 300.0 ms" in why
    # Within 1% measured and predicted alike (F = I = W): the one holding less memory.
    chosen, why = choose(predictions, measured={"zb-h2": 0.250, "zb-h1": 0.251})
    assert chosen.schedule == "zb-h1" and "least memory among zb-h1, zb-h2" in why
    # Within 1% measured, but predicted 2% apart: a trial step cannot tell them apart, so the
    # prediction does (a timed step's noise; the fastest predicted holding more memory).
    apart = [replace(p, step_s=p.step_s * (1.02 if p.schedule == "zb-h1" else 1.0)) for p in predictions]
    chosen, why = choose(apart, measured={"zb-h2": 0.251, "zb-h1": 0.250})
    assert chosen.schedule == "zb-h2" and "the fastest predicted of them" in why
    # Measured more than 1% apart: the measurement decides against the prediction.
    assert choose(apart, measured={"zb-h2": 0.256, "zb-h1": 0.250})[0].schedule == "zb-h1"
    # A measured schedule over the budget is not chosen however fast.
    assert choose(predictions, budget_bytes=5 * MIB, measured={"zb-h2": 0.1, "zb-h1": 0.3})[0].schedule == "zb-h1"
    table = format_table(predictions, chosen, measured={"zb-h1": 0.25})
    assert "250.0 ms" in next(line for line in table.splitlines() if line.startswith("zb-h1"))


def expected_steps(choice: dict) -> list[str]:
    """The schedules a grid run's first steps run while choosing (`ScheduleChooser`)."""
    from raypar.schedule.choice import TIMING_SCHEDULE, TIMING_STEPS, TRIAL_STEPS

    finals = finalists([Prediction(**p) for p in choice["predictions"]], choice["memory_budget_bytes"])
    steps = [TIMING_SCHEDULE] * TIMING_STEPS
    if len(finals) > 1:
        # Those of one chunk per stage (the timing's cut) first, then the others cut by cut.
        cut = choice["layouts"]
        trials = sorted((p.schedule for p in finals if p.schedule != TIMING_SCHEDULE),
                        key=lambda s: (cut[s] != cut[TIMING_SCHEDULE], cut[s]))
        steps += [s for name in trials if name not in choice["dropped"] for s in [name] * TRIAL_STEPS]
    return steps


def assert_steps_follow_the_choice(schedules: list[str], choice: dict | None) -> None:
    """One grid run's schedules, step by step: the choice's timing and trials, then the chosen
    one. `choice` None: the run ended before choosing, in its first steps."""
    if choice is None:
        assert schedules[:2] == ["zb-h1"] * min(2, len(schedules)), schedules
        return
    steps = expected_steps(choice)
    assert schedules[:len(steps)] == steps, (schedules, steps)
    assert schedules[len(steps):] == [choice["schedule"]] * (len(schedules) - len(steps)), (schedules, choice)
    assert set(choice["measured_step_s"]) == set(steps)
    assert choice["steps"][1] - choice["steps"][0] + 1 == len(steps)


AUTO_STEPS = 18  # enough to time, try every schedule (two steps each) and run the choice


@pytest.fixture(scope="module")
def auto_runs(ray_session, tmp_path_factory):
    """Runs of the tiny model on pp=2 with 4 micro-batches (zb-h2 may hold three on a stage
    where zb-h1 holds two) and dropout, by schedule; the fixed 1F1B run made once."""
    from helpers import run_config

    from raypar.data import write_synthetic_corpus
    from raypar.driver.trainer import Trainer

    tmp = tmp_path_factory.mktemp("auto")
    write_synthetic_corpus(tmp / "data.parquet", 256, 8, 64, seed=1)
    made = {}

    def run(name: str, schedule: str):
        if name not in made:
            cfg = run_config(tmp, name, (1, 2, 1), AUTO_STEPS, model={"dropout": 0.1},
                             parallel={"schedule": schedule, "microbatches": 4})
            made[name] = Trainer(cfg, log=lambda m: None).fit(), tmp / name / "run"
        return made[name]

    return run


def test_auto_times_tries_and_chooses_with_the_losses_of_a_fixed_schedule(auto_runs, capsys) -> None:
    """parallel.schedule=auto on pp=2: every step is a training step (the losses equal a 1F1B
    run's), the steps follow the chooser, and `raypar plan --from-run` reads the costs back."""
    from raypar.plan import run_costs

    auto, run_dir = auto_runs("auto", "auto")
    fixed, _ = auto_runs("1f1b", "1f1b")
    assert [r.loss for r in auto.records] == pytest.approx([r.loss for r in fixed.records], rel=1e-5)
    (choice,) = auto.schedule_choices
    assert choice["grid"] == "dp=1 x pp=2 x ep=1" and choice["steps"][0] == 0
    assert choice["costs"]["source"] == "measured at step 1 with zb-h1"
    assert_steps_follow_the_choice([r.schedule for r in auto.records], choice)
    assert auto.schedule == f"auto: {choice['schedule']}"
    # Peak activation bytes predicted from one zb-h1 step bound what each schedule the run went
    # on to run measured, stage by stage (CPU: exact byte counts, no timing noise). A bound, not
    # an estimate: a micro-batch between its I and its W holds less than one between F and I,
    # and the prediction counts every live one at the average.
    predicted = {p["schedule"]: p["peak_bytes"] for p in choice["predictions"]}
    for r in auto.records[2:]:
        if choice["layouts"][r.schedule] != "one chunk per stage":
            continue  # another cut: carried over by FLOPs, an estimate (test_auto_moves_the_model...)
        assert all(m <= b * (1 + PEAK_SLACK) for m, b in zip(r.peak_activation_bytes, predicted[r.schedule])), \
            (r.schedule, r.peak_activation_bytes, predicted[r.schedule])
    cfg, costs, cut = run_costs(run_dir)  # the run's second zero-bubble step: step 1
    assert costs.forward == pytest.approx(choice["costs"]["forward"]) and cut == Layout(2)
    assert cli_main(["plan", "--from-run", str(run_dir)]) == 0
    assert "costs measured at step 1 of" in capsys.readouterr().out


def test_auto_moves_the_model_to_other_cuts_without_changing_a_loss(auto_runs, monkeypatch) -> None:
    """With every schedule a finalist, auto runs them all: the workers move to ZB-V's and
    interleaved 1F1B's cuts on their devices (and to the chosen one's), and every loss is a
    fixed 1F1B run's, dropout on (its masks follow the samples, not the cut). Moves through
    a checkpoint: tests/test_schedule_switch.py."""
    monkeypatch.setattr("raypar.schedule.choice.MEASURE_WITHIN", 100.0)
    auto, run_dir = auto_runs("auto-every-schedule", "auto")
    fixed, _ = auto_runs("1f1b", "1f1b")
    assert [r.loss for r in auto.records] == pytest.approx([r.loss for r in fixed.records], rel=1e-5)
    (choice,) = auto.schedule_choices
    assert set(choice["measured_step_s"]) == set(choice["layouts"]) == {
        "fthenb", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "zb-v-half"}
    assert_steps_follow_the_choice([r.schedule for r in auto.records], choice)
    v, loop = "2 chunks per stage in a V", "2 chunks per stage in a loop"
    moves = [(m["cut"], m["step"]) for m in choice["moves"]]
    # Two timing steps and three one-chunk schedules of two, then each cut once where its
    # first trial starts (ZB-V's two schedules, then interleaved), then the chosen one's cut.
    assert moves[:2] == [(v, 8), (loop, 12)], moves
    chosen_cut = choice["layouts"][choice["schedule"]]
    assert moves[2:] == ([] if chosen_cut == loop else [(chosen_cut, 14)])
    # Every move kept the state on the workers: no checkpoint written.
    assert {m["through"] for m in choice["moves"]} == {"devices"} and auto.checkpoints == []
    assert not list((run_dir.parent / "ckpt").glob("step-*"))


def test_a_cut_that_cannot_be_made_drops_out(monkeypatch) -> None:
    """The controller could not move the workers to a cut: its schedules leave the choice,
    which goes on with the next cut's trials, then chooses among what ran."""
    from raypar.driver import schedule_choice
    from raypar.topology import Grid

    layouts = candidate_layouts(2, 4, 4)
    assert set(layouts) == {"fthenb", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "zb-v-half"}
    monkeypatch.setattr(schedule_choice, "report_costs", lambda *args: even(2))
    monkeypatch.setattr("raypar.schedule.choice.MEASURE_WITHIN", 100.0)
    chooser = schedule_choice.ScheduleChooser(Grid(1, 2, 1), 4, layouts, lambda layout: [1.0, 1.0])
    ran, refused = [], []
    for _ in range(40):
        if not chooser.choosing:
            break
        if chooser.layout.placement == "v":
            refused.append(chooser.schedule)
            chooser.unavailable("disk full")
            continue
        ran.append(chooser.schedule)
        chooser.step_done([], None, 1.0 - 0.01 * len(ran), None)
    assert not chooser.choosing and set(chooser.dropped) == {"zb-v", "zb-v-half"} and refused == ["zb-v"]
    assert ran[:2] == ["zb-h1"] * 2 and ran[-2:] == ["interleaved-1f1b"] * 2
    assert sorted(set(ran)) == ["1f1b", "fthenb", "interleaved-1f1b", "zb-h1", "zb-h2"] and len(ran) == 10
    # The last tried is the fastest measured (step times fall in this test).
    assert chooser.schedule == "interleaved-1f1b" and "not run: zb-v, zb-v-half (disk full)" in chooser.choice["reason"]


def test_candidates_are_the_cuts_that_fit() -> None:
    one = {"fthenb", "1f1b", "zb-h1", "zb-h2"}
    assert set(candidate_layouts(1, 4, 4)) == one  # one stage: no other cut
    assert set(candidate_layouts(2, 4, 4, several_chunks=False)) == one
    assert set(candidate_layouts(2, 3, 4)) == one | {"zb-v", "zb-v-half"}  # interleaved: groups of pp
    assert set(candidate_layouts(4, 8, 4)) == one  # 8 virtual stages of 4 layers: none
    assert candidate_layouts(2, 4, 8, chunks=4)["interleaved-1f1b"] == Layout(2, 4, "loop")


def test_costs_carry_over_to_another_cut_by_flops() -> None:
    measured = UnitCosts([1.0, 3.0], [2.0, 2.0], [1.0, 1.0], transfer=0.1, activation_bytes=[10, 30],
                         fixed_bytes=[100, 50], source="step 1")
    moved = on_layout(measured, [3.0, 1.0], "2 chunks per stage in a V")
    assert moved.forward == pytest.approx([3.0, 1.0]) and moved.input_grad == pytest.approx([3.0, 1.0])
    assert moved.weight_grad == pytest.approx([1.5, 0.5]) and moved.transfer == 0.1
    assert moved.activation_bytes == [30, 10] and moved.fixed_bytes == [100, 100]
    assert moved.source == "step 1, carried over to 2 chunks per stage in a V by FLOPs"
    with pytest.raises(ScheduleError, match="positive FLOPs of each of 2 stages"):
        on_layout(measured, [1.0, 0.0], "x")


def test_a_slow_last_stage_is_seen_by_the_prediction() -> None:
    balanced, skewed = even(2), UnitCosts([1.0, 1.5], [1.0, 1.5], [1.0, 1.5])
    assert predict("1f1b", 8, skewed).step_s > predict("1f1b", 8, balanced).step_s * 1.3


def test_measured_costs_from_spans() -> None:
    spans = [[(Op.F, 1.0), (Op.F, 3.0), (Op.I, 2.0), (Op.W, 1.0), (Op.RECV_B, 0.5), (Op.RECV_B, 0.2)],
             [(Op.F, 2.0), (Op.B, 4.0), (Op.RECV_F, 0.3), (Op.SEND_B, 0.01), (Op.STEP, 0.7)]]
    costs = measured_costs(spans, peak_live=[2, 1], activation_bytes=[8 * MIB, 3 * MIB],
                           device_bytes=[20 * MIB, 10 * MIB], source="test")
    assert costs.forward == [2.0, 2.0]
    assert costs.input_grad == [2.0, 2.0] and costs.weight_grad == [1.0, 2.0]  # a whole B is split in halves
    assert costs.transfer == 0.2  # the shortest receive; sends and the optimizer are not transfers
    assert costs.activation_bytes == [4 * MIB, 3 * MIB]
    assert costs.fixed_bytes == [12 * MIB, 7 * MIB]
    # On CPU no device bytes are measured: the fixed part is unknown, not zero.
    assert measured_costs(spans, [2, 1], [8, 3], [0, 0], "cpu").fixed_bytes is None


def test_bad_costs_are_refused() -> None:
    with pytest.raises(ScheduleError, match="F, I and W for each of the same stages"):
        UnitCosts([1.0, 1.0], [1.0], [1.0, 1.0])
    with pytest.raises(ScheduleError, match="activation_bytes needs one value per stage"):
        UnitCosts([1.0], [1.0], [1.0], activation_bytes=[1, 2])
    with pytest.raises(ScheduleError, match="positive FLOPs"):
        modelled_costs([1.0, 0.0])


def test_plan_command_prints_the_table_and_the_choice(capsys) -> None:
    code = cli_main(["plan", "--config", "configs/gpt-1b.yaml", "parallel.pp=2", "parallel.microbatches=8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "pp=2, 8 micro-batches; costs modelled" in out
    for schedule in ("fthenb", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zb-v", "zb-v-half"):
        assert any(line.startswith(schedule) for line in out.splitlines())
    assert ("2 chunks per stage in a V: zb-v, zb-v-half; one chunk per stage: zb-h1, zb-h2, fthenb, 1f1b; "
            "2 chunks per stage in a loop: interleaved-1f1b") in out
    # ZB-V and two zero-bubble orders of one chunk predicted within 5%: auto would run them all.
    assert ("parallel.schedule=auto would run zb-v, zb-h1, zb-h2 for 2 steps each (predicted within 5% of the "
            "fastest) and keep the fastest measured; by prediction alone zb-v: fastest predicted") in out
    # A list of layers per stage is a cut of its own: only its schedules.
    assert cli_main(["plan", "--config", "configs/gpt-1b.yaml", "parallel.layers_per_stage=[8,6]"]) == 0
    assert "zb-v" not in capsys.readouterr().out


def test_plan_command_errors(capsys, tmp_path) -> None:
    assert cli_main(["plan", "--step", "3"]) == 2
    assert "--step needs --from-run" in capsys.readouterr().err
    assert cli_main(["plan", "--from-run", str(tmp_path)]) == 2
    assert "is not a raypar run directory" in capsys.readouterr().err
    assert cli_main(["plan", "parallel.memory_budget_gb=-1"]) == 2
    assert "parallel.memory_budget_gb=-1" in capsys.readouterr().err
