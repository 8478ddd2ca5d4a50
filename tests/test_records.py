"""Run summaries print whatever a run produced."""
from raypar.driver.records import Recovery, RunSummary


def test_summary_prints_with_device_memory_checkpoints_and_a_recovery():
    recovery = Recovery(restart=1, error="RayActorError", failed_grid="dp=2 x pp=2 x ep=1", detection_s=0.5,
                        salvage_s=0.25, steps_done=7, detected_at=100.0)
    recovery.resumed("dp=1 x pp=2 x ep=1", step=4, workers_s=1.5, setup_s={}, load_s=0.5, now=103.0)
    recovery.finished(now=104.5)
    summary = RunSummary(
        steps=8, grid="dp=1 x pp=2 x ep=1", schedule="1f1b", microbatches=4, device="cuda", final_loss=2.5,
        tokens_per_s=1000.0, step_time_s=0.3, bubble_measured=0.1, bubble_simulated=0.12, control_overhead=0.01,
        peak_activation_bytes=[2**20, 2**21], peak_device_bytes=[3 * 2**30, 2**30], consumed_samples=64,
        checkpoints=[{"step": 4, "path": "/c/4", "bytes": 8 * 2**20, "write_s": 0.5, "duration_s": 1.0, "error": None},
                     {"step": 8, "path": None, "bytes": 0, "write_s": 0.0, "duration_s": 0.0, "error": "lost"}],
        checkpoint_stall_s=0.002, recoveries=[recovery.to_dict()])
    text = summary.format()
    assert "peak device memory  stage 0: 3072.00 MiB  stage 1: 1024.00 MiB" in text
    assert "checkpoints         1 committed, 1 failed, 0 skipped; 8.0 MiB each, written at 16 MiB/s" in text
    assert "recovery 1" in text and "3 steps redone" in text
