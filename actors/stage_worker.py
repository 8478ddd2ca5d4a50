"""One cell of the dp x pp x ep grid: a Ray actor wrapping raypar.runtime.StageRuntime."""
from __future__ import annotations

import faulthandler
import os
import socket
import threading
import time
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist

from raypar import host_wait, kernels
from raypar.checkpoint.pieces import FlatPieces
from raypar.config import Config, config_from_dict
from raypar.data import TokenDataset
from raypar.data.source import open_corpus
from raypar.resources import host_available_bytes
from raypar.runtime.graphs import wants_backward_groups
from raypar.runtime.groups import abort_groups, build_groups, init_world
from raypar.schedule import run_layout
from raypar.runtime.profile import PROFILER_READY, StepProfiler
from raypar.runtime.recent_states import (OWN_SLOTS, OWN_SLOTS_ALONE, RecentStates, choose_sources, pack, tensor_name,
                                          unpack)
from raypar.model.tensor_parallel import join_tp_pieces
from raypar.runtime.state import own_slice_keys, split_own_slices, whole_slices
from raypar.runtime.shared_copies import SharedCopies, process_running
from raypar.runtime.report import ReportTail, StepReport
from raypar.runtime.stage import StageRuntime
from raypar.runtime.state_move import Manifest, MovePlan, exchange, manifest, stage_parameters
from raypar.schedule import Action
from raypar.topology import Grid


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class ProgramVersionError(RuntimeError):
    """A step named a program version the worker was not sent (a driver bug)."""


class NodeLost(RuntimeError):
    """This worker's node is gone (its raylet ended); the process lingers until Ray's cleanup reaches it."""


class StepRefused(RuntimeError):
    """A step queued behind one that failed on this worker (or after `abort`): it waits for `reset`."""


@ray.remote(concurrency_groups={"io": 1, "control": 1, "report": 1, "memory": 1})
class StageWorker:
    def __init__(self, cfg: dict, grid: Grid, rank: int, device: str, data_path: str, borrows_gpu: bool = False):
        # A standby without a GPU of its own (elastic.standby_gpu=borrow) sees every GPU of its
        # node and picks one in `take_gpu`; until then it has none.
        self.borrows_gpu = borrows_gpu and device == "cuda"
        self.gpu_id: str | None = None  # the node's id of this worker's GPU (as Ray numbers them)
        if device == "cuda":
            self.device = torch.device("cuda", 0)
            if not self.borrows_gpu:
                # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU.
                self.gpu_id = str(ray.get_runtime_context().get_accelerator_ids()["GPU"][0])
                torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self._salvage_lock = threading.Lock()
        # Ray starts workers from their node's raylet: when it ends (the node is lost) this
        # process is reparented, though it may answer calls a while longer.
        self._raylet_pid = os.getppid()
        # `abort` (control thread) and a failed step (step thread) may abort NCCL at once.
        self._nccl_lock = threading.Lock()
        self._bind(config_from_dict(cfg), grid, rank, data_path)

    def _bind(self, cfg: Config, grid: Grid, rank: int, data_path: str) -> None:
        """Everything of this worker that belongs to one run; the process, its device and
        imports outlive it (`rebind`)."""
        self.cfg, self.grid, self.rank = cfg, grid, rank
        if self.device.type == "cpu":
            # Several workers share a node's cores: one intra-op thread each avoids thrashing.
            torch.set_num_threads(max(1, int(self.cfg.runtime.cpus_per_worker)))
        self.data_path = data_path
        self._dataset: TokenDataset | None = None  # opened on first use, kept across re-plans
        self.runtime: StageRuntime | None = None
        # Pinned host buffers of the last stage's checkpoint snapshots, kept across `reset`:
        # pinning them again costs seconds of the recovery's first steps.
        self._snapshot_buffers: dict[str, torch.Tensor] = {}
        # This worker's newest states and a peer's (elastic.memory_every), kept across `reset`:
        # a recovery restores from them. `_peer`: the worker its copies go to.
        self.recent = RecentStates(self._shared_copies())
        self._peer = None
        # Copies whose host buffers a recovery's setup left for after its first step: pinning
        # gigabytes holds up the process's CUDA calls, the state load's copies included.
        self._reserve_after_step = 0
        self.program_version = 0  # of the program set by set_program; 0: none yet
        self._profiler: StepProfiler | None = None  # runtime.profile_step's, from the step before it
        # Set when a step failed or the driver aborted: the groups are broken and steps
        # queued behind (the driver sends the next step before the last one returns) are
        # refused until `reset`, instead of waiting on peers that have left.
        self.failed: str | None = None
        # The last salvage this worker was reset for: `abort` and `reset` of one salvage run on
        # different threads in either order, and a late abort must not hit the next plan.
        self.salvage = 0
        # The state of the stage before `reset_holding_state`, on its device until `load_moved`.
        self._move_held: dict[str, torch.Tensor] = {}

    def rebind(self, cfg: dict, grid: Grid, rank: int, data_path: str) -> int:
        """Join another run (`runtime.keep_workers`): a worker `reset` after its last run takes
        this run's config, grid, rank and data, and keeps nothing else of the last one (its
        copies in memory, snapshot buffers and peer go). Returns this worker's process id."""
        if self.runtime is not None or self.borrows_gpu:
            raise RuntimeError(f"rank {self.rank}: only a worker reset after its run, on a device of its own, "
                               f"can join another run")
        self._check_node()
        self._bind(config_from_dict(cfg), grid, rank, data_path)
        return os.getpid()

    def _shared_copies(self) -> SharedCopies | None:
        """Where this worker's copies in memory go when they should outlive its process
        (`elastic.memory_shared`): the run's directory in this node's shared memory."""
        e = self.cfg.elastic
        if not (e.enabled and e.memory_every > 0 and e.memory_shared):
            return None
        shared = SharedCopies.open(self.cfg.runtime.run_dir, ray.get_runtime_context().get_node_id(),
                                   pin=self.device.type == "cuda")
        if shared is None:
            print("raypar: shared memory (/dev/shm) is not writable here: this worker's copies in memory die "
                  "with its process", flush=True)
        return shared

    def _shared_memory_info(self) -> dict | None:
        """Whether this worker's copies in memory all found room in shared memory, and what is left there."""
        shared = self.recent.shared
        if shared is None:
            return None
        return {"short": shared.short, "free_bytes": shared.free_bytes(), "ended_bytes": shared.ended_bytes(),
                "abandoned_bytes": shared.abandoned_bytes()}

    def warm(self) -> None:
        """A standby's start-up work, done while it waits (elastic.standby_workers), so that
        taking a lost worker's place costs only `setup`: what torch imports on first building a
        stage (a meta-device build: no memory), the data, the CUDA context, the kernels and
        the pinned buffers of checkpoint snapshots and of copies in memory (seconds for a 1B
        model's stage: pinned in a recovery, they would hold up its load and first step)."""
        from raypar.runtime.snapshot import pinned_buffers
        from raypar.runtime.state import snapshot_shapes_for_any_stage, takes_snapshots

        shapes = snapshot_shapes_for_any_stage(self.cfg, self.grid)  # also imports what building needs
        if self._dataset is None:
            self._dataset = open_corpus(self.cfg, self.data_path)
        if self.device.type == "cuda":
            kernels.set_enabled(self.cfg.runtime.kernels)
            # A borrowing standby does not know whose GPU it will take: it readies every one
            # of its node's (a context, kernels and handles each; pinned memory serves all).
            devices = range(torch.cuda.device_count()) if self.borrows_gpu else [self.device.index]
            for index in devices:
                with torch.cuda.device(index):
                    kernels.load_all()
                    # cuBLAS and attention create their handles and workspaces on first use.
                    dtype = getattr(torch, self.cfg.model.dtype)
                    x = torch.randn(1, 2, 64, 64, device=f"cuda:{index}", dtype=dtype, requires_grad=True)
                    out = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)
                    (out @ x.transpose(-1, -2)).sum().backward()
                    torch.cuda.synchronize(index)
            if takes_snapshots(self.cfg):
                self._snapshot_buffers = pinned_buffers(shapes)
            if self.cfg.elastic.enabled and self.cfg.elastic.memory_every > 0 and self.recent.shared is None:
                # (Copies in shared memory get their files once the stage's layout is known.)
                memory = snapshot_shapes_for_any_stage(self.cfg, self.grid, everything=True)
                self.recent.adopt([pinned_buffers(memory) for _ in range(OWN_SLOTS_ALONE)])

    def take_gpu(self, gpu_id: str | None, lost_pid: int | None, timeout_s: float) -> float:
        """A borrowing standby replacing a worker of its node: wait until the lost worker's
        process `lost_pid` has ended (its GPU memory is free then), then run on its GPU
        `gpu_id` (None on CPU runs). Returns the seconds waited."""
        t0 = time.monotonic()
        while lost_pid is not None and process_running(lost_pid):
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the lost worker's process {lost_pid} still runs {timeout_s:g}s after it was "
                                   f"replaced; its GPU {gpu_id} is not free for the standby")
            time.sleep(0.02)
        if self.borrows_gpu and gpu_id is not None:
            visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v]
            self.device = torch.device("cuda", visible.index(gpu_id) if visible else int(gpu_id))
            torch.cuda.set_device(self.device)
            self.gpu_id, self.borrows_gpu = gpu_id, False
        return time.monotonic() - t0

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the process-group rendezvous."""
        self._check_node()
        return ray.util.get_node_ip_address(), _free_port()

    def _check_node(self) -> None:
        """Raise NodeLost when this worker's raylet has ended: a worker of a lost node must not
        pass for a survivor (its node's resources are gone, the next setup would fail on them)."""
        if os.getppid() != self._raylet_pid:
            raise NodeLost(f"rank {self.rank}: the raylet of this worker's node (pid {self._raylet_pid}) has ended")

    def setup(self, master_addr: str, master_port: int, cfg: dict | None = None, grid: Grid | None = None,
              rank: int | None = None, init_weights: bool = True) -> dict:
        """Join the process groups and build this cell's stage. After a failure, a kept worker
        is set up again with the new plan's config, grid and rank (see `reset`).
        `init_weights=False`: a checkpoint is loaded next, so the stage is not initialised."""
        if cfg is not None:
            self.cfg, self.grid, self.rank = config_from_dict(cfg), grid, rank
        t0 = time.perf_counter()
        timeout = timedelta(seconds=self.cfg.runtime.collective_timeout_s)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        arrival = init_world(backend, master_addr, master_port, self.rank, self.grid.size, timeout, host_wait.check)
        layout = run_layout(self.cfg.parallel.schedule, self.grid.pp, self.cfg.parallel.chunks)
        groups = build_groups(self.grid, self.rank, timeout, layout,
                              backward_groups=wants_backward_groups(self.cfg, self.grid, backend),
                              high_priority=self.cfg.runtime.collectives_high_priority)
        t1 = time.perf_counter()
        coord = self.grid.coord(self.rank)
        needs_data = layout.holds_data(coord.pp)
        if needs_data and self._dataset is None:
            self._dataset = open_corpus(self.cfg, self.data_path)
        dataset = self._dataset if needs_data else None
        torch.manual_seed(self.cfg.train.seed)
        kernels.set_enabled(self.cfg.runtime.kernels)
        # Compile at start-up (cached on the node), so the first step does not pay for it.
        kernel_status = kernels.load_all() if self.device.type == "cuda" else {}
        t2 = time.perf_counter()
        self.runtime = StageRuntime(self.cfg, self.grid, self.rank, groups, self.device, dataset, init_weights,
                                    self._snapshot_buffers)
        self._snapshot_buffers = {}
        if self.cfg.elastic.enabled and self.cfg.elastic.memory_every > 0:
            # The copies' host buffers: at the run's start before the first step (counted in
            # "build"); in a recovery once its first step is done, beside the steps after it
            # (pinned during the state load, they held it up: 11-12 s of a 4.6 GB state's load
            # on one H200, BENCHMARKS.md). Those of the copies a worker sending no replicas
            # uses; `set_memory_peer` adds the rest.
            if cfg is None and OWN_SLOTS_ALONE * self.runtime.state_bytes() <= host_available_bytes():
                self.runtime.setup_s["build"] += self.recent.reserve(self.runtime.memory_layout(),
                                                                     pin=self.device.type == "cuda",
                                                                     slots=OWN_SLOTS_ALONE)
            elif cfg is not None:
                self._reserve_after_step = OWN_SLOTS_ALONE
            # Else they would not fit: the driver's check of the host's memory says so (allocated,
            # Ray's memory monitor would kill this worker before that check could).
        # Where a setup's time goes: waiting for every rank at the rendezvous, forming the
        # process groups, data and kernels, building the stage and optimizer, the first
        # connections to its neighbours and the world.
        setup_s = {"arrival": arrival, "groups": t1 - t0 - arrival, "data_kernels": t2 - t1, **self.runtime.setup_s}
        return {"setup_s": setup_s, "rank": self.rank, "coord": str(coord), "node": ray.util.get_node_ip_address(),
                "state_bytes": self.runtime.state_bytes(),
                "parameters": sum(p.numel() for p in self.runtime.model.parameters()),
                "shared_memory": self._shared_memory_info(),
                "host_available_bytes": host_available_bytes(),
                "memory_held_bytes": self.recent.held_bytes(),
                "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid(), "device": str(self.device), "gpu": self.gpu_id, "backend": backend,
                "kernels": kernel_status,
                "device_name": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
                "device_memory_bytes": (torch.cuda.get_device_properties(self.device).total_memory
                                        if self.device.type == "cuda" else None)}

    def set_program(self, version: int, program: list[Action]) -> None:
        """The program of this worker's stage; steps name it by `version` (sent once per plan)."""
        self.runtime.set_program(program)
        self.program_version = version

    def prefetch(self, sample_ids: list[int]) -> None:
        """Start reading the batch of `sample_ids` in the background (`StageRuntime.prefetch`)."""
        self.runtime.prefetch(sample_ids)

    def run_step(self, step: int, version: int, sample_ids: list[int],
                 capture_grads: bool = False, snapshot: dict | None = None,
                 next_sample_ids: list[int] | None = None, memory: bool = False,
                 replicate: bool = False) -> StepReport:
        """One step of program `version`; with `snapshot` (save options) the state after it
        starts copying to host; with `memory`, all of it starts copying into this worker's
        recent states (`elastic.memory_every`), and with `replicate` that copy then goes to its
        peer; with `next_sample_ids`, the next step's batch,
        whose first forward may be issued ahead (`runtime.forward_ahead`). The report carries
        numbers, not the program's labels."""
        if self.failed is not None:
            raise StepRefused(f"rank {self.rank}: step {step} not run: {self.failed}; the worker waits for reset")
        if version != self.program_version:
            raise ProgramVersionError(f"rank {self.rank}: step {step} is for program version {version}, this worker "
                                      f"holds version {self.program_version} (set_programs was not called)")
        try:
            # Not ahead of a snapshot (its peer check would wait for that forward) or into or
            # out of a profiled step (whose trace holds one step).
            profiled = self.cfg.runtime.profiled_steps
            if snapshot is not None or step in profiled or step + 1 in profiled:
                next_sample_ids = None
            if step in profiled:
                if self._profiler is None:  # the run starts at the profiled step
                    self._profiler = self._start_profiler(step)
                self._profiler.record(ready=self._every_worker_ready)
            report = self.runtime.run_step(step, sample_ids, capture_grads, next_sample_ids)
            if step in profiled:
                self._profiler.stop()
                self._profiler = None
            if step + 1 in profiled:
                self._profiler = self._start_profiler(step + 1)
            if snapshot is not None:
                report.checkpoint_stall_s += self.runtime.start_snapshot(step, **snapshot)
            if memory:
                # A worker without a peer sends nothing: asked to, it would look busy sending.
                send = self._send_replica if replicate and self._peer is not None else None
                report.checkpoint_stall_s += self.runtime.keep_recent(step, self.recent, send)
            if self._reserve_after_step:
                self.recent.reserve(self.runtime.memory_layout(), pin=self.device.type == "cuda", wait=False,
                                    slots=self._reserve_after_step)
                self._reserve_after_step = 0
            report.memory_busy = self.recent.busy(step + 1)
            report.replica_busy = self.recent.sending()
        except BaseException as e:
            self.failed = f"step {step} failed ({type(e).__name__})"
            self._break_groups()
            raise
        return report

    @ray.method(concurrency_group="report")
    def report_tail(self, step: int) -> ReportTail:
        """The rest of a report made before the device finished its step (`StepReport.complete`).
        Runs beside run_step: the next step is being issued meanwhile."""
        return self.runtime.report_tail(step)

    def late_units(self) -> tuple[int | None, list[float]]:
        """The last step's units that its report did not have (see `StepReport.pending_units`)."""
        return self.runtime.late_units()

    def _every_worker_ready(self) -> None:
        """Return once every worker is here (their profilers started): a barrier over all
        of them, waited for on the host, so the traces start together."""
        # Named, so that a trace that held it would show it (tests/test_profile.py).
        with torch.profiler.record_function(PROFILER_READY):
            if dist.get_world_size() > 1:
                # An all-reduce on this worker's device rather than dist.barrier, which on NCCL
                # picks a device by rank (a standby that took another's GPU sees every GPU).
                dist.all_reduce(torch.zeros(1, device=self.device))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    def _start_profiler(self, step: int) -> StepProfiler:
        """The profiler of step `step` (`runtime.profile_step`), started now: after the step
        before it, so that every worker's trace starts with the step (see StepProfiler)."""
        trace = Path(self.cfg.runtime.run_dir) / "profile" / f"rank{self.rank}-step{step}.json"
        return StepProfiler(trace, self.device.type == "cuda")

    def start_snapshot(self, step: int, options: dict) -> float:
        return self.runtime.start_snapshot(step, **options)

    @ray.method(concurrency_group="io")
    def write_snapshot(self, root: str, step: int) -> dict:
        """Write the last snapshot, once copied, as this worker's shard of checkpoint `step`,
        straight from its host buffers. Runs beside run_step; the commit gathers the result."""
        from raypar.checkpoint import checkpoint_dir, write_shard

        t0 = time.perf_counter()
        tensors = self.runtime.snapshot_for_writing()
        t1 = time.perf_counter()
        pieces = self.runtime.checkpoint_pieces(tensors)
        results = write_shard(checkpoint_dir(root, step), f"shard-{self.rank:05d}.safetensors", pieces)
        return {"results": results, "shapes": {name: shape for name, _, _, shape in pieces},
                "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
                "copy_wait_s": t1 - t0, "seconds": time.perf_counter() - t1}

    # -- states in memory (elastic.memory_every) ------------------------------------------

    def set_memory_peer(self, peer, generation: int) -> None:
        """The worker this one's copies go to (None: no other worker), set for the peers'
        `generation` (one per plan): replicas sent for an earlier one are dropped on arrival."""
        self._peer = peer
        self.recent.generation = generation
        if peer is not None:
            # The copies its replicas come from stay behind the newest: buffers for them too,
            # beside the next steps (a copy that finds its buffers still pinning is skipped);
            # in a recovery, after its first step with the rest.
            if self._reserve_after_step:
                self._reserve_after_step = OWN_SLOTS
            else:
                self.recent.reserve(self.runtime.memory_layout(), pin=self.device.type == "cuda", wait=False)

    def _send_replica(self, steps_done: int) -> None:
        """Send the copy of the state after `steps_done` steps to the peer and wait until it
        holds it. Runs on a thread of its own while copies go on: a slow peer spaces out
        this worker's replicas, not its copies; a lost one costs that copy its replica."""
        peer = self._peer
        if peer is None:
            return
        try:
            ref = ray.put(pack(self.recent.own(steps_done)))
            ray.get(peer.keep_replica.remote(self.rank, steps_done, [ref], self.recent.generation),
                    timeout=self.cfg.checkpoint.timeout_s)
        except Exception as e:  # noqa: BLE001 - the recovery falls back to an older step or storage
            print(f"raypar: rank {self.rank}: the replica of step {steps_done} was not kept ({type(e).__name__}: {e})",
                  flush=True)

    @ray.method(concurrency_group="memory")
    def keep_replica(self, rank: int, steps_done: int, refs: list, generation: int) -> None:
        """Keep a peer's state after `steps_done` steps, copied into this process's memory
        (the object store's copy dies with the sender): into the buffers of a replica no
        longer kept where there is one, whose pages are already mapped."""
        incoming = unpack(ray.get(refs[0]), copy=False)
        buffers = self.recent.replica_buffers(rank, incoming)
        for name, t in incoming.items():
            buffers[name].copy_(t)
        self.recent.keep_replica(rank, steps_done, buffers, generation)

    def memory_inventory(self, generation: int | None = None) -> list[tuple[int, int]]:
        """(rank, steps done) of every whole state this worker holds, its own and replicas, and
        with `generation` those of that generation's peers in its node's shared memory."""
        return self.recent.inventory(generation)

    def export_memory(self, rank: int, steps_done: int, generation: int | None = None) -> tuple[list[str], list]:
        """The keys of `rank`'s state after `steps_done` steps, and it in the object store."""
        tensors = self.recent.tensors(rank, steps_done, generation)
        return sorted(tensors), [ray.put(pack(tensors))]

    def load_memory(self, sources: list[tuple[list[str], list]], same_grid: bool,
                    local: tuple[int, int, int | None] | None = None) -> dict:
        """Load this worker's state from `export_memory` results, fetching only the sources
        it needs (`choose_sources`: one of alike replicas, its own tp slice's holder), and from
        `local` (rank, steps done, generation): a state this worker holds itself, read in
        place; returns its rank, the bytes loaded and the number of states they came from."""
        needed = self.runtime.state_names()
        tensors: dict[str, torch.Tensor] = {}
        if local is not None:
            tensors.update({k: t for k, t in self.recent.tensors(*local).items() if tensor_name(k) in needed})
        # The RNG states are restored on the same grid only.
        required = needed if same_grid else {n for n in needed if not n.startswith("rng.")}
        chosen = choose_sources([keys for keys, _ in sources], required,
                                own_slice_keys(required, self.runtime.tp_slices))
        for i in chosen:
            tensors.update(unpack(ray.get(sources[i][1][0]), needed, copy=False))  # the load copies them
        self._load_held(tensors, same_grid)
        return {"rank": self.rank, "bytes": sum(t.nbytes for t in tensors.values()),
                "states": len(chosen) + (local is not None)}

    def _load_held(self, tensors: dict[str, torch.Tensor], same_grid: bool) -> None:
        """Load this worker's stage from tensors keyed as in the copies in memory. A sharded
        optimizer's shares come in flat pieces (of tp slices: put together into the slices
        first); a tp slice that is this worker's own loads as it is, others are joined whole
        (each worker then takes its own slice, on any tp)."""
        own, rest = split_own_slices(whole_slices(tensors, self.runtime.global_shapes()), self.runtime.tp_slices)
        held = FlatPieces(join_tp_pieces(rest))
        self.runtime.load_checkpoint(held.read, held.names | set(own), same_grid, read_flat=held.read_flat,
                                     own_slices=own)

    def clear_memory(self, drop: bool = False) -> None:
        """Forget the states held (`drop`: the run is over, and its files in shared memory go)."""
        self.recent.clear()
        if drop:
            self.recent.drop_shared()

    def load_checkpoint(self, path: str, same_grid: bool) -> dict:
        """Load this worker's share of checkpoint `path`; returns how many bytes it read."""
        from raypar.checkpoint import CheckpointReader

        sizes: list[int] = []  # appended from the reading threads
        with CheckpointReader(path) as reader:
            def read(*args, **kwargs) -> torch.Tensor:
                t = reader.read(*args, **kwargs)
                sizes.append(t.nbytes)
                return t

            def read_flat(*args) -> torch.Tensor:
                t = reader.read_flat(*args)
                sizes.append(t.nbytes)
                return t

            names = set(reader.names())
            missing = self.runtime.load_checkpoint(read, names, same_grid, read_flat=read_flat)
        return {"rank": self.rank, "missing_optimizer_state": len(missing), "bytes": sum(sizes)}

    def owned_weight_names(self) -> list[str]:
        """The weights this worker writes to checkpoints (one writer per replicated tensor)."""
        from raypar.model import unstacked
        from raypar.runtime.state import writes

        sliced = self.runtime.optimizer.tp_slices
        return [n for n, _ in unstacked(self.runtime.model) if writes(self.grid.coord(self.rank), n, n in sliced)]

    def load_parameters(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        return self.runtime.load_parameters(tensors)

    def set_expert_biases(self, biases: dict[str, list[float]]) -> None:
        """The MoE layers' routing biases for the next step (`StageRuntime.set_expert_biases`)."""
        self.runtime.set_expert_biases(biases)

    def parameters(self) -> dict[str, torch.Tensor]:
        return self.runtime.parameters_cpu()

    def move_room(self, cfg: dict) -> tuple[int, int]:
        """Before a move to `cfg`'s cut on the devices (`raypar.runtime.state_move`): the
        bytes it needs free beside this worker's state (its new stage's state, estimated by its
        parameters against its stage's now, and as much again received at most), and those free
        (the device's, with what torch's cache holds unused; else the host's)."""
        new = config_from_dict(cfg)
        now, then = (stage_parameters(c, self.grid, self.rank) for c in (self.cfg, new))
        need = 2 * self.runtime.state_bytes() * then // max(now, 1)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return need, free + torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return need, host_available_bytes()

    def reset_holding_state(self, salvage: int) -> Manifest:
        """`reset` for a move to another cut on the devices: the state's tensors stay where
        they are, held beyond the stage, until `load_moved`. Returns what is held."""
        held = self.runtime.held_state()
        self.reset(salvage)
        self._move_held = held
        return manifest(held)

    def state_names(self) -> list[str]:
        """The tensors a load of this worker's stage reads."""
        return sorted(self.runtime.state_names())

    def load_moved(self, plan: MovePlan, held: list[Manifest]) -> dict:
        """This worker's part of a move on the devices: send what others need of the state it
        held, receive what it needs, and load it into its new stage (`state_move.exchange`)."""
        t0 = time.perf_counter()
        try:
            tensors = exchange(plan, held, self.rank, self._move_held, self.device)
            t1 = time.perf_counter()
            self._load_held(tensors, same_grid=True)
        finally:
            self._move_held = {}
            tensors = None  # what was received goes before the cache is emptied
        if self.device.type == "cuda":
            # The held state's blocks would stay cached in sizes of the old cut's tensors; the
            # new cut's steps allocate others.
            torch.cuda.empty_cache()
        return {"rank": self.rank, "exchange_s": t1 - t0, "load_s": time.perf_counter() - t1}

    def reset(self, salvage: int) -> str:
        """Leave the process groups and drop the stage, keeping the process (and its CUDA
        context, imports and kernels) for the next plan's `setup`. Runs after the failed step
        has returned on this worker. Returns this worker's node id."""
        import gc

        self._check_node()
        self._move_held = {}  # a move's held state: gone with the stage it came from
        with self._salvage_lock:
            faulthandler.cancel_dump_traceback_later()
            self.failed = None
            self.salvage = salvage
            host_wait.clear()
        self.recent.freeze()  # what a recovery from memory will ask for and fetch
        if self.runtime is not None:
            self.runtime.close()
            self._snapshot_buffers = self.runtime.snapshot.release()
        self.runtime = None
        self.program_version = 0
        # The stage's graphs go before its process groups (`StageRuntime.close`), also those
        # only a reference cycle still holds. Its device memory goes back to torch's cache,
        # not to CUDA: the next stage reuses it, and the allocator frees cached blocks itself
        # when it needs other sizes.
        gc.collect()
        self._destroy_groups()
        return ray.get_runtime_context().get_node_id()

    @ray.method(concurrency_group="control")
    def abort(self, salvage: int, dump_after_s: float | None = None) -> None:
        """Cancel the step in flight (`host_wait`), break NCCL collectives stuck on a lost peer
        (`abort_groups`) so that it returns, and refuse the steps queued behind it.

        Runs beside run_step. Gloo (CPU) needs no abort: a lost peer, or one whose step failed
        (`_break_groups`), closes its connections; a hung one runs into the collective timeout.
        """
        with self._salvage_lock:
            if salvage <= self.salvage:
                return  # its salvage's reset already ran: the worker holds the next plan's groups now
            self.failed = self.failed or "aborted by the driver after a failure"
            # The step in flight is worthless (the recovery goes back to a checkpoint): stop it
            # issuing work and waiting on the GPU.
            host_wait.cancel(f"salvage {salvage}: the driver is recovering from a failure")
            if dump_after_s is not None:
                # If `reset` has not come within dump_after_s, every thread's stack goes to this
                # worker's log: where a survivor that is about to be replaced was stuck.
                faulthandler.dump_traceback_later(dump_after_s, exit=False)
            if self.device.type == "cuda":
                self._abort_nccl()

    def _break_groups(self) -> None:
        """After a failed step: leave the groups so that peers waiting on this worker fail now.

        Gloo peers see the closed connections at once; NCCL has no such signal, so the
        driver's `abort` frees peers that wait on this worker.
        """
        # Collectives the optimizer queued (reduce-scatters from inside backward, gathers for
        # the next forwards) keep their group alive: a gloo group whose connections stay open
        # would leave its peers waiting until the collective timeout.
        if self.runtime is not None:
            self.runtime.forget_collectives()
        if self.device.type == "cuda":
            self._abort_nccl()
        else:
            self._destroy_groups()

    def _abort_nccl(self) -> None:
        with self._nccl_lock:
            abort_groups()

    def _destroy_groups(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - an aborted group may not tear down cleanly; it is gone either way
                pass

    def shutdown(self) -> None:
        if self.runtime is not None:
            self.runtime.close()  # its graphs go before the process groups
        self._destroy_groups()
