"""`raypar plan`: every pipeline schedule's predicted step time and peak memory, and the choice.

From a config alone the costs are modelled (each stage's FLOPs, I = W = F); with `--from-run`
they are what a run measured at one step (events.jsonl's spans and metrics.jsonl's memory
peaks), the same figures `parallel.schedule: auto` chooses from while it trains.

Schedules of several model chunks per stage (interleaved-1f1b, zb-v, zb-v-half) cut the model
otherwise (ZB-V puts the head on stage 0 beside the embedding): the costs of one cut are
carried over to theirs by FLOPs, as `auto` does, which moves the workers to the cut it
chooses. The candidates are `auto`'s (`candidate_layouts`).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import replace
from pathlib import Path

from raypar.config import Config, ConfigError, config_from_dict, load_config
from raypar.schedule import CHUNKED_SCHEDULES, Layout, ScheduleError, build_programs, prepare, schedule_layout
from raypar.schedule.choice import (MEASURE_WITHIN, TRIAL_STEPS, UnitCosts, candidate_layouts, choose, describe,
                                    finalists, format_table, measured_costs, modelled_costs, predict_cuts)
from raypar.schedule.generators import run_layout


class PlanError(ValueError):
    """The run directory cannot give costs (no such step, no events)."""


def config_costs(cfg: Config, layout: Layout | None = None) -> UnitCosts:
    """Modelled costs of `cfg`'s stages: their layers' and the head's FLOPs per token;
    `layout`: the stages of a schedule of several chunks each (their chunks' layers summed)."""
    from raypar.model.partition import layout_flops

    return modelled_costs(layout_flops(cfg.model, cfg.data.seq_len, layout or Layout(cfg.parallel.pp),
                                       cfg.parallel.layers_per_stage))


def plan_layouts(cfg: Config) -> dict[str, Layout]:
    """The schedules `auto` would choose among on `cfg`'s grid, each with its cut (a list of
    layers per stage describes the cut `cfg` builds: only its schedules)."""
    p = cfg.parallel
    every = candidate_layouts(p.pp, p.microbatches, cfg.model.n_layers, p.chunks)
    if not isinstance(p.layers_per_stage, list):
        return every
    own = run_layout(p.schedule, p.pp, p.chunks)
    return {name: layout for name, layout in every.items() if layout == own}


def run_costs(run_dir: str | Path, step: int | None = None) -> tuple[Config, UnitCosts, Layout]:
    """A run's config, the costs it measured at `step` (default: the second step whose
    backward was split into I and W, else the first, else its last step), and the cut of the
    model they were measured on."""
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
    layout = schedule_layout(schedule, pp, chunks)
    programs = prepare(build_programs(schedule, pp, cfg.parallel.microbatches, chunks=chunks), layout)
    spans = [[(e.op, e.end - e.start) for w in workers if w.pp == s for e in w.events] for s in range(pp)]
    costs = measured_costs(spans, programs.peak_live, record["peak_activation_bytes"], record["peak_device_bytes"],
                           f"measured at step {step} of {run} with {schedule}")
    if layout.n_chunks > 1:
        # Units (and live micro-batches) of one chunk: a stage's are its chunks' together.
        v = layout.n_chunks
        costs = replace(costs, forward=[x * v for x in costs.forward], input_grad=[x * v for x in costs.input_grad],
                        weight_grad=[x * v for x in costs.weight_grad],
                        activation_bytes=[a * v for a in costs.activation_bytes])
    return cfg, costs, layout


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
    from raypar.model.partition import layout_flops

    try:
        if args.from_run:
            if args.config or args.overrides:
                raise PlanError("--from-run takes the run's own config: drop --config and the overrides")
            cfg, costs, measured_on = run_costs(args.from_run, args.step)
        else:
            if args.step is not None:
                raise PlanError("--step needs --from-run RUN_DIR")
            cfg = load_config(args.config, list(args.overrides))
            measured_on = run_layout(cfg.parallel.schedule, cfg.parallel.pp, cfg.parallel.chunks)
            costs = config_costs(cfg, measured_on)
        p = cfg.parallel
        budget = int(p.memory_budget_gb * 2**30) if p.memory_budget_gb is not None else None
        layouts = plan_layouts(cfg)
        flops = functools.partial(layout_flops, cfg.model, cfg.data.seq_len, layers_per_stage=p.layers_per_stage)
        predictions = predict_cuts(p.microbatches, costs, measured_on, layouts, flops)
        chosen, why = choose(predictions, budget)
    except (PlanError, ConfigError, ScheduleError) as e:
        print(f"raypar: error: {e}", file=sys.stderr)
        return 2
    units = "s" if costs.source != "modelled" else "FLOPs per token, F = I = W"
    print(f"pp={p.pp}, {p.microbatches} micro-batches; costs {costs.source} ({units})")
    print(format_table(predictions, chosen, budget))
    cuts: dict[str, list[str]] = {}
    for p_ in predictions:
        cuts.setdefault(describe(layouts[p_.schedule]), []).append(p_.schedule)
    if len(cuts) > 1:
        print("cuts of the model (live counts chunk micro-batches): "
              + "; ".join(f"{cut}: {', '.join(names)}" for cut, names in cuts.items()))
    finals = [f.schedule for f in finalists(predictions, budget)]
    if len(finals) > 1:
        print(f"parallel.schedule=auto would run {', '.join(finals)} for {TRIAL_STEPS} steps each (predicted "
              f"within {MEASURE_WITHIN:.0%} of the fastest) and keep the fastest measured; by prediction alone "
              f"{chosen.schedule}: {why}")
    else:
        print(f"parallel.schedule=auto would run {chosen.schedule}: {why}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`raypar plan` on its own: argv is what follows the subcommand."""
    args = _configure(argparse.ArgumentParser(prog="raypar plan", description=_DESCRIPTION)).parse_args(argv)
    return args.func(args)
