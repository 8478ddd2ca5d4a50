"""Lowering: turn compute-only orders into full per-stage programs.

Receives go right before the compute that needs them and sends right after the compute that
produces them. That makes communication of neighbouring computes adjacent (1F1B's steady state
gives `SEND_F(i) RECV_B(j)`), and the runtime posts each adjacent run as one batched p2p call;
pairing a send with the receive the peer is posting at the same time is what keeps NCCL, whose
p2p calls block until the peer posts the matching call, from deadlocking.
"""
from __future__ import annotations

from typing import Sequence

from raypar.schedule.generators import get_schedule
from raypar.schedule.ir import Action, Op, ScheduleError, comm_groups
from raypar.schedule.simulator import validate

__all__ = ["build_programs", "comm_groups", "lower"]


def lower(compute_orders: Sequence[Sequence[Action]], release: bool = True) -> list[list[Action]]:
    """Insert communication, (optionally) memory releases, and the end-of-step actions."""
    n_stages = len(compute_orders)
    if n_stages == 0:
        raise ScheduleError("lower() needs at least one stage")
    programs = []
    for s, order in enumerate(compute_orders):
        first, last = s == 0, s == n_stages - 1
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
            # A receive is posted before the W's ahead of its compute: it arrives while they run.
            forward = action.op is Op.F
            if not (first if forward else last):
                program.append(Action(Op.RECV_F if forward else Op.RECV_B, action.mb, s - 1 if forward else s + 1))
            program += weights
            weights = []
            program.append(action)
            if not (last if forward else first):
                program.append(Action(Op.SEND_F if forward else Op.SEND_B, action.mb, s + 1 if forward else s - 1))
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
                out.append(Action(Op.RELEASE_OUT, action.mb))
            elif action.op is Op.SEND_B:
                out.append(Action(Op.RELEASE_IN, action.mb))
    return out


def build_programs(
    schedule: str, n_stages: int, n_microbatches: int, release: bool = True
) -> list[list[Action]]:
    """Generate, lower and validate the programs of every stage for one training step."""
    programs = lower(get_schedule(schedule)(n_stages, n_microbatches), release)
    validate(programs)  # a program that would deadlock or misorder must never reach the runtime
    return programs
