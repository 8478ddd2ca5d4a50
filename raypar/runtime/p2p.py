"""A step's sends and receives between pipeline stages, posted without waiting.

Each goes on its channel's communicator (`StageGroups.channels`: one per direction of each
link) when the program reaches it. A compute waits only for the receive of its input
(`received`); a send runs beside the stage's compute, and what must wait for it (the sent
tensor's memory, a release) is held until it is done (`after_send`, `poll`, `finish`).
On a channel, sends and receives run in posting order, which the schedule's validation
matched on both ends (`raypar.schedule.simulator`).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from raypar import host_wait
from raypar.runtime.comm import wait_for
from raypar.schedule import Action, Op

# The channel each op goes on, seen from the stage that posts it.
CHANNEL = {Op.SEND_F: ("F", "next"), Op.RECV_F: ("F", "prev"), Op.SEND_B: ("B", "prev"), Op.RECV_B: ("B", "next")}
# Sends a stage may have under way on one channel. The next waits for the oldest: a stage
# far ahead of its receiver would otherwise hold every unsent output (a release frees one
# only once it is sent). `raypar.schedule.simulator` models the same bound.
SENDS_IN_FLIGHT = 2


class Inflight:
    """The sends and receives one step has posted and not yet seen complete."""

    def __init__(self, channels: dict[tuple[str, str], object], timeout: timedelta) -> None:
        self.channels, self.timeout = channels, timeout
        self._recvs: dict[tuple[Op, int], object] = {}
        # (op, mb) -> [work, tensor (held until sent), callbacks to run once it is], in posting order
        self._sends: dict[tuple[Op, int], list] = {}

    def post(self, action: Action, tensor: torch.Tensor, peer: int) -> None:
        group = self.channels[CHANNEL[action.op]]
        if action.is_send:
            under_way = [key for key in self._sends if key[0] == action.op]
            for key in under_way[:len(under_way) - SENDS_IN_FLIGHT + 1]:
                wait_for(self._sends[key][0], self.timeout, f"send of {key[0].value}{key[1]}")
                self._done(key)
            self._sends[action.op, action.mb] = [dist.isend(tensor, dst=peer, group=group), tensor, []]
        else:
            self._recvs[action.op, action.mb] = dist.irecv(tensor, src=peer, group=group)

    def received(self, op: Op, mb: int, what: str) -> None:
        """Make what runs next wait for receive (op, mb) (on a GPU the stream waits, not the host)."""
        work = self._recvs.pop((op, mb), None)
        if work is not None:
            wait_for(work, self.timeout, what)

    def after_send(self, op: Op, mb: int, fn: Callable[[], None]) -> None:
        """Run `fn` once send (op, mb) is done: at once if it is."""
        entry = self._sends.get((op, mb))
        if entry is None:
            fn()
        else:
            entry[2].append(fn)

    def poll(self) -> None:
        """Let go of the sends that are done (their callbacks run), without waiting."""
        for key in [k for k, (work, _, _) in self._sends.items() if work.is_completed()]:
            self._done(key)

    def finish(self, what: str) -> None:
        """Wait for every send (a step's gradients are reduced only after it has sent them all)."""
        for key, (work, _, _) in list(self._sends.items()):
            wait_for(work, self.timeout, what)
            self._done(key)
        for key, work in list(self._recvs.items()):  # a program receives only what it uses: none left
            wait_for(work, self.timeout, what)
        self._recvs.clear()

    def _done(self, key: tuple[Op, int]) -> None:
        _, _, callbacks = self._sends.pop(key)
        for fn in callbacks:
            fn()


def connect_channels(channels: dict[tuple[str, str], object], prev: int | None, next_: int | None,
                     device: torch.device, timeout: timedelta) -> None:
    """One element over every channel of this stage before any step: NCCL connects a pair of
    ranks lazily, inside its first send or receive, and a first connection made inside a
    schedule's exchanges has hung a step before (BENCHMARKS.md)."""
    works = []
    for (kind, side), group in channels.items():
        peer = prev if side == "prev" else next_
        sending = (kind, side) in (("F", "next"), ("B", "prev"))
        t = torch.zeros(1, device=device)
        works.append(dist.isend(t, dst=peer, group=group) if sending else dist.irecv(t, src=peer, group=group))
    for work in works:
        wait_for(work, timeout, "connecting pipeline neighbours")
    host_wait.synchronize(device, "connecting pipeline neighbours")
