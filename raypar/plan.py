"""`raypar plan`: every pipeline schedule's predicted step time and peak memory, and the choice.

From a config alone the costs are modelled (each stage's FLOPs, I = W = F); with `--from-run`
they are what a run measured at one step (events.jsonl's spans and metrics.jsonl's memory
peaks), the same figures `parallel.schedule: auto` chooses from while it trains.

Schedules of several model chunks per stage (interleaved-1f1b, zb-v, zb-v-half) come in a
table of their own: their stages hold other layers (ZB-V puts the head on stage 0 beside
the embedding), and `auto` does not change how the model is cut, so they run only when
`parallel.schedule` names them. From a config they are modelled on their own layout; from a
run, only those of the run's own layout (one chunk per stage, or the run's chunks).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from raypar.config import Config, ConfigError, config_from_dict, load_config
from raypar.schedule import (CHUNKED_SCHEDULES, SCHEDULES, Layout, ScheduleError, build_programs, prepare,
                             schedule_fits, schedule_layout)
from raypar.schedule.choice import (MEASURE_WITHIN, TRIAL_STEPS, Prediction, UnitCosts, choose, finalists,
                                    format_table, measured_costs, modelled_costs, predict, predict_all)


class PlanError(ValueError):
    """The run directory cannot give costs (no such step, no events)."""


def config_costs(cfg: Config, layout: Layout | None = None) -> UnitCosts:
    """Modelled costs of `cfg`'s stages: their layers' and the head's FLOPs per token;
    `layout`: the stages of a schedule of several chunks each (their chunks' layers summed)."""
    from raypar.model.partition import split_layers, stage_layers
    from raypar.model.transformer import head_flops, layer_flops

    m, pp = cfg.model, cfg.parallel.pp
    layout = layout or Layout(pp)
    n = layout.n_virtual
    ranges = split_layers(m.n_layers, n, stage_layers(m, n, cfg.parallel.layers_per_stage))
    flops = [0.0] * pp
    for vs, r in enumerate(ranges):
        stage = layout.place(vs)[0]
        flops[stage] += sum(layer_flops(m, i, cfg.data.seq_len) for i in r) + (head_flops(m) if vs == n - 1 else 0)
    return modelled_costs(flops)


def chunked_predictions(cfg: Config, costs: UnitCosts | None) -> list[Prediction]:
    """The schedules of several chunks per stage that fit `cfg`'s model and micro-batches,
    fastest first: modelled on their own layouts when `costs` is None, else with `costs`
    (measured on a run of that layout: only the schedules that share it)."""
    p, out = cfg.parallel, []
    measured_on = None if costs is None or p.schedule not in CHUNKED_SCHEDULES else schedule_layout(
        p.schedule, p.pp, p.chunks)
    for name in CHUNKED_SCHEDULES:
        if schedule_fits(name, p.pp, p.microbatches, cfg.model.n_layers) is not None:
            continue
        layout = schedule_layout(name, p.pp)
        if costs is not None and layout != measured_on:
            continue
        out.append(predict(name, p.microbatches, costs or config_costs(cfg, layout)))
    return sorted(out, key=lambda x: x.step_s)


def run_costs(run_dir: str | Path, step: int | None = None) -> tuple[Config, UnitCosts]:
    """A run's config and the costs it measured at `step` (default: the second step whose
    backward was split into I and W, else the first, else its last step)."""
    from raypar.timeline import TimelineError, load_step

    run = Path(run_dir)
    try:
        cfg = config_from_dict(json.loads((run / "config.json").read_text()))
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    except FileNotFoundError as e:
        raise PlanError(f"{run_dir} is not a raypar run directory (runtime.run_dir): {e.filename} is missing") from e
    if not records:
        raise PlanError(f"{run / 'metrics.jsonl'} has no steps yet")
    by_step = {r["step"]: r for r in records}
    if step is None:
        # The second zero-bubble step: the first on a grid pays for the device's warm-up.
        split = [r for r in records if (r.get("schedule") or cfg.parallel.schedule).startswith("zb")]
        step = (split[1] if len(split) > 1 else split[0] if split else records[-1])["step"]
    if step not in by_step:
        raise PlanError(f"{run / 'metrics.jsonl'} has no step {step}; it has {min(by_step)} to {max(by_step)}")
    record = by_step[step]
    schedule = record.get("schedule") or cfg.parallel.schedule
    try:
        workers = load_step(run, step)
    except TimelineError as e:
        raise PlanError(str(e)) from e
    pp = max(w.pp for w in workers) + 1
    chunks = cfg.parallel.chunks if schedule in CHUNKED_SCHEDULES else None
    programs = prepare(build_programs(schedule, pp, cfg.parallel.microbatches, chunks=chunks),
                       schedule_layout(schedule, pp, chunks))
    spans = [[(e.op, e.end - e.start) for w in workers if w.pp == s for e in w.events] for s in range(pp)]
    costs = measured_costs(spans, programs.peak_live, record["peak_activation_bytes"], record["peak_device_bytes"],
                           f"measured at step {step} of {run} with {schedule}")
    return cfg, costs


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", "-c", default=None, help="YAML config file (default: built-in defaults)")
    parser.add_argument("--from-run", default=None, metavar="RUN_DIR",
                        help="use the costs a run measured (its runtime.run_dir) instead of modelled ones")
    parser.add_argument("--step", type=int, default=None,
                        help="with --from-run: the step to take costs from (default: its second zero-bubble step, "
                             "whose F, I and W are timed apart after the first's warm-up, else its last)")
    parser.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.pp=4 parallel.microbatches=8")
    parser.set_defaults(func=_run)
    return parser


_DESCRIPTION = ("Predict every pipeline schedule's step time and peak memory (the simulator, fed modelled or "
                "measured per-unit costs) and say which parallel.schedule=auto would run.")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `raypar plan` on the CLI's subparsers."""
    return _configure(subparsers.add_parser("plan", help="compare pipeline schedules for a config or a run",
                                            description=_DESCRIPTION))


def _run(args: argparse.Namespace) -> int:
    try:
        if args.from_run:
            if args.config or args.overrides:
                raise PlanError("--from-run takes the run's own config: drop --config and the overrides")
            cfg, costs = run_costs(args.from_run, args.step)
        else:
            if args.step is not None:
                raise PlanError("--step needs --from-run RUN_DIR")
            cfg = load_config(args.config, list(args.overrides))
            costs = config_costs(cfg)
        p = cfg.parallel
        budget = int(p.memory_budget_gb * 2**30) if p.memory_budget_gb is not None else None
        chunked = chunked_predictions(cfg, costs if args.from_run else None)
        if args.from_run and p.schedule in CHUNKED_SCHEDULES:
            predictions, chosen, why = [], None, None  # measured on other stages than one chunk's
        else:
            if not args.from_run and p.schedule in CHUNKED_SCHEDULES:
                costs = config_costs(cfg, Layout(p.pp))  # the one-chunk stages auto would build
            predictions = predict_all(p.microbatches, costs, list(SCHEDULES))
            chosen, why = choose(predictions, budget)
    except (PlanError, ConfigError, ScheduleError) as e:
        print(f"raypar: error: {e}", file=sys.stderr)
        return 2
    units = "s" if costs.source != "modelled" else "FLOPs per token, F = I = W"
    print(f"pp={p.pp}, {p.microbatches} micro-batches; costs {costs.source} ({units})")
    # Both tables' step times relative to the fastest of all.
    fastest = min(x.step_s for x in predictions + chunked)
    if predictions:
        print(format_table(predictions, chosen, budget, baseline=fastest))
        finals = [f.schedule for f in finalists(predictions, budget)]
        if len(finals) > 1:
            print(f"parallel.schedule=auto would run {', '.join(finals)} for {TRIAL_STEPS} steps each (predicted "
                  f"within {MEASURE_WITHIN:.0%} of the fastest) and keep the fastest measured; by prediction alone "
                  f"{chosen.schedule}: {why}")
        else:
            print(f"parallel.schedule=auto would run {chosen.schedule}: {why}")
    if chunked:
        print(f"\nseveral model chunks per stage (live counts chunk micro-batches; run them by naming them in "
              f"parallel.schedule, auto keeps one chunk per stage); fastest of all: "
              f"{min(predictions + chunked, key=lambda x: x.step_s).schedule}")
        print(format_table(chunked, None, budget, baseline=fastest))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`raypar plan` on its own: argv is what follows the subcommand."""
    args = _configure(argparse.ArgumentParser(prog="raypar plan", description=_DESCRIPTION)).parse_args(argv)
    return args.func(args)
