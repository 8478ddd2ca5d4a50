"""The worker group's states in host memory (`elastic.memory_every`): who replicates to
whom, and a recovery's restore from what the survivors hold (`RecentStates` on each worker)."""
from __future__ import annotations

import itertools
import time

import ray

from raypar.config import ConfigError
from raypar.runtime.recent_states import OWN_SLOTS, OWN_SLOTS_ALONE, REPLICAS_KEPT



def peer_of(rank: int, nodes: list[str]) -> int:
    """The rank that keeps `rank`'s replica: on one node the next rank; else the rank in the
    same position on the next node (nodes in the order their first ranks come), so every
    worker keeps about one replica and none of its own node's."""
    order = list(dict.fromkeys(nodes))
    if len(order) == 1:
        return (rank + 1) % len(nodes)
    mine = [r for r, n in enumerate(nodes) if n == nodes[rank]]
    following = order[(order.index(nodes[rank]) + 1) % len(order)]
    theirs = [r for r, n in enumerate(nodes) if n == following]
    return theirs[mine.index(rank) % len(theirs)]


def peers_of(nodes: list[str], shared: list[bool]) -> list[int]:
    """Who keeps each rank's replicas (`peer_of`; a rank that is its own peer sends none).
    On one node a worker whose copies are in shared memory (`shared[rank]`) needs none: its
    copies outlive its process, and nothing on the node outlives the node."""
    if len(set(nodes)) == 1:
        return [r if shared[r] or len(nodes) == 1 else peer_of(r, nodes) for r in range(len(nodes))]
    return [peer_of(r, nodes) for r in range(len(nodes))]


def check_host_memory(every: int, nodes: list[str], state_bytes: list[int], available: list[int],
                      peers: list[int], node_names: list[str] | None = None, held: list[int] | None = None,
                      reclaimable: list[int] | None = None, abandoned: list[int] | None = None) -> None:
    """Raise ConfigError when some node cannot hold what its workers keep: per worker the
    copies of its own state (`OWN_SLOTS`: the newest, one being made, the sources of its
    replicas; `OWN_SLOTS_ALONE` for a worker that sends none) and the replicas it keeps for
    its peer (the two newest). Lists are by rank;
    `available` is what each worker's host reported free, `held` what its copies already
    held then (allocated at setup: not free, but theirs), `reclaimable` what its node's
    shared memory held of ended processes then (freed once a recovery restored from them:
    counted once per node), `abandoned` what other runs' ended processes left there (named
    in the error: only their removal frees it)."""
    need: dict[str, int] = {}
    free: dict[str, int] = {}
    count: dict[str, int] = {}
    held_on: dict[str, int] = {}
    ended_on: dict[str, int] = {}
    left_on: dict[str, int] = {}
    for rank, node in enumerate(nodes):
        slots = OWN_SLOTS if peers[rank] != rank else OWN_SLOTS_ALONE
        need[node] = need.get(node, 0) + slots * state_bytes[rank]
        free[node] = min(free.get(node, available[rank]), available[rank])
        count[node] = count.get(node, 0) + 1
        held_on[node] = held_on.get(node, 0) + (held[rank] if held else 0)
        ended_on[node] = max(ended_on.get(node, 0), reclaimable[rank] if reclaimable else 0)
        left_on[node] = max(left_on.get(node, 0), abandoned[rank] if abandoned else 0)
    for node in free:
        free[node] += held_on[node] + ended_on[node]
    for source, keeper in enumerate(peers):
        if keeper != source:
            need[nodes[keeper]] += REPLICAS_KEPT * state_bytes[source]
    names = dict(zip(nodes, node_names or nodes))
    for node, bytes_needed in need.items():
        if bytes_needed > free[node]:
            raise ConfigError(
                f"elastic.memory_every={every} keeps the workers' states in host memory: node {names[node]} needs "
                f"about {bytes_needed / 2**30:.1f} GiB for its {count[node]} worker(s) ({OWN_SLOTS} copies "
                f"of each one's state, {OWN_SLOTS_ALONE} where it sends no replicas, and the replicas it keeps for its "
                f"peers) and has {free[node] / 2**30:.1f} GiB "
                f"available; set elastic.memory_every=0 to recover from checkpoints only, or use nodes with more memory"
                + (f". Of its memory, {left_on[node] / 2**30:.1f} GiB is held by files in /dev/shm/raypar-* that "
                   f"processes of other runs left when they ended (a crashed run leaves them): once those runs "
                   f"are over, `raypar shared-memory --remove` on that node removes them" if left_on[node] >= 2**30 / 10 else ""))


def check_object_store(every: int, nodes: list[str], state_bytes: list[int], peers: list[int],
                       capacity: dict[str, float], node_names: list[str] | None = None) -> None:
    """Raise ConfigError when some node's object store cannot hold the replicas passing
    through it: each worker's state travels as one object, put on the sender's node (and
    pulled onto its peer's, when that is another), until the peer has copied it."""
    need: dict[str, int] = {}
    for source, keeper in enumerate(peers):
        if keeper != source:
            for node in {nodes[source], nodes[keeper]}:
                need[node] = need.get(node, 0) + state_bytes[source]
    names = dict(zip(nodes, node_names or nodes))
    for node, bytes_needed in need.items():
        if bytes_needed > capacity.get(node, 0):
            raise ConfigError(
                f"elastic.memory_every={every} sends replicas of the workers' states through Ray's object store: "
                f"node {names[node]} needs about {bytes_needed / 2**30:.1f} GiB of it and has "
                f"{capacity.get(node, 0) / 2**30:.1f} GiB; start Ray with a larger object store (`ray start "
                f"--object-store-memory`, or `object_store_memory` in ray.init), or set elastic.memory_every=0")


# Generations of peers set, unique across the groups and drivers of a run (copies in shared
# memory outlive both): a state copied for one is never taken for another's.
_GENERATIONS = itertools.count(time.time_ns() // 1000)


def shared_memory_notes(info: list[dict]) -> list[str]:
    """One line per node where some worker's copies in memory found no room in shared
    memory (`elastic.memory_shared`): there they die with a lost process."""
    short: dict[str, list[dict]] = {}
    for i in info:
        if (i.get("shared_memory") or {}).get("short"):
            short.setdefault(i["node"], []).append(i)
    return [f"raypar: /dev/shm on node {node} had no room for the copies in memory of {len(held)} worker(s) "
            f"({min(i['shared_memory']['free_bytes'] for i in held) / 2**30:.2f} GiB left): those copies went to the "
            f"workers' own memory and die with a lost process; a larger /dev/shm (docker run --shm-size, or a "
            f"larger tmpfs) keeps them" for node, held in short.items()]


class WorkerMemory:
    def __init__(self, group) -> None:
        self.group = group
        self.generation = 0  # of the peers set last: a replica sent for an earlier one is dropped
        self.sends_replicas = False  # some worker has a peer (set_peers): on one node with shared memory none has

    def set_peers(self) -> None:
        """Tell each worker where its copies go (after every setup: ranks and nodes change),
        once the nodes are known to hold what the workers will keep (`check_host_memory`)."""
        g = self.group
        nodes = [i["node_id"] for i in g.info]
        shared = [bool(i.get("shared_memory")) and not i["shared_memory"]["short"] for i in g.info]
        peers = peers_of(nodes, shared)
        state_bytes, node_names = [i["state_bytes"] for i in g.info], [i["node"] for i in g.info]
        check_host_memory(g.cfg.elastic.memory_every, nodes, state_bytes, [i["host_available_bytes"] for i in g.info],
                          peers, node_names, [i.get("memory_held_bytes", 0) for i in g.info],
                          [(i.get("shared_memory") or {}).get("ended_bytes", 0) for i in g.info],
                          [(i.get("shared_memory") or {}).get("abandoned_bytes", 0) for i in g.info])
        stores = {n["NodeID"]: n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n["Alive"]}
        check_object_store(g.cfg.elastic.memory_every, nodes, state_bytes, peers, stores, node_names)
        self.generation = next(_GENERATIONS)
        self.sends_replicas = any(peer != r for r, peer in enumerate(peers))
        refs = [w.set_memory_peer.remote(g.workers[peer] if peer != r else None, self.generation)
                for r, (w, peer) in enumerate(zip(g.workers, peers))]
        g.get(refs, g.cfg.runtime.step_timeout_s, "set_memory_peer")

    def newest_whole(self, ranks: int, steps: list[int], generation: int) -> tuple[int, dict[int, int]] | str:
        """The newest of `steps` whose state every rank of a `ranks`-worker grid, copied for
        the peers of `generation`, has on some live worker or in its node's shared memory,
        and which worker (index) serves each rank's; else why there is none."""
        g = self.group
        held: dict[tuple[int, int], int] = {}
        inventories = g.get([w.memory_inventory.remote(generation) for w in g.workers], g.cfg.runtime.step_timeout_s,
                            "memory_inventory")
        for index, inventory in enumerate(inventories):
            for rank, step in inventory:
                held.setdefault((rank, step), index)
        for step in sorted(steps, reverse=True):
            if all((r, step) in held for r in range(ranks)):
                return step, {r: held[r, step] for r in range(ranks)}
        by_rank = {r: sorted(s for (q, s) in held if q == r) for r in range(ranks)}
        return (f"no step in memory for every rank (steps the driver saw copied: {sorted(steps)[-6:]}; "
                f"held by rank: {by_rank})")

    def restore(self, step: int, holders: dict[int, int], same_grid: bool, generation: int) -> tuple[list[dict], float]:
        """Load the state after `step` steps into every worker from the holders' memory (each
        rank of the failed grid from `holders[rank]`), then forget what they held. Returns
        per worker its rank and bytes loaded, and the seconds it took."""
        g = self.group
        t0 = time.perf_counter()
        timeout = g.cfg.checkpoint.timeout_s
        # On the same grid, without tp slices or optimizer shares (which are put together from
        # several ranks' states), worker r needs rank r's state alone: where it holds that
        # itself (its own copy, or a lost process's in its node's shared memory) it reads it
        # in place rather than through the object store.
        alone = same_grid and g.grid.tp == 1 and not g.cfg.parallel.shard_optimizer
        local = {rank for rank, index in holders.items() if alone and index == rank}
        sources = g.get([g.workers[index].export_memory.remote(rank, step, generation)
                         for rank, index in holders.items() if rank not in local], timeout, "export_memory")
        loaded = g.get([w.load_memory.remote([] if r in local else sources, same_grid,
                                             (r, step, generation) if r in local else None)
                        for r, w in enumerate(g.workers)], timeout, "load_memory")
        self.clear()
        return loaded, time.perf_counter() - t0

    def clear(self, drop: bool = False) -> None:
        """Every worker forgets the states it holds and those in its node's shared memory
        (`drop`: the run's files there go too)."""
        g = self.group
        g.get([w.clear_memory.remote(drop) for w in g.workers], g.cfg.runtime.step_timeout_s, "clear_memory")
