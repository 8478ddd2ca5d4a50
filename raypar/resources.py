"""What a grid asks of the cluster, checked before anything is placed."""
from __future__ import annotations

import os

from dataclasses import dataclass

from raypar.config import Config
from raypar.topology import Grid


class ResourceError(RuntimeError):
    """The cluster cannot hold the requested grid."""


@dataclass(frozen=True)
class WorkerResources:
    device: str  # "cpu" or "cuda"
    cpus: float
    gpus: int

    def bundle(self, gpu: bool = True) -> dict[str, float]:
        """One worker's bundle; `gpu=False`: its CPUs only (a standby that borrows a GPU)."""
        b = {"CPU": self.cpus}
        if self.gpus and gpu:
            b["GPU"] = self.gpus
        return b


def plan_resources(cfg: Config, grid: Grid, cluster: dict[str, float]) -> WorkerResources:
    """One GPU per worker when the run uses GPUs; fail at once if the cluster is too small."""
    n = grid.size
    cpus_have = cluster.get("CPU", 0.0)
    gpus_have = int(cluster.get("GPU", 0))
    device = cfg.runtime.device
    if device == "auto":
        device = "cuda" if gpus_have > 0 else "cpu"
    if device == "cuda" and gpus_have < n:
        raise ResourceError(
            f"the grid {grid} needs {n} GPUs (one per stage worker) but the cluster has {gpus_have}; "
            f"use a grid of at most {gpus_have} workers, or runtime.device=cpu"
        )
    need_cpus = n * cfg.runtime.cpus_per_worker
    if need_cpus > cpus_have + 1e-9:
        fit = cpus_have / n
        raise ResourceError(
            f"the grid {grid} needs {n} workers x runtime.cpus_per_worker={cfg.runtime.cpus_per_worker} "
            f"= {need_cpus:g} CPUs but the cluster has {cpus_have:g}; "
            + (f"set runtime.cpus_per_worker<={fit:.3g} or use a smaller grid" if fit > 0 else "add CPUs to the cluster")
        )
    return WorkerResources(device=device, cpus=cfg.runtime.cpus_per_worker, gpus=1 if device == "cuda" else 0)


def host_available_bytes() -> int:
    """Memory this host can still give without swapping (Linux's MemAvailable, which counts
    reclaimable page cache; elsewhere the free pages), less what Ray's memory monitor keeps
    free: past its threshold it kills workers (`host_headroom_bytes`)."""
    return _meminfo("MemAvailable", os.sysconf("SC_AVPHYS_PAGES")) - host_headroom_bytes()


def host_headroom_bytes() -> int:
    """Memory Ray's memory monitor keeps free on this host: it kills workers once the host
    uses more than `RAY_memory_usage_threshold` (0.95 unless set) of its memory, unless
    `RAY_memory_monitor_refresh_ms=0` turned it off."""
    if os.environ.get("RAY_memory_monitor_refresh_ms", "").strip() == "0":
        return 0
    threshold = float(os.environ.get("RAY_memory_usage_threshold", "0.95"))
    return int((1 - min(max(threshold, 0.0), 1.0)) * _meminfo("MemTotal", os.sysconf("SC_PHYS_PAGES")))


def _meminfo(key: str, pages: int) -> int:
    """`key` of /proc/meminfo in bytes; elsewhere `pages` pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return pages * os.sysconf("SC_PAGE_SIZE")
