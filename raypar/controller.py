"""The controller: the state machine (`raypar.elastic.State`) that drives a Trainer's run.

As in Ray Train v2, the controller runs in the driver and moves between explicit states:
PLANNING picks a grid for what the cluster has, STARTING places the workers and loads a
checkpoint, RUNNING steps. A lost worker or node, or a hung collective, moves to
RECOVERING (with `elastic.enabled`): the run is planned again and reloads its last
committed checkpoint. GROWING restarts on a larger grid at a checkpoint when resources
have come back.

The Trainer keeps what callers read about the run (its grid, config, workers, restarts and
recoveries) and the operations on the workers (start, resume, issue_step and finish_step, shutdown); the
controller decides when they run and keeps the bookkeeping between states.
"""
from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import IO, TYPE_CHECKING

import ray

from raypar.actors.worker_group import StepTimeout, is_echo
from raypar.data import SampleOrder, TokenDataset
from raypar.elastic import Plan, State, StateMachine, plan_grid, with_plan
from raypar.event_log import EventLog
from raypar.progress import write_status
from raypar.schedule import build_programs

if TYPE_CHECKING:
    from raypar.trainer import PendingStep, StepRecord, Trainer


# A lost worker or node, or a collective that hung: what the controller recovers from.
WORKER_FAILURES = (ray.exceptions.RayActorError, ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError,
                   StepTimeout)


# status.json is rewritten at most this often while steps run (and when the run ends).
STATUS_EVERY_S = 1.0


@dataclass
class _InFlight:
    """A step sent to the workers, and what the driver does once it is back."""

    pending: PendingStep
    save: bool  # its snapshot becomes a checkpoint
    ema: bool  # its snapshot updates the EMA
    stall: float  # seconds the loop waited on checkpointing before sending it


class Controller:
    """Drives one Trainer from PLANNING to FINISHED (or FAILED)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.states = StateMachine(on_change=self._state_changed)
        self._recovery: dict | None = None  # the recovery under way, until its first good step
        self._next_plan: Plan | None = None
        self._grow_to: Plan | None = None
        self._max_step_done = 0
        self._step_started: float | None = None  # when the step being waited for could start (perf_counter)
        self._committed = 0  # saves seen finished (committed or failed) in this RUNNING stretch
        self._stop = False
        self._stop_save = False
        self._status_written = 0.0  # monotonic time of the last status.json
        self._timeline_due = False  # runtime.timeline_step has run; drawn once its events are written

    @property
    def recovering(self) -> bool:
        """Between a failure and the first good step after it."""
        return self._recovery is not None

    def stop(self, save: bool) -> None:
        self._stop = True
        self._stop_save = save

    # -- the loop ----------------------------------------------------------------------------

    def run(self, dataset: TokenDataset, order: SampleOrder) -> tuple[list[StepRecord], int]:
        """Every state from PLANNING to FINISHED: the records of the steps run, and the samples consumed.

        Raises (after moving to FAILED) what it does not recover from.
        """
        t = self.trainer
        records: list[StepRecord] = []
        consumed = 0
        resume = t.cfg.checkpoint.resume
        mode = "a" if resume else "w"
        try:
            with open(t.run_dir / "metrics.jsonl", mode) as metrics, \
                    EventLog(open(t.run_dir / "events.jsonl", mode)) as events:
                while True:
                    try:
                        t0 = time.time()
                        t.start(dataset, resume)  # a worker lost while starting is a failure like any other
                        t1 = time.time()
                        start, consumed = t.resume(resume)
                        t.saver.start_writers(t.group)
                        self.states.to(State.RUNNING)
                        self._recovered(workers_s=t1 - t0, load_s=time.time() - t1)
                        for callback in t.callbacks:
                            callback.on_train_start(t)
                        consumed, outcome = self._run(start, consumed, order, records, metrics, events)
                    except WORKER_FAILURES as e:
                        events.flush()  # the lost workers' last steps, without their late units
                        resume = self._recover(e)
                        continue
                    if outcome == "grow":
                        self.states.to(State.GROWING, f"resources for {self._grow_to}")
                        t.saver.finish()
                        t.shutdown()
                        self._next_plan = self._grow_to
                        self.states.to(State.PLANNING)
                        resume = "latest"
                        continue
                    break
            self.states.to(State.FINISHED)
            self._write_status(self._max_step_done, records[-1].loss if records else None)
        except BaseException as e:
            if self.states.state not in (State.FINISHED, State.FAILED):
                self.states.to(State.FAILED, repr(e)[:200])
                self._write_status(self._max_step_done)
            raise
        finally:
            t.shutdown()
        return records, consumed

    def _run(self, start: int, consumed: int, order: SampleOrder, records: list, metrics: IO[str],
             events: EventLog) -> tuple[int, str]:
        """Steps from `start` to the end (or a stop request, or a chance to grow).

        Up to `runtime.steps_ahead` steps are sent before the reports of the one running come
        back: workers run their calls in order, so they go from one step to the next without
        waiting for the driver, which reads reports, writes metrics and starts saves meanwhile.
        """
        t = self.trainer
        self._committed = len(t.saver.results)
        inflight: deque[_InFlight] = deque()
        next_step, next_consumed = start, consumed
        outcome = "finished"
        while True:
            while (outcome == "finished" and not self._stop and next_step < t.cfg.train.steps
                   and len(inflight) <= t.cfg.runtime.steps_ahead and self._may_issue(next_step, inflight)):
                inflight.append(self._issue(next_step, next_consumed, order))
                next_step += 1
                next_consumed += t.cfg.train.global_batch_size
            if not inflight:
                break
            entry = inflight.popleft()
            self._step_started = t.step_started(entry.pending)
            record = t.finish_step(entry.pending, events)
            consumed = record.consumed_samples
            if self._after_step(record, entry, records, metrics, events, overlapped=bool(inflight)) \
                    and outcome == "finished":
                outcome = "grow"  # after the steps already sent, which run and count
        t.finish_events(events)
        if self._timeline_due:
            self._draw_timeline(t.cfg.runtime.timeline_step, events)
        last = records[-1] if records else None
        if outcome == "finished" and self._stop and self._stop_save and last is not None \
                and not t.saver.due(last.step + 1):
            # Stopped early on request: keep where it stopped.
            if t.saver.ready_for()[0]:
                t.group.snapshot(last.step, t.saver.snapshot_options())
                t.saver.begin(t.group, last.step + 1, consumed)
        if outcome == "finished":
            t.saver.finish()
        return consumed, outcome

    def _may_issue(self, step: int, inflight: deque[_InFlight]) -> bool:
        """Whether `step` may be sent behind the steps in flight.

        A step that snapshots is sent alone: it reuses host buffers that the last snapshot's
        export must have left, and it may have to wait for the last save to commit. Waiting
        with nothing in flight keeps that wait out of the other steps' times.
        """
        t = self.trainer
        return not inflight or not (t.saver.due(step + 1) or t.saver.ema_due(step + 1))

    def _issue(self, step: int, consumed: int, order: SampleOrder) -> _InFlight:
        t = self.trainer
        save = t.saver.due(step + 1)
        ema = t.saver.ema_due(step + 1)
        stall = 0.0
        if save:
            save, stall = t.saver.ready_for()
        snapshot = None
        if save or ema:
            # The last snapshot's buffers are reused: it must have left the workers.
            stall += t.group.wait_exports(t.cfg.checkpoint.timeout_s)
            snapshot = t.saver.snapshot_options() if save else {"save_optimizer": False, "save_master": False}
        return _InFlight(t.issue_step(step, order, consumed, snapshot=snapshot), save, ema, stall)

    def _after_step(self, record: StepRecord, entry: _InFlight, records: list, metrics: IO[str],
                    events: EventLog, overlapped: bool) -> bool:
        """Everything the driver does with a finished step; returns whether the run should grow.

        `overlapped`: the next step is already running, so the time spent here holds no worker up.
        """
        t = self.trainer
        step = record.step
        t0 = time.perf_counter()
        if entry.save:
            t.saver.begin(t.group, step + 1, record.consumed_samples, update_ema=entry.ema)
        elif entry.ema:
            t.group.update_ema(str(t.saver.root))
        else:
            t.saver.poll()
        record.checkpoint_stall_s += entry.stall + (0.0 if overlapped else time.perf_counter() - t0)
        records.append(record)
        self._max_step_done = max(self._max_step_done, step + 1)
        if self._recovery is not None:
            self._finish_recovery(record)
        if step == t.cfg.runtime.timeline_step:
            self._timeline_due = True  # drawn once its events are whole: after the next step's reports
        elif self._timeline_due:
            self._draw_timeline(t.cfg.runtime.timeline_step, events)
        metrics.write(json.dumps(asdict(record)) + "\n")
        metrics.flush()
        t.progress.step(step, record.loss, record.tokens_per_s, record.step_time_s, record.lr, record.grad_norm)
        if time.monotonic() - self._status_written >= STATUS_EVERY_S or step + 1 == t.cfg.train.steps:
            self._write_status(step + 1, record.loss)
        for callback in t.callbacks:
            callback.on_step_end(t, record)
        if len(t.saver.results) > self._committed:
            self._committed = len(t.saver.results)
            if t.saver.results[-1].error is None and step + 1 < t.cfg.train.steps and self._can_grow():
                return True
        return False

    def _state_changed(self, state: State, why: str) -> None:
        t = self.trainer
        with open(t.run_dir / "controller.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "state": state.value, "why": why}) + "\n")
        for callback in t.callbacks:
            callback.on_state_change(t, state.value)

    def _draw_timeline(self, step: int, events: EventLog) -> None:
        from raypar.timeline import draw_png, load_step, write_chrome_trace

        self._timeline_due = False
        t = self.trainer
        events.out.flush()
        spans = load_step(t.run_dir, step)
        png = draw_png(spans, t.run_dir / f"timeline-step{step}.png", title=f"{t.grid}, step {step}")
        write_chrome_trace(spans, t.run_dir / f"timeline-step{step}.json")
        t.log(f"raypar: timeline of step {step} -> {png}")

    def _write_status(self, step: int, loss: float | None = None) -> None:
        t = self.trainer
        self._status_written = time.monotonic()
        ok = [r for r in t.saver.results if r.error is None]
        write_status(t.run_dir, run_dir=str(t.run_dir), state=self.states.state.value, grid=str(t.grid),
                     schedule=t.cfg.parallel.schedule, microbatches=t.cfg.parallel.microbatches,
                     device=t.device, step=step, total_steps=t.cfg.train.steps,
                     loss=loss, last_checkpoint=ok[-1].path if ok else None, restarts=t.restarts)

    # -- planning ------------------------------------------------------------------------------

    def plan(self) -> None:
        """PLANNING with elastic.enabled: the grid chosen to grow to, or the largest that fits now."""
        plan, self._next_plan = self._next_plan, None
        self._adopt(plan or self._plan_elastic())

    def _plan_elastic(self) -> Plan:
        """The largest grid the cluster can hold now; waits up to elastic.resource_timeout_s."""
        import ray

        from raypar.resources import ResourceError

        t = self.trainer
        deadline = time.monotonic() + t.cfg.elastic.resource_timeout_s
        while True:
            # Workers kept after a failure (and their free bundles) count beside free resources.
            slots = self._worker_slots(ray.available_resources()) + (t.group.reusable_slots() if t.group else 0)
            plan = plan_grid(t.base_cfg, slots, t.cfg.elastic.min_workers)
            if plan is not None:
                return plan
            if time.monotonic() >= deadline:
                raise ResourceError(
                    f"no grid of at least elastic.min_workers={t.cfg.elastic.min_workers} workers fits: the cluster "
                    f"has room for {slots} workers of {t.cfg.runtime.cpus_per_worker:g} CPUs"
                    + (" and 1 GPU" if self._device() == "cuda" else "")
                    + f" after waiting elastic.resource_timeout_s={t.cfg.elastic.resource_timeout_s:g}s"
                )
            time.sleep(1.0)

    def _adopt(self, plan: Plan) -> None:
        t = self.trainer
        if plan.grid != t.grid or plan.microbatches != t.cfg.parallel.microbatches:
            t.log(f"raypar: planned grid {plan}")
        t.cfg = with_plan(t.base_cfg, plan)
        t.grid = plan.grid
        t.saver.grid = plan.grid
        t.saver.cfg = t.cfg
        t._set_programs(build_programs(t.cfg.parallel.schedule, t.grid.pp, t.cfg.parallel.microbatches,
                                       release=t.cfg.runtime.release))

    def _worker_slots(self, resources: dict[str, float]) -> int:
        cpus = self.trainer.cfg.runtime.cpus_per_worker
        slots = int(resources.get("CPU", 0.0) / cpus + 1e-9)
        if self._device() == "cuda":
            slots = min(slots, int(resources.get("GPU", 0.0)))
        return slots

    def _device(self) -> str:
        """The device workers get: as placed, or as planning for this cluster would choose."""
        t = self.trainer
        if t.device is not None:
            return t.device
        if t.cfg.runtime.device != "auto":
            return t.cfg.runtime.device
        return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"

    def _can_grow(self) -> bool:
        import ray

        t = self.trainer
        if not (t.cfg.elastic.enabled and t.cfg.elastic.grow) or t.grid == t.configured_grid:
            return False
        # Bundles the group still holds (e.g. placed again on a returned node) count as free.
        slots = self._worker_slots(ray.available_resources()) + t.grid.size + t.group.held_free_slots()
        plan = plan_grid(t.base_cfg, slots, t.cfg.elastic.min_workers)
        if plan is not None and plan.grid.size > t.grid.size:
            self._grow_to = plan
            return True
        return False

    # -- failures ------------------------------------------------------------------------------

    def _recover(self, error: BaseException) -> str | None:
        """Tear down after a failure; returns what to resume from. Raises when out of tries."""
        t = self.trainer
        detected = time.time()
        detection_s = time.perf_counter() - (self._step_started or time.perf_counter())
        elastic = t.cfg.elastic
        if not self._is_worker_failure(error):
            raise error  # a bug in a worker, not a lost one: recovering would only repeat it
        if not elastic.enabled or t.restarts >= elastic.max_restarts:
            if elastic.enabled:
                t.log(f"raypar: giving up after {t.restarts} restarts "
                      f"(elastic.max_restarts={elastic.max_restarts})")
            raise error
        self.states.to(State.RECOVERING, repr(error)[:200])
        t.log(f"raypar: lost a worker or a collective ({type(error).__name__}: {str(error).splitlines()[0][:160]}); "
              f"recovering from the last committed checkpoint")
        save_lost = t.saver.abandon()
        kept = 0
        if elastic.keep_survivors and t.group is not None:
            try:
                kept = t.group.salvage(elastic.survivor_timeout_s, keep_writers=not save_lost)
            except Exception as e:  # noqa: BLE001 - fall back to starting every worker again
                t.log(f"raypar: could not keep the surviving workers ({type(e).__name__}: {e}); restarting all")
        if not kept:
            t.shutdown()
        salvage_s = time.time() - detected
        t.restarts += 1
        if self._recovery is not None:
            # Failed again before the first good step: one recovery, timed from the first failure.
            self._recovery["attempts"] += 1
        else:
            self._recovery = {"error": type(error).__name__, "failed_grid": str(t.grid), "detected_at": detected,
                              "detection_s": detection_s,
                              "restart": t.restarts, "attempts": 1, "steps_done": self._max_step_done,
                              "salvage_s": salvage_s}
        self.states.to(State.PLANNING)
        return "latest"

    def _is_worker_failure(self, error: BaseException) -> bool:
        import ray

        if not isinstance(error, ray.exceptions.RayTaskError) or isinstance(error, ray.exceptions.RayActorError):
            return True
        if is_echo(error):
            return True
        group = self.trainer.group
        return group is not None and not group.all_alive()

    def workers_reused(self, counts: dict[str, int]) -> None:
        """STARTING on workers kept after a failure: how many were kept and started, for the recovery event."""
        if self._recovery is not None:
            self._recovery["workers_kept"] = counts["kept"]
            self._recovery["workers_started"] = self._recovery.get("workers_started", 0) + counts["started"]
            self._recovery["workers_from_standby"] = (self._recovery.get("workers_from_standby", 0)
                                                      + counts["standby"])

    def _recovered(self, workers_s: float, load_s: float) -> None:
        """STARTING done after a failure: where the recovery resumed and what its phases took."""
        if self._recovery is not None:
            # Each setup phase's longest over the workers: what "workers up" was made of.
            setups = [i["setup_s"] for i in self.trainer.group.info if "setup_s" in i]
            setup_s = {k: max(s[k] for s in setups) for k in setups[0]} if setups else {}
            self._recovery.update(grid=str(self.trainer.grid), resumed_step=self.trainer.start_step,
                                  workers_s=workers_s, setup_s=setup_s, load_s=load_s, running_at=time.time())

    def _finish_recovery(self, record: StepRecord) -> None:
        t = self.trainer
        event, self._recovery = self._recovery, None
        now = time.time()
        event["recovery_s"] = now - event.pop("detected_at")
        # recovery_s = salvage_s + (planning) + workers_s + load_s + first_step_s
        event["first_step_s"] = now - event.pop("running_at")
        # Steps done before the failure that the run had to do again from the checkpoint.
        event["steps_lost"] = max(0, event.pop("steps_done") - event["resumed_step"])
        t.recoveries.append(event)
        t.group.refill_standbys()
        t.log(f"raypar: recovered on {event['grid']} in {event['recovery_s']:.1f}s "
              f"(detected after {event['detection_s']:.1f}s, {event['steps_lost']} steps redone)")
        for callback in t.callbacks:
            callback.on_recovery(t, event)
