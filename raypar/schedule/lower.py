"""Lowering: turn compute-only orders into full per-stage programs.

Receives go right before the compute that needs them and sends right after the compute that
produces them. That makes communication of neighbouring computes adjacent (1F1B's steady state
gives `SEND_F(i) RECV_B(j)`), and the runtime posts each adjacent run as one batched p2p call;
pairing a send with the receive the peer is posting at the same time is what keeps NCCL, whose
p2p calls block until the peer posts the matching call, from deadlocking.
"""
from __future__ import annotations

from typing import Sequence

from raypar.schedule.generators import compute_orders, schedule_layout
from raypar.schedule.ir import Action, Op, ScheduleError, comm_groups
from raypar.schedule.layout import Layout, single
from raypar.schedule.simulator import validate

__all__ = ["build_programs", "comm_groups", "lower"]


def lower(compute_orders: Sequence[Sequence[Action]], release: bool = True,
          layout: Layout | None = None) -> list[list[Action]]:
    """Insert communication, (optionally) memory releases, and the end-of-step actions.

    `layout` says which worker holds each chunk's neighbours (default: one chunk per worker);
    a hand-over between two chunks of one worker (ZB-V's turn) needs no send."""
    n_stages = len(compute_orders)
    if n_stages == 0:
        raise ScheduleError("lower() needs at least one stage")
    layout = layout or single(n_stages)
    if layout.n_actors != n_stages:
        raise ScheduleError(f"lower() got orders for {n_stages} stage(s) and a layout of {layout.n_actors} worker(s)")
    programs = []
    for s, order in enumerate(compute_orders):
        program: list[Action] = []
        weights: list[Action] = []  # W's waiting for the next compute that talks to a peer
        for action in order:
            if action.op is Op.W:
                weights.append(action)
                continue
            if action.op not in (Op.F, Op.B, Op.I):
                raise ScheduleError(
                    f"lower() takes compute-only orders (F, B, I and W), but stage {s} has {action}"
                )
            if action.chunk >= layout.n_chunks:
                raise ScheduleError(f"stage {s}: {action} names chunk {action.chunk}, but the layout has "
                                    f"{layout.n_chunks} chunk(s) per stage")
            forward = action.op is Op.F
            source = layout.prev(s, action.chunk) if forward else layout.next(s, action.chunk)
            target = layout.next(s, action.chunk) if forward else layout.prev(s, action.chunk)
            # A receive is posted before the W's ahead of its compute: it arrives while they run.
            if source is not None and source[0] != s:
                program.append(Action(Op.RECV_F if forward else Op.RECV_B, action.mb, source[0], action.chunk))
            program += weights
            weights = []
            program.append(action)
            if target is not None and target[0] != s:
                program.append(Action(Op.SEND_F if forward else Op.SEND_B, action.mb, target[0], action.chunk))
        program += weights
        if release:
            program = _insert_releases(program)
        program += [Action(Op.REDUCE_GRAD), Action(Op.STEP)]
        programs.append(program)
    return programs


def _insert_releases(program: list[Action]) -> list[Action]:
    # A release goes after the whole comm run holding its send: putting it inside would split
    # one batched p2p call into two, which can deadlock. The send's presence already encodes
    # the stage condition (only non-last stages SEND_F, only non-first stages SEND_B).
    out: list[Action] = []
    for group in comm_groups(program):
        out.extend(group)
        for action in group:
            if action.op is Op.SEND_F:
                out.append(Action(Op.RELEASE_OUT, action.mb, chunk=action.chunk))
            elif action.op is Op.SEND_B:
                out.append(Action(Op.RELEASE_IN, action.mb, chunk=action.chunk))
    return out


def build_programs(
    schedule: str, n_stages: int, n_microbatches: int, release: bool = True, chunks: int | None = None
) -> list[list[Action]]:
    """Generate, lower and validate the programs of every stage for one training step;
    `chunks`: model chunks per stage of an interleaved schedule (`schedule_layout`)."""
    layout = schedule_layout(schedule, n_stages, chunks)
    programs = lower(compute_orders(schedule, layout, n_microbatches), release, layout)
    validate(programs, layout)  # a program that would deadlock or misorder must never reach the runtime
    return programs
