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


def channel_key(action: Action, stage: int) -> tuple[str, int, int]:
    """(kind, sending stage, receiving stage): the channel a send or receive of `stage` goes on."""
    kind = action.op.value[-1]
    return (kind, stage, action.peer) if action.is_send else (kind, action.peer, stage)

# Sends a stage may have under way on one channel. The next waits for the oldest: a stage
# far ahead of its receiver would otherwise hold every unsent output (a release frees one
# only once it is sent). `raypar.schedule.simulator` models the same bound.
SENDS_IN_FLIGHT = 2


class Inflight:
    """The sends and receives one step has posted and not yet seen complete."""

    def __init__(self, channels: dict[tuple[str, int, int], object], stage: int, line: list[int],
                 timeout: timedelta) -> None:
        """`line`: the global rank of each stage of the pipeline."""
        self.channels, self.stage, self.line, self.timeout = channels, stage, line, timeout
        self._recvs: dict[tuple[Op, int, int], object] = {}
        # (op, chunk, mb) -> [work, tensor (held until sent), callbacks to run once it is, the
        # send action], in posting order
        self._sends: dict[tuple[Op, int, int], list] = {}

    def post(self, action: Action, tensor: torch.Tensor) -> None:
        channel = channel_key(action, self.stage)
        group, peer = self.channels[channel], self.line[action.peer]
        if action.is_send:
            under_way = [key for key, entry in self._sends.items() if channel_key(entry[3], self.stage) == channel]
            for key in under_way[:len(under_way) - SENDS_IN_FLIGHT + 1]:
                wait_for(self._sends[key][0], self.timeout, f"send of {self._sends[key][3]}")
                self._done(key)
            self._sends[(action.op, *action.key)] = [dist.isend(tensor, dst=peer, group=group), tensor, [], action]
        else:
            self._recvs[(action.op, *action.key)] = dist.irecv(tensor, src=peer, group=group)

    def received(self, op: Op, key: tuple[int, int], what: str) -> None:
        """Make what runs next wait for receive (op, (chunk, mb)) (on a GPU the stream waits, not the host)."""
        work = self._recvs.pop((op, *key), None)
        if work is not None:
            wait_for(work, self.timeout, what)

    def after_send(self, op: Op, key: tuple[int, int], fn: Callable[[], None]) -> None:
        """Run `fn` once send (op, (chunk, mb)) is done: at once if it is."""
        entry = self._sends.get((op, *key))
        if entry is None:
            fn()
        else:
            entry[2].append(fn)

    def poll(self) -> None:
        """Let go of the sends that are done (their callbacks run), without waiting."""
        for key in [k for k, (work, *_) in self._sends.items() if work.is_completed()]:
            self._done(key)

    def finish(self, what: str) -> None:
        """Wait for every send (a step's gradients are reduced only after it has sent them all)."""
        for key, (work, *_) in list(self._sends.items()):
            wait_for(work, self.timeout, what)
            self._done(key)
        for key, work in list(self._recvs.items()):  # a program receives only what it uses: none left
            wait_for(work, self.timeout, what)
        self._recvs.clear()

    def _done(self, key: tuple[Op, int, int]) -> None:
        _, _, callbacks, _ = self._sends.pop(key)
        for fn in callbacks:
            fn()


def connect_channels(channels: dict[tuple[str, int, int], object], stage: int, line: list[int],
                     device: torch.device, timeout: timedelta) -> None:
    """One element over every channel of this stage before any step: NCCL connects a pair of
    ranks lazily, inside its first send or receive, and a first connection made inside a
    schedule's exchanges has hung a step before (BENCHMARKS.md)."""
    works = []
    for (_, src, dst), group in channels.items():
        t = torch.zeros(1, device=device)
        works.append(dist.isend(t, dst=line[dst], group=group) if src == stage
                     else dist.irecv(t, src=line[src], group=group))
    for work in works:
        wait_for(work, timeout, "connecting pipeline neighbours")
    host_wait.synchronize(device, "connecting pipeline neighbours")
