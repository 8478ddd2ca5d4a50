"""CUDA graphs of a stage's micro-batch: where they apply, and what the CPU side of them
keeps true (counters and gradients that stay put). Capture and replay themselves run on the
GPU machine (tests/test_gpu_graphs.py)."""
import pytest
import torch

from raypar.model.moe import MoEStats
from raypar.runtime.graphs import graphs_blocked, live_microbatches, overlap_blocked, wants_backward_groups
from raypar.runtime.memory import ActivationTracker
from raypar.schedule import Action, Op, build_programs
from raypar.topology import Grid

from helpers import tiny_config

CUDA = torch.device("cuda")  # only its type is read: no GPU needed


def _blocked(tmp_path, schedule="1f1b", m=4, grid=(1, 1, 1), device=CUDA, **sections):
    dp, pp, ep = grid
    cfg = tiny_config(tmp_path, parallel={"dp": dp, "pp": pp, "ep": ep}, **sections)
    return graphs_blocked(cfg, Grid(dp, pp, ep), build_programs(schedule, pp, m)[0], device)


def test_one_chunk_schedules_on_gpu_take_graphs(tmp_path):
    assert _blocked(tmp_path) is None
    assert _blocked(tmp_path, grid=(2, 1, 1)) is None
    assert _blocked(tmp_path, grid=(1, 1, 2), model={"n_experts": 4}) is None  # padded all-to-alls
    assert _blocked(tmp_path, grid=(1, 2, 1)) is None  # a pipeline stage
    assert _blocked(tmp_path, schedule="fthenb") is None  # every micro-batch live: a set each


@pytest.mark.parametrize("schedule, pp, m, sets", [
    ("1f1b", 1, 4, [1]), ("fthenb", 1, 4, [4]), ("1f1b", 2, 8, [2, 1]), ("1f1b", 4, 8, [4, 3, 2, 1]),
    ("1f1b", 4, 2, [2, 2, 2, 1]), ("fthenb", 3, 3, [3, 3, 3]),
    # Split backward: a micro-batch holds its set until its W (ZB-H1 as 1F1B's first stage, ZB-H2 2p - 1).
    ("zb-h1", 2, 8, [2, 2]), ("zb-h1", 4, 8, [4, 4, 4, 4]), ("zb-h2", 2, 8, [3, 3]), ("zb-h2", 4, 8, [7, 7, 7, 7]),
])
def test_graph_sets_follow_the_microbatches_a_stage_holds_live(schedule, pp, m, sets):
    assert [live_microbatches(p) for p in build_programs(schedule, pp, m)] == sets


def test_several_chunks_a_stage_take_a_graph_set_per_live_microbatch_of_each(tmp_path):
    cfg = tiny_config(tmp_path, parallel={"pp": 2})
    programs = build_programs("interleaved-1f1b", 2, 4, chunks=2)
    assert all(graphs_blocked(cfg, Grid(1, 2, 1), p, CUDA) is None for p in programs)
    sets = [[live_microbatches(p, chunk) for chunk in (0, 1)] for p in programs]
    assert all(1 <= n <= 4 for stage in sets for n in stage), sets


def test_microbatches_out_of_order_have_no_graph_sets():
    assert live_microbatches([Action(Op.F, 0), Action(Op.F, 1), Action(Op.B, 1), Action(Op.B, 0)]) is None
    # W out of order holds micro-batch 0's set while micro-batch 1's W runs.
    split = [Action(Op.F, 0), Action(Op.F, 1), Action(Op.I, 0), Action(Op.I, 1), Action(Op.W, 1), Action(Op.W, 0)]
    assert live_microbatches(split) is None
    assert live_microbatches(split[:4] + [Action(Op.W, 0), Action(Op.W, 1)]) == 2


def test_split_backward_schedules_take_graphs_for_every_chunk(tmp_path):
    cfg = tiny_config(tmp_path, parallel={"pp": 2})
    for schedule, chunks in (("zb-h1", None), ("zb-h2", None), ("zb-v", 2), ("zb-v-half", 2)):
        programs = build_programs(schedule, 2, 8, chunks=chunks)
        assert all(graphs_blocked(cfg, Grid(1, 2, 1), p, CUDA) is None for p in programs), schedule


@pytest.mark.parametrize("case, why", [
    (dict(device=torch.device("cpu")), "not on a GPU"),
    (dict(runtime={"cuda_graphs": False}), "runtime.cuda_graphs is off"),
    (dict(runtime={"recompute": "block"}), "runtime.recompute"),
    (dict(grid=(1, 1, 2), model={"n_experts": 4}, runtime={"moe_alltoall": "exact"}), "moe_alltoall=exact"),
], ids=["cpu", "off", "recompute", "exact"])
def test_what_keeps_a_program_eager_is_named(tmp_path, case, why):
    assert why in _blocked(tmp_path, **case)


def test_moe_counters_accumulate_in_place_across_steps():
    """A replayed graph adds into the tensors it captured: reset zeroes them, never replaces them."""
    stats = MoEStats()
    stats.add(torch.tensor([1, 2, 0]), torch.tensor(3))
    routed, dropped = stats.routed, stats.dropped
    stats.add(torch.tensor([1, 0, 1]), torch.tensor(1))
    assert routed.tolist() == [2, 2, 1] and int(dropped) == 4
    stats.alltoall_bytes = 10
    stats.reset()
    assert stats.routed is routed and stats.dropped is dropped
    assert routed.tolist() == [0, 0, 0] and int(dropped) == 0 and stats.alltoall_bytes == 0


def test_graphed_microbatches_count_in_live_activations():
    tracker = ActivationTracker([])
    tracker.hold_graphed(0, 1000)
    tracker.hold_graphed(1, 500)
    assert tracker.sample() == 1500 and tracker.live_microbatches() == 2
    tracker.backward_done(0)
    assert tracker.sample() == 500 and tracker.peak_bytes == 1500 and tracker.live_microbatches() == 1
    tracker.clear()
    assert tracker.live_bytes() == 0


def _overlap(tmp_path, grid=(1, 1, 2), tp=1, m=4, has_moe=True, has_group=True, schedule="1f1b", **sections):
    dp, pp, ep = grid
    cfg = tiny_config(tmp_path, model={"n_experts": 4}, parallel={"dp": dp, "pp": pp, "ep": ep, "tp": tp},
                      train={"global_batch_size": 16}, **sections)
    return overlap_blocked(cfg, Grid(dp, pp, ep, tp), has_moe, build_programs(schedule, pp, m)[0], has_group)


def test_graphed_microbatches_overlap_at_ep2_and_at_tp2(tmp_path):
    assert _overlap(tmp_path) is None
    assert _overlap(tmp_path, grid=(2, 1, 2)) is None
    assert _overlap(tmp_path, grid=(1, 1, 1), tp=2, has_moe=False) is None
    assert _overlap(tmp_path, grid=(2, 1, 1), tp=2, has_moe=False) is None
    # MoE at ep=2 split by tp: either switch on overlaps (both have collectives to hide).
    assert _overlap(tmp_path, tp=2) is None
    assert _overlap(tmp_path, tp=2, runtime={"moe_microbatch_overlap": False}) is None
    assert _overlap(tmp_path, tp=2, runtime={"tp_microbatch_overlap": False}) is None


@pytest.mark.parametrize("case, why", [
    (dict(runtime={"moe_microbatch_overlap": False}), "runtime.moe_microbatch_overlap off"),
    (dict(grid=(1, 1, 1), tp=2, has_moe=False, runtime={"tp_microbatch_overlap": False}),
     "runtime.tp_microbatch_overlap off"),
    (dict(tp=2, runtime={"moe_microbatch_overlap": False, "tp_microbatch_overlap": False}),
     "runtime.moe_microbatch_overlap and runtime.tp_microbatch_overlap off"),
    (dict(grid=(2, 1, 1)), "no collective to hide"),
    (dict(has_moe=False), "no collective to hide"),
    (dict(m=1), "one micro-batch"),
    (dict(has_group=False), "no second ep or tp communicator"),
    (dict(grid=(1, 1, 1), tp=2, has_moe=False, has_group=False), "no second ep or tp communicator"),
    (dict(schedule="fthenb"), "several micro-batches live"),
    (dict(grid=(1, 2, 2)), "parallel.pp > 1"),
    (dict(grid=(1, 2, 1), tp=2, has_moe=False), "parallel.pp > 1"),
], ids=["off", "tp-off", "both-off", "ep1", "dense", "one-microbatch", "no-group", "tp-no-group", "fthenb", "pp2",
        "tp2-pp2"])
def test_what_keeps_graphed_microbatches_apart_is_named(tmp_path, case, why):
    assert why in _overlap(tmp_path, **case)


@pytest.mark.parametrize("backend, grid, tp, experts, sections, wanted", [
    ("nccl", (1, 1, 2), 1, 4, {}, True),
    ("gloo", (1, 1, 2), 1, 4, {}, False),
    ("nccl", (1, 2, 2), 1, 4, {}, False),
    ("nccl", (1, 1, 1), 1, 4, {}, False),
    ("nccl", (1, 1, 2), 2, 4, {}, True),
    ("nccl", (1, 1, 1), 2, 0, {}, True),
    ("nccl", (2, 1, 1), 2, 0, {}, True),
    ("nccl", (1, 2, 1), 2, 0, {}, False),
    ("nccl", (1, 1, 1), 2, 0, {"runtime": {"tp_microbatch_overlap": False}}, False),
    ("nccl", (1, 1, 2), 1, 4, {"runtime": {"cuda_graphs": False}}, False),
    ("nccl", (1, 1, 2), 1, 4, {"runtime": {"moe_microbatch_overlap": False}}, False),
], ids=["ep2", "cpu", "pp2", "ep1", "ep2-tp2", "tp2", "dp2-tp2", "tp2-pp2", "tp-overlap-off", "graphs-off",
        "overlap-off"])
def test_the_second_communicators_are_made_only_where_they_are_used(tmp_path, backend, grid, tp, experts, sections,
                                                                     wanted):
    dp, pp, ep = grid
    cfg = tiny_config(tmp_path, model={"n_experts": experts}, parallel={"dp": dp, "pp": pp, "ep": ep, "tp": tp},
                      **sections)
    assert wants_backward_groups(cfg, Grid(dp, pp, ep, tp), backend) is wanted


def test_a_second_graph_set_that_fails_to_capture_keeps_the_first_without_overlap(tmp_path, monkeypatch, capsys):
    """Overlapped micro-batches need a second graph set (a second micro-batch's activations):
    where its capture fails (most likely no room), the stage keeps the first set and replays
    its micro-batches one after another, saying why; where the first fails, it runs eagerly."""
    from types import SimpleNamespace

    import raypar.runtime.stage as stage_module
    from raypar.runtime.graphs import GraphCaptureError, graph_key

    from helpers import one_cpu_stage

    made = []

    class Graph:
        """A capture that works the first `works` times."""
        works = 1

        def __init__(self, model, inputs, micro_batches, **_):
            if len(made) >= Graph.works:
                raise GraphCaptureError("CUDA out of memory (at the second set)")
            self.key = graph_key(inputs, micro_batches)
            made.append(self)

    class Streams:  # stands in for MicroBatchStreams (CUDA streams) on the CPU
        def join(self):
            pass

    monkeypatch.setattr(stage_module, "MicroBatchGraph", Graph)
    cfg = tiny_config(tmp_path, parallel={"pp": 1, "microbatches": 2})
    with one_cpu_stage(tmp_path, cfg) as runtime:
        inputs = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long), None)
        first_forward = SimpleNamespace(backwards=0)

        runtime.graphs_blocked, runtime.overlap_blocked, runtime._streams = None, None, Streams()
        assert runtime._graph_for(first_forward, inputs, Action(Op.F, 0)) is made[0]
        assert runtime._streams is None and "the second graph set failed to capture" in runtime.overlap_blocked
        assert runtime.graphs_blocked is None
        assert "micro-batches replay one after another" in capsys.readouterr().err
        # The next micro-batches replay the one set, captured once.
        assert runtime._graph_for(SimpleNamespace(backwards=1), inputs, Action(Op.F, 1)) is made[0] and len(made) == 1

        made.clear()
        Graph.works = 0
        runtime._graphs, runtime._streams = {}, Streams()
        assert runtime._graph_for(first_forward, inputs, Action(Op.F, 0)) is None
        assert runtime.graphs_blocked.startswith("capture failed") and runtime._streams is None


def test_each_chunk_captures_its_sets_at_its_first_forward_before_any_backward(tmp_path, monkeypatch):
    """A stage of several chunks captures a chunk's graph sets at that chunk's micro-batch 0,
    unless a backward has run in the step (the warm-up's gradients are zeroed after it);
    one chunk's capture keeps the other's sets. Split programs capture I and W apart."""
    from types import SimpleNamespace

    import raypar.runtime.stage as stage_module
    from raypar.runtime.graphs import graph_key

    from helpers import one_cpu_stage

    made = []

    class Graph:
        def __init__(self, model, inputs, micro_batches, chunk=0, split=False, **_):
            self.key, self.chunk, self.split = graph_key(inputs, micro_batches), chunk, split
            made.append(self)

    monkeypatch.setattr(stage_module, "MicroBatchGraph", Graph)
    cfg = tiny_config(tmp_path, parallel={"pp": 1, "microbatches": 2})
    with one_cpu_stage(tmp_path, cfg) as runtime:
        inputs = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long), None)
        runtime.graphs_blocked, runtime._splits = None, True
        runtime._graph_sets = {0: 2, 1: 1}  # as a two-chunk program holding 2 and 1 micro-batches live
        fresh, after_backward = SimpleNamespace(backwards=0), SimpleNamespace(backwards=1)

        first = runtime._graph_for(fresh, inputs, Action(Op.F, 0, chunk=0))
        assert first is made[0] and len(made) == 2 and all(g.chunk == 0 and g.split for g in made)
        assert runtime._graph_for(fresh, inputs, Action(Op.F, 1, chunk=0)) is made[1]
        # Chunk 1: not at a later micro-batch, nor once a backward ran; then at its micro-batch 0.
        assert runtime._graph_for(fresh, inputs, Action(Op.F, 1, chunk=1)) is None
        assert runtime._graph_for(after_backward, inputs, Action(Op.F, 0, chunk=1)) is None
        assert len(made) == 2
        assert runtime._graph_for(fresh, inputs, Action(Op.F, 0, chunk=1)) is made[2] and made[2].chunk == 1
        # Chunk 0's sets are kept and replayed, whatever the step has run since.
        assert runtime._graph_for(after_backward, inputs, Action(Op.F, 0, chunk=0)) is first and len(made) == 3


def test_a_warm_up_keeps_the_moe_counts_of_the_steps_earlier_forwards(tmp_path):
    """A chunk captured mid-step (after another chunk's forwards) undoes only what its own
    warm-up added to the MoE counters, in place (a replay adds into the captured tensors);
    the all-to-all's bytes and time too (a replay adds the capture's bytes itself)."""
    from helpers import one_cpu_stage

    cfg = tiny_config(tmp_path, model={"n_experts": 4}, parallel={"pp": 1, "microbatches": 2})
    with one_cpu_stage(tmp_path, cfg) as runtime:
        stats = next(iter(runtime.moe_layers.values())).stats
        stats.add(torch.tensor([1, 2, 0, 3]), torch.tensor(1))  # the step's forwards so far
        stats.alltoall_bytes, stats.alltoall_s = 100, 0.5
        routed, dropped = stats.routed, stats.dropped
        undo = runtime._undo_warm_up()
        stats.add(torch.tensor([5, 5, 5, 5]), torch.tensor(4))  # the warm-up's
        stats.alltoall_bytes, stats.alltoall_s = 160, 0.75
        undo()
        assert stats.routed is routed and stats.dropped is dropped
        assert routed.tolist() == [1, 2, 0, 3] and int(dropped) == 1
        assert (stats.alltoall_bytes, stats.alltoall_s) == (100, 0.5)
