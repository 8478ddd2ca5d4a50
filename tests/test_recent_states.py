"""A worker's states in memory (`RecentStates`) and who keeps whose replica (`peer_of`)."""
import threading
import time

import torch

from raypar.actors.memory import peer_of
from raypar.runtime.recent_states import (OWN_KEPT, OWN_SLOTS, OWN_SLOTS_ALONE, REPLICAS_KEPT, RecentStates,
                                          pack, unpack)


def _take(recent: RecentStates, rank: int, steps_done: int, state: dict, send=None) -> bool:
    taken = recent.begin(rank, steps_done, lambda: {k: v for k, v in state.items()}, {"rng": torch.tensor([rank])},
                         cuda=False, send=send)
    recent.fence()  # as the next optimizer step does: the copy is made before the state changes
    return taken


def test_keeps_the_three_newest_copies_as_they_were_and_replicas_by_rank():
    recent = RecentStates()
    w = torch.zeros(4)
    for steps_done in (1, 2, 3, 4):
        w.fill_(steps_done)
        assert _take(recent, 0, steps_done, {"w": w})
        recent.settle()
    for step in (2, 1, 3):  # the two newest replicas of a peer are kept, in any order of arrival
        recent.keep_replica(1, step, {"w": torch.full((4,), 10.0 * step)}, generation=0)
    assert sorted(recent.inventory()) == [(0, 2), (0, 3), (0, 4), (1, 2), (1, 3)]
    assert torch.equal(recent.tensors(0, 2)["w"], torch.full((4,), 2.0))
    assert torch.equal(recent.tensors(0, 3)["rng"], torch.tensor([0]))
    assert torch.equal(recent.tensors(1, 2)["w"], torch.full((4,), 20.0))
    recent.clear()
    assert recent.inventory() == []


def test_a_replica_sent_for_earlier_peers_is_dropped():
    """After a re-plan (new ranks, new peers) a replica still on its way from before must not
    be kept under the new grid's rank numbers."""
    recent = RecentStates()
    recent.generation = 2
    recent.keep_replica(1, 5, {"w": torch.ones(2)}, generation=1)
    assert recent.inventory() == []
    recent.keep_replica(1, 5, {"w": torch.ones(2)}, generation=2)
    assert recent.inventory() == [(1, 5)]


def test_frozen_states_stay_as_they_were_until_cleared():
    recent = RecentStates()
    recent.generation = 1
    release = threading.Event()
    assert _take(recent, 0, 1, {"w": torch.ones(2)})
    recent.settle()
    assert _take(recent, 0, 2, {"w": torch.ones(2)}, send=lambda s: release.wait(10))
    while not recent.sending() or (0, 2) not in recent.inventory():
        time.sleep(0.001)  # step 2's copy is whole and on its way to the peer
    recent.freeze()  # a failure: a replica on its way, another arriving
    recent.keep_replica(1, 2, {"w": torch.ones(2)}, generation=1)
    release.set()
    recent.settle()
    assert sorted(recent.inventory()) == [(0, 1), (0, 2)]


def test_a_worker_sending_no_replicas_holds_buffers_for_fewer_copies():
    """Without a peer a worker keeps its three newest copies and makes one: buffers for
    `OWN_SLOTS_ALONE` copies, reserved at setup, serve every copy it takes; a peer set later
    reserves the rest."""
    recent = RecentStates()
    layout = {"w": (torch.Size([256]), torch.float32), "rng": (torch.Size([1]), torch.int64)}
    one = 256 * 4 + 8
    recent.reserve(layout, pin=False, slots=OWN_SLOTS_ALONE)
    assert recent.held_bytes() == OWN_SLOTS_ALONE * one
    for steps_done in range(1, 3 * OWN_SLOTS):
        assert _take(recent, 0, steps_done, {"w": torch.full((256,), float(steps_done))})
        recent.settle()
        assert recent.held_bytes() == OWN_SLOTS_ALONE * one, steps_done
    assert sorted(recent.inventory()) == [(0, s) for s in range(3 * OWN_SLOTS - OWN_KEPT, 3 * OWN_SLOTS)]
    recent.reserve(layout, pin=False, wait=True)
    assert recent.held_bytes() == OWN_SLOTS * one


def test_copies_go_into_reserved_buffers():
    recent = RecentStates()
    assert recent.reserve({"w": (torch.Size([3]), torch.float32)}, pin=False) >= 0
    w = torch.full((3,), 7.0)
    assert _take(recent, 0, 1, {"w": w})
    recent.settle()
    assert torch.equal(recent.tensors(0, 1)["w"], w)


def test_buffers_allocated_ahead_are_taken_instead_of_new_ones():
    """A standby pins buffers before it knows its stage; its copies must go into them (a
    recovery that pins gigabytes holds up its own load and first step)."""
    from raypar.runtime.snapshot import pinned_buffers

    recent = RecentStates()
    ahead = [pinned_buffers([(torch.Size([3]), torch.float32), (torch.Size([2, 2]), torch.bfloat16)], pin=False)
             for _ in range(OWN_SLOTS)]
    recent.adopt(ahead)
    recent.reserve({"w": (torch.Size([3]), torch.float32), "b": (torch.Size([2, 2]), torch.bfloat16)}, pin=False)
    w = torch.full((3,), 5.0)
    assert _take(recent, 0, 1, {"w": w, "b": torch.ones(2, 2, dtype=torch.bfloat16)})
    recent.settle()
    held = recent.tensors(0, 1)
    assert torch.equal(held["w"], w)
    pointers = {t.data_ptr() for bufs in ahead for t in bufs.values()}
    assert held["w"].data_ptr() in pointers and held["b"].data_ptr() in pointers


def test_copies_go_on_while_a_replica_is_on_its_way_which_keeps_its_source():
    """A replica crosses nodes at its own pace: the copies after it are taken meanwhile (a lost
    process's newest copy is what its recovery wants), a replica asked for meanwhile is not
    sent, and the copy a replica was made from stays held, however old, until the next one
    arrives (a lost node's ranks come back at their replicas' step: the others need theirs)."""
    recent = RecentStates()
    release, sent = threading.Event(), []

    def send(step):
        release.wait(10)
        sent.append(step)

    assert _take(recent, 0, 1, {"w": torch.ones(2)}, send=send)
    assert not recent.busy(1)  # the copy just begun: it usually ends within a step
    for step in range(2, OWN_SLOTS + 3):
        while recent.busy(step):
            time.sleep(0.001)  # the last copy is being made
        assert _take(recent, 0, step, {"w": torch.full((2,), float(step))}, send=send)
        assert recent.sending()
    assert recent.replica_skipped == OWN_SLOTS + 1 and recent.skipped == 0
    while recent.busy(OWN_SLOTS + 3):
        time.sleep(0.001)
    newest = list(range(OWN_SLOTS, OWN_SLOTS + 3))
    assert sorted(s for _, s in recent.inventory()) == [1, *newest]  # step 1's copy is on its way
    release.set()
    recent.settle()
    assert sent == [1]
    # Sent and held by the peer: still the copy every rank keeps for that step.
    assert sorted(s for _, s in recent.inventory()) == [1, *newest]
    assert _take(recent, 0, 50, {"w": torch.ones(2)}, send=send)
    recent.settle()
    assert sent == [1, 50]
    assert sorted(s for _, s in recent.inventory()) == [*newest[1:], 50]  # step 50's replaced it


def test_pack_and_unpack_keep_dtype_shape_and_values():
    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b": torch.tensor(7.0), "c": torch.arange(6).view(2, 3)}
    back = unpack(pack(tensors))
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape and torch.equal(back[name], t)
    assert set(unpack(pack(tensors), {"b"})) == {"b"}
    views = unpack(pack(tensors), copy=False)  # the same bytes, not a copy
    assert views["c"].data_ptr() == tensors["c"].data_ptr() and torch.equal(views["a"], tensors["a"])


def test_replicas_go_to_another_node_where_there_is_one_one_each():
    assert [peer_of(r, ["a", "a", "b", "b"]) for r in range(4)] == [2, 3, 0, 1]
    assert [peer_of(r, ["a", "b", "a", "b"]) for r in range(4)] == [1, 0, 3, 2]
    assert [peer_of(r, ["a", "a", "a", "b"]) for r in range(4)] == [3, 3, 3, 0]  # b has one worker
    assert [peer_of(r, ["a", "a", "b", "b", "c", "c"]) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    assert [peer_of(r, ["a", "a", "a"]) for r in range(3)] == [1, 2, 0]


def test_a_node_that_cannot_hold_the_copies_is_a_clear_error():
    import pytest

    from raypar.actors.memory import check_host_memory
    from raypar.config import ConfigError

    gib = 2**30
    nodes, states = ["n1", "n1", "n2", "n2"], [2 * gib] * 4
    peers = [peer_of(r, nodes) for r in range(4)]  # n1's ranks keep n2's replicas and back
    # Per node: two workers' own copies, and the replicas of the other node's two workers.
    need = (2 * OWN_SLOTS * 2 + 2 * REPLICAS_KEPT * 2) * gib
    check_host_memory(1, nodes, states, [need] * 4, peers)
    with pytest.raises(ConfigError, match=rf"node n2 needs about {need / gib:.1f} GiB for its 2 worker\(s\) "
                                          rf"\({OWN_SLOTS} copies of each.*has {need / gib - 1:.1f} GiB "
                                          r"available; set elastic.memory_every=0"):
        check_host_memory(1, nodes, states, [need, need, need - gib, need + 4 * gib], peers)
    # One node: each worker keeps the next one's replica.
    check_host_memory(1, ["n"] * 2, [gib] * 2, [2 * (OWN_SLOTS + REPLICAS_KEPT) * gib] * 2, [1, 0])
    # A worker that sends no replicas (its own peer) keeps fewer copies; what they already
    # held when the node's free memory was read counts as theirs.
    alone = OWN_SLOTS_ALONE * gib
    assert OWN_SLOTS_ALONE < OWN_SLOTS
    check_host_memory(1, ["n"], [gib], [alone], [0])
    with pytest.raises(ConfigError, match=r"has 3.0 GiB available"):
        check_host_memory(1, ["n"], [gib], [3 * gib], [0])
    check_host_memory(1, ["n"], [gib], [3 * gib], [0], held=[alone - 3 * gib])
    with pytest.raises(ConfigError, match=rf"has {OWN_SLOTS_ALONE - 0.5:.1f} GiB available"):
        check_host_memory(1, ["n"], [gib], [3 * gib], [0], held=[alone - 3.5 * gib])
    # A lost worker's files in shared memory (a recovery restores from them, then frees
    # them) count as room, once per node whichever of its workers reports them.
    check_host_memory(1, ["n", "n"], [gib] * 2, [gib] * 2, [0, 1], reclaimable=[2 * alone - gib] * 2)
    with pytest.raises(ConfigError, match=rf"has {2 * OWN_SLOTS_ALONE - 1:.1f} GiB available"):
        check_host_memory(1, ["n", "n"], [gib] * 2, [gib] * 2, [0, 1], reclaimable=[2 * alone - 2 * gib] * 2)
    # What other runs' ended processes left in shared memory is not room: the error names it.
    with pytest.raises(ConfigError, match=r"has 3.0 GiB available.*Of its memory, 40.0 GiB is held by files in "
                                          r"/dev/shm/raypar-\* that processes of other runs left"):
        check_host_memory(1, ["n"], [gib], [3 * gib], [0], abandoned=[40 * gib])
    with pytest.raises(ConfigError) as error:
        check_host_memory(1, ["n"], [gib], [3 * gib], [0], abandoned=[0])
    assert "other runs" not in str(error.value)


def test_what_a_host_can_give_leaves_rays_memory_monitor_its_margin(monkeypatch):
    from raypar.resources import _meminfo, host_headroom_bytes

    total = _meminfo("MemTotal", 0)
    assert total > 0
    monkeypatch.delenv("RAY_memory_monitor_refresh_ms", raising=False)
    monkeypatch.setenv("RAY_memory_usage_threshold", "0.9")
    assert abs(host_headroom_bytes() - 0.1 * total) <= 1
    monkeypatch.delenv("RAY_memory_usage_threshold")
    assert abs(host_headroom_bytes() - 0.05 * total) <= 1  # Ray's default threshold, 0.95
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")  # the monitor off: it kills nothing
    assert host_headroom_bytes() == 0


def test_replicas_that_do_not_fit_the_object_store_are_a_clear_error():
    import pytest

    from raypar.actors.memory import check_object_store
    from raypar.config import ConfigError

    gib = 2**30
    nodes, states = ["n1", "n1", "n2", "n2"], [2 * gib] * 4
    peers = [peer_of(r, nodes) for r in range(4)]
    # Each node sends two states and receives two: 4 x 2 GiB in transit at most.
    check_object_store(1, nodes, states, peers, {"n1": 8 * gib, "n2": 8 * gib})
    with pytest.raises(ConfigError, match=r"node n1 needs about 8.0 GiB of it and has 7.0 GiB; start Ray with a "
                                          r"larger object store"):
        check_object_store(1, nodes, states, peers, {"n1": 7 * gib, "n2": 8 * gib})
    check_object_store(1, ["n"] * 2, [gib] * 2, [1, 0], {"n": 2 * gib})  # one node: each state once


def test_a_replica_is_copied_into_the_buffers_of_the_one_it_replaces():
    recent = RecentStates()
    like = {"w": torch.zeros(3), "b": torch.zeros(2, dtype=torch.bfloat16)}
    first = [recent.replica_buffers(1, like) for _ in range(REPLICAS_KEPT + 1)]
    for step, buffers in enumerate(first):
        recent.keep_replica(1, step, buffers, generation=0)
    # The oldest was dropped: its buffers take the next replica of that rank, and no other's.
    assert recent.replica_buffers(2, like)["w"] is not first[0]["w"]
    reused = recent.replica_buffers(1, like)
    assert reused["w"] is first[0]["w"] and reused["b"] is first[0]["b"]
    assert recent.replica_buffers(1, like)["w"] is not first[0]["w"]  # given out once
    recent.keep_replica(1, 9, reused, generation=0)
    recent.keep_replica(1, 10, recent.replica_buffers(1, like), generation=0)
    assert recent.replica_buffers(1, {"w": torch.zeros(4)})["w"].shape == (4,)  # another layout: new buffers
    assert sorted(s for r, s in recent.inventory() if r == 1) == [9, 10]


def test_on_one_node_copies_in_shared_memory_need_no_replica():
    from raypar.actors.memory import peers_of

    assert peers_of(["a", "a", "a"], [True, True, True]) == [0, 1, 2]  # nobody sends
    assert peers_of(["a", "a", "a"], [True, False, True]) == [0, 2, 2]  # rank 1's copies die with it
    assert peers_of(["a", "a", "b", "b"], [True] * 4) == [2, 3, 0, 1]  # a lost node needs the other's
    assert peers_of(["a"], [False]) == [0]


def test_a_restore_fetches_one_of_alike_replicas_and_only_its_own_tp_slice():
    """What a worker fetches of the states offered: one replica of tensors several hold whole;
    the holder of exactly its own tp slice rather than every tp rank's; every holder of a
    tensor kept only in other pieces (flat shares of a sharded optimizer, other tp slices)."""
    from raypar.runtime.recent_states import choose_sources

    # dp=2 replicas of one stage, and another stage's state.
    replicas = [["a", "master.a", "rng.rank0.cpu"], ["a", "master.a", "rng.rank1.cpu"], ["b", "master.b"]]
    assert choose_sources(replicas, {"a", "master.a"}, {}) == [0]
    assert choose_sources(replicas, {"a", "master.a", "rng.rank1.cpu"}, {}) == [1]  # same grid: its own RNG
    assert choose_sources(replicas, {"a", "b"}, {}) == [0, 2]
    # tp=2: each rank's slices of w, the norm whole on both.
    tp = [["w#tp0.0.2", "norm"], ["w#tp0.1.2", "norm"]]
    assert choose_sources(tp, {"w", "norm"}, {"w": "w#tp0.1.2"}) == [1]
    assert choose_sources(tp, {"w", "norm"}, {"w": "w#tp0.0.4"}) == [0, 1]  # another tp: every slice
    assert choose_sources(tp, {"w", "norm"}, {}) == [0, 1]  # no tp now: joined whole
    # A sharded optimizer's shares: every holder of a piece.
    sharded = [["w", "master.w@0"], ["w", "master.w@6"], ["v"]]
    assert choose_sources(sharded, {"w", "master.w"}, {}) == [0, 1]
    assert choose_sources(sharded, {"z"}, {}) == []  # held by none: the load names what is missing
    # Both: the flat shares of its own tp slice only (each dp rank holds some of them).
    both = [["w#tp0.0.2", "master.w#tp0.0.2@0"], ["w#tp0.0.2", "master.w#tp0.0.2@3"],
            ["w#tp0.1.2", "master.w#tp0.1.2@0"], ["w#tp0.1.2", "master.w#tp0.1.2@3"]]
    assert choose_sources(both, {"w", "master.w"}, {"w": "w#tp0.1.2", "master.w": "master.w#tp0.1.2"}) == [2, 3]
    assert choose_sources(both, {"w", "master.w"}, {"w": "w#tp0.0.4", "master.w": "master.w#tp0.0.4"}) == [0, 1, 2, 3]
    # Shares of what every tp rank holds whole are alike on the tp ranks of one dp rank: one each.
    norms = [["master.n@0"], ["master.n@0"], ["master.n@4"], ["master.n@4"]]
    assert choose_sources(norms, {"master.n"}, {}) == [0, 2]


def test_a_workers_own_tp_slice_loads_as_it_is():
    from raypar.model.tensor_parallel import Slice, tp_piece_name
    from raypar.runtime.state import own_slice_keys, split_own_slices

    mine = {"w": (Slice(0, 1, 2),)}
    assert own_slice_keys({"w", "master.w", "norm", "optim.step.w"}, mine) == {
        "w": tp_piece_name("w", Slice(0, 1, 2)), "master.w": tp_piece_name("master.w", Slice(0, 1, 2))}
    ours, theirs = torch.ones(2), torch.zeros(2)
    tensors = {tp_piece_name("w", Slice(0, 1, 2)): ours, tp_piece_name("w", Slice(0, 0, 2)): theirs,
               tp_piece_name("master.w", Slice(0, 0, 2)): theirs, tp_piece_name("master.w", Slice(0, 1, 2)): theirs,
               "norm": ours}
    own, rest = split_own_slices(tensors, mine)
    assert own["w"] is ours and set(own) == {"w", "master.w"} and set(rest) == {"norm"}
    # Another tp's slices are not its own: they stay, to be joined whole.
    own, rest = split_own_slices({tp_piece_name("w", Slice(0, 1, 4)): ours}, mine)
    assert own == {} and len(rest) == 1
