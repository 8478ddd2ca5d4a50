"""A recovery cancels the survivors' steps: every wait of a step on the device, and the step's
loop between units, raises StepCancelled once cancelled, until the worker is reset."""
import pytest
import torch
from helpers import synthetic_data, tiny_config

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
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from raypar.runtime.groups import build_groups, init_world
    from raypar.runtime.stage import StageRuntime
    from raypar.schedule import build_programs
    from raypar.topology import Grid

    cfg = tiny_config(tmp_path, parallel={"pp": 1, "microbatches": 2})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_world("gloo", "127.0.0.1", port, 0, 1, timedelta(seconds=30))
    try:
        grid = Grid(1, 1, 1)
        runtime = StageRuntime(cfg, grid, 0, build_groups(grid, 0, timedelta(seconds=30)), torch.device("cpu"),
                               synthetic_data(tmp_path, cfg))
        runtime.set_program(build_programs("1f1b", 1, 2)[0])
        assert len(runtime.run_step(0, list(range(8))).losses) == 2
        host_wait.cancel("the driver is recovering")
        with pytest.raises(host_wait.StepCancelled, match="stage 0: step 1: cancelled"):
            runtime.run_step(1, list(range(8, 16)))
    finally:
        dist.destroy_process_group()
