"""States in memory that outlive the process that made them (`elastic.memory_shared`).

A worker's copies of its state, and the replicas it keeps of a peer's, live in files in
shared memory (/dev/shm), one file per copy, mapped into the process: the state is copied
into them directly, as into private host buffers. Beside each file a manifest says whose
state it holds, after how many steps, for which set of peers (`generation`) and where each
tensor lies. The manifest is written, atomically, once the copy is whole and removed before
the file is written again, so a manifest never names a file being written.

When a worker's process dies its files stay. Any worker of the run on that node lists them
(`inventory`) and reads them (`read`): a lost process then costs the steps since its own
last copy, as a kept worker's does, not those since its replica reached a peer. Each node has
its own directory (nodes simulated on one machine share /dev/shm, and must not see each
other's). The files go when the run's copies are cleared (`clear`: after a restore, every
node's manifests and the files of processes that have ended) or the run ends (`drop`).
A run that crashed (its driver killed) leaves its files until another run of the same run
directory starts there, or until removed: `run_areas` lists every run's directory on a
machine, `remove_ended_runs` removes those no running process has files in (`raypar
shared-memory`).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

Layout = dict[str, tuple[torch.Size, torch.dtype]]

SHM_ROOT = Path("/dev/shm")
# Each tensor starts at a multiple of this in its file: any dtype's view is aligned.
_ALIGN = 256
# Most bytes of a copy written beside its file rather than in it (RNG states: a few KiB).
_EXTRA_BYTES = 64 * 2**20
# In a run's directory: the run directory it is of (its name is a hash of it).
_RUN_DIR_FILE = "run_dir"


def run_key(run_dir: str) -> str:
    """The name of a run's directory in shared memory: one per run directory."""
    return "raypar-" + hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def process_running(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie has ended: its memory, GPU's too, is free)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _place(layout: Layout) -> tuple[dict[str, int], int]:
    """Each tensor's offset in a file holding `layout`, and the file's size."""
    offsets, end = {}, 0
    for name, (shape, dtype) in layout.items():
        offsets[name] = end
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        end += -(-nbytes // _ALIGN) * _ALIGN
    return offsets, end


class SharedCopies:
    """One process's files in a run's shared-memory directory on its node, and what it can
    read of the other processes' there."""

    def __init__(self, node_dir: Path, pin: bool = False, run_dir: str | None = None) -> None:
        self.node_dir = node_dir
        self.root = node_dir.parent.parent  # /dev/shm: what its space is counted against
        self.own_dir = node_dir / f"p{os.getpid()}"
        self.pin = pin  # register the files' pages with CUDA (copies from the GPU need pinned memory)
        # By slot (a file's name): its bytes as mapped here, and whether CUDA has them registered.
        self._mapped: dict[str, tuple[torch.Tensor, bool]] = {}
        self.short = False  # a copy found no room here and went to private memory
        self._dropped = False  # the run is over here: nothing is made again (`drop`)
        self.run_dir = run_dir  # the run directory, noted beside the files for `run_areas`

    @classmethod
    def open(cls, run_dir: str, node_id: str, pin: bool = False, root: Path = SHM_ROOT) -> SharedCopies | None:
        """The area of run `run_dir` on this node, or None where shared memory is not writable."""
        if not (root.is_dir() and os.access(root, os.W_OK)):
            return None
        return cls(root / run_key(run_dir) / node_id, pin, str(Path(run_dir).resolve()))

    # -- this process's files -------------------------------------------------------------------

    def allocate(self, slot: str, layout: Layout) -> dict[str, torch.Tensor] | None:
        """Host tensors for `layout` in a file of their own (replacing the slot's last one).
        None when shared memory has no room for it: the caller uses private memory instead.
        The file's space is reserved now, so that a full /dev/shm fails here, not as a
        bus error on a later write."""
        self.free(slot)
        if self._dropped:
            return None
        offsets, size = _place(layout)
        path = self.own_dir / f"{slot}.bin"
        self.own_dir.mkdir(parents=True, exist_ok=True)
        note = self.node_dir.parent / _RUN_DIR_FILE
        if self.run_dir is not None and not note.exists():
            note.write_text(self.run_dir)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                if size:
                    os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError as e:
            path.unlink(missing_ok=True)
            if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.ENOMEM):
                raise
            if not self.short:
                self.short = True
                st = os.statvfs(self.own_dir)
                print(f"raypar: {self.root} has no room for a {size / 2**30:.2f} GiB copy "
                      f"({st.f_bavail * st.f_frsize / 2**30:.2f} GiB free): this worker's copies in memory die with "
                      f"its process (a larger /dev/shm, e.g. docker --shm-size, keeps them)", flush=True)
            return None
        flat = (torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8) if size
                else torch.empty(0, dtype=torch.uint8))
        pinned = False
        if self.pin and size:
            error = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), size, 0)
            pinned = error == 0
            if not pinned:
                # Copies from the GPU into pageable memory are synchronous: they would stall steps.
                print(f"raypar: CUDA could not pin {size / 2**30:.2f} GiB of shared memory in {self.root} (cudaError "
                      f"{int(error)}; it pins files of a tmpfs such as /dev/shm, and may refuse others); copies into "
                      f"it will be slow: set elastic.memory_shared=false", flush=True)
        self._mapped[slot] = (flat, pinned)
        return {name: _view(flat, offsets[name], shape, dtype) for name, (shape, dtype) in layout.items()}

    def free_bytes(self) -> int:
        """Room left in shared memory on this node."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def ended_bytes(self) -> int:
        """Memory the run's files of ended processes on this node hold: the next `clear` frees
        it (after a recovery restored from them, or at a run's start)."""
        return sum(_held(folder) for folder in self.node_dir.glob("p*")
                   if folder != self.own_dir and not process_running(int(folder.name[1:])))

    def abandoned_bytes(self) -> int:
        """Memory held by other runs' files of processes that have ended on this machine: a
        run that crashed (its driver killed, its node's memory exhausted) leaves them, and
        nothing frees them but removing their directories (`/dev/shm/raypar-*`)."""
        total = 0
        for folder in self.root.glob("raypar-*/*/p*"):
            if folder.parent.parent == self.node_dir.parent or not folder.name[1:].isdigit():
                continue
            if not process_running(int(folder.name[1:])):
                total += _held(folder)
        return total

    def commit(self, slot: str, rank: int, step: int, generation: int, tensors: dict[str, torch.Tensor]) -> bool:
        """Say that the slot's file holds `rank`'s state after `step` steps. Tensors not in the
        file (the RNG states a copy takes as they are) are written beside it, up to
        `_EXTRA_BYTES`; past that (the state is not the one the file was made for), or when the
        slot has no file (no room for it), nothing is committed and this returns False."""
        if slot not in self._mapped or self._dropped:
            return False
        entries, extra = {}, {}
        for name, t in tensors.items():
            offset = self._offset(slot, t)
            if offset is None:
                extra[name] = t.detach().cpu().contiguous()
            else:
                entries[name] = [str(t.dtype).removeprefix("torch."), list(t.shape), offset]
        if sum(t.nbytes for t in extra.values()) > _EXTRA_BYTES:
            return False
        if extra:
            save_file(extra, str(self.own_dir / f"{slot}.extra"))
        manifest = {"rank": rank, "step": step, "generation": generation, "file": f"{slot}.bin",
                    "tensors": entries, "extra": f"{slot}.extra" if extra else None}
        tmp = self.own_dir / f".{slot}.json.tmp"
        tmp.write_text(json.dumps(manifest))
        os.replace(tmp, self.own_dir / f"{slot}.json")
        return True

    def retract(self, slot: str) -> None:
        """The slot's file is about to be written: it no longer holds a whole state."""
        (self.own_dir / f"{slot}.json").unlink(missing_ok=True)
        (self.own_dir / f"{slot}.extra").unlink(missing_ok=True)

    def free(self, slot: str) -> None:
        """Give the slot's file back (its mapping here lasts while tensors still view it)."""
        self.retract(slot)
        mapped = self._mapped.pop(slot, None)
        if mapped is not None and mapped[1]:
            torch.cuda.cudart().cudaHostUnregister(mapped[0].data_ptr())
        (self.own_dir / f"{slot}.bin").unlink(missing_ok=True)

    def _offset(self, slot: str, t: torch.Tensor) -> int | None:
        flat = self._mapped[slot][0] if slot in self._mapped else None
        if flat is None or t.device.type != "cpu" or not t.is_contiguous():
            return None
        offset = t.data_ptr() - flat.data_ptr()
        return offset if 0 <= offset and offset + t.numel() * t.element_size() <= flat.numel() else None

    # -- every process's files on this node ------------------------------------------------------

    def _manifests(self, generation: int):
        if not self.node_dir.is_dir():
            return
        for path in sorted(self.node_dir.glob("p*/*.json")):
            try:
                manifest = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # removed or replaced meanwhile
            if manifest.get("generation") == generation:
                yield path.parent, manifest

    def inventory(self, generation: int) -> list[tuple[int, int]]:
        """(rank, steps done) of every whole state on this node copied for `generation`'s peers."""
        return sorted({(m["rank"], m["step"]) for _, m in self._manifests(generation)})

    def read(self, rank: int, step: int, generation: int) -> dict[str, torch.Tensor]:
        """`rank`'s state after `step` steps from a file on this node, whichever process wrote it
        (views of the file: nothing is copied). KeyError when no file holds it."""
        for folder, m in self._manifests(generation):
            if (m["rank"], m["step"]) != (rank, step):
                continue
            try:
                path = folder / m["file"]
                flat = torch.from_file(str(path), shared=False, size=path.stat().st_size, dtype=torch.uint8)
                tensors = {name: _view(flat, offset, shape, getattr(torch, dtype))
                           for name, (dtype, shape, offset) in m["tensors"].items()}
                if m["extra"]:
                    tensors.update(load_file(str(folder / m["extra"])))
            except FileNotFoundError:
                continue  # cleared meanwhile
            return tensors
        raise KeyError((rank, step))

    def clear(self) -> None:
        """Forget every state on this node: the manifests of the live processes (their files
        are reused) and everything of those that have ended."""
        for folder in self.node_dir.glob("p*"):
            if folder != self.own_dir and not process_running(int(folder.name[1:])):
                shutil.rmtree(folder, ignore_errors=True)
                continue
            for path in folder.glob("*.json"):
                path.unlink(missing_ok=True)
            for path in folder.glob("*.extra"):
                path.unlink(missing_ok=True)
        self._sweep_ended_nodes()

    def _sweep_ended_nodes(self) -> None:
        """Remove the run's directories of other nodes on this machine none of whose processes
        runs: a node whose raylet died and came back under another id, or (on one machine) a
        simulated node that went. A live node's are kept."""
        for node_dir in self.node_dir.parent.glob("*"):
            if node_dir != self.node_dir and node_dir.is_dir() and not any(
                    process_running(int(folder.name[1:])) for folder in node_dir.glob("p*")):
                shutil.rmtree(node_dir, ignore_errors=True)

    def drop(self) -> None:
        """The run is over on this node: remove its directory (live mappings stay valid), and
        those of nodes that ended on this machine."""
        self._dropped = True
        for slot in list(self._mapped):
            self.free(slot)
        shutil.rmtree(self.node_dir, ignore_errors=True)
        self._sweep_ended_nodes()
        run = self.node_dir.parent
        try:
            if not any(p.is_dir() for p in run.iterdir()):  # the run's, once no node of it is left here
                (run / _RUN_DIR_FILE).unlink(missing_ok=True)
                run.rmdir()
        except OSError:
            pass


@dataclass(frozen=True)
class RunArea:
    """One run's directory in shared memory on this machine."""
    path: Path
    run_dir: str | None  # the run directory it is of, where noted
    processes: int  # worker processes with files there (any node simulated on this machine)
    running: int  # of them, those still running
    bytes: int  # memory the files hold


def run_areas(root: Path = SHM_ROOT) -> list[RunArea]:
    """Every run's directory in `root` on this machine, with how many of its processes run."""
    areas = []
    for path in sorted(root.glob("raypar-*")):
        if not path.is_dir() or path.name.startswith("raypar-move-"):  # moves clean up after themselves
            continue
        folders = [f for f in path.glob("*/p*") if f.name[1:].isdigit()]
        note = path / _RUN_DIR_FILE
        try:
            run_dir = note.read_text().strip() if note.exists() else None
        except OSError:
            run_dir = None
        areas.append(RunArea(path, run_dir, len(folders), sum(process_running(int(f.name[1:])) for f in folders),
                             sum(_held(f) for f in folders)))
    return areas


def remove_ended_runs(root: Path = SHM_ROOT) -> list[RunArea]:
    """Remove the run directories in `root` that no running process has files in; returns them."""
    removed = []
    for area in run_areas(root):
        if area.running == 0:
            shutil.rmtree(area.path, ignore_errors=True)
            removed.append(area)
    return removed


def _held(folder: Path) -> int:
    """What a process's copies in `folder` hold in memory (tmpfs blocks, not apparent sizes)."""
    total = 0
    for path in folder.glob("*.bin"):
        try:
            total += path.stat().st_blocks * 512
        except FileNotFoundError:  # cleared meanwhile
            pass
    return total


def _view(flat: torch.Tensor, offset: int, shape, dtype: torch.dtype) -> torch.Tensor:
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return flat[offset:offset + nbytes].view(dtype).view(tuple(shape))
