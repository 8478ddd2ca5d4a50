"""Run per-stage programs without tensors: prove them correct and deadlock-free, and time them.

Communication follows the runtime on NCCL. Each direction of each pipeline link is a channel
(activations from stage s to s + 1, gradients from s + 1 to s) with a communicator of its
own. A stage posts a send or receive when its program reaches it and goes on at once: a
send never holds up the stage's compute, and a compute waits only for the receive of its
input. On a channel the ops run one after another in posting order, each once the stage's
compute has reached it (a send reads what that compute wrote); an op completes once its
partner has started on the other end. Messages on a channel are matched in posting order.
REDUCE_GRAD is a collective over all stages (the global grad-norm needs every stage),
entered once a stage's compute has reached it and its sends and receives are complete; it
completes once every stage has.

Checks that depend only on one stage's program order (data dependencies, duplicates, releases)
and on channel order are done statically first; the timed run then only has to find deadlocks.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

from raypar.schedule.ir import Action, Op, ScheduleError, format_program
from raypar.schedule.layout import Layout, single

Programs = Sequence[Sequence[Action]]
# Sends a stage may have under way on one channel (raypar.runtime.p2p: the next waits for the oldest).
SENDS_IN_FLIGHT = 2
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


def validate(programs: Programs, layout: Layout | None = None) -> SimResult:
    """Simulate with default durations; raises ScheduleError on any invalid program."""
    return simulate(prepare(programs, layout))


def simulate(
    programs: "Programs | Prepared",
    t_f: float | Sequence[float] = 1.0,
    t_b: float | Sequence[float] = 2.0,
    t_comm: float = 0.0,
    t_w: float | Sequence[float] | None = None,
) -> SimResult:
    """Check `programs` (one per stage) and time them; raises ScheduleError if they are invalid.

    t_f / t_b are forward / whole backward durations of one chunk's unit (with one chunk per
    stage, the stage's), one for all stages or one per stage; a
    split backward's W takes t_w (default half of t_b) and its I the rest. A comm unit takes
    t_comm after the last of its own and its partners' posts. Releases, REDUCE_GRAD and
    STEP take no time. `programs` may be the result of `prepare`, which skips the checks: a
    driver that times the same programs every step checks them once. Programs of more than
    one chunk per stage come prepared, with their layout (`prepare`).
    """
    if not isinstance(programs, Prepared) and len(programs) == 0:
        raise ScheduleError("no programs: need one per stage")
    n = len(programs.programs) if isinstance(programs, Prepared) else len(programs)
    t_fwd = _per_stage(t_f, n, "t_f")
    t_bwd = _per_stage(t_b, n, "t_b")
    t_wgt = [b / 2 for b in t_bwd] if t_w is None else _per_stage(t_w, n, "t_w")
    if any(w > b for w, b in zip(t_wgt, t_bwd)):
        raise ScheduleError(f"t_w {t_wgt} is part of the backward and cannot exceed t_b {t_bwd}")
    if t_comm < 0:
        raise ScheduleError(f"t_comm must be >= 0, got {t_comm}")
    prepared = programs if isinstance(programs, Prepared) else prepare(programs)
    return _run(prepared, t_fwd, t_bwd, t_wgt, t_comm)


@dataclass
class Prepared:
    """Programs that passed the static checks, with what a timed run needs (see `prepare`)."""

    programs: list[list[Action]]
    peak_live: list[int]
    partner: dict[_Loc, _Loc]  # every send's receive and every receive's send (stage, index)
    before: dict[_Loc, _Loc | None]  # the op posted before it on its channel by the same stage
    receive: list[dict[tuple[Op, int, int], int]]  # per stage: (RECV_F or RECV_B, mb, chunk) -> index
    layout: Layout


def prepare(programs: Programs, layout: Layout | None = None) -> Prepared:
    """Check `programs` once (raises ScheduleError) for any number of timed `simulate` runs.
    `layout`: where each chunk's neighbours are (default: one chunk per stage)."""
    programs = [list(p) for p in programs]
    n = len(programs)
    if n == 0:
        raise ScheduleError("no programs: need one per stage")
    layout = layout or single(n)
    if layout.n_actors != n:
        raise ScheduleError(f"{n} program(s) for a layout of {layout.n_actors} stage(s): give one per stage")
    peak_live = [_check_stage(programs, s, layout) for s in range(n)]
    _check_collectives(programs)
    partner = _match_channels(programs, layout)
    before: dict[_Loc, _Loc | None] = {}
    receive: list[dict[tuple[Op, int, int], int]] = []
    for s, program in enumerate(programs):
        last: dict[tuple[Op, int], _Loc] = {}
        for i, a in enumerate(program):
            if a.is_comm:
                before[(s, i)] = last.get((a.op, a.peer))
                last[(a.op, a.peer)] = (s, i)
        receive.append({(a.op, a.mb, a.chunk): i for i, a in enumerate(program) if a.op in (Op.RECV_F, Op.RECV_B)})
    return Prepared(programs, peak_live, partner, before, receive, layout)


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


def _neighbour(layout: Layout, op: Op, s: int, chunk: int) -> tuple[int, int] | None:
    """(stage, chunk) an op's data comes from or goes to: the next virtual stage for
    activations out and gradients in, the previous one otherwise."""
    downstream = op in (Op.SEND_F, Op.RECV_B, Op.RELEASE_OUT)
    return layout.next(s, chunk) if downstream else layout.prev(s, chunk)


def _prerequisites(action: Action, s: int, layout: Layout, split: set[tuple[int, int]]) -> list[Action]:
    """Actions that must have completed earlier on stage s before `action` may run (`split`:
    the (chunk, micro-batch)s whose backward runs as I and W)."""
    mb, c = action.mb, action.chunk

    def backward(chunk: int) -> Action:
        return Action(Op.I if (chunk, mb) in split else Op.B, mb, chunk=chunk)

    if action.op is Op.F:
        prev = layout.prev(s, c)
        if prev is None:
            return []
        return [Action(Op.F, mb, chunk=prev[1])] if prev[0] == s else [Action(Op.RECV_F, mb, prev[0], c)]
    if action.op in (Op.B, Op.I):
        nxt = layout.next(s, c)
        if nxt is None:
            return [Action(Op.F, mb, chunk=c)]
        return [Action(Op.F, mb, chunk=c),
                backward(nxt[1]) if nxt[0] == s else Action(Op.RECV_B, mb, nxt[0], c)]
    if action.op is Op.W:
        return [Action(Op.I, mb, chunk=c)]
    if action.op is Op.SEND_F:
        return [Action(Op.F, mb, chunk=c)]
    if action.op is Op.SEND_B:
        return [backward(c)]
    if action.op in (Op.RELEASE_OUT, Op.RELEASE_IN):
        peer = _neighbour(layout, action.op, s, c)[0]
        return [Action(Op.SEND_F if action.op is Op.RELEASE_OUT else Op.SEND_B, mb, peer, c)]
    return []


def _check_stage(programs: list[list[Action]], s: int, layout: Layout) -> int:
    """Check one stage's local ordering rules; return its peak number of live micro-batches
    (of all its chunks)."""
    n, program = len(programs), programs[s]

    def fail(i: int, why: str) -> ScheduleError:
        shown = _programs_text(programs, [s])
        return ScheduleError(f"stage {s}: {program[i]} (action #{i}) {why}{shown}")

    done: set[Action] = set()
    has = set(program)
    split = {a.key for a in program if a.op in (Op.I, Op.W)}
    live = peak = 0
    for i, a in enumerate(program):
        if Action(Op.STEP) in done:
            raise fail(i, "comes after STEP, which must be the last action")
        if a.chunk >= layout.n_chunks:
            raise fail(i, f"names chunk {a.chunk}, but the layout has {layout.n_chunks} chunk(s) per stage")
        if a.is_comm or a.is_release:
            neighbour = _neighbour(layout, a.op, s, a.chunk)
            side = "next" if a.op in (Op.SEND_F, Op.RECV_B, Op.RELEASE_OUT) else "previous"
            where = f"chunk {a.chunk} of stage {s}" if layout.n_chunks > 1 else f"stage {s}"
            if a.is_comm and not 0 <= a.peer < n:
                raise fail(i, f"names peer stage {a.peer}, but programs were given for {n} stage(s)")
            if neighbour is None and a.op is Op.RELEASE_OUT:
                raise fail(i, f"is on the last stage ({where}), which sends no activations to release")
            if neighbour is None and a.op is Op.RELEASE_IN:
                raise fail(i, f"is on the first stage ({where}), which receives no activations to release")
            if neighbour is None:
                raise fail(i, f"talks to a {side} stage, but {where} has none")
            if neighbour[0] == s:
                raise fail(i, f"exchanges with chunk {neighbour[1]} of its own stage, which is handed over "
                              f"without a send")
            if a.is_comm and a.peer != neighbour[0]:
                raise fail(i, f"must talk to the adjacent stage {neighbour[0]}")
        if a in done:
            raise fail(i, "appears twice")
        if a.op.is_backward and Action(Op.REDUCE_GRAD) in done:
            raise fail(i, "runs after REDUCE_GRAD, which needs every gradient")
        if a.op is Op.B and a.key in split:
            raise fail(i, f"is a whole backward of a micro-batch whose backward also runs split "
                          f"({Action(Op.I, a.mb, chunk=a.chunk)}, {Action(Op.W, a.mb, chunk=a.chunk)})")
        for need in _prerequisites(a, s, layout, split):
            if need not in done:
                raise fail(i, f"runs before {need}")
        done.add(a)
        # A micro-batch's activations live from its F until its last backward: B, or W (W
        # still needs the layers' inputs).
        if a.op is Op.F:
            live += 1
            peak = max(peak, live)
        elif a.op in (Op.B, Op.W):
            live -= 1
    for i, a in enumerate(program):
        if a.op is not Op.F:
            continue
        b, i_, w = (Action(op, a.mb, chunk=a.chunk) for op in (Op.B, Op.I, Op.W))
        if not (b in has or {i_, w} <= has):
            raise fail(i, f"has no matching {b} (or {i_} and {w})")
    return peak


def _check_collectives(programs: list[list[Action]]) -> None:
    having = [s for s, p in enumerate(programs) if Action(Op.REDUCE_GRAD) in p]
    if having and len(having) != len(programs):
        missing = [s for s in range(len(programs)) if s not in having]
        raise ScheduleError(
            f"REDUCE_GRAD is collective over all stages, but stage(s) {missing} lack it "
            f"while stage(s) {having} have it{_programs_text(programs)}"
        )


def _match_channels(programs: list[list[Action]], layout: Layout) -> dict[_Loc, _Loc]:
    """Pair every send with its receive by channel order; return (stage, index) -> partner.
    A message is a micro-batch's tensor from one virtual stage: of the sender's chunk, and
    of the receiver's chunk's neighbour."""
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

    def message(loc: _Loc) -> tuple[int, int]:
        a = programs[loc[0]][loc[1]]
        vs = layout.virtual(loc[0], a.chunk)
        if not a.is_send:
            vs += -1 if a.op is Op.RECV_F else 1
        return a.mb, vs

    def mb(loc: _Loc) -> str:
        a = programs[loc[0]][loc[1]]
        return f"{a.mb}" if layout.n_chunks == 1 else f"{a.mb} of virtual stage {message(loc)[1]}"

    partner: dict[_Loc, _Loc] = {}
    for src, dst, kind in sorted(sends.keys() | recvs.keys()):
        out, inc = sends[(src, dst, kind)], recvs[(src, dst, kind)]
        shown = _LazyText(programs, sorted({src, dst}))  # only an error message needs it
        for k, (snd, rcv) in enumerate(zip(out, inc)):
            if message(snd) != message(rcv):
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


def _needs(a: Action, s: int, layout: Layout) -> tuple[Op, int, int] | None:
    """The receive whose data compute `a` on stage s reads, if any (a hand-over between two
    chunks of the stage is no receive: program order covers it)."""
    if a.op is Op.F:
        source = layout.prev(s, a.chunk)
        return (Op.RECV_F, a.mb, a.chunk) if source is not None and source[0] != s else None
    if a.op in (Op.B, Op.I):
        source = layout.next(s, a.chunk)
        return (Op.RECV_B, a.mb, a.chunk) if source is not None and source[0] != s else None
    return None


def _run(
    prepared: Prepared,
    t_fwd: list[float],
    t_bwd: list[float],
    t_wgt: list[float],
    t_comm: float,
) -> SimResult:
    programs, partner, before, receive = prepared.programs, prepared.partner, prepared.before, prepared.receive
    n = len(programs)
    # Each send's SENDS_IN_FLIGHT-th send before it on its channel, which must be done first.
    in_flight_bound: dict[_Loc, _Loc | None] = {}
    for loc in sorted(before):
        back, prior = loc, None
        for _ in range(SENDS_IN_FLIGHT):
            prior = before[back]
            if prior is None:
                break
            back = prior
        in_flight_bound[loc] = prior

    pc = [0] * n
    clock = [0.0] * n  # compute
    busy = [0.0] * n
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(n)]
    posted: dict[_Loc, float] = {}  # comm op -> when its stage's compute reached it
    started: dict[_Loc, float] = {}  # -> when it started on its channel
    completed: dict[_Loc, float] = {}
    open_ops: list[_Loc] = []  # posted, not completed
    at_reduce: dict[int, float] = {}  # stage -> when it entered REDUCE_GRAD

    # Every time below is a function of the programs alone (a start depends only on earlier
    # completions and posts, which depend only on earlier starts), so the order stages are
    # visited in cannot change the result; it only decides how many sweeps it takes.
    progress = True
    while progress:
        progress = False
        for s in range(n):
            program = programs[s]
            while pc[s] < len(program):
                a = program[pc[s]]
                if a.is_comm:
                    if a.is_send:
                        # At most SENDS_IN_FLIGHT sends under way on a channel: the next waits
                        # for the oldest (the runtime holds what an unsent output uses).
                        oldest = in_flight_bound[(s, pc[s])]
                        if oldest is not None:
                            if oldest not in completed:
                                break
                            clock[s] = max(clock[s], completed[oldest])
                    posted[(s, pc[s])] = clock[s]
                    open_ops.append((s, pc[s]))
                elif a.op is Op.REDUCE_GRAD:
                    if s not in at_reduce:
                        mine = [loc for loc in posted if loc[0] == s]
                        if not all(loc in completed for loc in mine):
                            break
                        at_reduce[s] = max([clock[s]] + [completed[loc] for loc in mine])
                        progress = True
                    if len(at_reduce) < n:
                        break
                    clock[s] = max(at_reduce.values())
                elif a.is_compute:
                    need = _needs(a, s, prepared.layout)
                    start = clock[s]
                    if need is not None:
                        loc = (s, receive[s][need])
                        if loc not in completed:
                            break
                        start = max(start, completed[loc])
                    duration = {Op.F: t_fwd[s], Op.B: t_bwd[s], Op.I: t_bwd[s] - t_wgt[s], Op.W: t_wgt[s]}[a.op]
                    timeline[s].append((a, start, start + duration))
                    clock[s] = start + duration
                    busy[s] += duration
                # Releases and STEP take no time and wait for nothing.
                pc[s] += 1
                progress = True
        still_open = []
        for loc in open_ops:
            if loc not in started:
                prior = before[loc]
                if prior is not None and prior not in completed:
                    still_open.append(loc)
                    continue
                started[loc] = max(posted[loc], completed[prior] if prior is not None else 0.0)
                progress = True
            other = partner[loc]
            if other not in started:
                still_open.append(loc)
                continue
            completed[loc] = max(started[loc], started[other]) + t_comm
            timeline[loc[0]].append((programs[loc[0]][loc[1]], started[loc], completed[loc]))
            progress = True
        open_ops = still_open

    if open_ops or any(pc[s] < len(programs[s]) for s in range(n)):
        raise ScheduleError(_deadlock_message(prepared, pc, started, completed, at_reduce))

    ends = [max([clock[s]] + [t for (q, _), t in completed.items() if q == s]) for s in range(n)]
    for stage_timeline in timeline:
        stage_timeline.sort(key=lambda entry: entry[1])
    makespan = max(ends)
    total = sum(busy)
    return SimResult(
        makespan=makespan,
        busy=busy,
        bubble_fraction=1.0 - total / (n * makespan) if makespan > 0 else 0.0,
        stage_bubble=[1.0 - b / makespan if makespan > 0 else 0.0 for b in busy],
        peak_live=prepared.peak_live,
        timeline=timeline,
    )


def _deadlock_message(prepared: Prepared, pc: list[int], started: dict, completed: dict,
                      at_reduce: dict[int, float]) -> str:
    programs, partner, receive = prepared.programs, prepared.partner, prepared.receive
    n = len(programs)
    states, details = [], []
    for s in range(n):
        program = programs[s]
        if pc[s] == len(program):
            states.append(f"stage {s} finished its program")
        elif program[pc[s]].op is Op.REDUCE_GRAD:
            states.append(f"stage {s} waits at REDUCE_GRAD")
            missing = [str(t) for t in range(n) if t not in at_reduce]
            if missing:
                details.append(f"\n  stage {s}: REDUCE_GRAD needs stage(s) {', '.join(missing)} to reach it")
        else:
            a = program[pc[s]]
            need = _needs(a, s, prepared.layout) if a.is_compute else None
            if need is not None:
                states.append(f"stage {s} waits at {a} for {program[receive[s][need]]}")
            else:  # a send, held by the sends under way on its channel
                states.append(f"stage {s} waits at {a} for an earlier send on its channel "
                              f"(at most {SENDS_IN_FLIGHT} under way)")
    for (s, i), (ps, pi) in sorted(partner.items()):
        if (s, i) in completed or (ps, pi) in started:
            continue
        if s < len(pc) and i < pc[s] and (s, i) in started:
            details.append(f"\n  stage {s}: {programs[s][i]} needs stage {ps} to post {programs[ps][pi]}")
    shown = _programs_text(programs)
    return "deadlock: " + ", ".join(states) + "".join(details) + "\n programs:" + shown
