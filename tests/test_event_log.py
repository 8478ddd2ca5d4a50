"""events.jsonl stays whole when a GPU step's last units are timed in the next report."""
import io
import json
from types import SimpleNamespace

from raypar.driver.event_log import EventLog
from raypar.runtime.report import UnitSpan
from raypar.schedule import parse_program
from raypar.topology import Grid


def spans(units) -> list[UnitSpan]:
    return [UnitSpan(label, parse_program(label)[0].op, b, e) for label, b, e in units]


def report(rank: int, step: int, events: list, pending: int = 0, late_step=None, late_events=()):
    return SimpleNamespace(rank=rank, events=spans(events), issued=[b - 0.001 for _, b, _ in events],
                           pending_units=pending, late_step=late_step,
                           late_events=spans(late_events), called=0.0, reported=1.0)


def lines(out: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


GRID = Grid(dp=1, pp=2, ep=1)


def test_a_step_with_pending_units_is_written_once_the_next_report_brings_them():
    out = io.StringIO()
    log = EventLog(out)
    log.add(0, [report(0, 0, [("F0", 0.0, 1.0)], pending=1), report(1, 0, [("F0", 1.0, 2.0), ("STEP", 2.0, 3.0)])], GRID)
    assert [(r["step"], r["rank"]) for r in lines(out)] == [(0, 1)]  # rank 0's line waits for its STEP
    log.add(1, [report(0, 1, [("F0", 4.0, 5.0)], pending=1, late_step=0, late_events=[("STEP", 1.0, 3.5)]),
                report(1, 1, [("F0", 5.0, 6.0), ("STEP", 6.0, 7.0)])], GRID)
    written = {(r["step"], r["rank"]): r["events"] for r in lines(out)}
    assert written[(0, 0)] == [["F0", "F", 0.0, 1.0], ["STEP", "STEP", 1.0, 3.5]]
    assert (1, 0) not in written and (1, 1) in written


def test_the_last_steps_units_are_completed_or_flushed_as_they_are():
    out = io.StringIO()
    text = []
    out.close = lambda: text.append(out.getvalue())  # the log closes its file on exit
    with EventLog(out) as log:
        log.add(0, [report(0, 0, [("F0", 0.0, 1.0)], pending=1), report(1, 0, [("F0", 1.0, 2.0)], pending=1)], GRID)
        log.complete(0, 0, spans([("STEP", 1.0, 2.0)]))
        log.complete(1, 7, spans([("STEP", 9.0, 9.5)]))  # another step's tail (a re-planned run): not merged
    written = {r["rank"]: r["events"] for r in map(json.loads, text[0].splitlines())}
    assert written[0] == [["F0", "F", 0.0, 1.0], ["STEP", "STEP", 1.0, 2.0]]
    assert written[1] == [["F0", "F", 1.0, 2.0]]


def test_flush_writes_held_lines_after_a_failure():
    out = io.StringIO()
    log = EventLog(out)
    log.add(3, [report(0, 3, [("F0", 0.0, 1.0)], pending=1)], GRID)
    log.flush()
    assert [(r["step"], r["events"]) for r in lines(out)] == [(3, [["F0", "F", 0.0, 1.0]])]
    log.flush()
    assert len(lines(out)) == 1


def test_a_reports_tail_completes_it_as_if_the_stage_had_waited():
    """A first stage that reported ahead of its device (`StepReport.complete` false) gets
    its last units' times, its end of backward and its device values from its tail."""
    import dataclasses

    import pytest

    from raypar.runtime.report import ReportTail, StepReport, complete_report

    early = StepReport(
        rank=0, stage=0, step=3, losses=[], times=[10.0, 10.5], compute_s=0.5, start=10.0,
        end_of_backward=9.0, wall_s=0.1, called=9.0, reported=9.1, peak_activation_bytes=1, peak_device_bytes=2,
        peak_live_microbatches=1, released_outputs=0, expert_tokens={}, tokens_dropped=0, alltoall_bytes=0,
        alltoall_s=0.0, grad_norm=None, lr=1e-3, checkpoint_stall_s=0.0, complete=False, pending_units=3)
    tail = ReportTail(step=3, times=[10.5, 11.5, 11.5, 11.6, 11.6, 11.9], compute_s=1.0, end_of_backward=11.5,
                      losses=[], grad_norm=0.25, expert_tokens={"0": [3, 1]}, tokens_dropped=2)
    with pytest.raises(ValueError, match="tail of step 3 cannot complete step 4"):
        complete_report(dataclasses.replace(early, step=4), tail)
    report = complete_report(early, tail)
    assert report.complete and report.pending_units == 0
    assert report.times == [10.0, 10.5, 10.5, 11.5, 11.5, 11.6, 11.6, 11.9]
    assert report.start == 10.0 and report.compute_s == 1.5 and report.end_of_backward == 11.5
    assert (report.grad_norm, report.expert_tokens, report.tokens_dropped) == (0.25, {"0": [3, 1]}, 2)
    # Reported before the device had timed any unit: its start comes from the tail.
    none_timed = complete_report(dataclasses.replace(early, times=[], compute_s=0.0, complete=False),
                                 dataclasses.replace(tail, times=[10.0, 10.5] + tail.times))
    assert none_timed.start == 10.0 and none_timed.compute_s == 1.0
