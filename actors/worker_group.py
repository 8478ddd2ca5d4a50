"""The stage workers of one grid: placed together, wired into process groups, stepped."""
from __future__ import annotations

import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypar.config import Config
from raypar.resources import ResourceError, WorkerResources
from raypar.runtime.stage import StepReport
from raypar.schedule import Action
from raypar.topology import Grid

from .stage_worker import StageWorker

# NVLink multicast (NVLS) hangs on the GPU machines this runs on; keep it off in workers.
# CUDA_MODULE_LOADING=EAGER: with lazy loading, the first launch of a kernel waits for the
# GPU's queue to drain while holding the context lock; a p2p kernel in that queue waiting
# on the peer then never finishes, because NCCL's proxy thread needs the same lock. That
# hung forward-then-backward at its first backward (the first new kernels launched while
# receives were pending).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "CUDA_MODULE_LOADING": "EAGER"}


class StepTimeout(RuntimeError):
    """Some stage workers did not finish a step in time."""


class WorkerGroup:
    def __init__(self, cfg: Config, grid: Grid, resources: WorkerResources, data_path: str):
        self.cfg = cfg
        self.grid = grid
        self._writers: dict = {}  # node id -> CheckpointWriter, started on first use
        self._exports: list = []  # the last snapshot's export refs, still leaving the workers
        self.pg = placement_group([resources.bundle()] * grid.size, strategy="PACK")
        timeout = cfg.runtime.placement_timeout_s
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout)
        if not ready:
            remove_placement_group(self.pg)
            raise ResourceError(
                f"could not place {grid.size} stage workers with {resources.bundle()} each within "
                f"runtime.placement_timeout_s={timeout:g}s; the cluster is busy or its free resources are "
                f"split across nodes (ray status shows them)"
            )
        env = {"env_vars": GPU_ENV} if resources.device == "cuda" else None
        cfg_dict = cfg.to_dict()
        self.workers = [
            StageWorker.options(
                num_cpus=resources.cpus,
                num_gpus=resources.gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
                runtime_env=env,
                name=None,
            ).remote(cfg_dict, grid, rank, resources.device, data_path)
            for rank in range(grid.size)
        ]
        setup_timeout = cfg.runtime.collective_timeout_s + 120.0
        addr, port = ray.get(self.workers[0].address.remote(), timeout=setup_timeout)
        self.info = self._get([w.setup.remote(addr, port) for w in self.workers], setup_timeout, "setup")

    def run_step(self, step: int, programs: list[list[Action]], sample_ids: list[list[int]],
                 capture_grads: bool = False, snapshot: dict | None = None) -> list[StepReport]:
        """programs[rank] and sample_ids[rank]; one Ray call per worker."""
        refs = [w.run_step.remote(step, programs[r], sample_ids[r], capture_grads, snapshot)
                for r, w in enumerate(self.workers)]
        return self._get(refs, self.cfg.runtime.step_timeout_s, f"step {step}")

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
        deadline = time.monotonic() + timeout
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                late = [refs.index(r) for r in pending]
                raise StepTimeout(f"{what}: stage workers of ranks {late} did not answer within {timeout:g}s")
            ray.get(done[0])  # a worker's error surfaces now, not after its peers time out
        return ray.get(refs)

    def shutdown(self) -> None:
        for w in [*self.workers, *self._writers.values()]:
            try:
                ray.kill(w)
            except Exception:
                pass
        remove_placement_group(self.pg)
        # Removal is asynchronous; a re-plan right after must see the resources as free.
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            if ray.util.placement_group_table(self.pg).get("state") == "REMOVED":
                break
            time.sleep(0.05)
