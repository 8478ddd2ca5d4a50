"""Per-step timelines from a run's events.jsonl: a PNG Gantt chart and a Chrome trace.

`raypar timeline RUN_DIR --step N` writes timeline-step{N}.png (matplotlib) and
timeline-step{N}.json (chrome://tracing / ui.perfetto.dev). Both show each worker's
measured action spans, so the pipeline's bubbles and a slow stage are visible at a glance.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from raypar.schedule import Op, ScheduleError, parse_program


class TimelineError(ValueError):
    """The run directory has no events for the requested step."""


@dataclass(frozen=True)
class Event:
    label: str  # the action(s) as the runtime wrote them, e.g. "F3" or "SEND_F3->1 RECV_B0<-1"
    op: Op  # the op of the unit's first action
    start: float  # wall-clock seconds
    end: float

    @property
    def kind(self) -> str:
        return event_kind(self.op)

    @property
    def microbatches(self) -> list[int]:
        try:
            return [a.mb for a in parse_program(self.label) if a.mb is not None]
        except ScheduleError:
            return []

    @property
    def chunk(self) -> int:
        """The model chunk its first action ran on (0 with one chunk per stage)."""
        try:
            return parse_program(self.label)[0].chunk
        except (ScheduleError, IndexError):
            return 0


@dataclass(frozen=True)
class WorkerEvents:
    step: int
    rank: int
    dp: int
    pp: int
    ep: int
    events: list[Event]

    @property
    def name(self) -> str:
        return f"stage {self.pp} (dp {self.dp}, ep {self.ep})"


# Colours per kind; dict order is the legend's order.
KINDS: dict[str, str] = {
    "forward": "#4c72b0",
    "backward": "#55a868",
    "input gradient": "#8fd19e",  # I of a split backward (zero-bubble schedules)
    "weight gradient": "#2f6b3a",  # W: deferred into what would be bubbles
    "communication": "#dd8452",
    "optimizer": "#8172b3",
    "release/other": "#b0b0b0",
}


_KIND_OF_OP = {Op.F: "forward", Op.B: "backward", Op.I: "input gradient", Op.W: "weight gradient",
               Op.SEND_F: "communication", Op.RECV_F: "communication",
               Op.SEND_B: "communication", Op.RECV_B: "communication", Op.REDUCE_GRAD: "optimizer",
               Op.STEP: "optimizer"}


def event_kind(op: Op) -> str:
    return _KIND_OF_OP.get(op, "release/other")


# ---------------------------------------------------------------------------------------
# Loading


def load_step(run_dir: str | Path, step: int) -> list[WorkerEvents]:
    """Every worker's events of `step`, ordered by (dp, ep, stage)."""
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        raise TimelineError(f"{run_dir} has no events.jsonl; is it a raypar run directory (runtime.run_dir)?")
    found: list[WorkerEvents] = []
    steps: set[int] = set()
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                # The last line of a run that was killed mid-write; earlier steps are still good.
                continue
            steps.add(row["step"])
            if row["step"] == step:
                found.append(WorkerEvents(row["step"], row["rank"], row["dp"], row["pp"], row.get("ep", 0),
                                          [_event(item) for item in row["events"]]))
    if not found:
        have = _ranges(sorted(steps)) if steps else "none"
        raise TimelineError(f"{path} has no events for step {step}; steps available: {have}")
    return sorted(found, key=lambda w: (w.dp, w.ep, w.pp))


def _event(item: list) -> Event:
    """An events.jsonl span: [label, op, start, end]; runs written before spans carried their
    op have [label, start, end], whose op is the label's first action."""
    if len(item) == 3:
        label, start, end = item
        op = parse_program(label)[0].op
    else:
        label, op, start, end = item
    return Event(label, Op(op), float(start), float(end))


def _ranges(steps: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5": a long run's step list stays one line."""
    parts: list[str] = []
    start = prev = steps[0]
    for cur in steps[1:] + [None]:
        if cur is not None and cur == prev + 1:
            prev = cur
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if cur is not None:
            start = prev = cur
    return ", ".join(parts)


def _origin(step_events: Sequence[WorkerEvents]) -> float:
    starts = [e.start for w in step_events for e in w.events]
    return min(starts) if starts else 0.0


# ---------------------------------------------------------------------------------------
# PNG


def draw_png(step_events: Sequence[WorkerEvents], out_path: str | Path, title: str | None = None) -> Path:
    """One row per worker, time in ms from the step's first event, boxes coloured by kind.

    Gaps between boxes are idle time and stay white; compute boxes carry their micro-batch
    number, and with several model chunks per stage the chunk ("3c1": micro-batch 3 on chunk
    1), whose boxes after chunk 0 are hatched.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on workers or CI
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0 = _origin(step_events)
    rows = list(step_events)
    end_ms = max((e.end - t0 for w in rows for e in w.events), default=0.0) * 1e3
    fig, ax = plt.subplots(figsize=(12, 0.7 * len(rows) + 1.8))
    for y, w in enumerate(rows):
        for kind, colour in KINDS.items():
            for later_chunk in (False, True):
                spans = [((e.start - t0) * 1e3, (e.end - e.start) * 1e3) for e in w.events
                         if e.kind == kind and (e.chunk > 0) == later_chunk]
                if spans:
                    ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=colour, edgecolors="white", linewidth=0.3,
                                   hatch="///" if later_chunk else None)
        for e in w.events:
            if e.op.is_compute and e.microbatches:
                mid = ((e.start + e.end) / 2 - t0) * 1e3
                text = f"{e.microbatches[0]}c{e.chunk}" if e.chunk else str(e.microbatches[0])
                ax.text(mid, y, text, ha="center", va="center", fontsize=7, color="white", clip_on=True)
        # Mean measured F, B (or I and W) durations at the row's end: the numbers behind the box widths.
        means = [f"{op.value} {_mean_ms(d)}" for op in (Op.F, Op.B, Op.I, Op.W)
                 if (d := [e.end - e.start for e in w.events if e.op == op])]
        if means:
            ax.text(1.01, y, " / ".join(means) + " ms", transform=ax.get_yaxis_transform(), va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), [w.name for w in rows])
    ax.set_ylim(len(rows) - 0.5, -0.5)  # stage 0 on top
    ax.set_xlim(0, end_ms * 1.01 if end_ms > 0 else 1)
    ax.set_xlabel("ms since the step's first action")
    ax.set_facecolor("white")
    ax.grid(axis="x", alpha=0.3)
    step = rows[0].step if rows else "?"
    ax.set_title(title or f"step {step}", loc="left")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in KINDS.items()], loc="lower right",
              bbox_to_anchor=(1.0, 1.0), ncol=len(KINDS), fontsize=8, frameon=False)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def _mean_ms(durations: list[float]) -> str:
    return f"{sum(durations) / len(durations) * 1e3:.2f}" if durations else "-"


# ---------------------------------------------------------------------------------------
# Chrome trace


def chrome_trace(step_events: Sequence[WorkerEvents]) -> dict[str, Any]:
    """Trace Event Format: a process per worker (pid = rank), a thread per kind of action."""
    t0 = _origin(step_events)
    tids = {kind: i for i, kind in enumerate(KINDS)}
    events: list[dict[str, Any]] = []
    for w in step_events:
        events.append({"ph": "M", "name": "process_name", "pid": w.rank, "tid": 0, "args": {"name": w.name}})
        # Perfetto and chrome://tracing order processes by this index: pipeline order.
        events.append({"ph": "M", "name": "process_sort_index", "pid": w.rank, "tid": 0,
                       "args": {"sort_index": w.rank}})
        for kind, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": w.rank, "tid": tid, "args": {"name": kind}})
        for e in w.events:
            mbs = e.microbatches
            events.append({
                "ph": "X", "name": e.label, "cat": e.kind, "pid": w.rank, "tid": tids[e.kind],
                "ts": (e.start - t0) * 1e6, "dur": max(0.0, e.end - e.start) * 1e6,
                "args": {"mb": mbs[0] if len(mbs) == 1 else (mbs or None), "chunk": e.chunk, "stage": w.pp,
                         "dp": w.dp, "ep": w.ep, "step": w.step},
            })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(step_events: Sequence[WorkerEvents], path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(chrome_trace(step_events)))
    return out


# ---------------------------------------------------------------------------------------
# Command line


def _configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("run_dir", help="run directory holding events.jsonl (runtime.run_dir)")
    parser.add_argument("--step", type=int, required=True, help="step to draw (0-based, as in metrics.jsonl)")
    parser.add_argument("--out", default=None, help="output folder (default: the run directory)")
    parser.set_defaults(func=_run)
    return parser


_DESCRIPTION = ("Write timeline-step{N}.png and a Chrome trace timeline-step{N}.json "
                "(open in chrome://tracing or ui.perfetto.dev) from RUN_DIR/events.jsonl.")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `raypar timeline` on the CLI's subparsers."""
    return _configure(subparsers.add_parser("timeline", help="draw one step's per-worker timeline",
                                            description=_DESCRIPTION))


def _run(args: argparse.Namespace) -> int:
    try:
        events = load_step(args.run_dir, args.step)
    except TimelineError as e:
        print(f"raypar: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.run_dir)
    png = draw_png(events, out / f"timeline-step{args.step}.png", title=f"{args.run_dir}: step {args.step}")
    trace = write_chrome_trace(events, out / f"timeline-step{args.step}.json")
    print(f"wrote {png} and {trace}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`raypar timeline` on its own: argv is what follows the subcommand."""
    args = _configure(argparse.ArgumentParser(prog="raypar timeline", description=_DESCRIPTION)).parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
