"""Tiny configs and a harness that steps a worker group next to the single-process reference."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import ray
import torch

from raypar.driver.callbacks import Callback
from raypar.config import Config, config_from_dict
from raypar.data import SampleOrder, TokenDataset, split_batch, write_synthetic_corpus
from raypar.reference import ReferenceTrainer
from raypar.resources import WorkerResources
from raypar.schedule import CHUNKED_SCHEDULES, build_programs
from raypar.driver.stats import step_loss

from conftest import WORKER_CPUS

ROOT = Path(__file__).resolve().parent.parent


def tiny_config(tmp_path, **sections) -> Config:
    raw = {
        "model": {"vocab_size": 64, "dim": 32, "n_layers": 4, "n_heads": 4, "max_seq_len": 16},
        "parallel": {"pp": 2, "microbatches": 4},
        "train": {"steps": 6, "global_batch_size": 8, "lr": 1e-2, "warmup_steps": 1, "grad_clip": 1.0},
        "data": {"seq_len": 8, "synthetic_samples": 256},
        "runtime": {"run_dir": str(tmp_path / "run"), "device": "cpu", "cpus_per_worker": WORKER_CPUS,
                    "collective_timeout_s": 60.0, "step_timeout_s": 120.0,
                    # One worker process serves many tests' groups: starting one costs ~3 s of CPU.
                    "keep_workers": True},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


def run_config(tmp_path, name: str, grid: tuple[int, int, int], steps: int, model: dict | None = None,
               **sections) -> Config:
    """A Trainer run `name` of the tiny model on `grid` over the shared data.parquet, with
    checkpoints under the run (`sections`: checkpoint, elastic, ... settings)."""
    dp, pp, ep = grid
    return tiny_config(
        tmp_path / name, model=model or {},
        parallel={"dp": dp, "pp": pp, "ep": ep, "microbatches": 2, **sections.pop("parallel", {})},
        train={"steps": steps, "global_batch_size": 8, "eps": 1e-6, **sections.pop("train", {})},
        data={"path": str(tmp_path / "data.parquet"), **sections.pop("data", {})},
        **{**sections, "checkpoint": {"dir": str(tmp_path / name / "ckpt"), **sections.get("checkpoint", {})}},
    )


def run_bench_cpu(suite: str, out_dir, timeout: int, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`python -m bench.run --suite <suite> --cpu --steps 2 [args]`; its output and results.json."""
    out = subprocess.run([sys.executable, "-m", "bench.run", "--suite", suite, "--cpu", "--steps", "2",
                          "--out", str(out_dir), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out, json.loads((Path(out_dir) / "results.json").read_text())


def synthetic_data(tmp_path, cfg: Config) -> TokenDataset:
    path = write_synthetic_corpus(tmp_path / "data.parquet", cfg.data.synthetic_samples, cfg.data.seq_len,
                                  cfg.model.vocab_size, seed=1)
    return TokenDataset(path, cfg.data.seq_len)


def start_group(cfg: Config, dataset: TokenDataset):
    return start_group_on(cfg, dataset, "cpu")


def start_group_on(cfg: Config, dataset: TokenDataset, device: str):
    from raypar.actors.worker_group import WorkerGroup

    grid = cfg.parallel.grid
    resources = WorkerResources(device, cfg.runtime.cpus_per_worker, 1 if device == "cuda" else 0)
    return WorkerGroup(cfg, grid, resources, str(dataset.path))


def step_both(group, ref: ReferenceTrainer, dataset: TokenDataset, order: SampleOrder, step: int,
              schedule: str, microbatches: int, release: bool = True, device: str = "cpu",
              announce: int | None = None, tol=None):
    """One step on the workers and on the reference, same samples. Returns both sides.
    `announce`: the step whose batch the call names as the next one (for a forward issued ahead).
    `tol` (tolerances.Tolerances) is given the step to bound what the two sides may differ by."""
    cfg, grid = group.cfg, group.grid
    gbs = cfg.train.global_batch_size

    def per_rank(batch: list[int]) -> list[list[int]]:
        return [split_batch(batch, grid.data_parallel_size, grid.data_rank(c)) for c in grid.coords()]

    batch = order.indices(step * gbs, gbs)
    # A group built for several chunks per stage runs the schedules of its layout.
    chunks = cfg.parallel.chunks if schedule in CHUNKED_SCHEDULES else None
    programs = build_programs(schedule, grid.pp, microbatches, release=release, chunks=chunks)
    if group.programs != programs:  # programs go to the workers only when they change
        group.set_programs(programs)
    following = per_rank(order.indices(announce * gbs, gbs)) if announce is not None else None
    reports = group.run_step(step, per_rank(batch), capture_grads=True, next_sample_ids=following)
    grads: dict[str, torch.Tensor] = {}
    for r in reports:
        for name, g in r.grads.items():
            grads.setdefault(name, g)
    tokens, labels = dataset.get(batch)
    ref_loss, ref_grads = ref.step(step, tokens.to(device), labels.to(device), sample_ids=batch)
    if tol is not None:
        tol.observe(step, tokens.to(device), labels.to(device), batch, ref_loss, ref_grads,
                    [r.grad_norm for r in reports if r.grad_norm is not None])
    return step_loss(reports), grads, ref_loss, ref_grads, reports


def assert_step_matches(group, ref: ReferenceTrainer, dataset: TokenDataset, order: SampleOrder, step: int,
                        schedule: str, microbatches: int, tol) -> tuple[list, float]:
    """One step on both sides, then: the loss, every gradient and the weights after it within
    `tol` of the reference's; the first stage of every pipeline reports the whole model's
    norm, the others none. Returns the reports and the reference's gradient norm."""
    loss, grads, ref_loss, ref_grads, reports = step_both(group, ref, dataset, order, step, schedule, microbatches,
                                                          tol=tol)
    where = f"step {step} ({schedule}, {microbatches} micro-batches)"
    assert abs(loss - ref_loss) <= tol.loss, f"{where}: loss {loss} vs {ref_loss}"
    assert_same(grads, ref_grads, tol.grads, where)
    ref_norm = float(torch.stack([g.norm() for g in ref_grads.values()]).norm())
    for r in reports:
        if r.stage == 0:
            assert abs(r.grad_norm - ref_norm) <= tol.grad_norm, f"{where}, rank {r.rank}"
        else:
            assert r.grad_norm is None, f"{where}, rank {r.rank}"
    tol.check_weights(group.parameters(), ref.parameters(), where)
    return reports, ref_norm


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bound: dict[str, torch.Tensor],
                where: str) -> None:
    """Same names, and every element within its bound (tests/tolerances.py) of the reference's."""
    assert got.keys() == want.keys(), where
    for name, w in want.items():
        diff = (got[name].to(w.device) - w).abs()
        over = diff > bound[name]
        if over.any():
            i = int((diff - bound[name]).flatten().argmax())
            raise AssertionError(f"{where} {name}: {int(over.sum())} of {w.numel()} elements out of bounds, worst at "
                                 f"flat index {i}: |{float(got[name].flatten()[i]):.9g} - {float(w.flatten()[i]):.9g}| "
                                 f"= {float(diff.flatten()[i]):.3g} > {float(bound[name].expand_as(w).flatten()[i]):.3g}")


class SwitchAt(Callback):
    """Calls `trainer.switch_schedule(*args)` at the end of each step named in `plan`."""

    def __init__(self, plan: dict[int, tuple]):
        self.plan = plan

    def on_step_end(self, trainer, record):
        if record.step in self.plan:
            trainer.switch_schedule(*self.plan.pop(record.step))


class KillWorker(Callback):
    """Kills one stage worker after step `at` (once), as a crash would."""

    def __init__(self, at: int, rank: int):
        self.at, self.rank, self.killed_at = at, rank, None

    def on_step_end(self, trainer, record):
        if record.step == self.at and self.killed_at is None:
            self.killed_at = time.time()
            ray.kill(trainer.group.workers[self.rank])


def last_loss_per_step(summary) -> dict[int, float]:
    # Steps after the last checkpoint before a failure run twice; the later run counts.
    return {r.step: r.loss for r in summary.records}


@contextmanager
def one_cpu_stage(tmp_path, cfg: Config):
    """A one-stage `StageRuntime` in this process (a gloo world of one) running `cfg`'s 1F1B
    program, without Ray: for what a stage does between its units."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from raypar.runtime.groups import build_groups, init_world
    from raypar.runtime.stage import StageRuntime
    from raypar.topology import Grid

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_world("gloo", "127.0.0.1", port, 0, 1, timedelta(seconds=30))
    try:
        grid = Grid(1, 1, 1)
        runtime = StageRuntime(cfg, grid, 0, build_groups(grid, 0, timedelta(seconds=30)), torch.device("cpu"),
                               synthetic_data(tmp_path, cfg))
        runtime.set_program(build_programs("1f1b", 1, cfg.parallel.microbatches)[0])
        yield runtime
    finally:
        dist.destroy_process_group()


def assert_same_checkpoints(expected: Path, got: Path, step: int, rtol: float = 1e-5, atol: float = 1e-6) -> list[str]:
    """The checkpoints of step `step` under the checkpoint folders `expected` and `got` name
    the same tensors, RNG states aside, and hold them within the tolerances (compared in
    fp32); returns the names."""
    from raypar.checkpoint import CheckpointReader, checkpoint_dir

    with CheckpointReader(checkpoint_dir(expected, step)) as a, CheckpointReader(checkpoint_dir(got, step)) as b:
        names = sorted(n for n in a.names() if not n.startswith("rng."))
        assert names == sorted(n for n in b.names() if not n.startswith("rng."))
        for n in names:
            torch.testing.assert_close(b.read(n).float(), a.read(n).float(), rtol=rtol, atol=atol, msg=n)
    return names
