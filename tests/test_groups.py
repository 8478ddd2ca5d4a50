"""Which process groups a worker builds: every rank the same new_group calls, in the same order;
and the rendezvous before them, which a recovery's abort can end."""
from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from raypar.runtime import groups as groups_mod
from raypar.schedule import Layout
from raypar.topology import Grid

WORLD = object()


@pytest.fixture
def fake_dist(monkeypatch):
    """torch.distributed as build_groups sees it: new_group records its ranks and returns
    them as the group; the world is a sentinel."""
    calls: list[tuple[int, ...]] = []
    world_size = {"n": 0}

    def new_group(ranks, timeout=None):
        calls.append(tuple(ranks))
        return tuple(ranks)

    fake = SimpleNamespace(new_group=new_group, get_world_size=lambda group=None: world_size["n"],
                           group=SimpleNamespace(WORLD=WORLD))
    monkeypatch.setattr(groups_mod, "dist", fake)
    return calls, world_size


@pytest.mark.parametrize("dp,pp,ep,layout", [(1, 2, 1, None), (2, 2, 1, None), (1, 2, 2, None), (2, 1, 2, None),
                                              (1, 1, 4, None), (2, 2, 2, None), (1, 2, 1, Layout(2, 2, "loop")),
                                              (2, 3, 1, Layout(3, 2, "loop")), (1, 3, 2, Layout(3, 2, "v"))])
def test_every_rank_builds_the_same_groups_and_a_group_of_every_rank_is_the_world(fake_dist, dp, pp, ep, layout):
    calls, world_size = fake_dist
    grid = Grid(dp=dp, pp=pp, ep=ep)
    world_size["n"] = grid.size
    timeout = timedelta(seconds=5)
    links = (layout or Layout(pp)).forward_links()
    per_rank = []
    for rank in range(grid.size):
        calls.clear()
        g = groups_mod.build_groups(grid, rank, timeout, layout)
        per_rank.append(list(calls))
        c = grid.coord(rank)
        expected = {
            "replica": grid.replica_ranks(c.dp),
            "dense_grad": grid.dense_grad_ranks(c.pp),
            "expert_grad": grid.expert_grad_ranks(c.pp, c.ep),
            "ep": grid.ep_ranks(c.dp, c.pp),
        }
        for kind, ranks in expected.items():
            got = getattr(g, kind)
            assert rank in ranks
            if len(ranks) == 1:
                assert got is None, kind
            elif len(ranks) == grid.size:
                assert got is WORLD, kind
            else:
                assert got == tuple(ranks), kind
        # The pipeline's channels: a two-rank group per direction of travel of each link (a
        # loop's last stage sends back to the first, a V's chunk 1 up the stages), of its own
        # also when the pair is the whole world (each direction needs its own communicator).
        line = grid.pipeline_ranks(c.dp, c.ep)
        assert g.line == line
        want = {}
        for a, b in links:
            for kind, src, dst in (("F", a, b), ("B", b, a)):
                if c.pp in (src, dst):
                    want[kind, src, dst] = tuple(sorted([line[src], line[dst]]))
        assert g.channels == want
    # new_group is collective over the world: a rank that skipped or reordered one would hang.
    assert all(c == per_rank[0] for c in per_rank)
    n = grid.dp * grid.ep * 2 * len(links)
    shared, channels = per_rank[0][:len(per_rank[0]) - n], per_rank[0][len(per_rank[0]) - n:]
    assert all(len(ranks) not in (1, grid.size) for ranks in shared)
    assert len(channels) == n and all(len(ranks) == 2 for ranks in channels)


@pytest.mark.parametrize("dp,pp,ep,tp", [(1, 1, 2, 1), (1, 1, 1, 2), (2, 1, 1, 2), (1, 1, 2, 2), (2, 1, 2, 1)])
def test_backward_groups_are_second_communicators_over_each_ep_and_tp_group(fake_dist, dp, pp, ep, tp):
    """With `backward_groups`, every rank also makes a group of its own (never the world's)
    over each ep group's and each tp group's ranks, in the same order on every rank."""
    calls, world_size = fake_dist
    grid = Grid(dp=dp, pp=pp, ep=ep, tp=tp)
    world_size["n"] = grid.size
    per_rank = []
    for rank in range(grid.size):
        calls.clear()
        plain = groups_mod.build_groups(grid, rank, timedelta(seconds=5))
        n_plain = len(calls)
        calls.clear()
        g = groups_mod.build_groups(grid, rank, timedelta(seconds=5), backward_groups=True)
        per_rank.append(list(calls))
        c = grid.coord(rank)
        ep_ranks, tp_ranks = grid.ep_ranks(c.dp, c.pp, c.tp), grid.tp_ranks(c.dp, c.pp, c.ep)
        assert g.ep_backward == (tuple(ep_ranks) if ep > 1 else None)
        assert g.tp_backward == (tuple(tp_ranks) if tp > 1 else None)
        assert (plain.ep_backward, plain.tp_backward) == (None, None)
        seconds = (dp * pp * tp if ep > 1 else 0) + (dp * pp * ep if tp > 1 else 0)
        assert len(calls) == n_plain + seconds
    assert all(c == per_rank[0] for c in per_rank)


@pytest.mark.parametrize("dp,pp,ep,tp", [(1, 1, 2, 1), (1, 1, 1, 2), (2, 1, 2, 1)])
def test_high_priority_collectives_are_groups_of_their_own(monkeypatch, dp, pp, ep, tp):
    """runtime.collectives_high_priority on NCCL: every ep and tp group, and their second
    communicators, is made with high-priority stream options, also where it spans the whole
    world (the world's own group keeps its normal stream); the others are made as before."""
    made: list[tuple[tuple[int, ...], object]] = []
    urgent = object()

    def new_group(ranks, timeout=None, pg_options=None):
        made.append((tuple(ranks), pg_options))
        return tuple(ranks)

    monkeypatch.setattr(groups_mod, "dist", SimpleNamespace(
        new_group=new_group, get_world_size=lambda group=None: grid.size, group=SimpleNamespace(WORLD=WORLD)))
    monkeypatch.setattr(groups_mod, "_high_priority_options", lambda: urgent)
    grid = Grid(dp=dp, pp=pp, ep=ep, tp=tp)
    for rank in range(grid.size):
        made.clear()
        g = groups_mod.build_groups(grid, rank, timedelta(seconds=5), backward_groups=True, high_priority=True)
        c = grid.coord(rank)
        ep_ranks, tp_ranks = tuple(grid.ep_ranks(c.dp, c.pp, c.tp)), tuple(grid.tp_ranks(c.dp, c.pp, c.ep))
        marked = [ranks for ranks, options in made if options is urgent]
        wanted = [ranks for d in range(dp) for s in range(pp) for ranks in
                  ([tuple(grid.ep_ranks(d, s, t)) for t in range(tp)] if ep > 1 else [])]
        wanted += [ranks for d in range(dp) for s in range(pp) for ranks in
                   ([tuple(grid.tp_ranks(d, s, e)) for e in range(ep)] if tp > 1 else [])]
        assert sorted(marked) == sorted(wanted * 2)  # each group and its second communicator
        assert all(options is None or ranks in wanted for ranks, options in made)
        assert (g.ep, g.tp) == ((ep_ranks if ep > 1 else None), (tp_ranks if tp > 1 else None))


def test_loop_and_v_links():
    """One chunk per stage: activations go down the line, gradients back. Interleaved chunks
    add the way back from the last stage to the first; a V adds every link upwards."""
    assert Layout(3).forward_links() == [(0, 1), (1, 2)]
    assert Layout(3, 2, "loop").forward_links() == [(0, 1), (1, 2), (2, 0)]
    assert Layout(3, 2, "v").forward_links() == [(0, 1), (1, 2), (2, 1), (1, 0)]


def test_the_rendezvous_returns_once_every_rank_has_arrived():
    import threading

    from ports import free_port

    port, stores, errors = free_port(), {}, []

    def join(rank):
        try:
            stores[rank] = groups_mod.rendezvous("127.0.0.1", port, rank, 3, timedelta(seconds=30))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    # The host last: the others wait for it to listen, then for each other.
    threads = [threading.Thread(target=join, args=(r,)) for r in (2, 1, 0)]
    for i, t in enumerate(threads):
        t.start()
        if i < 2:
            t.join(0.3)
    for t in threads:
        t.join(30)
    assert not errors and sorted(stores) == [0, 1, 2]
    stores[1].set("from 1", "seen")
    assert stores[2].get("from 1") == b"seen"


def test_a_rank_that_never_arrives_ends_the_wait_when_checked_or_timed_out():
    from ports import free_port

    class Aborted(RuntimeError):
        pass

    def aborted_after(polls):
        calls = []

        def check(what):
            calls.append(what)
            if len(calls) > polls:  # the driver's abort, some polls into the wait
                raise Aborted(what)
        return check

    # Rank 1 never comes: the check ends the wait, not the 60 s timeout.
    start = time.monotonic()
    with pytest.raises(Aborted, match=r"rank 0: joining the world of 2 ranks"):
        groups_mod.rendezvous("127.0.0.1", free_port(), 0, 2, timedelta(seconds=60), aborted_after(5))
    assert time.monotonic() - start < 30
    # Without a check: the timeout, naming who is missing.
    with pytest.raises(TimeoutError, match=r"ranks \[1, 2\] did not arrive within 0.5s"):
        groups_mod.rendezvous("127.0.0.1", free_port(), 0, 3, timedelta(seconds=0.5))
    # A rank whose host never listens gives up as checked, between its tries to connect.
    with pytest.raises(Aborted):
        groups_mod.rendezvous("127.0.0.1", free_port(), 1, 2, timedelta(seconds=60), aborted_after(1))


def test_a_rank_waiting_for_the_others_fails_at_once_when_the_host_of_the_store_is_gone():
    """Rank 0 hosts the store; when its process ends, a rank waiting there fails within a
    poll, not at the timeout."""
    import gc
    import threading

    import torch.distributed as dist
    from ports import free_port

    port, outcome = free_port(), {}
    host = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)

    def wait():
        start = time.monotonic()
        try:
            groups_mod.rendezvous("127.0.0.1", port, 1, 2, timedelta(seconds=60))
        except Exception as e:  # noqa: BLE001 - the outcome under test
            outcome["error"] = e
        outcome["s"] = time.monotonic() - start

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(0.5)
    del host  # its server goes with it, as with rank 0's process
    gc.collect()
    waiting.join(60)
    assert isinstance(outcome.get("error"), RuntimeError) and outcome["s"] < 30, outcome
