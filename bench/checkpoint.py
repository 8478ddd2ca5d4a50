"""Checkpoint suite: what a save costs the training loop, how fast it writes, how fast it loads.

Side by side in one run: the same pp=2 run without saves, saving every N steps
(`checkpoint.every`, tokens/s against not saving, each stage of a save's path timed), and
with an EMA of the weights folded every step (tokens/s against not saving); a synchronous
`torch.save` and `torch.distributed.checkpoint.async_save` of the same state (weights, fp32
masters, AdamW moments) from a whole-model reference on the driver; the disk's sequential
write speed (fsync'd) and the device-to-host copy bandwidth into pinned memory, which a
save's write and snapshot are compared with; loading the checkpoint on the grid that wrote
it and resharded onto pp=1.
"""
from __future__ import annotations

import os
import shutil
import socket
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from raypar.driver.callbacks import Callback
from raypar.driver.trainer import Trainer

if TYPE_CHECKING:
    from raypar.config import Config
    from raypar.driver.records import RunSummary

    from bench.run import Context

TITLE = "training-loop stall per save, write speed against the disk, resharded load"
NOTES = ("stall: time the step loop was held up by a save (raypar: first save / mean over saves, the mean "
         "including waits for the last save to commit when saves come faster than the disk takes them; "
         "torch.save: the whole save; async_save: until it returned); overlap: extra "
         "time of the steps that ran while a raypar save was in flight, against steps with none; "
         "stall / step: against raypar's median step time for the same model and batch. Writes fsync. "
         "raypar's MiB/s is its own figure, bytes / the slowest worker's shard write time (each worker "
         "writes its own shard, in parallel): save to commit (snapshot copies, write, commit) bounds it "
         "from below. tokens/s: global batch tokens over the mean step time of steps 1 .. n-2, so the "
         "steps a save slowed count; vs the run without saves in the same call. "
         "Load: read_manifest + WorkerCheckpoints.load (same grid: into the workers that just saved; "
         "resharded: the resume of a new pp=1 run (Trainer.resumed.load_s), whose one worker reads what two read on pp=2, so it is "
         "also compared per byte read by the busiest worker); the files were just written, so reads may come "
         "from the page cache.")

DISK_BYTES = {"gpu": 2 * 2**30, "cpu": 16 * 2**20}
COPY_BYTES = 2**30


def run(ctx: "Context") -> list[dict]:
    rows: list[dict] = []
    where = ctx.work / ctx.suite
    where.mkdir(parents=True, exist_ok=True)
    rows += ctx.attempt("disk: sequential write + fsync", lambda: disk_row(where, DISK_BYTES["cpu" if ctx.cpu else "gpu"]),
                        min_time_s=5)
    if not ctx.cpu and torch.cuda.is_available():
        rows += ctx.attempt("device to pinned host copy", lambda: copy_row(COPY_BYTES), min_time_s=5)
    # On GPU 24 steps, a save due every 4 (the setting); on CPU a save halfway.
    steps = max(ctx.default_steps(gpu=24), 2)
    every = min(4, max(1, steps // 2))
    # A save takes longer to commit than `every` steps run (11 GB against ~1.5 GB/s): with
    # when_busy=skip the saves due while one writes are skipped, not waited for, so each
    # measured stall is a save's own and the run measures steps beside a save in flight.
    cfg = ctx.config(["parallel.pp=2", f"checkpoint.every={every}", "checkpoint.keep_last=2",
                      "checkpoint.when_busy=skip"], f"save every {every}", steps=steps)
    cfg.data.path = ctx.corpus(cfg)
    saved: dict = {}
    plain = ctx.config(["parallel.pp=2", "checkpoint.every=0"], "no saves", steps=steps)
    plain.data.path = cfg.data.path
    rows += ctx.attempt("raypar, no saves (pp=2)", lambda: plain_row(ctx, plain, "raypar, no saves (pp=2)"))
    rows += ctx.attempt(f"raypar, checkpoint.every={every} (pp=2)", lambda: raypar_save_rows(ctx, cfg, every, saved))
    # The EMA folded after every step, one save at the end (the EMA is saved only with checkpoints).
    ema = ctx.config(["parallel.pp=2", f"checkpoint.every={steps}", "checkpoint.ema_decay=0.999",
                      "checkpoint.ema_every=1"], "ema every step", steps=steps)
    ema.data.path = cfg.data.path
    rows += ctx.attempt("raypar, EMA every step (pp=2)", lambda: plain_row(ctx, ema, "raypar, EMA every step (pp=2)"))
    rows += ctx.attempt("torch.save, synchronous (whole model on the driver)",
                        lambda: reference_rows(ctx, cfg, where, quick=ctx.quick), min_time_s=20)
    if saved.get("path") and not ctx.quick:
        label = "load, resharded (pp=2 -> pp=1)"
        rows += ctx.attempt(label, lambda: resharded_load_row(ctx, cfg, saved, label))
    relate(rows, saved.get("step_time_s"))
    return rows


def relate(rows: list[dict], step_s: float | None) -> None:
    """Ratios between rows of this run: to the disk, to raypar's step, to the same-grid load,
    to the run without saves, to the device-to-host copy."""
    disk = next((r for r in rows if "disk_bytes_per_s" in r), None)
    same = next((r for r in rows if r.get("load_pp") == 2 and "load_s" in r), None)
    plain = next((r for r in rows if r.get("label", "").startswith("raypar, no saves") and r.get("loop_tokens_per_s")),
                 None)
    copy = next((r for r in rows if "copy_bytes_per_s" in r), None)
    for r in rows:
        if plain and r is not plain and r.get("loop_tokens_per_s"):
            r["vs_no_saves"] = r["loop_tokens_per_s"] / plain["loop_tokens_per_s"]
        if copy and r.get("snapshot_bytes_per_s"):
            r["snapshot_vs_copy"] = r["snapshot_bytes_per_s"] / copy["copy_bytes_per_s"]
        if disk and r.get("write_bytes_per_s"):
            r["vs_disk"] = r["write_bytes_per_s"] / disk["disk_bytes_per_s"]
        if disk and r.get("end_to_end_bytes_per_s"):
            r["end_to_end_vs_disk"] = r["end_to_end_bytes_per_s"] / disk["disk_bytes_per_s"]
        if step_s and r.get("stall_s") is not None:
            r["stall_per_step"] = r["stall_s"] / step_s
        if same and r.get("load_pp") == 1 and "load_s" in r:
            r["vs_same_grid"] = r["load_s"] / same["load_s"]
            # pp=1's one worker reads what pp=2's two read between them: compare the time per
            # byte of the worker that read the most, which is what resharding itself costs.
            if r.get("busiest_worker_bytes") and same.get("busiest_worker_bytes"):
                r["vs_same_grid_per_byte"] = (r["load_s"] / r["busiest_worker_bytes"]) / (
                    same["load_s"] / same["busiest_worker_bytes"])


# -- the disk ------------------------------------------------------------------------------


def disk_row(where: Path, nbytes: int) -> dict:
    """Sequential write of `nbytes` with fsync: the speed a checkpoint writer could reach."""
    block = os.urandom(4 * 2**20)  # incompressible, in case the filesystem compresses
    path = where / "disk-speed.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < nbytes:
            written += os.write(fd, block[: nbytes - written])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    path.unlink()
    return {"label": f"disk: sequential write {nbytes / 2**20:.0f} MiB + fsync", "bytes": nbytes,
            "write_s": seconds, "disk_bytes_per_s": nbytes / seconds, "write_bytes_per_s": nbytes / seconds}


def copy_row(nbytes: int) -> dict:
    """Device-to-host copies into pinned memory with nothing else running: one cudaMemcpy
    (the bandwidth a snapshot could reach), and one per tensor of 64 as a snapshot copies."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    parts = list(zip(src.chunk(64), dst.chunk(64)))

    def per_tensor() -> None:
        for s, d in parts:
            d.copy_(s, non_blocking=True)

    out = {}
    for name, fn in (("memcpy", lambda: dst.copy_(src, non_blocking=True)), ("per_tensor", per_tensor)):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        out[name] = 3 * nbytes / (time.perf_counter() - t0)
    return {"label": f"device to pinned host copy, {nbytes / 2**20:.0f} MiB", "bytes": nbytes,
            "copy_bytes_per_s": out["memcpy"], "memcpy_bytes_per_s": out["memcpy"],
            "per_tensor_bytes_per_s": out["per_tensor"], "write_bytes_per_s": out["memcpy"]}


def loop_tokens_per_s(cfg: "Config", summary: "RunSummary") -> float:
    """Tokens over the mean step time of steps 1 .. n-2: the slowed steps of the saves count;
    the first (warm-up) and the last (whose save only starts) do not."""
    steps = [r.step_time_s for r in summary.records[1:-1]] or [summary.step_time_s]
    return cfg.train.global_batch_size * cfg.data.seq_len / statistics.fmean(steps)


def plain_row(ctx: "Context", cfg: "Config", label: str) -> dict:
    summary = ctx.trainer(cfg, label).fit()
    return ctx.row(label, cfg, summary, loop_tokens_per_s=loop_tokens_per_s(cfg, summary),
                   stall_s=summary.checkpoint_stall_s)


# -- raypar's own checkpoints --------------------------------------------------------------


class SaveTimeline(Callback):
    """Which steps ran while each save was in flight (from its start to its commit being seen)."""

    def __init__(self) -> None:
        self.last_step = -1
        self.commits: dict[int, int] = {}  # checkpoint step (steps done) -> step during which it was seen

    def on_step_end(self, trainer: Trainer, record) -> None:
        self.last_step = record.step

    def on_checkpoint(self, trainer: Trainer, result) -> None:
        # Seen by a poll inside step last_step + 1, or after the loop.
        self.commits[result.step] = self.last_step + 1


def raypar_save_rows(ctx: "Context", cfg: "Config", every: int, saved: dict) -> list[dict]:
    """The saves' stall and write speed, and the same-grid load of the last one."""
    label = f"raypar, checkpoint.every={every} (pp=2)"
    timeline, load = SaveTimeline(), LoadAtEnd()
    trainer = ctx.trainer(cfg, label, callbacks=[timeline, load])
    summary = trainer.fit()
    ok = [c for c in summary.checkpoints if not c["error"]]
    if not ok and trainer.bench_stop.stopped_after is not None:
        return [{"label": label, "skipped": f"time budget: stopped after step {trainer.bench_stop.stopped_after}, "
                                            f"before a save"}]
    if not ok:
        raise RuntimeError(f"no checkpoint committed: {summary.checkpoints}")
    saved_steps = {c["step"] for c in summary.checkpoints}  # saves started (skipped ones are not)
    stalls = [r.checkpoint_stall_s for r in summary.records if r.step + 1 in saved_steps]
    # The step a save is compared with: the median after the first, which the saves' own
    # waits (e.g. for the last save to commit) do not move.
    clean_step_s = statistics.median(r.step_time_s for r in summary.records[1:]) if len(summary.records) > 1 \
        else summary.step_time_s
    saved.update(path=ok[-1]["path"], bytes=ok[-1]["bytes"], step=ok[-1]["step"], step_time_s=clean_step_s)
    nbytes = statistics.fmean(c["bytes"] for c in ok)
    write_s = statistics.fmean(c["write_s"] for c in ok)
    stages = {k: statistics.fmean(c[k] for c in ok) for k in ("copy_wait_s", "write_s", "commit_s", "duration_s")}
    rows = [ctx.row(label, cfg, summary, bytes=nbytes, stall_s=stalls[0] if stalls else 0.0,
                    stall_mean_s=statistics.fmean(stalls) if stalls else 0.0, stalls_s=stalls,
                    overlap_s=overlap_cost(summary, timeline), write_s=write_s,
                    write_bytes_per_s=nbytes / write_s if write_s else None,
                    save_duration_s=statistics.fmean(c["duration_s"] for c in ok), clean_step_s=clean_step_s,
                    saves_skipped=summary.checkpoints_skipped, saves_committed=len(ok), save_stages_s=stages,
                    # A worker's share over its wait for the copies: the snapshot's device-to-host speed.
                    snapshot_bytes_per_s=(nbytes / cfg.parallel.pp / stages["copy_wait_s"]
                                          if stages["copy_wait_s"] else None),
                    loop_tokens_per_s=loop_tokens_per_s(cfg, summary),
                    end_to_end_bytes_per_s=statistics.fmean(c["bytes"] / c["duration_s"] for c in ok))]
    if load.load_s is not None:
        rows.append({"label": "load, same grid (pp=2 -> pp=2), into the running workers", "load_s": load.load_s,
                     "load_pp": 2, "bytes": load.bytes, "load_bytes_per_s": load.bytes / load.load_s,
                     "busiest_worker_bytes": load.busiest_bytes,
                     "path": load.path, "config": cfg.to_dict()})
    return rows


class LoadAtEnd(Callback):
    """After the last step: wait for its save to commit, then time loading it on the same grid.

    The same call a resume makes (WorkerCheckpoints.load), into the workers that wrote
    it, so the same-grid load costs no second launch.
    """

    def __init__(self) -> None:
        self.load_s: float | None = None
        self.bytes = 0
        self.busiest_bytes = 0  # what the worker that read the most read
        self.path: str | None = None

    def on_step_end(self, trainer: Trainer, record) -> None:
        from raypar.checkpoint import read_manifest

        if record.step + 1 != trainer.cfg.train.steps:
            return
        trainer.saver.finish()
        ok = [r for r in trainer.saver.results if r.error is None]
        if not ok:
            return
        self.path, self.bytes = ok[-1].path, ok[-1].bytes
        t0 = time.perf_counter()
        manifest = read_manifest(self.path)
        g = trainer.grid
        same = {"tp": 1, **manifest.topology} == {"dp": g.dp, "pp": g.pp, "ep": g.ep, "tp": g.tp}
        loaded = trainer.group.checkpoints.load(self.path, same_grid=same)
        self.load_s = time.perf_counter() - t0
        self.busiest_bytes = max(r["bytes"] for r in loaded)


def overlap_cost(summary: "RunSummary", timeline: SaveTimeline) -> float | None:
    """Mean extra seconds per save of the steps that overlapped it, against clean steps.

    A save copies state to host memory beside the next steps; this is what that costs them.
    None when every step after warm-up overlapped a save.
    """
    times = {r.step: r.step_time_s for r in summary.records}
    busy: dict[int, list[int]] = {}
    for done, seen in timeline.commits.items():
        save_step = done - 1
        busy[done] = [s for s in range(save_step + 1, seen + 1) if s in times]
    touched = {s for steps in busy.values() for s in steps} | {d - 1 for d in timeline.commits}
    clean = [t for s, t in times.items() if s > 0 and s not in touched]
    if not clean:
        return None
    base = statistics.median(clean)
    extra = [sum(times[s] - base for s in steps) for steps in busy.values() if steps]
    return statistics.fmean(extra) if extra else 0.0


def resharded_load_row(ctx: "Context", saved_cfg: "Config", saved: dict, label: str) -> dict:
    """A new pp=1 run resuming the pp=2 checkpoint; one step, so the load is used."""
    overrides = ["parallel.pp=1", "checkpoint.every=0", f"checkpoint.resume={saved['path']}"]
    cfg = ctx.config(overrides, label, steps=saved["step"] + 1)
    cfg.data.path = saved_cfg.data.path
    trainer = ctx.trainer(cfg, label)
    summary = trainer.fit()
    resumed = trainer.resumed  # the load timed inside `fit`: manifest + every worker's read
    if resumed.path is None:
        raise RuntimeError("the run did not resume from the checkpoint")
    return ctx.row(label, cfg, summary, load_s=resumed.load_s, load_pp=1, bytes=saved["bytes"],
                   load_bytes_per_s=saved["bytes"] / resumed.load_s,
                   busiest_worker_bytes=max(r["bytes"] for r in resumed.loaded))


# -- the reference: the same state saved by torch ----------------------------------------------


def reference_rows(ctx: "Context", cfg: "Config", where: Path, quick: bool) -> list[dict]:
    """torch.save and DCP async_save of one optimizer step's state of the whole model."""
    from raypar.data import TokenDataset
    from raypar.model import build_stage
    from raypar.optim import MasterOptimizer
    from raypar.runtime.state import state_tensors

    device = torch.device("cpu" if ctx.cpu or not torch.cuda.is_available() else "cuda", 0)
    model = build_stage(cfg.model, 0, 1, cfg.parallel.layers_per_stage, seed=cfg.train.seed, device=device)
    optimizer = MasterOptimizer(model, cfg.train)
    tokens, labels = TokenDataset(cfg.data.path, cfg.data.seq_len).get(range(cfg.microbatch_size))
    model(tokens.to(device), labels.to(device)).backward()  # one step, so the AdamW moments exist
    optimizer.step(0, float(optimizer.local_sq_norm().sqrt()))
    state = state_tensors(model, optimizer, None, 0, device)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    rows = [torch_save_row(state, nbytes, where)]
    if not quick:
        rows.append(dcp_row(state, nbytes, where))
    del state, optimizer, model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next suite's workers need this GPU
    for r in rows:
        r.update(device=str(device), config=cfg.to_dict())
    return rows


def torch_save_row(state: dict, nbytes: int, where: Path) -> dict:
    path = where / "torch-save.pt"
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    written = path.stat().st_size
    path.unlink()
    return {"label": "torch.save, synchronous (whole model on the driver)", "bytes": written,
            "state_bytes": nbytes, "stall_s": seconds, "write_s": seconds, "write_bytes_per_s": written / seconds}


def dcp_row(state: dict, nbytes: int, where: Path) -> dict:
    """DCP async_save in a process group of one; 'not available' where it raises."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    label = "torch.distributed.checkpoint.async_save"
    path = where / "dcp"
    own = not dist.is_initialized()
    try:
        if own:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        t0 = time.perf_counter()
        pending = dcp.async_save(state, checkpoint_id=str(path))
        stall = time.perf_counter() - t0
        # Newer torch returns staging and upload futures; older a single future.
        getattr(pending, "upload_completion", pending).result()
        total = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - recorded as a finding, not a harness failure
        return {"label": label, "unavailable": f"not available: {type(e).__name__}: {e}"[:500]}
    finally:
        if own and dist.is_initialized():
            dist.destroy_process_group()
    written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    shutil.rmtree(path, ignore_errors=True)
    return {"label": label, "bytes": written, "state_bytes": nbytes, "stall_s": stall, "write_s": total,
            "write_bytes_per_s": written / total}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the table -----------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    ms = lambda s: "-" if s is None else f"{s * 1000:.1f}"  # noqa: E731
    lines = ["| row | MiB | stall ms per save | stall / step | overlap ms per save | write or load s | MiB/s | "
             "vs disk | note |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        stall = ms(r.get("stall_s"))
        if "stall_mean_s" in r:
            stall = f"{ms(r['stall_s'])} / {ms(r['stall_mean_s'])}"
        per_step = f"{r['stall_per_step']:.1%}" if r.get("stall_per_step") is not None else "-"
        seconds = r.get("load_s", r.get("write_s"))
        rate = r.get("load_bytes_per_s", r.get("write_bytes_per_s"))
        note = []
        if "vs_same_grid" in r:
            note.append(f"{r['vs_same_grid']:.2f}x the same-grid load")
        if "vs_same_grid_per_byte" in r:
            note.append(f"{r['vs_same_grid_per_byte']:.2f}x its time per byte read by the busiest worker")
        if "save_duration_s" in r:
            note.append(f"save to commit {r['save_duration_s']:.2f}s = {r['end_to_end_bytes_per_s'] / 2**20:,.0f} MiB/s"
                        + (f" ({r['end_to_end_vs_disk']:.2f} of disk)" if "end_to_end_vs_disk" in r else "")
                        + f"; step {r['clean_step_s'] * 1000:.0f} ms (median)")
            if r.get("saves_skipped"):
                note.append(f"{r['saves_skipped']} save(s) skipped while one was writing (when_busy=skip)")
        if "vs_no_saves" in r:
            note.append(f"tokens/s {r['loop_tokens_per_s']:,.0f} = {r['vs_no_saves']:.3f} of the run without saves")
        if "save_stages_s" in r:
            st = r["save_stages_s"]
            note.append(f"per save: copies {st['copy_wait_s']:.2f}s, write {st['write_s']:.2f}s, commit "
                        f"{st['commit_s']:.2f}s, snapshot to commit {st['duration_s']:.2f}s; "
                        f"{r.get('saves_committed', 0)} committed")
        if "snapshot_vs_copy" in r:
            note.append(f"snapshot copies at {r['snapshot_bytes_per_s'] / 2**20:,.0f} MiB/s per worker = "
                        f"{r['snapshot_vs_copy']:.2f} of the measured copy")
        if "memcpy_bytes_per_s" in r:
            note.append(f"one memcpy {r['memcpy_bytes_per_s'] / 2**20:,.0f} MiB/s, one per tensor of 64 "
                        f"{r['per_tensor_bytes_per_s'] / 2**20:,.0f} MiB/s")
        if "device" in r:
            note.append(f"on {r['device']}")
        vs_disk = f"{r['vs_disk']:.2f}" if r.get("vs_disk") else "-"
        lines.append(f"| {r['label']} | {r.get('bytes', 0) / 2**20:,.1f} | {stall} | {per_step} | "
                     f"{ms(r.get('overlap_s'))} | {'-' if seconds is None else f'{seconds:.2f}'} | "
                     f"{'-' if not rate else f'{rate / 2**20:,.0f}'} | {vs_disk} | {'; '.join(note)} |")
    return "\n".join(lines)
