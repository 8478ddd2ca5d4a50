"""Run per-stage programs without tensors: prove them correct and deadlock-free, and time them.

Communication follows NCCL, the strictest backend: each comm unit (see `comm_groups`) is posted
when its stage reaches it and completes only once the matching call of every op in it has been
posted by the peer; until then its stage is blocked. Messages on one directed channel
(src, dst, F or B) are matched in posting order. REDUCE_GRAD is a collective over all stages
(the global grad-norm needs every stage), so it completes once every stage has reached it.

Checks that depend only on one stage's program order (data dependencies, duplicates, releases)
and on channel order are done statically first; the timed run then only has to find deadlocks.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from raypar.schedule.ir import Action, Op, ScheduleError, comm_groups, format_program

Programs = Sequence[Sequence[Action]]
_Loc = tuple[int, int]  # (stage, index into that stage's program or unit list)


@dataclass
class SimResult:
    makespan: float
    busy: list[float]  # compute time per stage
    bubble_fraction: float  # 1 - sum(busy) / (n_stages * makespan)
    stage_bubble: list[float]  # 1 - busy[s] / makespan
    peak_live: list[int]  # per stage: max micro-batches whose F has run and whose B has not finished
    # per stage (action, start, end) for compute and comm actions; the ops of one comm unit
    # share its span, from the stage posting it to its completion
    timeline: list[list[tuple[Action, float, float]]]


def validate(programs: Programs) -> SimResult:
    """Simulate with default durations; raises ScheduleError on any invalid program."""
    return simulate(programs)


def simulate(
    programs: "Programs | Prepared",
    t_f: float | Sequence[float] = 1.0,
    t_b: float | Sequence[float] = 2.0,
    t_comm: float = 0.0,
) -> SimResult:
    """Check `programs` (one per stage) and time them; raises ScheduleError if they are invalid.

    t_f / t_b are forward / backward durations, one for all stages or one per stage; a comm unit
    takes t_comm after the last of its own and its partners' posts. Releases, REDUCE_GRAD and
    STEP take no time. `programs` may be the result of `prepare`, which skips the checks: a
    driver that times the same programs every step checks them once.
    """
    if not isinstance(programs, Prepared) and len(programs) == 0:
        raise ScheduleError("no programs: need one per stage")
    n = len(programs.programs) if isinstance(programs, Prepared) else len(programs)
    t_fwd = _per_stage(t_f, n, "t_f")
    t_bwd = _per_stage(t_b, n, "t_b")
    if t_comm < 0:
        raise ScheduleError(f"t_comm must be >= 0, got {t_comm}")
    prepared = programs if isinstance(programs, Prepared) else prepare(programs)
    return _run(prepared, t_fwd, t_bwd, t_comm)


@dataclass
class Prepared:
    """Programs that passed the static checks, with what a timed run needs (see `prepare`)."""

    programs: list[list[Action]]
    peak_live: list[int]
    units: list[list[tuple[Action, ...]]]
    # For every comm unit, each op and the (stage, unit) holding its partner: the unit waits for all.
    waits_for: dict[_Loc, list[tuple[Action, _Loc]]]


def prepare(programs: Programs) -> Prepared:
    """Check `programs` once (raises ScheduleError) for any number of timed `simulate` runs."""
    programs = [list(p) for p in programs]
    n = len(programs)
    if n == 0:
        raise ScheduleError("no programs: need one per stage")
    peak_live = [_check_stage(programs, s) for s in range(n)]
    _check_collectives(programs)
    partner = _match_channels(programs)
    units = [comm_groups(p) for p in programs]
    # per stage: program index -> unit index
    unit_of = [[u for u, unit in enumerate(stage_units) for _ in unit] for stage_units in units]
    waits_for: dict[_Loc, list[tuple[Action, _Loc]]] = defaultdict(list)
    for s, program in enumerate(programs):
        for i, a in enumerate(program):
            if a.is_comm:
                ps, pi = partner[(s, i)]
                waits_for[(s, unit_of[s][i])].append((a, (ps, unit_of[ps][pi])))
    return Prepared(programs, peak_live, units, waits_for)


def _per_stage(value: float | Sequence[float], n: int, name: str) -> list[float]:
    values = [float(value)] * n if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != n:
        raise ScheduleError(f"{name} has {len(values)} per-stage durations for {n} stages")
    if any(v < 0 for v in values):
        raise ScheduleError(f"{name} durations must be >= 0, got {values}")
    return values


def _programs_text(programs: Programs, stages: Sequence[int] | None = None) -> str:
    stages = range(len(programs)) if stages is None else stages
    return "".join(f"\n  stage {s}: {format_program(programs[s])}" for s in stages)


class _LazyText:
    """`_programs_text` formatted only when an f-string uses it."""

    def __init__(self, programs: Programs, stages: Sequence[int]):
        self.programs, self.stages = programs, stages

    def __format__(self, spec: str) -> str:
        return _programs_text(self.programs, self.stages)


def _expected_peer(op: Op, s: int) -> int:
    return s + 1 if op in (Op.SEND_F, Op.RECV_B) else s - 1


def _prerequisites(action: Action, s: int, n: int) -> list[Action]:
    """Actions that must have completed earlier on stage s before `action` may run."""
    mb = action.mb
    if action.op is Op.F:
        return [Action(Op.RECV_F, mb, s - 1)] if s > 0 else []
    if action.op is Op.B:
        return [Action(Op.F, mb)] + ([Action(Op.RECV_B, mb, s + 1)] if s < n - 1 else [])
    if action.op is Op.SEND_F:
        return [Action(Op.F, mb)]
    if action.op is Op.SEND_B:
        return [Action(Op.B, mb)]
    if action.op is Op.RELEASE_OUT:
        return [Action(Op.SEND_F, mb, s + 1)]
    if action.op is Op.RELEASE_IN:
        return [Action(Op.SEND_B, mb, s - 1)]
    return []


def _check_stage(programs: list[list[Action]], s: int) -> int:
    """Check one stage's local ordering rules; return its peak number of live micro-batches."""
    n, program = len(programs), programs[s]

    def fail(i: int, why: str) -> ScheduleError:
        shown = _programs_text(programs, [s])
        return ScheduleError(f"stage {s}: {program[i]} (action #{i}) {why}{shown}")

    done: set[Action] = set()
    live = peak = 0
    for i, a in enumerate(program):
        if Action(Op.STEP) in done:
            raise fail(i, "comes after STEP, which must be the last action")
        if a.is_comm:
            neighbour = _expected_peer(a.op, s)
            if not 0 <= a.peer < n:
                raise fail(i, f"names peer stage {a.peer}, but programs were given for {n} stage(s)")
            if not 0 <= neighbour < n:
                side = "next" if neighbour > s else "previous"
                raise fail(i, f"talks to a {side} stage, but stage {s} has none")
            if a.peer != neighbour:
                raise fail(i, f"must talk to the adjacent stage {neighbour}")
        if a.op is Op.RELEASE_OUT and s == n - 1:
            raise fail(i, "is on the last stage, which sends no activations to release")
        if a.op is Op.RELEASE_IN and s == 0:
            raise fail(i, "is on the first stage, which receives no activations to release")
        if a in done:
            raise fail(i, "appears twice")
        if a.op is Op.B and Action(Op.REDUCE_GRAD) in done:
            raise fail(i, "runs after REDUCE_GRAD, which needs every gradient")
        for need in _prerequisites(a, s, n):
            if need not in done:
                raise fail(i, f"runs before {need}")
        done.add(a)
        if a.op is Op.F:
            live += 1
            peak = max(peak, live)
        elif a.op is Op.B:
            live -= 1
    for i, a in enumerate(program):
        if a.op is Op.F and Action(Op.B, a.mb) not in done:
            raise fail(i, f"has no matching B{a.mb}")
    return peak


def _check_collectives(programs: list[list[Action]]) -> None:
    having = [s for s, p in enumerate(programs) if Action(Op.REDUCE_GRAD) in p]
    if having and len(having) != len(programs):
        missing = [s for s in range(len(programs)) if s not in having]
        raise ScheduleError(
            f"REDUCE_GRAD is collective over all stages, but stage(s) {missing} lack it "
            f"while stage(s) {having} have it{_programs_text(programs)}"
        )


def _match_channels(programs: list[list[Action]]) -> dict[_Loc, _Loc]:
    """Pair every send with its receive by channel order; return (stage, index) -> partner."""
    sends: dict[tuple[int, int, str], list[_Loc]] = defaultdict(list)
    recvs: dict[tuple[int, int, str], list[_Loc]] = defaultdict(list)
    for s, program in enumerate(programs):
        for i, a in enumerate(program):
            if a.is_comm:
                kind = a.op.value[-1]  # "F" or "B"
                if a.is_send:
                    sends[(s, a.peer, kind)].append((s, i))
                else:
                    recvs[(a.peer, s, kind)].append((s, i))

    def mb(loc: _Loc) -> int:
        return programs[loc[0]][loc[1]].mb

    partner: dict[_Loc, _Loc] = {}
    for src, dst, kind in sorted(sends.keys() | recvs.keys()):
        out, inc = sends[(src, dst, kind)], recvs[(src, dst, kind)]
        shown = _LazyText(programs, sorted({src, dst}))  # only an error message needs it
        for k, (snd, rcv) in enumerate(zip(out, inc)):
            if mb(snd) != mb(rcv):
                raise ScheduleError(
                    f"stage {src} sends {kind}{mb(snd)} to stage {dst} as message #{k} "
                    f"but stage {dst} expects {kind}{mb(rcv)}{shown}"
                )
            partner[snd], partner[rcv] = rcv, snd
        k = min(len(out), len(inc))
        if len(out) > k:
            raise ScheduleError(
                f"stage {src} sends {kind}{mb(out[k])} to stage {dst} as message #{k} "
                f"but stage {dst} posts only {k} {kind} receive(s) from stage {src}{shown}"
            )
        if len(inc) > k:
            raise ScheduleError(
                f"stage {dst} expects {kind}{mb(inc[k])} from stage {src} as message #{k} "
                f"but stage {src} posts only {k} {kind} send(s) to stage {dst}{shown}"
            )
    return partner


def _unit_text(unit: tuple[Action, ...]) -> str:
    return str(unit[0]) if len(unit) == 1 else f"[{format_program(unit)}]"


def _run(
    prepared: Prepared,
    t_fwd: list[float],
    t_bwd: list[float],
    t_comm: float,
) -> SimResult:
    programs, units, waits_for, peak_live = prepared.programs, prepared.units, prepared.waits_for, prepared.peak_live
    n = len(programs)

    pc = [0] * n
    clock = [0.0] * n
    busy = [0.0] * n
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(n)]
    posted: dict[_Loc, float] = {}  # comm unit -> time its stage reached it
    at_reduce: dict[int, float] = {}  # stage -> time it reached REDUCE_GRAD

    # Every time below is a function of the programs alone (a post time depends only on earlier
    # completions, which depend only on post times), so the order stages are visited in cannot
    # change the result; it only decides how many sweeps it takes.
    progress = True
    while progress:
        progress = False
        for s in range(n):
            while pc[s] < len(units[s]):
                unit = units[s][pc[s]]
                a = unit[0]
                if a.is_comm:
                    loc = (s, pc[s])
                    if loc not in posted:
                        posted[loc] = clock[s]
                        progress = True  # a new post can unblock a peer visited earlier
                    if not all(p in posted for _, p in waits_for[loc]):
                        break
                    end = max([posted[loc]] + [posted[p] for _, p in waits_for[loc]]) + t_comm
                    timeline[s].extend((x, posted[loc], end) for x in unit)
                    clock[s] = end
                elif a.op is Op.REDUCE_GRAD:
                    if s not in at_reduce:
                        at_reduce[s] = clock[s]
                        progress = True
                    if len(at_reduce) < n:
                        break
                    clock[s] = max(at_reduce.values())
                elif a.is_compute:
                    duration = t_fwd[s] if a.op is Op.F else t_bwd[s]
                    timeline[s].append((a, clock[s], clock[s] + duration))
                    clock[s] += duration
                    busy[s] += duration
                # Releases and STEP take no time and wait for nothing.
                pc[s] += 1
                progress = True

    stuck = [s for s in range(n) if pc[s] < len(units[s])]
    if stuck:
        raise ScheduleError(_deadlock_message(programs, units, pc, waits_for, posted, at_reduce))

    makespan = max(clock)
    total = sum(busy)
    return SimResult(
        makespan=makespan,
        busy=busy,
        bubble_fraction=1.0 - total / (n * makespan) if makespan > 0 else 0.0,
        stage_bubble=[1.0 - b / makespan if makespan > 0 else 0.0 for b in busy],
        peak_live=peak_live,
        timeline=timeline,
    )


def _deadlock_message(
    programs: list[list[Action]],
    units: list[list[tuple[Action, ...]]],
    pc: list[int],
    waits_for: dict[_Loc, list[tuple[Action, _Loc]]],
    posted: dict[_Loc, float],
    at_reduce: dict[int, float],
) -> str:
    states, details = [], []
    for s in range(len(programs)):
        if pc[s] == len(units[s]):
            states.append(f"stage {s} finished")
            continue
        unit = units[s][pc[s]]
        states.append(f"stage {s} waits at {_unit_text(unit)}")
        if unit[0].is_comm:
            for a, (ps, pu) in waits_for[(s, pc[s])]:
                if (ps, pu) not in posted:
                    wanted = _unit_text(units[ps][pu])
                    details.append(f"\n  stage {s}: {a} needs stage {ps} to post {wanted}")
        else:
            missing = [str(t) for t in range(len(programs)) if t not in at_reduce]
            details.append(f"\n  stage {s}: REDUCE_GRAD needs stage(s) {', '.join(missing)} to reach it")
    shown = _programs_text(programs)
    return "deadlock: " + ", ".join(states) + "".join(details) + "\n programs:" + shown
