"""Where stage workers run: placement groups of worker bundles, and starting a worker in one."""
from __future__ import annotations

import os
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raypar.config import Config
from raypar.resources import ResourceError, WorkerResources
from raypar.runtime.graphs import OVERLAP_HARDWARE_QUEUES
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
# CUDA_DEVICE_MAX_CONNECTIONS: the hardware queues overlapped micro-batches need
# (`OVERLAP_HARDWARE_QUEUES`, raypar/runtime/graphs.py; CUDA's default, 8, serialised them:
# a forward waited 13 ms of a 23 ms MoE backward it was to run beside, on 2 x H200).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "CUDA_MODULE_LOADING": "EAGER", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
           "CUDA_DEVICE_MAX_CONNECTIONS": str(OVERLAP_HARDWARE_QUEUES)}


def gpu_env() -> dict[str, str]:
    """GPU_ENV, where the driver's own environment sets one of its variables with the driver's value."""
    return {name: os.environ.get(name, value) for name, value in GPU_ENV.items()}


# A slot is one bundle of a placement group: (placement group, bundle index).
Slot = tuple


class Placement:
    """The placement groups a worker group reserved, and the workers it starts in their bundles."""

    def __init__(self, resources: WorkerResources, timeout_s: float):
        self.resources = resources
        self.timeout_s = timeout_s
        self._pgs: list = []
        self.strategies: dict[str, str] = {}  # by placement group id

    def reserve(self, n: int, per_node: int = 1) -> list[Slot]:
        """n worker bundles packed together, or ResourceError within the timeout. `per_node`
        > 1 (dividing n): each consecutive `per_node` of them on one node, in a placement group
        of their own (a stage cell's tp workers, whose all-reduces want NVLink)."""
        if n == 0:
            return []
        bundle = self.resources.bundle()
        strategy, size = group_shape(n, per_node)
        pgs = [placement_group([bundle] * size, strategy=strategy) for _ in range(n // size)]
        per_node = size
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.timeout_s)
        if len(ready) < len(pgs):
            for pg in pgs:
                remove_placement_group(pg)
            together = f", {per_node} on each node (a stage cell's tp workers)" if len(pgs) > 1 else ""
            raise ResourceError(
                f"could not place {n} stage workers with {bundle} each{together} within "
                f"runtime.placement_timeout_s={self.timeout_s:g}s; the cluster is busy or its free resources are "
                f"split across nodes (ray status shows them)"
            )
        self._add(pgs, strategy)
        return [(pg, i) for pg in pgs for i in range(per_node)]

    def _add(self, pgs: list, strategy: str) -> None:
        self._pgs += pgs
        self.strategies.update((pg.id.hex(), strategy) for pg in pgs)

    def adopt(self, pg, strategy: str) -> list[Slot]:
        """A placement group placed before (kept workers'): this group's from now on."""
        self._add([pg], strategy)
        return [(pg, i) for i in range(len(pg.bundle_specs))]

    def hand_over(self, pg) -> None:
        """Stop owning `pg` (kept workers go with it): `release` leaves it placed."""
        self._pgs = [g for g in self._pgs if g.id != pg.id]
        self.strategies.pop(pg.id.hex(), None)

    def owned(self) -> list:
        return list(self._pgs)

    def reserve_later(self, n: int, gpu: bool = True) -> list[Slot]:
        """n bundles that nothing waits for: a cluster without room only runs without them
        (the pending group stays visible to the autoscaler). `gpu=False`: CPUs only."""
        pg = placement_group([self.resources.bundle(gpu)] * n, strategy="PACK")
        self._add([pg], "PACK")
        return [(pg, i) for i in range(n)]

    def start_worker(self, slot: Slot, cfg: Config, grid: Grid, rank: int, data_path: str,
                     borrows_gpu: bool = False):
        """A stage worker in `slot`. `borrows_gpu`: a standby in a CPU-only bundle that sees
        every GPU of its node (Ray leaves CUDA_VISIBLE_DEVICES alone) and later runs on a
        lost worker's (`StageWorker.take_gpu`)."""
        pg, bundle = slot
        env = None
        if self.resources.device == "cuda":
            env_vars = gpu_env()
            if borrows_gpu:
                env_vars["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
            env = {"env_vars": env_vars}
        return StageWorker.options(
            num_cpus=self.resources.cpus,
            num_gpus=0 if borrows_gpu else self.resources.gpus,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
            runtime_env=env,
            name=None,
        ).remote(cfg.to_dict(), grid, rank, self.resources.device, data_path, borrows_gpu)

    def release(self) -> None:
        """Remove every placement group, waiting (briefly) until Ray sees them gone."""
        remove_groups(self._pgs)
        self._pgs, self.strategies = [], {}


def group_shape(n: int, per_node: int) -> tuple[str, int]:
    """(strategy, bundles) of each placement group that `Placement.reserve` makes for n workers."""
    if per_node > 1 and n % per_node == 0:
        return "STRICT_PACK", per_node
    return "PACK", n


def remove_groups(pgs: list) -> None:
    """Remove placement groups, waiting (briefly) until Ray sees them gone."""
    for pg in pgs:
        remove_placement_group(pg)
    # Removal is asynchronous; a re-plan right after must see the resources as free.
    deadline = time.monotonic() + 10.0
    for pg in pgs:
        while time.monotonic() < deadline:
            if ray.util.placement_group_table(pg).get("state") == "REMOVED":
                break
            time.sleep(0.05)


def slot_key(slot: Slot) -> tuple[str, int]:
    """A slot as a dictionary key: its placement group's id and bundle index."""
    pg, bundle = slot
    return pg.id.hex(), bundle


def bundle_node(slot: Slot) -> str | None:
    """The node a bundle is placed on, or None when Ray does not know (not placed, or lost)."""
    pg, bundle = slot
    try:
        return ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).get(bundle)
    except Exception:  # noqa: BLE001
        return None


def bundle_free(slot: Slot, available: dict[str, float]) -> bool:
    """Whether `slot`'s bundle is placed on a live node with nothing running in it, by
    `available` (`ray.available_resources()`): Ray offers a placed bundle's resources as
    `<resource>_group_<index>_<placement group id>`, also once it has placed a lost node's
    bundle again on another node."""
    pg, index = slot
    try:
        need = pg.bundle_specs[index]
    except Exception:  # noqa: BLE001 - a removed group
        return False
    return all(available.get(f"{key}_group_{index}_{pg.id.hex()}", 0.0) >= amount - 1e-9
               for key, amount in need.items() if amount > 0)


def kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
