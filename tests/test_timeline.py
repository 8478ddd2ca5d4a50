"""Timelines of a real 2-stage run: the PNG is drawn and the trace holds the schedule's actions."""
import argparse
import json
import struct

import pytest

from raypar.schedule import build_programs
from raypar.timeline import (
    TimelineError,
    add_parser,
    chrome_trace,
    draw_png,
    event_kind,
    load_step,
    main,
    write_chrome_trace,
)

from helpers import tiny_config

PP, STEPS = 2, 2


@pytest.fixture(scope="module")
def run(ray_session, tmp_path_factory):
    from raypar.driver.trainer import Trainer

    # Zero-bubble H1: its backwards come as I and W, each drawn and traced as its own kind.
    cfg = tiny_config(tmp_path_factory.mktemp("timeline"), parallel={"pp": PP, "schedule": "zb-h1"}, train={"steps": STEPS},
                      runtime={"metrics": "off"})
    Trainer(cfg, log=lambda s: None).fit()
    return cfg


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_png_is_drawn(run, tmp_path):
    events = load_step(run.runtime.run_dir, 1)
    out = draw_png(events, tmp_path / "t.png")
    width, height = png_size(out)
    assert width > 0 and height > 0


def test_trace_holds_each_stages_schedule(run, tmp_path):
    events = load_step(run.runtime.run_dir, 1)
    assert [w.pp for w in events] == list(range(PP))
    trace = chrome_trace(events)
    json.loads(json.dumps(trace))  # plain JSON, as chrome://tracing and Perfetto load it
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert all(e["ts"] >= 0 and e["dur"] >= 0 for e in spans)
    programs = build_programs(run.parallel.schedule, PP, run.parallel.microbatches, release=run.runtime.release)
    for w in events:
        compute = [e for e in spans if e["pid"] == w.rank and e["cat"] in ("forward", "input gradient", "weight gradient")]
        expected = [str(a) for a in programs[w.pp] if a.is_compute]
        assert [e["name"] for e in compute] == expected, f"stage {w.pp}"
        assert [e["args"]["mb"] for e in compute] == [a.mb for a in programs[w.pp] if a.is_compute]
    path = write_chrome_trace(events, tmp_path / "t.json")
    assert json.loads(path.read_text())["traceEvents"]


def test_cli_writes_png_and_trace(run, tmp_path, capsys):
    assert main([run.runtime.run_dir, "--step", "1", "--out", str(tmp_path)]) == 0
    png_size(tmp_path / "timeline-step1.png")
    assert json.loads((tmp_path / "timeline-step1.json").read_text())["traceEvents"]

    parser = argparse.ArgumentParser(prog="raypar")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["timeline", run.runtime.run_dir, "--step", "0", "--out", str(tmp_path)])
    assert args.func(args) == 0
    assert (tmp_path / "timeline-step0.png").exists()


def test_missing_step_lists_the_available_ones(run, tmp_path, capsys):
    with pytest.raises(TimelineError, match=r"step 9; steps available: 0-1"):
        load_step(run.runtime.run_dir, 9)
    with pytest.raises(TimelineError, match=str(tmp_path)):
        load_step(tmp_path, 0)
    assert main([str(tmp_path), "--step", "0"]) == 2
    assert "no events.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("label, kind", [
    ("F3", "forward"), ("B0", "backward"), ("I2", "input gradient"), ("W2", "weight gradient"),
    ("SEND_F3->1 RECV_B0<-1", "communication"), ("RECV_F0<-0", "communication"),
    ("SEND_B1->0", "communication"), ("RECV_B2<-1", "communication"),
    ("RELEASE_OUT3", "release/other"), ("RELEASE_IN0", "release/other"), ("REDUCE_GRAD", "optimizer"),
    ("STEP", "optimizer"),
])
def test_event_kinds(label, kind):
    """A unit's kind follows the op of its first action, which events.jsonl carries."""
    from raypar.schedule import parse_program

    assert event_kind(parse_program(label)[0].op) == kind


def test_a_run_written_before_spans_carried_their_op_still_loads(tmp_path):
    """events.jsonl rows of older runs are [label, start, end]; their kind comes from the label."""
    import json

    row = {"step": 0, "rank": 0, "dp": 0, "pp": 0, "ep": 0,
           "events": [["F0", 0.0, 1.0], ["SEND_F0->1", 1.0, 1.5], ["B0", 2.0, 4.0]]}
    (tmp_path / "events.jsonl").write_text(json.dumps(row) + "\n")
    (worker,) = load_step(tmp_path, 0)
    assert [e.kind for e in worker.events] == ["forward", "communication", "backward"]
