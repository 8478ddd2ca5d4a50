"""A recovery cancels the survivors' steps: every wait of a step on the device, and the step's
loop between units, raises StepCancelled once cancelled, until the worker is reset."""
import pytest
import torch
from helpers import one_cpu_stage, tiny_config

from raypar import host_wait


@pytest.fixture(autouse=True)
def cleared():
    host_wait.clear()
    yield
    host_wait.clear()


def test_waits_raise_once_cancelled_and_not_after_clear():
    cpu = torch.device("cpu")
    host_wait.check("step")
    host_wait.synchronize(cpu, "step end")
    assert host_wait.to_host(torch.arange(3), "sizes").tolist() == [0, 1, 2]
    host_wait.cancel("salvage 1: the driver is recovering from a failure")
    with pytest.raises(host_wait.StepCancelled, match=r"gradient norm: cancelled \(salvage 1: the driver"):
        host_wait.synchronize(cpu, "gradient norm")
    with pytest.raises(host_wait.StepCancelled, match="stage 0: step 3: cancelled"):
        host_wait.check("stage 0: step 3")
    host_wait.clear()
    host_wait.check("step")  # a reset worker runs the next plan's steps


def test_a_cancelled_stage_stops_its_step_between_units(tmp_path):
    cfg = tiny_config(tmp_path, parallel={"pp": 1, "microbatches": 2})
    with one_cpu_stage(tmp_path, cfg) as runtime:
        assert len(runtime.run_step(0, list(range(8))).losses) == 2
        host_wait.cancel("the driver is recovering")
        with pytest.raises(host_wait.StepCancelled, match="stage 0: step 1: cancelled"):
            runtime.run_step(1, list(range(8, 16)))
