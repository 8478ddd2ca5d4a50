"""The stage workers of one grid: placed together, wired into process groups, stepped.

The group has three parts of its own, each in its file: `reserve` (what it keeps between
grids after a failure: survivors, free bundles, standbys), `checkpoints` (writers,
snapshots, saves, EMA, loads) and `memory` (states kept in the workers' memory and their
replicas, restored after a failure). The driver's controller decides when any of them acts.
"""
from __future__ import annotations

import time

import ray
import torch

from raypar.config import Config
from raypar.resources import WorkerResources
from raypar.runtime.state_move import Manifest, moved_bytes, plan_move
from raypar.runtime.report import StepReport, Unit, complete_report, label_spans, late_spans, program_units
from raypar.schedule import Action
from raypar.topology import Grid

from . import worker_pool
from .checkpoints import WorkerCheckpoints
from .memory import WorkerMemory
from .placement import Placement, Slot, bundle_free, kill, slot_key
from .reserve import WorkerReserve
from .worker_pool import KeptPlacement

# How often a wait for all workers looks for one that already failed.
_ERROR_POLL_S = 0.1


class StepTimeout(RuntimeError):
    """Some stage workers did not finish a step in time."""


class WorkersLost(RuntimeError):
    """Some stage workers were found gone between steps."""


class WorkerGroup:
    """The stage workers of one grid, one per placement-group bundle (a *slot*)."""

    def __init__(self, cfg: Config, grid: Grid, resources: WorkerResources, data_path: str,
                 init_weights: bool = True):
        self.cfg = cfg
        self.grid = grid
        self.resources = resources
        self.data_path = data_path
        self.placement = Placement(resources, cfg.runtime.placement_timeout_s)
        self.reserve = WorkerReserve(self)
        self.checkpoints = WorkerCheckpoints(self)
        self.memory = WorkerMemory(self)
        self.program_version = 0  # of the programs the workers hold (set_programs)
        self.programs: list[list[Action]] = []
        self._units: list[list[Unit]] = []  # per stage: what each unit's times are of
        self.workers: list = []  # by rank
        self.slots: list[Slot] = []  # by rank
        self.info: list[dict] = []  # by rank: what `setup` returned
        # By slot (`slot_key`): what the last worker set up in it returned, kept after it is
        # lost: a borrowing standby takes its GPU once its process has ended.
        self.slot_owner: dict[tuple[str, int], dict] = {}
        try:
            # Workers an earlier group of this process left (`runtime.keep_workers`, or a run
            # growing onto a larger grid).
            kept = worker_pool.take(resources, grid.size, grid.tp)
            for k in kept:
                self.slots += self.placement.adopt(k.pg, k.strategy)
                self.workers += k.workers
            rebind = [rank for rank, w in enumerate(self.workers) if w is not None]
            # How this group's workers came (`reconfigure` counts its own): taken over, started.
            self.placed: dict[str, int] | None = {"kept": len(rebind), "started": grid.size - len(rebind), "standby": 0}
            self.slots += self.placement.reserve(grid.size - len(self.slots), per_node=grid.tp)
            self.workers += [None] * (len(self.slots) - len(self.workers))
            self.workers = [w if w is not None else self.start_worker(slot, rank)
                            for rank, (slot, w) in enumerate(zip(self.slots, self.workers))]
            self._rebind_kept(rebind)
            self.setup(fresh=True, init_weights=init_weights)
            self.reserve.start_standbys(cfg.elastic.standby_workers)
        except BaseException:
            self.shutdown(keep_workers=False)  # the caller never gets this group: release what it holds
            raise

    def start_worker(self, slot: Slot, rank: int, borrows_gpu: bool = False):
        return self.placement.start_worker(slot, self.cfg, self.grid, rank, self.data_path, borrows_gpu)

    def _rebind_kept(self, ranks: list[int]) -> None:
        """The workers of `ranks` were kept from an earlier run: this run's from now on. One
        that fails to answer is replaced by a worker started in its bundle."""
        refs = [self.workers[rank].rebind.remote(self.cfg.to_dict(), self.grid, rank, self.data_path)
                for rank in ranks]
        ray.wait(refs, num_returns=len(refs), timeout=worker_pool.ANSWER_TIMEOUT_S)
        for rank, ref in zip(ranks, refs):
            try:
                ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - lost or stuck since it was kept: start another
                kill(self.workers[rank])
                self.workers[rank] = self.start_worker(self.slots[rank], rank)

    def setup(self, fresh: bool, init_weights: bool) -> None:
        """Wire the process groups of the current grid and build every worker's stage
        (`fresh=False`: workers kept from another grid take this one's config, grid and rank)."""
        setup_timeout = self.cfg.runtime.collective_timeout_s + 120.0
        addr, port = ray.get(self.workers[0].address.remote(), timeout=setup_timeout)
        args = () if fresh else (self.cfg.to_dict(), self.grid)
        refs = [w.setup.remote(addr, port, *args, *(() if fresh else (rank,)), init_weights=init_weights)
                for rank, w in enumerate(self.workers)]
        self.info = self.get(refs, setup_timeout, "setup")
        self.slot_owner.update((slot_key(slot), info) for slot, info in zip(self.slots, self.info))

    # -- recovery: the reserve does the work on this group's workers -----------------------------

    def salvage(self, timeout: float) -> int:
        """After a failure: keep the workers that still answer (`WorkerReserve.salvage`)."""
        kept = self.reserve.salvage(timeout)
        self.workers, self.slots, self.info = [], [], []
        self.program_version, self.programs, self._units = 0, [], []
        self.checkpoints.forget_shard_writes()
        return kept

    def reconfigure(self, cfg: Config, grid: Grid, init_weights: bool = True) -> dict[str, int]:
        """Put `grid` on the kept workers plus new ones; returns how many were kept, started
        and taken from the standbys."""
        self.cfg, self.grid = cfg, grid
        self.placed = None  # a fill that fails part way counts nothing
        self.placed = self.reserve.fill(grid.size)
        self.setup(fresh=False, init_weights=init_weights)
        return self.placed

    def rebuild(self, cfg: Config, hold_state: bool = False) -> list[Manifest] | None:
        """The same workers and grid with `cfg`'s cut of the model (its schedule's chunks per
        stage): each leaves its process groups and drops its stage (`reset`), then builds its
        part of the new cut, not initialised (a checkpoint is loaded next, or with `hold_state`
        the state each worker kept on its device: `move_state`, given what this returns)."""
        timeout = self.cfg.runtime.step_timeout_s
        salvage = self.reserve.salvages
        held = self.get([w.reset_holding_state.remote(salvage) if hold_state else w.reset.remote(salvage)
                         for w in self.workers], timeout, "reset")
        self.cfg = cfg
        self.program_version, self.programs, self._units = 0, [], []
        self.checkpoints.forget_shard_writes()
        self.setup(fresh=False, init_weights=False)
        return held if hold_state else None

    def move_room(self, cfg: Config) -> list[tuple[int, int]]:
        """Per worker: the bytes a move to `cfg`'s cut on the devices needs free, and those free."""
        return self.get([w.move_room.remote(cfg.to_dict()) for w in self.workers], self.cfg.runtime.step_timeout_s,
                        "move_room")

    def move_state(self, held: list[Manifest]) -> tuple[list[dict], tuple[int, int]]:
        """After `rebuild(hold_state=True)`: every tensor each new stage needs goes to it from
        a worker holding it (itself where it can), over the world's process group, and is
        loaded. Returns per worker its times, and the bytes read in place and sent."""
        names = self.get([w.state_names.remote() for w in self.workers], self.cfg.runtime.step_timeout_s,
                         "state_names")
        plan = plan_move(held, [set(n) for n in names])
        # As long as a checkpoint's load: it moves as much, faster.
        done = self.get([w.load_moved.remote(plan, held) for w in self.workers], self.cfg.checkpoint.timeout_s,
                        "load_moved")
        return done, moved_bytes(plan, held)

    # -- stepping --------------------------------------------------------------------------------

    def set_programs(self, programs: list[list[Action]]) -> int:
        """Send every worker its stage's program (programs[stage]); returns the new version.

        Called when the plan changes (start, recovery, another schedule), not every step:
        a step then names the version and carries only what changes (step, sample ids).
        """
        self.program_version += 1
        self.programs = [list(p) for p in programs]
        self._units = [program_units(p) for p in self.programs]
        refs = [w.set_program.remote(self.program_version, self.programs[self.grid.coord(r).pp])
                for r, w in enumerate(self.workers)]
        self.get(refs, self.cfg.runtime.step_timeout_s, "set_programs")
        return self.program_version

    def prefetch(self, sample_ids: list[list[int]]) -> None:
        """Have every worker start reading its samples of a batch (by rank) in the background,
        e.g. the first step's after a recovery while the state loads. Not waited for: a
        read's error comes with the step that takes the batch."""
        for r, w in enumerate(self.workers):
            w.prefetch.remote(sample_ids[r])

    def issue_step(self, step: int, sample_ids: list[list[int]], capture_grads: bool = False,
                   snapshot: dict | None = None, next_sample_ids: list[list[int]] | None = None,
                   memory: bool = False, replicate: bool = False) -> list:
        """Send a step without waiting for it; one ObjectRef per worker, by rank. Workers run
        their calls in order, so a step issued while the last one runs starts the moment that
        one ends. `next_sample_ids`: the next step's batch per worker, when it follows;
        `memory`: the workers keep their state after it in memory (`WorkerMemory`), and with
        `replicate` send that copy to their peers."""
        return [w.run_step.remote(step, self.program_version, sample_ids[r], capture_grads, snapshot,
                                  next_sample_ids[r] if next_sample_ids is not None else None, memory, replicate)
                for r, w in enumerate(self.workers)]

    def wait_reports(self, step: int, refs: list) -> list[StepReport]:
        """Every worker's report of an issued step as it came (raises the first failure, or
        StepTimeout). A first stage's may not be `complete` yet: see `complete_reports`."""
        return self.get(refs, self.cfg.runtime.step_timeout_s, f"step {step}")

    def complete_reports(self, reports: list[StepReport]) -> list[StepReport]:
        """The reports with their tails fetched (a first stage reports before its device ends
        the step, and is issuing the next one meanwhile) and their spans labelled."""
        waiting = [r for r in reports if not r.complete]
        if waiting:
            tails = self.get([self.workers[r.rank].report_tail.remote(r.step) for r in waiting],
                             self.cfg.runtime.step_timeout_s, f"step {waiting[0].step}'s first stages")
            for r, tail in zip(waiting, tails):
                complete_report(r, tail)
        return [label_spans(r, self._units[r.stage]) for r in reports]

    def run_step(self, step: int, sample_ids: list[list[int]], capture_grads: bool = False,
                 snapshot: dict | None = None, next_sample_ids: list[list[int]] | None = None) -> list[StepReport]:
        """One step, waited for: issue, wait, complete."""
        refs = self.issue_step(step, sample_ids, capture_grads, snapshot, next_sample_ids)
        return self.complete_reports(self.wait_reports(step, refs))

    def late_units(self) -> list[tuple[int, int | None, list]]:
        """(rank, step, spans) per worker: the units of its last step that its report lacked."""
        refs = [w.late_units.remote() for w in self.workers]
        late = self.get(refs, self.cfg.runtime.step_timeout_s, "the last step's late units")
        return [(rank, step, late_spans(self._units[self.grid.coord(rank).pp], times))
                for rank, (step, times) in enumerate(late)]

    # -- parameters by global name ---------------------------------------------------------------

    def load_parameters(self, tensors: dict) -> None:
        """Overwrite parameters by global name on every worker that holds them."""
        ref = ray.put(tensors)
        ray.get([w.load_parameters.remote(ref) for w in self.workers])

    def set_expert_biases(self, biases: dict[str, list[float]]) -> None:
        """Every worker's MoE routing biases (by layer id) for the next step it runs."""
        self.get([w.set_expert_biases.remote(biases) for w in self.workers], self.cfg.runtime.step_timeout_s,
                 "setting the expert biases")

    def parameters(self) -> dict:
        merged: dict = {}
        # Replicas hold equal copies; take each name from its first holder.
        for params in ray.get([w.parameters.remote() for w in self.workers]):
            for name, t in params.items():
                merged.setdefault(name, t)
        return merged

    # -- health and waiting ----------------------------------------------------------------------

    def all_alive(self, timeout: float = 10.0) -> bool:
        try:
            ray.get([w.address.remote() for w in self.workers], timeout=timeout)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def get(self, refs: list, timeout: float, what: str) -> list:
        """Every result, in order. One wait for all in the usual case; a worker's error still
        surfaces within `_ERROR_POLL_S`, not after its peers time out waiting for it."""
        deadline = time.monotonic() + timeout
        results: dict = {}
        pending = list(refs)
        while pending:
            left = deadline - time.monotonic()
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, min(_ERROR_POLL_S, left)))
            if done:
                try:
                    results.update(zip(done, ray.get(done)))
                except Exception as e:  # noqa: BLE001 - a worker's error surfaces now
                    raise _root_cause(e, done + pending) from None
            elif left <= 0:
                late = [refs.index(r) for r in pending]
                raise StepTimeout(f"{what}: stage workers of ranks {late} did not answer within {timeout:g}s")
        return [results[r] for r in refs]

    def shutdown(self, keep_memory: bool = False, keep_workers: bool | None = None) -> None:
        """Kill the workers and give back what the group holds. Their states in shared memory
        go too, unless `keep_memory` (a recovery that starts every worker again restores from them).
        `keep_workers` (None: `runtime.keep_workers`): leave the workers, reset, for the next
        group of this process (`worker_pool`) rather than killing them."""
        e = self.cfg.elastic
        if not keep_memory and e.enabled and e.memory_every > 0 and e.memory_shared and self.workers:
            # Each live worker removes its node's files; one that does not answer leaves them
            # to the run's next `clear` on that node.
            ray.wait([w.clear_memory.remote(True) for w in self.workers], num_returns=len(self.workers),
                     timeout=_DROP_MEMORY_S)
        keep = self.cfg.runtime.keep_workers if keep_workers is None else keep_workers
        kept = self._keep_workers() if keep and self.workers else set()
        for w in [*self.workers, *self.reserve.actors()]:
            if id(w) not in kept:
                kill(w)
        self.workers = []
        self.reserve.clear()
        self.checkpoints.shutdown()
        self.placement.release()

    def _keep_workers(self) -> set[int]:
        """Reset the workers of every placement group each of whose bundles holds one of this
        group's workers or is placed with nothing in it (a lost node's, placed again), and hand
        those groups to `worker_pool`; the ids of the workers kept."""
        by_group: dict[str, dict[int, object]] = {}
        for (pg, bundle), w in zip(self.slots, self.workers):
            by_group.setdefault(pg.id.hex(), {})[bundle] = w
        available = ray.available_resources()

        def keepable(pg) -> bool:
            held = by_group.get(pg.id.hex(), {})
            return bool(held) and all(i in held or bundle_free((pg, i), available)
                                      for i in range(len(pg.bundle_specs)))

        whole = [pg for pg in self.placement.owned() if keepable(pg)]
        resets = {pg.id.hex(): [w.reset.remote(self.reserve.salvages) for w in by_group[pg.id.hex()].values()]
                  for pg in whole}
        every = [ref for refs in resets.values() for ref in refs]
        if every:
            ray.wait(every, num_returns=len(every), timeout=worker_pool.ANSWER_TIMEOUT_S)
        kept: set[int] = set()
        for pg in whole:
            try:
                ray.get(resets[pg.id.hex()], timeout=0)
            except Exception:  # noqa: BLE001 - a worker that cannot reset ends with the run
                continue
            workers = [by_group[pg.id.hex()].get(i) for i in range(len(pg.bundle_specs))]
            worker_pool.keep(KeptPlacement(pg, self.placement.strategies[pg.id.hex()], self.resources.device,
                                           workers))
            self.placement.hand_over(pg)
            kept |= {id(w) for w in workers if w is not None}
        return kept


# How long a shutdown waits for the workers to remove the run's states from shared memory.
_DROP_MEMORY_S = 10.0


def _root_cause(error: Exception, refs: list) -> Exception:
    """The failure that started it rather than its echoes in the peers.

    A worker whose step fails leaves its process groups, so its peers' collectives fail
    too and may report first. Give the others a moment, then prefer an actor death, then an
    error that is not a broken connection or a refused step.
    """
    if isinstance(error, ray.exceptions.RayActorError):
        return error
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=_ERROR_POLL_S)
    errors = [error]
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as e:
            return e
        except Exception as e:  # noqa: BLE001 - another peer's error: keep looking
            errors.append(e)
    return next((e for e in errors if not is_echo(e)), error)


def is_echo(error: BaseException) -> bool:
    """A peer's view of another worker's failure: a broken collective or connection, a refused step."""
    from raypar.runtime.comm import CollectiveTimeout

    from .stage_worker import StepRefused

    cause = getattr(error, "cause", error)
    if isinstance(cause, (CollectiveTimeout, StepRefused, ConnectionError, torch.distributed.DistBackendError)):
        return True
    # gloo reports a vanished peer as a RuntimeError
    return isinstance(cause, RuntimeError) and any(
        s in str(cause) for s in ("Connection closed", "Connection reset", "connection", "Timed out"))
