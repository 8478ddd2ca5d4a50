"""The controller: the run's state machine, owner of the worker group and the saver.

As in Ray Train v2, the controller runs in the driver and moves between explicit states
(`raypar.driver.states`): PLANNING picks a grid for what the cluster has, STARTING places
the workers and loads a checkpoint, RUNNING steps. A lost worker or node, or a hung
collective, moves to RECOVERING (with `elastic.enabled`): the run is planned again and
reloads its last committed checkpoint. GROWING restarts on a larger grid at a checkpoint
when resources have come back. The decisions come from `raypar.driver.policies`; the
controller gathers what they need and acts on their answers.

The driver makes one Ray call per worker per step (DESIGN.md: an awaited actor call costs
~1 ms, so per-micro-batch calls would dominate small steps); tensors never pass through it.
"""
from __future__ import annotations

import functools
import json
import os
import time
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Callable

import ray

from raypar.actors import worker_pool
from raypar.actors.memory import shared_memory_notes
from raypar.actors.worker_group import StepTimeout, WorkerGroup, WorkersLost, is_echo
from raypar.checkpoint import read_manifest
from raypar.checkpoint.storage import Location, redact
from raypar.config import Config
from raypar.data import SampleOrder, TokenDataset, open_dataset, split_batch
from raypar.driver.callbacks import Callback
from raypar.driver.cut_move import move_on_devices, move_through_checkpoint, room_on_devices
from raypar.driver.event_log import EventLog
from raypar.driver.expert_balance import ExpertBalance
from raypar.driver.expert_bias import MANIFEST_KEY as EXPERT_BIASES, ExpertBiases
from raypar.driver.policies import Decision, FailurePolicy, Plan, grow_plan, plan_grid, with_plan, worker_slots
from raypar.driver.progress import Progress, write_status
from raypar.driver.records import Recovery, RunSummary, StepRecord, step_record, summarise
from raypar.driver.saver import Resumed, Saver
from raypar.driver.run_schedule import RunSchedule
from raypar.driver.states import State, StateMachine
from raypar.metrics import peak_flops_per_device
from raypar.model import flops_per_token
from raypar.model.tensor_parallel import fallbacks
from raypar.resources import ResourceError, plan_resources
from raypar.runtime.state_move import MoveFailed
from raypar.schedule import CHUNKED_SCHEDULES, Layout
from raypar.schedule.choice import describe
from raypar.topology import Grid, cells_across_nodes

# A lost worker or node, or a collective that hung: what the controller recovers from.
WORKER_FAILURES = (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError,
                   StepTimeout, WorkersLost, MoveFailed)

# status.json is rewritten at most this often while steps run (and when the run ends).
STATUS_EVERY_S = 1.0
# parallel.schedule=auto's default memory budget: this share of the device's memory (the rest
# for the caching allocator's fragmentation, NCCL's buffers and the CUDA context).
DEVICE_MEMORY_SHARE = 0.9
# Steps whose samples consumed the driver remembers for a recovery from memory: enough to
# cover a replica that lags its owner's copies by as many steps as one replication takes.
MEMORY_STEPS_KEPT = 256


@dataclass
class InFlightStep:
    """A step sent to the workers whose reports the driver has not read yet."""

    step: int
    consumed: int  # samples consumed before it
    issued_at: float  # time.perf_counter() when it was sent
    refs: list  # one ObjectRef per worker, by rank
    save: bool  # its snapshot becomes a checkpoint
    stall: float  # seconds the loop waited on checkpointing before sending it
    memory: bool = False  # the workers keep their state after it in memory (elastic.memory_every)
    replicate: bool = False  # and send that copy to their peers


class Controller:
    """Drives one run from PLANNING to FINISHED (or FAILED). `owner` is what callbacks get."""

    def __init__(self, cfg: Config, callbacks: list[Callback], progress: Progress, log: Callable[[str], None],
                 owner: object):
        self.base_cfg = cfg  # the configured run; elastic re-plans derive from it
        self.cfg = cfg  # the plan running now
        self.grid = cfg.parallel.grid
        self.callbacks = callbacks
        self.progress = progress
        self.log = log
        self.owner = owner
        self.run_dir = Path(cfg.runtime.run_dir).resolve()
        self.expert_biases = ExpertBiases(cfg.model, log)  # model.moe_bias_update_rate
        self.saver = Saver(cfg, self.run_dir, log, on_result=lambda r: self._notify("on_checkpoint", r),
                           run_state=self.expert_biases.saved)
        self.failures = FailurePolicy(cfg.elastic)
        self.states = StateMachine(on_change=self._state_changed)
        self.group: WorkerGroup | None = None
        self.device: str | None = None  # "cpu" or "cuda" once the workers are placed
        self.resumed = Resumed(0, 0, None, [])
        self.restarts = 0
        self.recoveries: list[Recovery] = []
        self._recovery: Recovery | None = None  # the recovery under way, until its first good step
        # Steps done -> samples consumed, for the steps whose states the workers keep in memory
        # and whose every report came back (elastic.memory_every); then, during a recovery,
        # the failed grid, those steps and the generation of peers they were copied for.
        self._memory_steps: dict[int, int] = {}
        self._memory_from: tuple[Grid, Layout, dict[int, int], int] | None = None
        self._memory_swept = False  # the first group has cleared the nodes' shared memory
        self._memory_busy = False  # some worker was still copying at its last report
        self._replica_busy = False  # some worker was still sending a replica at its last report
        self._next_plan: Plan | None = None
        self._max_step_done = 0
        self._step_started: float | None = None  # when the step being waited for could start (perf_counter)
        self._last_step_done = 0.0  # perf_counter when the last step's reports came back
        self._stop = False
        self._stop_save = False
        self._status_written = 0.0  # monotonic time of the last status.json
        self._timeline_due = False  # runtime.timeline_step has run; drawn once its events are written
        self._kernels_said = False
        self._flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self._peak_flops = 0.0  # per device, from the workers' devices once they are placed
        self.run_schedule = RunSchedule(log)  # what the workers run, on which cut; auto's choices
        self.run_schedule.start(self.cfg, self.grid)
        self.expert_balance = ExpertBalance(log)  # parallel.rebalance_experts_every

    def stop(self, save: bool) -> None:
        self._stop = True
        self._stop_save = save

    def _notify(self, hook: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, hook)(self.owner, *args)

    # -- the run ---------------------------------------------------------------------------

    def fit(self) -> RunSummary:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dataset = open_dataset(self.cfg, self.run_dir)
        order = SampleOrder(len(dataset), self.cfg.train.seed, shuffle=self.cfg.data.shuffle)
        self._connect()
        (self.run_dir / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=2))
        records, consumed = self.run(dataset, order)
        summary = summarise(
            records, grid=self.grid, schedule=self.run_schedule.label(), microbatches=self.cfg.parallel.microbatches,
            device=self.device or "?", tokens_per_step=self.cfg.train.global_batch_size * self.cfg.data.seq_len,
            consumed=consumed, start_step=self.resumed.step,
            checkpoints=[{**asdict(c), "path": c.path and redact(c.path), "write_bytes_per_s": c.write_bytes_per_s}
                         for c in self.saver.results],
            checkpoints_skipped=self.saver.skipped, restarts=self.restarts, recoveries=self.recoveries,
            schedule_choices=self.run_schedule.choices, moves=self.run_schedule.moves,
            expert_moves=self.expert_balance.moves,
            controller_states=[state.value for _, state, _ in self.states.history])
        (self.run_dir / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2))
        self._notify("on_train_end", summary)
        return summary

    def _connect(self) -> None:
        if ray.is_initialized():
            return
        address = self.cfg.runtime.ray_address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address)
        else:
            # "local": a new cluster even if `ray start` left one registered on this machine.
            ray.init(address="local", num_cpus=self.cfg.runtime.num_cpus, include_dashboard=False)

    def run(self, dataset: TokenDataset, order: SampleOrder) -> tuple[list[StepRecord], int]:
        """Every state from PLANNING to FINISHED: the records of the steps run, and the samples consumed.

        Raises (after moving to FAILED) what it does not recover from.
        """
        records: list[StepRecord] = []
        consumed = 0
        resume = self.cfg.checkpoint.resume
        mode = "a" if resume else "w"
        try:
            with open(self.run_dir / "metrics.jsonl", mode) as metrics, \
                    EventLog(open(self.run_dir / "events.jsonl", mode)) as events:
                while True:
                    try:
                        t0 = time.time()
                        path = self._start(dataset, resume)  # a worker lost while starting is a failure like any other
                        t1 = time.time()
                        self.saver.start(self.group.checkpoints)
                        source = "memory"
                        self.resumed = self._restore_from_memory(path, order)
                        if self.resumed is None:
                            source = "storage" if path is not None else "start"
                            self.resumed = self.saver.resume(path, self.cfg, self.grid,
                                                             fall_back=resume == "latest")
                        self.expert_biases.start(self.resumed.step, self.resumed.extra.get(EXPERT_BIASES))
                        self.states.to(State.RUNNING)
                        if self._recovery is not None:
                            self._recovery.resumed(str(self.grid), self.resumed.step, workers_s=t1 - t0,
                                                   setup_s=self._setup_phases(), load_s=time.time() - t1,
                                                   now=time.time(), source=source)
                        self._notify("on_train_start")
                        consumed, grow_to = self._steps(self.resumed.step, self.resumed.consumed_samples, order,
                                                        records, metrics, events)
                    except WORKER_FAILURES as e:
                        events.flush()  # the lost workers' last steps, without their late units
                        self._recover(e)
                        resume = "latest"
                        continue
                    if grow_to is None:
                        break
                    self.states.to(State.GROWING, f"resources for {grow_to}")
                    self.saver.finish()
                    self._shutdown(keep_workers=True)  # the larger grid's group takes them
                    self._memory_steps = {}  # held by the workers just shut down
                    self._next_plan = grow_to
                    self.states.to(State.PLANNING)
                    resume = "latest"
            self.states.to(State.FINISHED)
            self._write_status(self._max_step_done, records[-1].loss if records else None)
        except BaseException as e:
            if self.states.state not in (State.FINISHED, State.FAILED):
                self.states.to(State.FAILED, repr(e)[:200])
                self._write_status(self._max_step_done)
            raise
        finally:
            self._shutdown(keep_workers=self.cfg.runtime.keep_workers and self.states.state is State.FINISHED)
        return records, consumed

    def _steps(self, start: int, consumed: int, order: SampleOrder, records: list[StepRecord], metrics: IO[str],
               events: EventLog) -> tuple[int, Plan | None]:
        """Steps from `start` to the end (or a stop request, or a chance to grow): the samples
        consumed, and the plan to grow to (None: the run is done).

        Up to `runtime.steps_ahead` steps are sent before the reports of the one running come
        back: workers run their calls in order, so they go from one step to the next without
        waiting for the driver, which reads reports, writes metrics and starts saves meanwhile.
        """
        committed = len(self.saver.results)
        inflight: deque[InFlightStep] = deque()
        next_step, next_consumed = start, consumed
        grow_to: Plan | None = None
        self._send_expert_biases(start)
        while True:
            if self.run_schedule.due and not inflight and grow_to is None and not self._stop \
                    and next_step < self.cfg.train.steps:
                self._change_schedule(next_step, next_consumed)
                self._send_expert_biases(next_step)  # the workers' stages may be new
            if self.expert_balance.due(self.cfg, self.grid, next_step) and not inflight and grow_to is None \
                    and not self._stop:
                self._rebalance_experts(next_step, next_consumed)
                self._send_expert_biases(next_step)
            while (grow_to is None and not self._stop and next_step < self.cfg.train.steps
                   and len(inflight) <= self.cfg.runtime.steps_ahead and self._may_issue(next_step, inflight)):
                inflight.append(self._issue(next_step, next_consumed, order))
                next_step += 1
                next_consumed += self.cfg.train.global_batch_size
            if not inflight:
                break
            sent = inflight.popleft()
            record = self._finish(sent, events)
            consumed = record.consumed_samples
            self._after_step(record, sent, records, metrics, events, overlapped=bool(inflight))
            if len(self.saver.results) > committed:
                committed = len(self.saver.results)
                if grow_to is None and self.saver.results[-1].error is None and record.step + 1 < self.cfg.train.steps:
                    grow_to = self._grow_plan()  # after the steps already sent, which run and count
        for rank, step, late in self.group.late_units():
            events.complete(rank, step, late)
        events.flush()
        if self._timeline_due:
            self._draw_timeline(self.cfg.runtime.timeline_step, events)
        last = records[-1] if records else None
        if grow_to is None and self._stop and self._stop_save and last is not None \
                and not self.saver.policy.save_due(last.step + 1):
            # Stopped early on request: keep where it stopped.
            if self.saver.ready_for()[0]:
                self.saver.snapshot(last.step)
                self.saver.begin(last.step + 1, consumed, self.cfg, self.grid)
        if grow_to is None:
            self.saver.finish()
        return consumed, grow_to

    def _send_expert_biases(self, steps_done: int) -> None:
        """Before the workers run the step after `steps_done` steps, with nothing in flight:
        the expert biases that step routes with (they move them on from there)."""
        if self.expert_biases.enabled:
            self.group.set_expert_biases(self.expert_biases.at(steps_done))

    def _may_issue(self, step: int, inflight: deque[InFlightStep]) -> bool:
        """Whether `step` may be sent behind the steps in flight.

        A step that snapshots is sent alone unless the last save is committed and its
        snapshot written: it reuses host buffers that the last snapshot's write must have
        left, and it may have to wait for the last save to commit. Waiting with nothing in
        flight keeps that wait out of the other steps' times. A save that will be skipped
        (`checkpoint.when_busy=skip`) holds nothing back: the loop's own pauses (a write
        to the run's files while a save floods the disk) would show in that step.
        """
        if (self.run_schedule.choosing or self.run_schedule.due) and inflight:
            return False  # what the next step runs depends on the one in flight
        if self.expert_balance.due(self.cfg, self.grid, step) and inflight:
            return False  # experts may move before it, with nothing in flight
        policy = self.saver.policy
        if not inflight or not policy.save_due(step + 1):
            return True
        return self.saver.idle() or self.saver.skips(final=step + 1 == self.cfg.train.steps)

    def _issue(self, step: int, consumed: int, order: SampleOrder) -> InFlightStep:
        """Send step `step` (the batch after `consumed` samples) to the workers; do not wait."""
        policy, gbs = self.saver.policy, self.cfg.train.global_batch_size
        save, stall = policy.save_due(step + 1), 0.0
        if save:
            save, stall = self.saver.ready_for(final=step + 1 == self.cfg.train.steps)
        snapshot = None
        if save:
            # The last snapshot's buffers are reused: it must have left the workers.
            stall += self.saver.wait_shard_writes()
            snapshot = policy.snapshot_options()

        ids_after = functools.partial(self._batch_ids, order)
        # The workers hold the programs (set_programs at start and after a re-plan): a step
        # sends only its number, the program version and the sample ids, with the next
        # step's for a forward issued ahead.
        following = ids_after(consumed + gbs) if step + 1 < self.cfg.train.steps else None
        e = self.cfg.elastic
        # Only when every worker can take the copy (the last reports): a step some worker skips
        # is whole nowhere, and workers that skip on their own would copy different steps.
        memory = e.enabled and e.memory_every > 0 and (step + 1) % e.memory_every == 0 and not self._memory_busy
        # Replicas at their own pace (they cross nodes), the same steps on every worker;
        # none where no worker has a peer (one node, copies in shared memory).
        replicate = memory and not self._replica_busy and self.group.memory.sends_replicas
        issued_at = time.perf_counter()
        refs = self.group.issue_step(step, ids_after(consumed), snapshot=snapshot, next_sample_ids=following,
                                     memory=memory, replicate=replicate)
        return InFlightStep(step, consumed, issued_at, refs, save, stall, memory, replicate)

    def _batch_ids(self, order: SampleOrder, consumed: int) -> list[list[int]]:
        """Each worker's samples of the batch after `consumed` samples, by rank."""
        batch = order.indices(consumed, self.cfg.train.global_batch_size)
        return [split_batch(batch, self.grid.data_parallel_size, self.grid.data_rank(c)) for c in self.grid.coords()]

    def _finish(self, sent: InFlightStep, events: EventLog) -> StepRecord:
        """Wait for a sent step and make its record. Its time runs from when the workers could
        start it (its issue, or the end of the step it was queued behind) to when its reports
        are back; first stages' tails are fetched after that, while the workers run the next step."""
        self._step_started = started = max(sent.issued_at, self._last_step_done)
        reports = self.group.wait_reports(sent.step, sent.refs)
        self._last_step_done = time.perf_counter()
        reports = self.group.complete_reports(reports)
        self._memory_busy = any(r.memory_busy for r in reports)
        self._replica_busy = any(r.replica_busy for r in reports)
        # Each action's measured span, per worker: enough to redraw the step's timeline.
        events.add(sent.step, reports, self.grid)
        gbs = self.cfg.train.global_batch_size
        record = step_record(sent.step, reports, self.grid, self.run_schedule.prepared,
                             self._last_step_done - started, tokens=gbs * self.cfg.data.seq_len,
                             consumed_samples=sent.consumed + gbs, flops_per_token=self._flops_per_token,
                             peak_flops=self._peak_flops, schedule=self.run_schedule.schedule)
        if self.run_schedule.choosing:
            self.run_schedule.step_done(sent.step, reports, record.step_time_s, self._memory_budget())
        return record

    def _after_step(self, record: StepRecord, sent: InFlightStep, records: list[StepRecord], metrics: IO[str],
                    events: EventLog, overlapped: bool) -> None:
        """Everything the driver does with a finished step.

        `overlapped`: the next step is already running, so the time spent here holds no worker up.
        """
        step = record.step
        t0 = time.perf_counter()
        self.expert_biases.observe(record)  # before a save of the state after this step
        if self.expert_biases.enabled:
            record.expert_biases = self.expert_biases.at(step + 1)
        if sent.save:
            self.saver.begin(step + 1, record.consumed_samples, self.cfg, self.grid)
        else:
            self.saver.poll()
        record.memory_copied, record.memory_replicated = sent.memory, sent.replicate
        if sent.memory:
            self._memory_steps[step + 1] = record.consumed_samples
            # Workers keep their three newest copies and replicas of a peer's, which may be many
            # steps old: a copy is skipped while the last one is still being sent.
            for old in sorted(self._memory_steps)[:-MEMORY_STEPS_KEPT]:
                del self._memory_steps[old]
        self.expert_biases.forget_before(min(self._memory_steps, default=step + 1))
        record.checkpoint_stall_s += sent.stall + (0.0 if overlapped else time.perf_counter() - t0)
        records.append(record)
        self.expert_balance.observe(record)
        self._max_step_done = max(self._max_step_done, step + 1)
        if self._recovery is not None:
            self._finish_recovery()
        if step == self.cfg.runtime.timeline_step:
            self._timeline_due = True  # drawn once its events are whole: after the next step's reports
        elif self._timeline_due:
            self._draw_timeline(self.cfg.runtime.timeline_step, events)
        metrics.write(json.dumps(asdict(record)) + "\n")
        metrics.flush()
        self.progress.step(step, record.loss, record.tokens_per_s, record.step_time_s, record.lr, record.grad_norm)
        if time.monotonic() - self._status_written >= STATUS_EVERY_S or step + 1 == self.cfg.train.steps:
            self._write_status(step + 1, record.loss)
        self._notify("on_step_end", record)

    # -- planning and starting -------------------------------------------------------------

    def _start(self, dataset: TokenDataset, resume: str | None) -> Location | None:
        """PLANNING -> STARTING: pick the grid, place and wire its workers; returns the checkpoint
        `resume` names (None: from step 0). With one, the stages are not initialised: the load
        fills them."""
        if self.cfg.elastic.enabled:
            plan, self._next_plan = self._next_plan, None
            self._adopt(plan or self._plan_elastic())
        resources = plan_resources(self.cfg, self.grid, ray.cluster_resources())
        self.states.to(State.STARTING, str(self.grid))
        self.device = resources.device
        self.log(f"raypar: grid {self.grid} on {resources.device}, {self.run_schedule.label()} with "
                 f"{self.cfg.parallel.microbatches} micro-batches, run dir {self.run_dir}")
        for line in fallbacks(self.cfg.model, self.grid.tp):
            self.log(f"raypar: {line}")
        path = self.saver.checkpoint_path(resume, self._recovery is not None)
        init_weights = path is None
        if self.group is not None:
            # Workers kept after a failure (`_recover`): the new grid on them plus replacements.
            try:
                counts = self.group.reconfigure(self.cfg, self.grid, init_weights)
            finally:
                self._count_placed()  # also where the setup failed: its new workers were started
            self.log(f"raypar: kept {counts['kept']} stage workers, started {counts['started']}"
                     + (f", took {counts['standby']} from the standbys" if counts["standby"] else ""))
        else:
            self.group = WorkerGroup(self.cfg, self.grid, resources, str(dataset.path), init_weights)
            self._count_placed()
        self._say_kernels(self.group.info)
        for cell, nodes in cells_across_nodes(self.grid, [i["node"] for i in self.group.info]).items():
            self.log(f"raypar: the tp workers of stage cell {cell} are on nodes {nodes}: their all-reduces cross the "
                     f"network (slow); nodes with room for a whole cell ({self.grid.tp} workers) keep them together")
        # The workers' devices, not the driver's: a cluster's head node may have no GPU.
        peaks = [peak_flops_per_device(i.get("device_name"), self.cfg.model.dtype) for i in self.group.info]
        self._peak_flops = 0.0 if 0.0 in peaks else sum(peaks) / len(peaks)  # any unknown: MFU unknown
        self.group.set_programs(self.run_schedule.programs)
        self.run_schedule.started()
        if self.cfg.elastic.enabled and self.cfg.elastic.memory_every > 0:
            self.group.memory.set_peers()
            for line in shared_memory_notes(self.group.info):
                self.log(line)
            if not self._memory_swept:
                # What a run in this run directory before this driver left in shared memory.
                self.group.memory.clear()
                self._memory_swept = True
        return path

    def _restore_from_memory(self, path: Location | None, order: SampleOrder) -> Resumed | None:
        """During a recovery: load the newest step whose state survives in the workers'
        memory for every rank of the failed grid, unless checkpoint `path` is newer (memory
        is read faster than storage). None when storage (or step 0) is the better start.
        The workers read the first batch after it meanwhile."""
        failed, self._memory_from = self._memory_from, None
        if failed is None or self._recovery is None:
            return None
        failed_grid, failed_layout, steps, generation = failed
        stored = -1 if path is None else read_manifest(path).step
        found = self.group.memory.newest_whole(failed_grid.size, [s for s in steps if s >= stored], generation)
        if isinstance(found, str):
            self.log(f"raypar: {found}; loading from storage")
            self.group.memory.clear()
            return None
        step, holders = found
        self.group.prefetch(self._batch_ids(order, steps[step]))
        # A state kept on another cut of the model (parallel.schedule=auto's chunks) is not
        # rank for rank what this one's workers hold.
        same = failed_grid == self.grid and failed_layout == self.run_schedule.layout
        loaded, load_s = self.group.memory.restore(step, holders, same_grid=same, generation=generation)
        self.log(f"raypar: restored step {step} from the workers' memory"
                 + (f" (the newest checkpoint holds step {stored})" if stored >= 0 else ""))
        return Resumed(step, steps[step], None, loaded, load_s)

    def _plan_elastic(self) -> Plan:
        """The largest grid the cluster can hold now; waits up to elastic.resource_timeout_s."""
        e = self.cfg.elastic
        deadline = time.monotonic() + e.resource_timeout_s
        while True:
            # Workers kept after a failure (and their free bundles) count beside free resources,
            # as do those an earlier run of this process left (`runtime.keep_workers`).
            free = ray.available_resources()
            for key, amount in worker_pool.held_resources().items():
                free[key] = free.get(key, 0.0) + amount
            slots = self._slots(free) + (self.group.reserve.usable_slots() if self.group else 0)
            plan = plan_grid(self.base_cfg, slots, e.min_workers, self._node_room())
            if plan is not None:
                return plan
            if time.monotonic() >= deadline:
                raise ResourceError(
                    f"no grid of at least elastic.min_workers={e.min_workers} workers fits: the cluster "
                    f"has room for {slots} workers of {self.cfg.runtime.cpus_per_worker:g} CPUs"
                    + (" and 1 GPU" if self._device() == "cuda" else "")
                    + f" after waiting elastic.resource_timeout_s={e.resource_timeout_s:g}s"
                )
            time.sleep(1.0)

    def _grow_plan(self) -> Plan | None:
        if not (self.cfg.elastic.enabled and self.cfg.elastic.grow):
            return None
        # Bundles the group still holds (e.g. placed again on a returned node) count as free.
        slots = (self._slots(ray.available_resources()) + self.grid.size
                 + self.group.reserve.free_slots_on_live_nodes())
        return grow_plan(self.base_cfg, self.grid, slots, self._node_room())

    def _adopt(self, plan: Plan) -> None:
        if plan.grid != self.grid or plan.microbatches != self.cfg.parallel.microbatches:
            self.log(f"raypar: planned grid {plan}")
        self.cfg = with_plan(self.base_cfg, plan)
        self.grid = plan.grid
        self.run_schedule.start(self.cfg, self.grid)

    def switch_schedule(self, schedule: str, chunks: int | None = None) -> None:
        """Run `schedule` (with `chunks` per stage) from the first step not yet sent, once the
        steps in flight are done (`RunSchedule.request`)."""
        self.run_schedule.request(schedule, chunks)

    def _change_schedule(self, steps_done: int, consumed: int) -> None:
        """Before step `steps_done`, nothing in flight: what switch_schedule asked for, or
        auto's next schedule, its cut made first (`_move_to`)."""
        switched = self.run_schedule.apply(lambda schedule, layout: self._move_to(schedule, layout, steps_done,
                                                                                   consumed))
        if switched is not None:
            # The switch holds for the rest of the run, re-plans included.
            self.base_cfg, self.cfg = (
                replace(c, parallel=replace(c.parallel, schedule=switched.schedule, chunks=switched.chunks))
                for c in (self.base_cfg, self.cfg))
        self.group.set_programs(self.run_schedule.programs)

    def _move_to(self, schedule: str, layout: Layout, steps_done: int, consumed: int) -> str | None:
        """Move the workers to `layout` (how `schedule` cuts the model) after `steps_done`
        steps (`_move_workers`); the move goes to `moves`. Returns why not, when it failed
        before the stages were cut anew (the cut is unchanged)."""
        chunks = layout.n_chunks if schedule in CHUNKED_SCHEDULES else None
        new_cfg = replace(self.cfg, parallel=replace(self.cfg.parallel, schedule=schedule, chunks=chunks))
        move = self._move_workers(new_cfg, layout, steps_done, consumed)
        if isinstance(move, str):
            return move
        move = {"schedule": schedule, "cut": describe(layout), "step": steps_done, **move}
        self.run_schedule.moves.append(move)
        first = "saves in flight finished" if move["through"] == "devices" else "checkpoint"
        self.log(f"raypar: moved the model to {describe(layout)} for {schedule} at step {steps_done} through "
                 f"{move['through']} in {move['total_s']:.1f}s: {first} {move['save_s']:.1f}s, stages rebuilt "
                 f"{move['rebuild_s']:.1f}s, state loaded {move['load_s']:.1f}s ({move['bytes'] / 2**30:.2f} GiB)")
        return None

    def _rebalance_experts(self, steps_done: int, consumed: int) -> None:
        """Before step `steps_done`, nothing in flight: move experts between the ep workers
        where that evens out their rows (`ExpertBalance`); the move goes to `expert_moves`."""
        proposed = self.expert_balance.propose(self.cfg, self.grid, steps_done)
        if proposed is None:
            return
        placement, record = proposed
        new_cfg = replace(self.cfg, parallel=replace(self.cfg.parallel, expert_placement=placement))
        move = self._move_workers(new_cfg, self.run_schedule.layout, steps_done, consumed)
        if isinstance(move, str):
            self.log(f"raypar: experts stay on their workers at step {steps_done}: {move}")
            return
        # The placement holds for the rest of the run, re-plans included.
        self.base_cfg, self.cfg = (replace(c, parallel=replace(c.parallel, expert_placement=placement))
                                   for c in (self.base_cfg, self.cfg))
        self.group.set_programs(self.run_schedule.programs)
        record.update(move)
        self.expert_balance.moves.append(record)
        self.log(f"raypar: moved {record['experts_moved']} experts between workers at step {steps_done} through "
                 f"{move['through']} in {move['total_s']:.1f}s: the busiest workers receive "
                 f"{record['busiest_after']:.3f}x an even share of the rows, {record['busiest_before']:.3f}x before "
                 f"(stages rebuilt {move['rebuild_s']:.1f}s, state loaded {move['load_s']:.1f}s)")

    def _move_workers(self, new_cfg: Config, layout: Layout, steps_done: int, consumed: int) -> dict | str:
        """Rebuild the workers' stages as `new_cfg` cuts and places them, their state moved
        along: on their devices where they have room (and parallel.move_through allows), else
        through a checkpoint (`raypar.driver.cut_move`). Returns the move's record (its phases'
        seconds), or why not, when it failed before the stages were rebuilt (nothing changed)."""
        why_not = ("parallel.move_through is checkpoint" if self.cfg.parallel.move_through == "checkpoint"
                   else room_on_devices(self.group, new_cfg))
        if why_not is None:
            move = move_on_devices(self.group, self.saver, new_cfg)
        else:
            if self.cfg.parallel.move_through != "checkpoint":
                self.log(f"raypar: moving the model through a checkpoint: {why_not}")
            move = move_through_checkpoint(self.group, self.saver, self.cfg, new_cfg, self.grid, layout, steps_done,
                                           consumed, self.log)
            if isinstance(move, str):
                return move
        if self.cfg.elastic.enabled and self.cfg.elastic.memory_every > 0:
            # The copies held were of the stages before: from now on, these.
            self.group.memory.clear()
            self._memory_steps = {}
            self.group.memory.set_peers()
        move["total_s"] = move["save_s"] + move["rebuild_s"] + move["load_s"]
        return move

    def _memory_budget(self) -> int | None:
        """Bytes a stage may hold: parallel.memory_budget_gb, else DEVICE_MEMORY_SHARE of the
        smallest device's memory (none on CPU)."""
        if self.cfg.parallel.memory_budget_gb is not None:
            return int(self.cfg.parallel.memory_budget_gb * 2**30)
        sizes = [i["device_memory_bytes"] for i in self.group.info if i.get("device_memory_bytes")]
        return int(DEVICE_MEMORY_SHARE * min(sizes)) if sizes else None

    def _slots(self, resources: dict[str, float]) -> int:
        return worker_slots(resources, self.cfg.runtime.cpus_per_worker, self._device())

    def _node_room(self) -> int | None:
        """With tp: the most workers one live node holds (a cell's tp workers share a node)."""
        if self.base_cfg.parallel.tp == 1:
            return None
        return max((self._slots(n["Resources"]) for n in ray.nodes() if n.get("Alive")), default=0)

    def _device(self) -> str:
        """The device workers get: as placed, or as planning for this cluster would choose."""
        if self.device is not None:
            return self.device
        if self.cfg.runtime.device != "auto":
            return self.cfg.runtime.device
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"

    def _count_placed(self) -> None:
        """In a recovery: how the group's workers came (kept, started, from the standbys)."""
        placed = self.group.placed if self.group is not None else None
        if self._recovery is not None and placed is not None:
            self._recovery.workers_placed(placed["kept"], placed["started"], placed["standby"])

    def _say_kernels(self, info: list[dict]) -> None:
        """Which CUDA kernels the workers run, once per run (CPU workers use the references)."""
        status = next((i.get("kernels") for i in info if i.get("kernels")), None)
        if status and not self._kernels_said:
            self._kernels_said = True
            self.log("raypar: kernels " + ", ".join(f"{k}: {v}" for k, v in status.items()))

    def _setup_phases(self) -> dict[str, float]:
        """Each setup phase's longest over the workers: what "workers up" was made of."""
        setups = [i["setup_s"] for i in self.group.info if "setup_s" in i]
        return {k: max(s[k] for s in setups) for k in setups[0]} if setups else {}

    def _shutdown(self, keep_memory: bool = False, keep_workers: bool = False) -> None:
        if self.group is not None:
            self.group.shutdown(keep_memory, keep_workers)
            self.group = None

    # -- failures ------------------------------------------------------------------------------

    def _recover(self, error: BaseException) -> None:
        """Keep what survives a failure and go back to PLANNING; raises what the policy fails on."""
        detected = time.time()
        detection_s = time.perf_counter() - (self._step_started or time.perf_counter())
        decision, why = self.failures.decide(self._is_worker_failure(error), self.restarts)
        if decision is Decision.FAIL:
            if self.cfg.elastic.enabled:
                self.log(f"raypar: {why}")
            raise error
        self.states.to(State.RECOVERING, repr(error)[:200])
        self._memory_busy = self._replica_busy = False  # the workers' copies after the restore start afresh
        if self._memory_steps:
            # What the workers keep in memory is of this grid and these steps.
            self._memory_from = (self.grid, self.run_schedule.layout, dict(self._memory_steps),
                                 self.group.memory.generation)
            self._memory_steps = {}
        self.log(f"raypar: lost a worker or a collective ({type(error).__name__}: {str(error).splitlines()[0][:160]}); "
                 f"recovering")
        save_lost = self.saver.abandon()
        kept = 0
        if self.cfg.elastic.keep_survivors and self.group is not None:
            try:
                kept = self.group.salvage(self.cfg.elastic.survivor_timeout_s)
            except Exception as e:  # noqa: BLE001 - fall back to starting every worker again
                self.log(f"raypar: could not keep the surviving workers ({type(e).__name__}: {e}); restarting all")
        if kept or (self.group is not None and self.group.reserve.has_ready_standbys()):
            # A save in flight died with its workers: its writers go too; else keep the writers
            # of nodes that still hold workers.
            if save_lost:
                self.group.checkpoints.reset_writers()
            else:
                self.group.checkpoints.keep_writers_on(self.group.reserve.survivor_nodes())
        else:
            # The workers' states in shared memory stay: the new ones restore from them.
            self._shutdown(keep_memory=True)
        self.restarts += 1
        if self._recovery is not None:
            # Failed again before the first good step: one recovery, timed from the first failure.
            self._recovery.attempts += 1
        else:
            self._recovery = Recovery(restart=self.restarts, error=type(error).__name__, failed_grid=str(self.grid),
                                      detection_s=detection_s, salvage_s=time.time() - detected,
                                      steps_done=self._max_step_done, detected_at=detected)
        self.states.to(State.PLANNING)

    def _is_worker_failure(self, error: BaseException) -> bool:
        if not isinstance(error, ray.exceptions.RayTaskError) or isinstance(error, ray.exceptions.RayActorError):
            return True
        if is_echo(error):
            return True
        return self.group is not None and not self.group.all_alive()

    def _finish_recovery(self) -> None:
        recovery, self._recovery = self._recovery, None
        recovery.finished(time.time())
        self.recoveries.append(recovery)
        self.group.reserve.refill_standbys()
        self.log(f"raypar: recovered on {recovery.grid} in {recovery.recovery_s:.1f}s "
                 f"(detected after {recovery.detection_s:.1f}s, {recovery.steps_lost} steps redone)")
        self._notify("on_recovery", recovery)

    # -- what the run shows --------------------------------------------------------------------

    def _state_changed(self, state: State, why: str) -> None:
        with open(self.run_dir / "controller.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "state": state.value, "why": why}) + "\n")
        self._notify("on_state_change", state.value)

    def _draw_timeline(self, step: int, events: EventLog) -> None:
        from raypar.timeline import draw_png, load_step, write_chrome_trace

        self._timeline_due = False
        events.out.flush()
        spans = load_step(self.run_dir, step)
        png = draw_png(spans, self.run_dir / f"timeline-step{step}.png", title=f"{self.grid}, step {step}")
        write_chrome_trace(spans, self.run_dir / f"timeline-step{step}.json")
        self.log(f"raypar: timeline of step {step} -> {png}")

    def _write_status(self, step: int, loss: float | None = None) -> None:
        self._status_written = time.monotonic()
        write_status(self.run_dir, run_dir=str(self.run_dir), state=self.states.state.value, grid=str(self.grid),
                     schedule=self.run_schedule.label(), microbatches=self.cfg.parallel.microbatches,
                     device=self.device, step=step, total_steps=self.cfg.train.steps,
                     loss=loss, last_checkpoint=self.saver.last_committed(), restarts=self.restarts)
