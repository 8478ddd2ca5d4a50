"""Step records and run summaries: what they compute and how they print."""
import pytest

from raypar.driver.records import Recovery, RunSummary, step_record
from raypar.metrics import mfu
from raypar.runtime.report import StepReport, UnitSpan
from raypar.schedule import Op, build_programs, prepare
from raypar.topology import Grid


def test_summary_prints_with_device_memory_checkpoints_and_a_recovery():
    recovery = Recovery(restart=1, error="RayActorError", failed_grid="dp=2 x pp=2 x ep=1", detection_s=0.5,
                        salvage_s=0.25, steps_done=7, detected_at=100.0)
    recovery.resumed("dp=1 x pp=2 x ep=1", step=4, workers_s=1.5, setup_s={}, load_s=0.5, now=103.0)
    recovery.finished(now=104.5)
    summary = RunSummary(
        steps=8, grid="dp=1 x pp=2 x ep=1", schedule="1f1b", microbatches=4, device="cuda", final_loss=2.5,
        tokens_per_s=1000.0, step_time_s=0.3, bubble_measured=0.1, bubble_simulated=0.12, control_overhead=0.01,
        peak_activation_bytes=[2**20, 2**21], peak_device_bytes=[3 * 2**30, 2**30], consumed_samples=64,
        checkpoints=[{"step": 4, "path": "/c/4", "bytes": 8 * 2**20, "write_s": 0.5, "duration_s": 1.0, "error": None,
                      "copy_wait_s": 0.125, "commit_s": 0.25},
                     {"step": 8, "path": None, "bytes": 0, "write_s": 0.0, "duration_s": 0.0, "error": "lost"}],
        checkpoint_stall_s=0.002, recoveries=[recovery.to_dict()], mfu=0.41, cuda_graphs_share=1.0)
    text = summary.format()
    assert "tokens/s            1,000  (MFU 41.0%)" in text
    assert "CUDA graphs         100% of micro-batches replayed (runtime.cuda_graphs)\n" in text
    summary.overlap_share = 0.75
    assert ("CUDA graphs         100% of micro-batches replayed (runtime.cuda_graphs), 75% beside another's backward "
            "(runtime.*_microbatch_overlap)\n") in summary.format()
    assert "peak device memory  stage 0: 3072.00 MiB  stage 1: 1024.00 MiB" in text
    assert "checkpoints         1 committed, 1 failed, 0 skipped; 8.0 MiB each, written at 16 MiB/s" in text
    assert "checkpoint path     1.00 s snapshot to commit: copies 0.12 s, write 0.50 s, commit 0.25 s" in text
    assert "recovery 1" in text and "3 steps redone" in text


def test_step_mfu_counts_the_devices_of_the_grid_that_ran_it():
    """MFU over the grid running now (after an elastic shrink, fewer devices) and the workers'
    device peak; an unknown peak reads 0, not a guess."""
    assert mfu(1000.0, 6e9, devices=2, peak_flops=1e15) == 1000.0 * 6e9 / 2e15
    assert mfu(1000.0, 6e9, devices=1, peak_flops=1e15) == 2 * mfu(1000.0, 6e9, devices=2, peak_flops=1e15)
    assert mfu(1000.0, 6e9, devices=2, peak_flops=0.0) == 0.0

    def report(rank: int, stage: int) -> StepReport:
        r = StepReport(rank=rank, stage=stage, step=0, losses=[2.0] if stage == 1 else [], times=[0.0, 1.0, 1.0, 3.0],
                       compute_s=3.0, start=0.0, end_of_backward=3.0, wall_s=3.0, called=0.0, reported=3.0,
                       peak_activation_bytes=0, peak_device_bytes=0, peak_live_microbatches=1, released_outputs=0,
                       expert_tokens={}, tokens_dropped=0, alltoall_bytes=0, alltoall_s=0.0,
                       grad_norm=1.0 if stage == 0 else None, lr=1e-3, checkpoint_stall_s=0.0)
        r.events = [UnitSpan("F0", Op.F, 0.0, 1.0), UnitSpan("B0", Op.B, 1.0, 3.0)]
        return r

    grid = Grid(1, 2, 1)
    programs = prepare(build_programs("fthenb", 2, 1))
    record = step_record(0, [report(0, 0), report(1, 1)], grid, programs, step_time_s=4.0, tokens=4000,
                         consumed_samples=8, flops_per_token=6e9, peak_flops=1e15)
    assert record.mfu == pytest.approx(mfu(1000.0, 6e9, devices=2, peak_flops=1e15))
