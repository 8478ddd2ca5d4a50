"""Pipelined training equals the single-process model: loss, every gradient, weights."""
import pytest

from raypar.data import SampleOrder
from raypar.reference import ReferenceTrainer
from raypar.schedule import build_programs, prepare, schedule_layout

from helpers import assert_same, assert_step_matches, start_group, step_both, synthetic_data, tiny_config
from tolerances import Tolerances

# Each grid runs every (schedule, micro-batches) pair once, one optimizer step each, so the
# later steps also check that the optimizer state stayed in lockstep. The zero-bubble steps
# split every backward into I and W (and 1F1B after them runs whole backwards again).
PLAN = [("fthenb", 1), ("1f1b", 4), ("zb-h1", 4), ("fthenb", 8), ("zb-h2", 8), ("1f1b", 1), ("1f1b", 8)]

GRIDS = {
    "pp1": dict(model={"n_layers": 4}, parallel={"pp": 1}),
    "pp2": dict(model={"n_layers": 4}, parallel={"pp": 2}),
    "pp4": dict(model={"n_layers": 4}, parallel={"pp": 4}),
    # A vocabulary whose head costs ~1.5 layers: "auto" splits 4 layers as 2.5 | 1.5, a cut
    # inside layer 2 (test_model).
    "pp2-auto-halves": dict(model={"n_layers": 4, "vocab_size": 512}, parallel={"pp": 2, "layers_per_stage": "auto"}),
    # Listed, uneven, and inside layers 1 and 3: [0, 1-attn] | [1-mlp, 2, 3-attn] | [3-mlp, 4].
    "pp3-listed-1.5-2-1.5": dict(model={"n_layers": 5}, parallel={"pp": 3, "layers_per_stage": [1.5, 2, 1.5]}),
    # Dropout masks follow the sample (per-sample seeds), so replicas, micro-batches and
    # recompute all draw the reference's masks.
    "pp2-dp2-dropout-recompute": dict(model={"n_layers": 4, "dropout": 0.2}, parallel={"pp": 2, "dp": 2},
                                      train={"global_batch_size": 16},
                                      runtime={"recompute": "block"}),
}


def run_plan(tmp_path, sections: dict, plan: list[tuple[str, int]], check_step=None, check_group=None) -> None:
    """Every (schedule, micro-batches) step of `plan` on a worker group and on the reference,
    matched (`assert_step_matches`); then `check_step(cfg, step, schedule, m, reports)`.
    `check_group(group, ref)` looks at the group once it has started."""
    cfg = tiny_config(tmp_path, **sections)
    dataset = synthetic_data(tmp_path, cfg)
    order = SampleOrder(len(dataset), seed=cfg.train.seed)
    ref = ReferenceTrainer(cfg)
    tol = Tolerances(ref)
    group = start_group(cfg, dataset)
    try:
        if check_group is not None:
            check_group(group, ref)
        for step, (schedule, m) in enumerate(plan):
            reports, _ = assert_step_matches(group, ref, dataset, order, step, schedule, m, tol)
            if check_step is not None:
                check_step(cfg, step, schedule, m, reports)
    finally:
        group.shutdown()


@pytest.mark.parametrize("grid", list(GRIDS))
def test_pipeline_matches_single_process(ray_session, tmp_path, grid):
    run_plan(tmp_path, GRIDS[grid], PLAN)


# Several model chunks per stage: the group is built for its schedule's layout and runs the
# schedules of that layout (loop: interleaved 1F1B; V: ZB-V and its half-memory variant,
# split backward), one optimizer step each.
LOOP_PLAN = [("interleaved-1f1b", 4), ("interleaved-1f1b", 8), ("interleaved-1f1b", 4)]
V_PLAN = [("zb-v", 4), ("zb-v-half", 8), ("zb-v", 1), ("zb-v-half", 4)]
MOE = {"n_experts": 4, "moe_top_k": 2, "moe_aux_loss_coef": 0.01, "moe_z_loss_coef": 0.001}
CHUNKED = {
    "pp2-interleaved": (dict(model={"n_layers": 4}, parallel={"pp": 2, "schedule": "interleaved-1f1b"}), LOOP_PLAN),
    "pp2-interleaved-3-chunks-uneven": (
        dict(model={"n_layers": 7}, parallel={"pp": 2, "schedule": "interleaved-1f1b", "chunks": 3,
                                              "layers_per_stage": [1, 2, 1, 1, 1, 1]}), LOOP_PLAN),
    "pp4-interleaved": (dict(model={"n_layers": 8}, parallel={"pp": 4, "schedule": "interleaved-1f1b"}), LOOP_PLAN),
    "pp2-zb-v": (dict(model={"n_layers": 4}, parallel={"pp": 2, "schedule": "zb-v"}), V_PLAN),
    "pp4-zb-v": (dict(model={"n_layers": 8}, parallel={"pp": 4, "schedule": "zb-v"}), V_PLAN),
    "pp2-dp2-zb-v-dropout-recompute": (
        dict(model={"n_layers": 4, "dropout": 0.2}, parallel={"pp": 2, "dp": 2, "schedule": "zb-v"},
             train={"global_batch_size": 16}, runtime={"recompute": "block"}), V_PLAN),
    "pp2-interleaved-stage-recompute": (
        dict(model={"n_layers": 4, "dropout": 0.2}, parallel={"pp": 2, "schedule": "interleaved-1f1b"},
             runtime={"recompute": "stage"}), LOOP_PLAN),
    # MoE layers in every chunk, experts split over ep=2.
    # Cut by cost inside layers: [0, 1.attn] [1.mlp, 2] [3, 4.attn] [4.mlp + head], the V
    # placing the first and last on stage 0: MoE MLPs on another stage than their attention.
    "pp2-ep2-zb-v-moe-auto-halves": (dict(model={"n_layers": 5, "vocab_size": 512, **MOE},
                                          parallel={"pp": 2, "ep": 2, "schedule": "zb-v", "layers_per_stage": "auto"},
                                          train={"global_batch_size": 16, "eps": 1e-6}), V_PLAN),
    "pp2-ep2-zb-v-moe": (dict(model={"n_layers": 4, **MOE}, parallel={"pp": 2, "ep": 2, "schedule": "zb-v"},
                              train={"global_batch_size": 16, "eps": 1e-6}), V_PLAN),
    "pp2-ep2-interleaved-moe": (dict(model={"n_layers": 4, **MOE},
                                     parallel={"pp": 2, "ep": 2, "schedule": "interleaved-1f1b"},
                                     train={"global_batch_size": 16, "eps": 1e-6}), LOOP_PLAN),
}


def check_live_microbatches(cfg, step: int, schedule: str, m: int, reports) -> None:
    """The runtime keeps as many chunk micro-batches' activations as the simulator says (a
    split backward's micro-batch from its F to its W: its W holds the layers' inputs and
    output gradients)."""
    p = cfg.parallel
    programs = build_programs(schedule, p.pp, m, chunks=p.chunks)
    simulated = prepare(programs, schedule_layout(schedule, p.pp, p.chunks)).peak_live
    for r in reports:
        assert r.peak_live_microbatches == simulated[r.stage], f"step {step} ({schedule}), stage {r.stage}"


@pytest.mark.parametrize("grid", list(CHUNKED))
def test_chunked_pipeline_matches_single_process(ray_session, tmp_path, grid):
    sections, plan = CHUNKED[grid]
    run_plan(tmp_path, sections, plan, check_live_microbatches)


# (schedule, micro-batches, the step each call names as the next one). The first stage
# issues that step's first forward before its report: step 1 and step 4 take theirs; step 2
# is not the announced step 5, and step 3 runs another program, so theirs are dropped.
AHEAD_PLAN = [("fthenb", 1, 1), ("fthenb", 1, 5), ("1f1b", 4, 3), ("fthenb", 8, 4), ("fthenb", 8, None)]
TAKEN_AHEAD = {1, 4}


@pytest.mark.parametrize("grid", ["pp1", "pp2", "pp2-dp2-dropout-recompute"])
def test_forward_issued_ahead_matches_single_process(ray_session, tmp_path, grid):
    cfg = tiny_config(tmp_path, **GRIDS[grid])
    assert cfg.runtime.forward_ahead
    dataset = synthetic_data(tmp_path, cfg)
    order = SampleOrder(len(dataset), seed=cfg.train.seed)
    ref = ReferenceTrainer(cfg)
    tol = Tolerances(ref)
    group = start_group(cfg, dataset)
    try:
        for step, (schedule, m, announce) in enumerate(AHEAD_PLAN):
            loss, grads, ref_loss, ref_grads, reports = step_both(group, ref, dataset, order, step, schedule, m,
                                                                  announce=announce, tol=tol)
            where = f"step {step} ({schedule}, {m} micro-batches)"
            assert abs(loss - ref_loss) <= tol.loss, f"{where}: loss {loss} vs {ref_loss}"
            assert_same(grads, ref_grads, tol.grads, where)
            # A forward issued ahead began before the call of its step did.
            for r in reports:
                ahead = r.issued[0] < r.called
                assert ahead == (r.stage == 0 and step in TAKEN_AHEAD), f"{where}, rank {r.rank}"
            tol.check_weights(group.parameters(), ref.parameters(), where)
    finally:
        group.shutdown()


def test_a_first_stage_on_cpu_reports_whole_and_has_no_tail(ray_session, tmp_path):
    """The first stage leaves its report incomplete only while its device is behind; on CPU
    the step has run when it is issued, so the report comes whole and there is no tail to
    fetch (on GPU, tests/test_gpu.py checks the completed reports)."""
    import ray

    from raypar.schedule import build_programs

    cfg = tiny_config(tmp_path, model={"n_layers": 4}, parallel={"pp": 2})
    assert cfg.runtime.forward_ahead
    dataset = synthetic_data(tmp_path, cfg)
    group = start_group(cfg, dataset)
    try:
        group.set_programs(build_programs("1f1b", 2, 4))
        batch = SampleOrder(len(dataset), seed=cfg.train.seed).indices(0, cfg.train.global_batch_size)
        first, last = ray.get(group.issue_step(0, [batch, batch]))
        assert first.complete and last.complete and first.pending_units == 0
        assert first.grad_norm > 0 and last.grad_norm is None
        with pytest.raises(ValueError, match="no report of step 0 waits for its device"):
            ray.get(group.workers[0].report_tail.remote(0))
    finally:
        group.shutdown()
