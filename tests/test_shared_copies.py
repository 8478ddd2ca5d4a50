"""States in shared memory (`elastic.memory_shared`): what a process copied is listed and read
by another process of the same node after the first one died, never across nodes or
generations, never while it is being written; cleared and dropped without leftovers."""
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

from raypar.runtime.recent_states import OWN_KEPT, RecentStates
from raypar.runtime.shared_copies import SHM_ROOT, SharedCopies, run_key

GENERATION = 41


def _copy(recent: RecentStates, rank: int, step: int, w: torch.Tensor) -> None:
    assert recent.begin(rank, step, lambda: {"w": w.clone()}, {"rng": torch.tensor([rank, step], dtype=torch.uint8)},
                        False, lambda s: None)
    recent.settle()


def _layout(w: torch.Tensor) -> dict:
    return {"w": (w.shape, w.dtype)}


def test_a_dead_processes_copies_are_read_by_another_on_its_node(tmp_path):
    """A worker process copies its state twice and keeps a peer's replica, then dies without
    cleaning up: a process on the same node lists and reads all three; another node sees none."""
    child = textwrap.dedent(f"""
        import os, torch
        from pathlib import Path
        from raypar.runtime.recent_states import RecentStates
        from raypar.runtime.shared_copies import SharedCopies
        recent = RecentStates(SharedCopies.open("run", "node-a", root=Path({str(tmp_path)!r})))
        recent.generation = {GENERATION}
        w = torch.zeros(1000, dtype=torch.bfloat16)
        recent.reserve({{"w": (w.shape, w.dtype)}}, pin=False)
        for step in (1, 2):
            w.fill_(step)
            recent.begin(3, step, lambda: {{"w": w}}, {{"rng": torch.tensor([3, step], dtype=torch.uint8)}}, False,
                         lambda s: None)
            recent.settle()
        incoming = {{"w": torch.full((7,), 5.0)}}
        buffers = recent.replica_buffers(0, incoming)
        buffers["w"].copy_(incoming["w"])
        recent.keep_replica(0, 2, buffers, {GENERATION})
        os._exit(0)  # as a killed process: nothing cleans up
    """)
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)

    here = SharedCopies.open("run", "node-a", root=tmp_path)
    assert here.inventory(GENERATION) == [(0, 2), (3, 1), (3, 2)]
    state = here.read(3, 2, GENERATION)
    assert torch.equal(state["w"], torch.full((1000,), 2, dtype=torch.bfloat16))
    assert torch.equal(state["rng"], torch.tensor([3, 2], dtype=torch.uint8))
    assert torch.equal(here.read(0, 2, GENERATION)["w"], torch.full((7,), 5.0))
    # Served through a worker's RecentStates, as a recovery asks for it.
    recent = RecentStates(here)
    assert recent.inventory(GENERATION) == [(0, 2), (3, 1), (3, 2)]
    assert torch.equal(recent.tensors(3, 1, GENERATION)["w"], torch.ones(1000, dtype=torch.bfloat16))
    # Another generation of peers (a plan before, or a driver before) or another node: nothing.
    assert here.inventory(GENERATION + 1) == []
    assert SharedCopies.open("run", "node-b", root=tmp_path).inventory(GENERATION) == []
    with pytest.raises(KeyError):
        here.read(3, 3, GENERATION)
    # Its files count as room a clear frees; then a clear forgets them and removes them.
    assert here.ended_bytes() >= 2 * 1000 * 2 + 7 * 4
    recent.clear()
    assert here.ended_bytes() == 0
    assert here.inventory(GENERATION) == [] and list((tmp_path / here.node_dir.relative_to(tmp_path)).iterdir()) == []


def test_a_copy_being_written_is_not_listed(tmp_path):
    """Its slot's manifest goes before the copy writes into the file, and comes back once whole."""
    shared = SharedCopies.open("run", "node", root=tmp_path)
    recent = RecentStates(shared)
    recent.generation = GENERATION
    w = torch.zeros(64)
    recent.reserve(_layout(w), pin=False)
    for step in range(1, OWN_KEPT + 2):  # every slot holds a step
        _copy(recent, 0, step, w + step)
    assert shared.inventory(GENERATION) == [(0, s) for s in range(1, OWN_KEPT + 2)]

    release = []
    gate_open = __import__("threading").Event()

    def slow_collect():
        gate_open.wait(30)
        return {"w": w + 99}

    assert recent.begin(0, 9, slow_collect, {}, False, release.append)
    # The oldest step's file is being written: gone from the list, the others stay.
    assert shared.inventory(GENERATION) == [(0, s) for s in range(2, OWN_KEPT + 2)]
    gate_open.set()
    recent.settle()
    assert release == [9]
    assert shared.inventory(GENERATION) == [(0, s) for s in [*range(2, OWN_KEPT + 2), 9]]
    assert torch.equal(shared.read(0, 9, GENERATION)["w"], w + 99)


def test_no_room_in_shared_memory_falls_back_to_private_copies(tmp_path, monkeypatch):
    """A full /dev/shm fails when the file is made, not as a bus error later: the copies go
    to the process's own memory and still serve this process."""
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("os.posix_fallocate", full)
    shared = SharedCopies.open("run", "node", root=tmp_path)
    recent = RecentStates(shared)
    recent.generation = GENERATION
    w = torch.arange(16.0)
    recent.reserve(_layout(w), pin=False)
    _copy(recent, 2, 5, w)
    assert recent.inventory(GENERATION) == [(2, 5)]
    assert shared.inventory(GENERATION) == []
    assert torch.equal(recent.tensors(2, 5)["w"], w)
    # The driver says so, once per node.
    from raypar.actors.memory import shared_memory_notes

    info = [{"node": "10.0.0.1", "shared_memory": {"short": shared.short, "free_bytes": 2**29}},
            {"node": "10.0.0.1", "shared_memory": {"short": False, "free_bytes": 2**30}},
            {"node": "10.0.0.2", "shared_memory": None}]
    notes = shared_memory_notes(info)
    assert len(notes) == 1 and "/dev/shm on node 10.0.0.1 had no room for the copies in memory of 1 worker(s) " \
                               "(0.50 GiB left)" in notes[0] and "--shm-size" in notes[0]


def test_drop_removes_the_runs_files(tmp_path):
    shared = SharedCopies.open("run", "node", root=tmp_path)
    recent = RecentStates(shared)
    w = torch.ones(8)
    recent.reserve(_layout(w), pin=False)
    _copy(recent, 0, 1, w)
    assert any(tmp_path.iterdir())
    recent.drop_shared()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_shared_copies_are_pinned_for_copies_from_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # In a tmpfs, as runs keep them: CUDA may refuse to pin the pages of other files (a
    # disk's, an overlay's), and then the copies say so and go on unpinned.
    root = Path(tempfile.mkdtemp(dir=SHM_ROOT))
    shared = SharedCopies.open("run", "node", pin=True, root=root)
    buffers = shared.allocate("own0", {"w": (torch.Size([1 << 20]), torch.bfloat16)})
    assert buffers["w"].is_pinned()
    src = torch.randn(1 << 20, device="cuda").to(torch.bfloat16)
    buffers["w"].copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buffers["w"], src.cpu())
    shared.drop()
    shutil.rmtree(root)


def test_other_runs_files_of_ended_processes_are_counted_as_abandoned(tmp_path):
    """A crashed run leaves its copies in shared memory: each worker reports what other runs'
    ended processes hold there, which the host-memory check names in its error."""
    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: its pid runs no more
    here = SharedCopies.open("run", "node", root=tmp_path)
    other = tmp_path / run_key("other") / "node"
    for pid, size in ((ended.pid, 3 << 20), (os.getpid(), 5 << 20)):  # ended, and live
        (other / f"p{pid}").mkdir(parents=True)
        with open(other / f"p{pid}" / "0.bin", "wb") as f:
            f.write(b"x" * size)
    # This run's own ended process: room a clear frees, not abandoned.
    (here.node_dir / f"p{ended.pid}").mkdir(parents=True)
    (here.node_dir / f"p{ended.pid}" / "0.bin").write_bytes(b"y" * (7 << 20))
    assert 3 << 20 <= here.abandoned_bytes() < 4 << 20
    assert 7 << 20 <= here.ended_bytes() < 8 << 20


def test_the_cli_lists_runs_in_shared_memory_and_removes_only_ended_ones(tmp_path, capsys):
    """`raypar shared-memory`: each run's directory with its size, its run directory and whether
    a process that wrote it runs; `--remove` deletes the ended ones and keeps the live one."""
    from raypar.driver.cli import main

    ended = subprocess.Popen(["true"])
    ended.wait()
    (tmp_path / "shm").mkdir()
    crashed = SharedCopies.open(str(tmp_path / "crashed-run"), "node", root=tmp_path / "shm")
    crashed.own_dir = crashed.node_dir / f"p{ended.pid}"  # as if that process had made it
    crashed.allocate("own0", {"w": (torch.Size([1 << 18]), torch.float32)})
    live = SharedCopies.open(str(tmp_path / "live-run"), "node", root=tmp_path / "shm")
    live.allocate("own0", {"w": (torch.Size([1 << 10]), torch.float32)})
    root = ["--root", str(tmp_path / "shm")]

    assert main(["shared-memory", *root]) == 0
    out = capsys.readouterr().out
    assert f"ended (1 processes)  run_dir {tmp_path / 'crashed-run'}" in out
    assert f"1 of 1 processes running  run_dir {tmp_path / 'live-run'}" in out
    assert "--remove deletes them" in out
    assert crashed.node_dir.is_dir()  # listing removes nothing

    assert main(["shared-memory", *root, "--remove"]) == 0
    assert "removed 1 run(s)" in capsys.readouterr().out
    assert not crashed.node_dir.parent.exists() and live.node_dir.is_dir()
    # The live run ends as runs do: its directory goes, note included.
    live.drop()
    assert list((tmp_path / "shm").iterdir()) == []
    assert main(["shared-memory", *root]) == 0 and "no run keeps states" in capsys.readouterr().out
    assert main(["shared-memory", "--root", str(tmp_path / "nowhere")]) == 2
