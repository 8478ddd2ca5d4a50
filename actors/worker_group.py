"""The stage workers of one grid: placed together, wired into process groups, stepped."""
from __future__ import annotations

import time
from dataclasses import dataclass

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypar.config import Config
from raypar.resources import ResourceError, WorkerResources
from raypar.runtime.stage import StepReport, complete_report, label_events, tail_events, unit_labels
from raypar.schedule import Action
from raypar.topology import Grid

from .stage_worker import StageWorker

# NVLink multicast (NVLS) hangs on the GPU machines this runs on; keep it off in workers.
# CUDA_MODULE_LOADING=EAGER: with lazy loading, the first launch of a kernel waits for the
# GPU's queue to drain while holding the context lock; a p2p kernel in that queue waiting
# on the peer then never finishes, because NCCL's proxy thread needs the same lock. That
# hung forward-then-backward at its first backward (the first new kernels launched while
# receives were pending).
# TORCH_NCCL_ASYNC_ERROR_HANDLING=2: on an NCCL error or timeout, abort the communicator
# but keep the process. torch's default (3) ends the process, which turns every worker that
# shared a collective with a lost one into a lost one too, so none survive to be kept.
# Steps that ran into such an abort fail at their next collective; a snapshot is taken
# only after a check over the world (`StageRuntime.start_snapshot`).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "CUDA_MODULE_LOADING": "EAGER", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


# How often a wait for all workers looks for one that already failed.
_ERROR_POLL_S = 0.1
# How long a salvage waits for the standbys to answer (they were asked with the survivors).
_STANDBY_PING_S = 1.0


class StepTimeout(RuntimeError):
    """Some stage workers did not finish a step in time."""


@dataclass
class IssuedStep:
    """A step sent to every worker (`WorkerGroup.issue_step`), its reports not collected yet."""

    step: int
    refs: list  # one ObjectRef per worker, by rank
    # time.perf_counter() when every run_step report was back, before any first stage's tail:
    # the workers go on to the next step from there.
    reports_back: float | None = None


class WorkerGroup:
    """The stage workers of one grid, one per placement-group bundle (a *slot*).

    After a failure, `salvage` keeps the workers that still answer and `reconfigure` puts the
    next plan's grid on them plus replacements, instead of starting every worker again.
    """

    def __init__(self, cfg: Config, grid: Grid, resources: WorkerResources, data_path: str,
                 init_weights: bool = True):
        self.cfg = cfg
        self.grid = grid
        self.resources = resources
        self.data_path = data_path
        self._writers: dict = {}  # node id -> CheckpointWriter, started on first use
        self._exports: list = []  # the last snapshot's export refs, still leaving the workers
        self.program_version = 0  # of the programs the workers hold (set_programs)
        self.programs: list[list[Action]] = []
        self._labels: list[list[str]] = []
        self._pgs: list = []  # every placement group this group reserved
        self.workers: list = []  # by rank
        self.slots: list[tuple] = []  # by rank: (placement group, bundle index)
        self.info: list[dict] = []
        # After `salvage`: workers kept for the next grid, as (old rank, worker, slot, node id),
        # and slots whose worker is gone, as (slot, node id or None when unknown).
        self.survivors: list[tuple] = []
        self._idle: list[tuple] = []
        # Started, idle workers that replace lost ones (elastic.standby_workers), as (worker, slot);
        # those that answered at the last salvage are the ones a recovery may use.
        self.standbys: list[tuple] = []
        self._standbys_ready: list[tuple] = []
        self._salvages = 0  # numbers each salvage's abort and reset for the workers
        pg = self._reserve(grid.size)
        self.slots = [(pg, i) for i in range(grid.size)]
        try:
            self.workers = [self._start_worker(slot, rank) for rank, slot in enumerate(self.slots)]
            self._setup(fresh=True, init_weights=init_weights)
            self._start_standbys(cfg.elastic.standby_workers)
        except BaseException:
            self.shutdown()  # the caller never gets this group: release what it holds
            raise

    def _reserve(self, n: int):
        """A placement group of n worker bundles (PACK), or ResourceError within the timeout."""
        bundle = self.resources.bundle()
        pg = placement_group([bundle] * n, strategy="PACK")
        timeout = self.cfg.runtime.placement_timeout_s
        ready, _ = ray.wait([pg.ready()], timeout=timeout)
        if not ready:
            remove_placement_group(pg)
            raise ResourceError(
                f"could not place {n} stage workers with {bundle} each within "
                f"runtime.placement_timeout_s={timeout:g}s; the cluster is busy or its free resources are "
                f"split across nodes (ray status shows them)"
            )
        self._pgs.append(pg)
        return pg

    def _start_standbys(self, n: int) -> None:
        """Start `n` standby workers in a placement group of their own, without waiting for it:
        the grid never waits for its standbys, and a cluster without room for them only runs
        without (the pending group stays visible to the autoscaler)."""
        if n <= 0:
            return
        pg = placement_group([self.resources.bundle()] * n, strategy="PACK")
        self._pgs.append(pg)
        for i in range(n):
            self._add_standby((pg, i))

    def _add_standby(self, slot: tuple) -> None:
        worker = self._start_worker(slot, rank=-1)
        worker.warm.remote()  # its start-up work now, not when it is needed
        self.standbys.append((worker, slot))

    def _start_worker(self, slot: tuple, rank: int):
        pg, bundle = slot
        env = {"env_vars": GPU_ENV} if self.resources.device == "cuda" else None
        return StageWorker.options(
            num_cpus=self.resources.cpus,
            num_gpus=self.resources.gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
            runtime_env=env,
            name=None,
        ).remote(self.cfg.to_dict(), self.grid, rank, self.resources.device, self.data_path)

    def _setup(self, fresh: bool, init_weights: bool) -> None:
        """Wire the process groups of the current grid and build every worker's stage."""
        setup_timeout = self.cfg.runtime.collective_timeout_s + 120.0
        addr, port = ray.get(self.workers[0].address.remote(), timeout=setup_timeout)
        args = () if fresh else (self.cfg.to_dict(), self.grid)
        refs = [w.setup.remote(addr, port, *args, *(() if fresh else (rank,)), init_weights=init_weights)
                for rank, w in enumerate(self.workers)]
        self.info = self._get(refs, setup_timeout, "setup")

    # -- recovery ------------------------------------------------------------------------------

    def salvage(self, timeout: float, keep_writers: bool = True) -> int:
        """After a failure: keep the workers that still answer, kill the rest; returns how many stay.

        Each worker first lets its failed step return (on GPU, `abort` breaks NCCL calls
        stuck on the lost peer), then leaves its process groups and drops its stage
        (`reset`). A worker that has not done so within `timeout` seconds is killed, like a
        dead one. The kept workers wait for `reconfigure`.
        """
        # The grid's workers, and any kept before that a failed start did not place yet.
        candidates = [(rank, w, slot) for rank, (w, slot) in enumerate(zip(self.workers, self.slots))]
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
        survivors, idle = [], list(self._idle)
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
                _kill(w)
                idle.append((slot, None))
        alive = {node for *_, node in survivors}
        # A slot's bundle stays reserved after its worker died. Reuse it only where a survivor
        # just proved the node alive: a lost node's bundles wait for Ray to place them again.
        nodes = [self._bundle_node(slot) for slot, _ in idle]
        self.survivors = survivors
        self._idle = [(slot, node if node in alive else None) for (slot, _), node in zip(idle, nodes)]
        self.workers, self.slots, self.info = [], [], []
        self.program_version, self.programs, self._labels = 0, [], []
        self._exports = []
        if keep_writers:
            self._drop_dead_writers(alive)
        else:
            self.reset_writers()
        return len(survivors)

    def _sort_standbys(self, pings: list, answered: set) -> None:
        """Standbys that answered may replace lost workers; dead ones are dropped; the rest
        (not placed yet, or slow to start) stay standbys for a later recovery."""
        ready, kept = [], []
        for entry, ref in zip(self.standbys, pings):
            if ref in answered:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - dead: its bundle waits for a proven node, like a lost worker's
                    _kill(entry[0])
                    self._idle.append((entry[1], None))
                    continue
                ready.append(entry)
            kept.append(entry)
        self.standbys, self._standbys_ready = kept, ready

    def reusable_slots(self) -> int:
        """Workers the next grid can have without new resources: survivors, standbys that answered
        and free bundles on live nodes."""
        return len(self.survivors) + len(self._standbys_ready) + sum(1 for _, node in self._idle if node is not None)

    def reconfigure(self, cfg: Config, grid: Grid, init_weights: bool = True) -> dict:
        """Put `grid` on the kept workers plus new ones: new ranks, process groups and stages.

        Survivors keep their rank where the new grid has it and fill the gaps otherwise;
        replacements go to free bundles on live nodes first, then to a new placement group.
        Returns how many workers were kept and how many started.
        """
        self.cfg, self.grid = cfg, grid
        n = grid.size
        survivors = sorted(self.survivors, key=lambda s: s[0])
        self.survivors = []
        for _, w, slot, node in survivors[n:]:  # the grid shrank below what survived
            _kill(w)
            self._idle.append((slot, node))
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
        from_standby = self._standbys_ready[:len(missing)]
        for r, (w, slot) in zip(missing, from_standby):
            workers[r], slots[r] = w, slot
        missing = missing[len(from_standby):]
        self.standbys = [s for s in self.standbys if not any(s is used for used in from_standby)]
        self._standbys_ready = []
        trusted = [i for i, (_, node) in enumerate(self._idle) if node is not None][:len(missing)]
        usable = [self._idle[i][0] for i in trusted]
        self._idle = [x for i, x in enumerate(self._idle) if i not in trusted]
        try:
            if len(missing) > len(usable):
                pg = self._reserve(len(missing) - len(usable))
                usable += [(pg, i) for i in range(len(missing) - len(usable))]
            for r, slot in zip(missing, usable):
                slots[r] = slot
                workers[r] = self._start_worker(slot, r)
        finally:
            # Whatever happens, the group holds what it started: salvage or shutdown find it.
            held = [r for r in range(n) if workers[r] is not None]
            self.workers, self.slots = [workers[r] for r in held], [slots[r] for r in held]
            self._idle += [(slot, None) for slot in usable if slot not in self.slots]
        self._setup(fresh=False, init_weights=init_weights)
        return {"kept": len(survivors), "started": len(missing), "standby": len(from_standby)}

    def refill_standbys(self) -> None:
        """Replace the standbys a recovery used, on free bundles of live nodes (a lost worker's).
        Called once the run is going again, so that their start does not slow the recovery."""
        for _ in range(self.cfg.elastic.standby_workers - len(self.standbys)):
            free = next((i for i, (_, node) in enumerate(self._idle) if node is not None), None)
            if free is None:
                return
            slot, _ = self._idle.pop(free)
            self._add_standby(slot)

    def held_free_slots(self) -> int:
        """Bundles this group holds without a worker, placed on nodes Ray reports alive."""
        if not self._idle:
            return 0
        alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
        return sum(1 for slot, _ in self._idle if self._bundle_node(slot) in alive)

    @staticmethod
    def _bundle_node(slot: tuple) -> str | None:
        pg, bundle = slot
        try:
            return ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).get(bundle)
        except Exception:  # noqa: BLE001
            return None

    def _drop_dead_writers(self, alive_nodes: set) -> None:
        """Keep the checkpoint writers of nodes that still hold workers; drop the others."""
        for node in [n for n in self._writers if n not in alive_nodes]:
            _kill(self._writers.pop(node))

    def set_programs(self, programs: list[list[Action]]) -> int:
        """Send every worker its stage's program (programs[stage]); returns the new version.

        Called when the plan changes (start, recovery, another schedule), not every step:
        a step then names the version and carries only what changes (step, sample ids).
        """
        self.program_version += 1
        self.programs = [list(p) for p in programs]
        self._labels = [unit_labels(p) for p in self.programs]
        refs = [w.set_program.remote(self.program_version, self.programs[self.grid.coord(r).pp])
                for r, w in enumerate(self.workers)]
        self._get(refs, self.cfg.runtime.step_timeout_s, "set_programs")
        return self.program_version

    def run_step(self, step: int, sample_ids: list[list[int]], capture_grads: bool = False,
                 snapshot: dict | None = None) -> list[StepReport]:
        """sample_ids[rank] for the programs of the last `set_programs`; one Ray call per worker."""
        return self.collect_step(self.issue_step(step, sample_ids, capture_grads, snapshot))

    def issue_step(self, step: int, sample_ids: list[list[int]], capture_grads: bool = False,
                   snapshot: dict | None = None, next_sample_ids: list[list[int]] | None = None) -> "IssuedStep":
        """Send a step without waiting for it. Workers run their calls in order, so a step
        issued while the last one runs starts the moment that one ends. `next_sample_ids`:
        the next step's batch per worker, when it follows."""
        refs = [w.run_step.remote(step, self.program_version, sample_ids[r], capture_grads, snapshot,
                                  next_sample_ids[r] if next_sample_ids is not None else None)
                for r, w in enumerate(self.workers)]
        return IssuedStep(step, refs)

    def collect_step(self, issued: "IssuedStep") -> list[StepReport]:
        """Every worker's report of an issued step (raises the first failure, or StepTimeout)."""
        reports = self._get(issued.refs, self.cfg.runtime.step_timeout_s, f"step {issued.step}")
        issued.reports_back = time.perf_counter()
        # First stages report before their device ends the step; their next step is being
        # issued while this waits for the rest.
        waiting = [r for r in reports if not r.complete]
        if waiting:
            tails = self._get([self.workers[r.rank].finish_report.remote(r.step) for r in waiting],
                              self.cfg.runtime.step_timeout_s, f"step {issued.step}'s first stages")
            for r, tail in zip(waiting, tails):
                complete_report(r, tail)
        return [label_events(r, self._labels[r.stage]) for r in reports]

    def collect_late(self) -> list[tuple[int, int | None, list[tuple[str, float, float]]]]:
        """(rank, step, events) per worker: the units of its last step that its report lacked."""
        refs = [w.finish_timing.remote() for w in self.workers]
        tails = self._get(refs, self.cfg.runtime.step_timeout_s, "the last step's timings")
        return [(rank, step, tail_events(self._labels[self.grid.coord(rank).pp], times))
                for rank, (step, times) in enumerate(tails)]

    # -- checkpoints ---------------------------------------------------------------------------

    def writers(self, root: str) -> dict[str, "ray.actor.ActorHandle"]:
        """One checkpoint writer per node that holds workers, pinned to that node."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from .checkpoint_writer import CheckpointWriter

        for node in dict.fromkeys(i["node_id"] for i in self.info):
            if node not in self._writers:
                self._writers[node] = CheckpointWriter.options(
                    num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
                ).remote(root, self.cfg.checkpoint.keep_last, self.cfg.checkpoint.ema_decay)
        return self._writers

    def snapshot(self, step: int, options: dict) -> None:
        """Start a snapshot of the state as it is now (between steps)."""
        ray.get([w.start_snapshot.remote(step, options) for w in self.workers], timeout=self.cfg.checkpoint.timeout_s)

    def all_alive(self, timeout: float = 10.0) -> bool:
        try:
            ray.get([w.address.remote() for w in self.workers], timeout=timeout)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def reset_writers(self) -> None:
        """Drop the writers (after one died); the next save starts fresh ones."""
        for w in self._writers.values():
            ray.kill(w)
        self._writers = {}

    def save(self, root: str, step: int, meta: dict, update_ema: bool = False):
        """Hand each worker's snapshot to its node's writer; returns the commit's ObjectRef.

        Nothing here waits: workers export on their I/O thread while they train on, writers
        write as snapshots arrive, and the commit runs once every shard is written.
        """
        writers = self.writers(root)
        self._exports = [w.export_snapshot.remote() for w in self.workers]
        written = [writers[info["node_id"]].write.remote(step, rank, export, update_ema)
                   for rank, (export, info) in enumerate(zip(self._exports, self.info))]
        return writers[self.info[0]["node_id"]].commit.remote(step, meta, *written)

    def update_ema(self, root: str) -> None:
        """Fold the snapshot just taken into the writers' EMA (no waiting)."""
        writers = self.writers(root)
        self._exports = [w.export_snapshot.remote() for w in self.workers]
        for export, info in zip(self._exports, self.info):
            writers[info["node_id"]].update_ema.remote(export)

    def wait_exports(self, timeout: float) -> float:
        """Block until the last snapshot left every worker: its host buffers get reused next."""
        t0 = time.perf_counter()
        exports, self._exports = self._exports, []
        if exports:
            ray.wait(exports, num_returns=len(exports), timeout=timeout)
        return time.perf_counter() - t0

    def load_ema(self, root: str, path: str) -> None:
        """Give each node's writer the EMA its workers' weights had in checkpoint `path`."""
        writers = self.writers(root)
        names = ray.get([w.owned_weight_names.remote() for w in self.workers])
        by_node: dict[str, list[str]] = {}
        for owned, info in zip(names, self.info):
            by_node.setdefault(info["node_id"], []).extend(owned)
        ray.get([writers[node].load_ema.remote(path, owned) for node, owned in by_node.items()],
                timeout=self.cfg.checkpoint.timeout_s)

    def load_checkpoint(self, path: str, same_grid: bool) -> list[dict]:
        return ray.get([w.load_checkpoint.remote(path, same_grid) for w in self.workers],
                       timeout=self.cfg.checkpoint.timeout_s)

    def load_parameters(self, tensors: dict) -> None:
        """Overwrite parameters by global name on every worker that holds them."""
        ref = ray.put(tensors)
        ray.get([w.load_parameters.remote(ref) for w in self.workers])

    def parameters(self) -> dict:
        merged: dict = {}
        # Replicas hold equal copies; take each name from its first holder.
        for params in ray.get([w.parameters.remote() for w in self.workers]):
            for name, t in params.items():
                merged.setdefault(name, t)
        return merged

    def _get(self, refs: list, timeout: float, what: str) -> list:
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

    def shutdown(self) -> None:
        for w in [*self.workers, *(s[1] for s in self.survivors), *(s[0] for s in self.standbys),
                  *self._writers.values()]:
            _kill(w)
        self.workers, self.survivors, self._writers = [], [], {}
        self.standbys, self._standbys_ready = [], []
        for pg in self._pgs:
            remove_placement_group(pg)
        # Removal is asynchronous; a re-plan right after must see the resources as free.
        deadline = time.monotonic() + 10.0
        for pg in self._pgs:
            while time.monotonic() < deadline:
                if ray.util.placement_group_table(pg).get("state") == "REMOVED":
                    break
                time.sleep(0.05)
        self._pgs = []


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


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
