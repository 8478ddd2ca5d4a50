"""A worker's newest states in host memory, and replicas of a peer's, for recovery
without storage (`elastic.memory_every`).

After every K-th step a worker copies all the state it holds (weights, fp32 masters, AdamW,
EMA, RNG) into host memory, beside the next step as a checkpoint snapshot does
(`StateSnapshot`), and keeps its three newest complete copies. Copies are also sent to one
peer (a worker on another node where there is one) at their own pace, on a thread of their
own, while the copies go on; the peer keeps the two newest it received whole (copied into
the buffers of the replica they replace: `replica_buffers`), and the sender keeps the copies
those replicas came from. After a failure the controller asks the survivors what they hold
and restores the newest step every rank of the failed grid has somewhere: a lost rank's
from its own copies where they outlived it, else from its peer's replica.

With `SharedCopies` (`elastic.memory_shared`) the copies and replicas are made in files in
shared memory, which outlive the process: a lost worker's newest copies are still on its
node, where the other workers list and serve them.

Tensors travel between processes as raw bytes in numpy arrays (Ray moves those without
pickling them; numpy has no bfloat16), with their dtype and shape beside them.
"""
from __future__ import annotations

import functools
import threading
import time
import warnings
from typing import Callable

import numpy as np
import torch

from raypar.checkpoint.pieces import split_piece_name
from raypar.model.tensor_parallel import split_tp_piece_name
from raypar.runtime.shared_copies import SharedCopies
from raypar.runtime.snapshot import StateSnapshot

Packed = dict[str, tuple[str, tuple[int, ...], np.ndarray]]

# Complete copies of its own state a worker keeps, the newest: a lost peer's own copy may
# lag the driver's newest complete step by one, and a survivor may have run one step past it.
OWN_KEPT = 3
# Copies a worker holds at most: the newest, one being made, and the two its replicas come
# from (the last one its peer holds, and the one on its way there), which replication at
# its own pace leaves behind the newest: a lost node's ranks come back at the step of their
# replicas, so the other ranks must still hold their own copies of it.
OWN_SLOTS = OWN_KEPT + 3
# Copies a worker holds at most when it sends no replicas (alone, or on one node with its
# copies in shared memory): its kept copies and one being made. The other slots get buffers only
# once a peer is set.
OWN_SLOTS_ALONE = OWN_KEPT + 1
# Replicas a worker keeps of each peer's state: the newest may be of a step the driver has
# not seen every report of when a failure comes (the peer ran ahead), so the one before it
# stays too.
REPLICAS_KEPT = 2


def pack(tensors: dict[str, torch.Tensor]) -> Packed:
    """Host tensors as (dtype, shape, raw bytes) without copying them."""
    return {name: (str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy())
            for name, t in tensors.items()}


def unpack(packed: Packed, names: set[str] | None = None, copy: bool = True) -> dict[str, torch.Tensor]:
    """`pack`'s tensors (those of tensors in `names`, flat pieces too): copied into this process's own memory, or with
    `copy=False` read-only views of the arrays as Ray returned them (for a load that copies
    them into its own tensors next, one copy fewer)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: torch.from_numpy(np.array(raw, copy=copy)).view(getattr(torch, dtype)).reshape(shape)
                for name, (dtype, shape, raw) in packed.items()
                if names is None or tensor_name(name) in names}


def tensor_name(key: str) -> str:
    """The global tensor a key of a copy holds (all of, a flat piece of, a tp slice of, or a
    flat piece of a tp slice: `<name>#tp<d>.<i>.<p>@<start>`)."""
    return split_tp_piece_name(split_piece_name(key)[0])[0]


def choose_sources(held: list[list[str]], needed: set[str], own_keys: dict[str, str]) -> list[int]:
    """Which of the states a restore is offered (`held[i]`: the keys of state i) a worker
    fetches to load the tensors `needed` (global names). Each tensor needs one state holding
    it whole or holding exactly this worker's tp slice of it (`own_keys`: global name -> that
    slice's key); else each piece of it (a sharded optimizer's flat shares: of this worker's
    slice where any are held, else of the whole tensor; other tp slices) needs one state
    holding that piece. The same key in several states is the same tensor (replicas), so one
    of them suffices. Fewest states first, earlier ones where they tie; returns their indices,
    sorted."""
    holders: dict[str, set[int]] = {}
    for i, keys in enumerate(held):
        for key in keys:
            holders.setdefault(key, set()).add(i)
    pieces: dict[str, set[str]] = {}  # global name -> keys of its pieces
    for key in holders:
        pieces.setdefault(tensor_name(key), set()).add(key)
    wanted: list[set[int]] = []  # one state of each is fetched
    for name in needed:
        own = own_keys.get(name)
        whole = holders.get(name, set()) | holders.get(own, set())
        if whole:
            wanted.append(whole)
            continue
        found = pieces.get(name, set())
        mine = {key for key in found if split_piece_name(key)[0] == own} if own else set()
        wanted += [holders[key] for key in mine or found]
    chosen: set[int] = set()
    pending = wanted
    while pending:
        best = max(range(len(held)), key=lambda i: (sum(i in where for where in pending), -i))
        chosen.add(best)
        pending = [where for where in pending if best not in where]
    return sorted(chosen)


class RecentStates:
    """Own copies (by step) and peers' replicas (by rank) of one worker's process.

    Kept across re-plans (a kept worker's copies are what a recovery restores from); the
    ranks are those of the grid that took them, until `clear`.
    """

    def __init__(self, shared: SharedCopies | None = None) -> None:
        """`shared`: where copies and replicas are made so that they outlive this process
        (None: in its private memory)."""
        self._lock = threading.Lock()
        self._rank: int | None = None
        self.shared = shared
        self._slots = [f"own{i}" for i in range(OWN_SLOTS)]  # each copy's file in `shared`
        self._copies: list[StateSnapshot] = [
            StateSnapshot(allocate=functools.partial(shared.allocate, slot) if shared else None)
            for slot in self._slots]
        self._complete: dict[int, StateSnapshot] = {}  # step -> copy
        self._copying: StateSnapshot | None = None
        self._making: threading.Thread | None = None  # makes the copy under way
        self._sender: threading.Thread | None = None  # sends the last copy asked to be sent
        self._sender_busy = False
        # The steps of the copies replicas come from: the one being sent, the last one sent.
        self._sending_step: int | None = None
        self._sent_step: int | None = None
        self._cleared = 0  # `clear`s so far: a copy finished after one is dropped
        # rank -> step -> (its file in `shared` or None, tensors)
        self._replicas: dict[int, dict[int, tuple[str | None, dict[str, torch.Tensor]]]] = {}
        # Per rank, the buffers of a replica no longer kept, for its next one.
        self._spare: dict[int, tuple[str | None, dict[str, torch.Tensor]]] = {}
        self._filling: dict[int, str | None] = {}  # rank -> the file `replica_buffers` gave its next replica
        self._replica_files = 0  # replica files made so far (their names)
        self.generation = 0  # of the peers set (`StageWorker.set_memory_peer`): replicas name theirs
        self.skipped = 0  # copies not taken because the last one was still being made
        self.replica_skipped = 0  # copies not sent because the last one was still being sent

    def begin(self, rank: int, step: int, collect: Callable[[], dict[str, torch.Tensor]],
              taken: dict[str, torch.Tensor], cuda: bool,
              send: Callable[[int], None] | None = None) -> bool:
        """Copy the state after `step` steps (`StateSnapshot.begin`'s arguments) on a thread of
        its own. With `send`, once the copy is whole `send(step)` runs on another thread (it
        sends the replica to the peer and returns once the peer holds it), while the next
        copies go on; the copy stays held until the next one sent has arrived.
        Returns False (and copies nothing) while the last copy is still being made, or while
        the next copy's buffers are still being pinned; a copy is not sent while the last one
        is still being sent (`replica_skipped`)."""
        with self._lock:
            if self._copying is not None:
                self.skipped += 1
                return False
            if self._rank != rank:
                self._complete.clear()
                self._sending_step = self._sent_step = None
                self._rank = rank
            free = self._next_copy()
            if free is None or free.reserving():  # pinning its buffers (after a recovery): copying would wait
                self.skipped += 1
                return False
            if send is not None and self._sender_busy:
                self.replica_skipped += 1
                send = None
            if send is not None:
                self._sender_busy = True
            self._copying = free
            cleared, generation = self._cleared, self.generation
            slot = self._slots[self._copies.index(free)]
            if self.shared is not None:
                self.shared.retract(slot)  # its file is about to be written
        free.begin(step, collect, taken, cuda)

        def finish() -> None:
            whole = False
            try:
                free.wait()
                with self._lock:
                    if cleared != self._cleared:
                        return
                    self._complete[step] = free
                    if send is not None:
                        self._sending_step = step
                    self._evict()
                    if self.shared is not None:
                        try:
                            self.shared.commit(slot, rank, step, generation, free.host_tensors())
                        except Exception:
                            if self.shared.own_dir.exists():
                                raise
                            return  # the run ended and another worker removed its files: nothing to keep
                    whole = True
            finally:
                with self._lock:
                    self._copying = None
                    if send is not None and not whole:
                        self._sender_busy = False
            if send is not None and whole:
                self._sender = threading.Thread(target=self._send, args=(send, step, cleared), name="recent-send",
                                                daemon=True)
                self._sender.start()

        self._making = threading.Thread(target=finish, name="recent-state", daemon=True)
        self._making.start()
        return True

    def _send(self, send: Callable[[int], None], step: int, cleared: int) -> None:
        """Send the copy of `step` to the peer; once it holds it, that copy replaces the last sent."""
        try:
            send(step)
        finally:
            with self._lock:
                self._sender_busy = False
                if cleared == self._cleared:
                    self._sending_step, self._sent_step = None, step
                    self._evict()

    def _evict(self) -> None:
        """Drop the complete copies that are neither the newest nor a replica's source (the lock held)."""
        keep = set(sorted(self._complete)[-OWN_KEPT:]) | {self._sending_step, self._sent_step}
        for old in [s for s in self._complete if s not in keep]:
            del self._complete[old]

    def _next_copy(self) -> StateSnapshot | None:
        """The copy the next state goes into: one that holds no complete state (the lock held)."""
        return next((c for c in self._copies if c not in self._complete.values()), None)

    def adopt(self, buffers: list[dict[str, torch.Tensor]]) -> None:
        """Host buffers allocated ahead, one set per copy (a standby pins them while it
        waits, before it knows its stage): `reserve` takes them instead of pinning."""
        with self._lock:
            for copy, held in zip(self._copies, buffers):
                copy.adopt(held)

    def reserve(self, layout, pin: bool, wait: bool = True, slots: int = OWN_SLOTS) -> float:
        """Allocate the host buffers for `layout` of the first `slots` copies (those they lack),
        all at once; copies are taken first-free in that order, so without replicas to send
        the first `OWN_SLOTS_ALONE` are all that are ever used.
        Pinning gigabytes takes seconds and holds up the process's CUDA calls: at the run's
        start `wait` makes setup pay for it rather than the first steps; in a recovery the
        next step should not wait for it (`wait=False`: on background threads; no copy is
        taken until they are done). Returns the seconds waited."""
        t0 = time.perf_counter()
        with self._lock:
            # Not the copies a recovery may still restore from (they keep their buffers, which
            # fit the next copies too while the grid stays the same).
            free = [c for c in self._copies[:slots] if c not in self._complete.values() and c is not self._copying]
        for copy in free:
            copy.reserve(layout, pin=pin)
        for copy in free if wait else ():
            copy.wait_reserved()
        return time.perf_counter() - t0

    def held_bytes(self) -> int:
        """Host memory the copies and replicas hold now: a node's free memory, measured after
        they were allocated, leaves it out, yet it counts towards what they need."""
        with self._lock:
            replicas = sum(t.nbytes for held in self._replicas.values() for _, tensors in held.values()
                           for t in tensors.values())
            return sum(c.held_bytes() for c in self._copies) + replicas

    def busy(self, steps_done: int) -> bool:
        """Whether a copy asked for after the next step would likely be skipped: one of a state
        before `steps_done` steps is still being made (the copy just begun for `steps_done`
        itself is not counted: it usually ends within a step), or no buffers are free or
        they are still being pinned."""
        with self._lock:
            if self._copying is not None:
                return self._copying.step != steps_done
            free = self._next_copy()
            return free is None or free.reserving()

    def sending(self) -> bool:
        """Whether a copy is still on its way to the peer: one asked to be sent now would not be."""
        with self._lock:
            return self._sender_busy

    def settle(self) -> None:
        """Wait until the copy under way (if any) is made, and sent where it was to be."""
        for thread in (self._making, self._sender):
            if thread is not None:
                thread.join()
        sender = self._sender  # started by the copy just joined
        if sender is not None:
            sender.join()

    def fence(self) -> float:
        """Order the copy being made before what the current stream runs next (`StateSnapshot.fence`)."""
        copying = self._copying
        return copying.fence() if copying is not None else 0.0

    def own(self, step: int) -> dict[str, torch.Tensor]:
        with self._lock:
            return self._complete[step].host_tensors()

    def replica_buffers(self, rank: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host tensors shaped as `like` to copy `rank`'s next replica into: those of its
        replica last dropped when they match (memory already mapped: a fresh allocation of
        gigabytes spends as long faulting its pages in as copying), else new ones."""
        with self._lock:
            slot, spare = self._spare.pop(rank, (None, None))
            if spare is not None and spare.keys() == like.keys() and all(
                    spare[n].shape == t.shape and spare[n].dtype == t.dtype for n, t in like.items()):
                self._filling[rank] = slot
                return spare
            if slot is not None:
                self.shared.free(slot)
            if self.shared is not None:
                self._replica_files += 1
                slot = f"replica{rank}-{self._replica_files}"
                buffers = self.shared.allocate(slot, {n: (t.shape, t.dtype) for n, t in like.items()})
                if buffers is not None:
                    self._filling[rank] = slot
                    return buffers
            self._filling[rank] = None
        return {n: torch.empty_like(t) for n, t in like.items()}

    def keep_replica(self, rank: int, step: int, tensors: dict[str, torch.Tensor], generation: int) -> None:
        """Keep `rank`'s state after `step` steps, sent for the peers set in `generation`; one
        sent for an earlier generation (before a re-plan renumbered the ranks) is dropped."""
        with self._lock:
            slot = self._filling.pop(rank, None)
            if generation != self.generation:
                if slot is not None:
                    self.shared.free(slot)
                return
            if slot is not None and not self.shared.commit(slot, rank, step, generation, tensors):
                self.shared.free(slot)  # not the buffers `replica_buffers` gave
                slot = None
            held = self._replicas.setdefault(rank, {})
            held[step] = (slot, tensors)
            for old in sorted(held)[:-REPLICAS_KEPT]:
                dropped = held.pop(old)
                if dropped[0] is not None:
                    self.shared.retract(dropped[0])
                if rank in self._spare and self._spare[rank][0] is not None:
                    self.shared.free(self._spare[rank][0])
                self._spare[rank] = dropped

    def inventory(self, generation: int | None = None) -> list[tuple[int, int]]:
        """(rank, step) of every whole state held: own copies and replicas; with `generation`,
        also those in shared memory on this node copied for that generation's peers (a lost
        process's among them)."""
        with self._lock:
            own = [(self._rank, s) for s in self._complete] if self._rank is not None else []
            held = own + [(r, s) for r, kept in self._replicas.items() for s in kept]
        if self.shared is not None and generation is not None:
            held += self.shared.inventory(generation)
        return sorted(set(held))

    def tensors(self, rank: int, step: int, generation: int | None = None) -> dict[str, torch.Tensor]:
        """The state of `rank` after `step` steps, own or replica, or with `generation` from
        shared memory on this node (KeyError when not held)."""
        with self._lock:
            if rank == self._rank and step in self._complete:
                copy = self._complete[step]
            elif step in self._replicas.get(rank, {}):
                return self._replicas[rank][step][1]
            elif self.shared is not None and generation is not None:
                return self.shared.read(rank, step, generation)
            else:
                raise KeyError((rank, step))
        return copy.host_tensors()

    def freeze(self) -> None:
        """Hold what is whole now, unchanged until `clear`: a copy finished later is dropped, as
        is a replica sent before the peers are set again. After a failure the controller asks
        what each worker holds and then fetches it; nothing may replace it in between."""
        with self._lock:
            self._cleared += 1
            self.generation = -1

    def clear(self) -> None:
        """Forget every copy and replica (after a restore: the new grid's ranks differ), and
        the copy under way once it is made; the host buffers stay for the next copies."""
        with self._lock:
            self._cleared += 1
            self._complete.clear()
            self._sending_step = self._sent_step = None
            if self.shared is not None:
                for slot, _ in [*self._spare.values(), *(r for kept in self._replicas.values() for r in kept.values())]:
                    if slot is not None:
                        self.shared.free(slot)
                self.shared.clear()  # also what processes that ended left on this node
            self._replicas.clear()
            self._spare.clear()
            self._rank = None

    def drop_shared(self) -> None:
        """The run is over: remove its files in shared memory on this node (any process's)."""
        if self.shared is not None:
            with self._lock:
                self.shared.drop()
