"""Stage workers kept between the runs of one driver process (`runtime.keep_workers`).

Starting a stage worker costs a process, torch's imports (about 2 s of CPU), and on a GPU
a CUDA context and the kernels: seconds a worker, every run. A group that ends with
`keep_workers` resets its workers (they leave their process groups and drop their stages)
and leaves them here with their placement groups; the next group of this process takes
those that fit it and rebinds them to its run (`StageWorker.rebind`).

A placement group is kept whole or not at all: every bundle holds a live worker, or is
placed with nothing in it (a lost node's bundle Ray placed again, where the next group
starts a worker). What the next group does not take is released when that group starts,
so kept workers hold their resources only between two runs; `release()` lets them go at once.
"""
from __future__ import annotations

from dataclasses import dataclass

import ray

from raypar.resources import WorkerResources

from .placement import group_shape, kill, remove_groups

# How long a kept worker may take to answer before it counts as lost.
ANSWER_TIMEOUT_S = 10.0


@dataclass
class KeptPlacement:
    """One placement group and the reset worker in each of its bundles (None in a bundle
    placed with no worker)."""

    pg: object
    strategy: str
    device: str
    workers: list  # actor handles or None, by bundle index
    session: tuple[str, str] = ("", "")  # the Ray job that kept them (`_session`)

    @property
    def bundle(self) -> dict[str, float]:
        return self.pg.bundle_specs[0]


_kept: list[KeptPlacement] = []


def keep(placement: KeptPlacement) -> None:
    placement.session = _session()
    _kept.append(placement)


def _session() -> tuple[str, str]:
    """This driver's Ray job and node: kept workers of an earlier `ray.init` are gone with it."""
    context = ray.get_runtime_context()
    return context.get_job_id(), context.get_node_id()


def kept_workers() -> int:
    """How many workers wait here for the next run."""
    return sum(w is not None for k in _kept for w in k.workers)


def held_resources() -> dict[str, float]:
    """What the kept workers hold: free for the next group (it takes them, or they go)."""
    held: dict[str, float] = {}
    for k in _kept:
        for key, amount in k.bundle.items():
            held[key] = held.get(key, 0.0) + amount * len(k.workers)
    return held


def take(resources: WorkerResources, n: int, per_node: int) -> list[KeptPlacement]:
    """Kept placement groups that make up part (or all) of a group of n workers placed as
    `Placement.reserve` would place them, their workers answering. Every other kept group
    is released: idle workers must not hold resources another group is waiting for."""
    strategy, size = group_shape(n, per_node)
    candidates, chosen, room = _current(), [], n
    for k in sorted(candidates, key=lambda k: -len(k.workers)):
        if k.device != resources.device or k.bundle != resources.bundle() or len(k.workers) > room:
            continue
        # A packed group takes any kept group; a tp cell only a whole one of its size on one node.
        if strategy == "PACK" or (len(k.workers) == size and None not in k.workers and _on_one_node(k)):
            chosen.append(k)
            room -= len(k.workers)
    answering = _answering(chosen)
    _release([k for k in candidates if k not in answering])
    return answering


def release() -> None:
    """End every kept worker and remove its placement group."""
    _release(_current())


def _current() -> list[KeptPlacement]:
    """Empty the pool; what it held of this Ray session (the rest was ended with its session)."""
    session = _session() if ray.is_initialized() else None
    current = [k for k in _kept if k.session == session]
    _kept.clear()
    return current


def _on_one_node(k: KeptPlacement) -> bool:
    if k.strategy == "STRICT_PACK":
        return True
    nodes = ray.util.placement_group_table(k.pg).get("bundles_to_node_id", {})
    return len(nodes) == len(k.workers) and len(set(nodes.values())) == 1


def _answering(groups: list[KeptPlacement]) -> list[KeptPlacement]:
    """The groups all of whose workers answer (a lost one takes its whole group out)."""
    pings = {id(k): [w.__ray_ready__.remote() for w in k.workers if w is not None] for k in groups}
    every = [ref for refs in pings.values() for ref in refs]
    ready, _ = ray.wait(every, num_returns=len(every), timeout=ANSWER_TIMEOUT_S) if every else ([], [])
    done = set(ready)
    alive = []
    for k in groups:
        try:
            if all(ref in done for ref in pings[id(k)]):
                ray.get(pings[id(k)])
                alive.append(k)
        except ray.exceptions.RayError:
            pass
    return alive


def _release(groups: list[KeptPlacement]) -> None:
    for k in groups:
        for w in k.workers:
            if w is not None:
                kill(w)
    try:
        remove_groups([k.pg for k in groups])
    except Exception:  # noqa: BLE001 - removed already (the job ended them): nothing is held
        pass
