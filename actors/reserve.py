"""What a worker group keeps between grids: survivors of a failure, free bundles, standbys.

After a failure, `salvage` keeps the workers that still answer and `fill` hands the next
grid those workers plus replacements (standbys first, then free bundles on live nodes, then
a new placement group), instead of starting every worker again.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import ray

from .placement import Slot, bundle_free, bundle_node, kill, slot_key

if TYPE_CHECKING:
    from .worker_group import WorkerGroup

# How long a salvage waits for the standbys to answer (they were asked with the survivors).
_STANDBY_PING_S = 1.0


class WorkerReserve:
    def __init__(self, group: WorkerGroup):
        self.group = group
        # After `salvage`: workers kept for the next grid, as (old rank, worker, slot, node id),
        # and slots whose worker is gone, as (slot, node id or None when unknown).
        self.survivors: list[tuple] = []
        self.idle: list[tuple[Slot, str | None]] = []
        # Started, idle workers that replace lost ones (elastic.standby_workers), as (worker, slot);
        # those that answered at the last salvage are the ones a recovery may use.
        self.standbys: list[tuple] = []
        self._standbys_ready: list[tuple] = []
        # elastic.standby_gpu=borrow: standbys run in bundles whose GPU, if any, is not theirs
        # to use: CPU-only bundles, and the bundles of lost workers whose GPU a standby took
        # (the keys of both in `_cpu_only`: no GPU worker starts in them). `standby_slots`:
        # those without a worker now, as (slot, node id or None).
        self.borrowing = group.cfg.elastic.standby_gpu == "borrow"
        self.standby_slots: list[tuple[Slot, str | None]] = []
        self._cpu_only: set[tuple[str, int]] = set()
        self._salvages = 0  # numbers each salvage's abort and reset for the workers

    # -- standbys --------------------------------------------------------------------------------

    def start_standbys(self, n: int) -> None:
        """Start `n` standby workers in a placement group of their own, without waiting for it:
        the grid never waits for its standbys."""
        if n > 0:
            slots = self.group.placement.reserve_later(n, gpu=not self.borrowing)
            if self.borrowing:
                self._cpu_only.update(slot_key(s) for s in slots)
            for slot in slots:
                self._add_standby(slot)

    def _add_standby(self, slot: Slot) -> None:
        worker = self.group.start_worker(slot, rank=-1, borrows_gpu=self.borrowing)
        worker.warm.remote()  # its start-up work now, not when it is needed
        self.standbys.append((worker, slot))

    def _free(self, slot: Slot, node: str | None) -> None:
        """A bundle without a worker: one for standbys only, or a worker's."""
        (self.standby_slots if slot_key(slot) in self._cpu_only else self.idle).append((slot, node))

    def _gpu_capable(self, slot: Slot) -> bool:
        return slot_key(slot) not in self._cpu_only

    def refill_standbys(self) -> None:
        """Replace the standbys a recovery used, on free bundles of live nodes (a lost worker's,
        or a borrowing standby's own). Called once the run is going again, so that their start
        does not slow the recovery."""
        for _ in range(self.group.cfg.elastic.standby_workers - len(self.standbys)):
            pool = self.standby_slots if self.borrowing else self.idle
            free = next((i for i, (_, node) in enumerate(pool) if node is not None), None)
            if free is None:
                return
            slot, _ = pool.pop(free)
            self._add_standby(slot)

    @property
    def salvages(self) -> int:
        """How many salvages this group has made: a worker reset outside one names the last."""
        return self._salvages

    # -- salvage ---------------------------------------------------------------------------------

    def salvage(self, timeout: float) -> int:
        """Keep the group's workers that still answer, kill the rest; returns how many stay.

        Each worker first lets its failed step return (on GPU, `abort` breaks NCCL calls
        stuck on the lost peer), then leaves its process groups and drops its stage
        (`reset`). A worker that has not done so within `timeout` seconds is killed, like a
        dead one. The kept workers wait for `fill`.
        """
        g = self.group
        # The grid's workers, and any kept before that a failed start did not place yet.
        candidates = [(rank, w, slot) for rank, (w, slot) in enumerate(zip(g.workers, g.slots))]
        candidates += [(rank, w, slot) for rank, w, slot, _ in self.survivors]
        self._salvages += 1
        for _, w, _ in candidates:
            # Also refuses the steps already queued behind the failed one.
            w.abort.remote(self._salvages, dump_after_s=0.8 * timeout)
        refs = [w.reset.remote(self._salvages) for _, w, _ in candidates]
        pings = [w.address.remote() for w, _ in self.standbys]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout) if refs else ([], [])
        ready = set(ready)
        # A live standby answers at once; one still waiting for room must not hold the recovery up.
        answered, _ = ray.wait(pings, num_returns=len(pings), timeout=_STANDBY_PING_S) if pings else ([], [])
        self._sort_standbys(pings, set(answered))
        survivors, idle = [], list(self.idle)
        for (rank, w, slot), ref in zip(candidates, refs):
            node = None
            if ref in ready:
                try:
                    node = ray.get(ref)
                except Exception:  # noqa: BLE001 - dead or broken: replaced below
                    node = None
            if node is not None:
                survivors.append((rank, w, slot, node))
            else:
                kill(w)
                idle.append((slot, None))
        self.survivors = survivors
        alive = self.proven_nodes()
        # A slot's bundle stays reserved after its worker died. Reuse it only where a survivor
        # or a standby just proved the node alive: a lost node's bundles wait for Ray to place
        # them again.
        nodes = [bundle_node(slot) for slot, _ in idle]
        self.idle = [(slot, node if node in alive else None) for (slot, _), node in zip(idle, nodes)]
        # The standbys' free bundles, like the workers', count only on nodes proven alive.
        self.standby_slots = [(slot, node if node in alive else None)
                              for slot, node in ((s, bundle_node(s)) for s, _ in self.standby_slots)]
        return len(survivors)

    def survivor_nodes(self) -> set[str]:
        """The nodes the survivors run on: alive, as their answers just proved."""
        return {node for *_, node in self.survivors}

    def proven_nodes(self) -> set[str]:
        """The nodes a survivor or a standby that answered the salvage runs on."""
        return self.survivor_nodes() | {bundle_node(slot) for _, slot in self._standbys_ready}

    def has_ready_standbys(self) -> bool:
        """Whether a standby answered the last salvage: it can take a lost rank even when no
        worker survived (a one-worker grid, or every worker on a lost node)."""
        return bool(self._standbys_ready)

    def _sort_standbys(self, pings: list, answered: set) -> None:
        """Standbys that answered may replace lost workers; dead ones are dropped; the rest
        (not placed yet, or slow to start) stay standbys for a later recovery."""
        ready, kept = [], []
        for entry, ref in zip(self.standbys, pings):
            if ref in answered:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - dead: its bundle waits for a proven node, like a lost worker's
                    kill(entry[0])
                    self._free(entry[1], None)
                    continue
                ready.append(entry)
            kept.append(entry)
        self.standbys, self._standbys_ready = kept, ready

    # -- the next grid ---------------------------------------------------------------------------

    def usable_slots(self) -> int:
        """Workers the next grid can have without new resources: survivors, standbys that answered
        (unless they borrow: then they only run in lost workers' bundles) and free bundles on
        live nodes."""
        live = [slot for slot, node in self.idle if node is not None]
        if not self.borrowing:
            return len(self.survivors) + len(self._standbys_ready) + len(live)
        # Borrowers take lost workers' bundles, those without a GPU of their own first; a new
        # worker needs one with its GPU.
        borrowed = min(len(self._standbys_ready), len(live))
        with_gpu = sum(map(self._gpu_capable, live))
        return len(self.survivors) + borrowed + min(with_gpu, len(live) - borrowed)

    def free_slots_on_live_nodes(self) -> int:
        """Bundles held without a worker whose resources a live node offers now: a lost
        node's count once Ray has placed them again (e.g. on a node that came back)."""
        if not self.idle:
            return 0
        available = ray.available_resources()
        return sum(1 for slot, _ in self.idle if bundle_free(slot, available))

    def fill(self, n: int) -> dict[str, int]:
        """Give the group `n` workers by rank: survivors keep their rank where it exists and fill
        the gaps otherwise; the rest come from the standbys, free bundles on live nodes, then a
        new placement group. Sets the group's workers and slots, also when it fails part way (so
        that a salvage or shutdown finds what it started). Returns how many were kept, started and
        taken from the standbys."""
        g = self.group
        survivors = sorted(self.survivors, key=lambda s: s[0])
        self.survivors = []
        for _, w, slot, node in survivors[n:]:  # the grid shrank below what survived
            kill(w)
            self.idle.append((slot, node))
        survivors = survivors[:n]
        workers: list = [None] * n
        slots: list = [None] * n
        moved = []
        for old, w, slot, _ in survivors:
            if old < n and workers[old] is None:
                workers[old], slots[old] = w, slot
            else:
                moved.append((w, slot))
        free = [r for r in range(n) if workers[r] is None]
        for (w, slot), r in zip(moved, free):
            workers[r], slots[r] = w, slot
        missing = [r for r in range(n) if workers[r] is None]
        from_standby = []
        for entry in self._standbys_ready:
            if len(from_standby) == len(missing):
                break
            slot = self._borrow_slot(*entry) if self.borrowing else entry[1]
            if slot is not None:
                r = missing[len(from_standby)]
                workers[r], slots[r] = entry[0], slot
                from_standby.append(entry)
        missing = missing[len(from_standby):]
        self.standbys = [s for s in self.standbys if not any(s is used for used in from_standby)]
        self._standbys_ready = []
        trusted = [i for i, (slot, node) in enumerate(self.idle)
                   if node is not None and self._gpu_capable(slot)][:len(missing)]
        usable = [self.idle[i][0] for i in trusted]
        self.idle = [x for i, x in enumerate(self.idle) if i not in trusted]
        try:
            if len(missing) > len(usable):
                # Whole stage cells started afresh get their tp workers on one node each.
                cells = not usable and _whole_cells(missing, g.grid.tp)
                usable += g.placement.reserve(len(missing) - len(usable), per_node=g.grid.tp if cells else 1)
            for r, slot in zip(missing, usable):
                slots[r] = slot
                workers[r] = g.start_worker(slot, r)
        finally:
            held = [r for r in range(n) if workers[r] is not None]
            g.workers, g.slots = [workers[r] for r in held], [slots[r] for r in held]
            self.idle += [(slot, None) for slot in usable if slot not in g.slots]
        return {"kept": len(survivors), "started": len(missing), "standby": len(from_standby)}

    def _borrow_slot(self, standby, own: Slot) -> Slot | None:
        """A borrowing standby replacing a worker lost on its node: once that worker's
        process has ended, the standby runs on its GPU (`StageWorker.take_gpu`), in its own
        bundle, which it returns; the lost worker's bundle then hosts standbys only (its GPU
        is in use). None when no worker of its node was lost."""
        node = bundle_node(own)
        mine = [i for i, (_, n) in enumerate(self.idle) if n is not None and n == node]
        if not mine:
            return None
        found = min(mine, key=lambda i: self._gpu_capable(self.idle[i][0]))  # GPU-less bundles first
        slot, _ = self.idle[found]
        lost = self.group.slot_owner.get(slot_key(slot), {})
        e = self.group.cfg.elastic
        try:
            ray.get(standby.take_gpu.remote(lost.get("gpu"), lost.get("pid"), e.survivor_timeout_s),
                    timeout=e.survivor_timeout_s + 30.0)
        except Exception as err:  # noqa: BLE001 - the rank gets a new worker instead
            print(f"raypar: a standby could not take the GPU of the worker lost on its node ({err}); "
                  f"starting a new worker instead", flush=True)
            return None
        del self.idle[found]
        self._cpu_only.add(slot_key(slot))
        self.standby_slots.append((slot, node))
        return own

    # -- lifetime --------------------------------------------------------------------------------

    def actors(self) -> list:
        """Every worker the reserve holds: survivors and standbys."""
        return [*(s[1] for s in self.survivors), *(s[0] for s in self.standbys)]

    def clear(self) -> None:
        self.survivors, self.standbys, self._standbys_ready, self.standby_slots = [], [], [], []


def _whole_cells(ranks: list[int], tp: int) -> bool:
    """Whether sorted `ranks` are whole stage cells: runs of `tp` consecutive ranks, each from
    a multiple of tp."""
    return len(ranks) % tp == 0 and all(ranks[i] % tp == 0 and ranks[i:i + tp] == list(range(ranks[i], ranks[i] + tp))
                                        for i in range(0, len(ranks), tp))
