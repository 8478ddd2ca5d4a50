"""Training on a streamed multi-GB corpus against a corpus that fits in memory, in one call.

    python -m bench.data_stream --out DIR [--corpus-gb 4] [--rounds 2] [--steps 12] [--baseline TREE]  # 2 GPUs
    python -m bench.data_stream --out DIR --cpu                                       # tiny model, CPU workers

The 1B config (`configs/gpt-1b.yaml`, pp=2) on three corpora of the same format:

- `small`: the 1,024-sample synthetic corpus the config generates (4 MiB: every block stays
  in the window after the first reads);
- `stream`: a `--corpus-gb` synthetic corpus written by `raypar prepare-data --synthetic`
  (sharded Parquet, 1 MiB row groups, a manifest), shuffled over the whole corpus, so that
  nearly every sample is a ranged read of a row group not in the window; prefetch on;
- `stream-no-prefetch`: the same with `data.prefetch=false`, every step reading its batch
  as it starts;
- `in-memory` (with `--baseline TREE`): the same corpus through TREE's reader, for a
  checkout whose reader loads the whole corpus into memory.

Before each launch the corpus's pages are dropped from the OS cache (posix_fadvise
DONTNEED), so reads come from the disk. Every launch is its own process; the order
reverses between rounds. Per launch: tokens/s (median steady step), the median and the
total time a step waited for its data (the slowest worker's) as a share of the step, the
bytes of corpus a worker kept, and the run's wall time from start to end. Writes DIR/data_stream.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("small", "stream", "stream-no-prefetch")
BASELINE = "in-memory"  # the same corpus through another checkout's reader (`--baseline`)
CPU_MODEL = ["model.vocab_size=256", "model.dim=64", "model.n_layers=4", "model.n_heads=4", "model.max_seq_len=64",
             "model.dtype=float32", "data.seq_len=32", "data.synthetic_samples=512", "runtime.device=cpu",
             "runtime.cpus_per_worker=0.25", "parallel.microbatches=4"]


def corpus_path(work: Path) -> Path:
    return work / "corpus"


def write_corpus(work: Path, gb: float, cpu: bool) -> dict:
    """The streamed corpus, written once per call (samples of the config's seq_len)."""
    from raypar import load_config
    from raypar.data import write_synthetic_corpus

    cfg = load_config(str(ROOT / "configs" / "gpt-1b.yaml"), CPU_MODEL if cpu else [])
    samples = int(gb * 2**30 / (4 * (cfg.data.seq_len + 1)))
    t0 = time.perf_counter()
    path = write_synthetic_corpus(corpus_path(work), samples, cfg.data.seq_len, cfg.model.vocab_size, seed=7)
    seconds = time.perf_counter() - t0
    nbytes = sum(f.stat().st_size for f in path.glob("*.parquet"))
    return {"samples": samples, "bytes": nbytes, "files": len(list(path.glob("*.parquet"))), "write_s": seconds}


def drop_from_page_cache(folder: Path) -> None:
    for f in folder.glob("*.parquet"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def launch(kind: str, steps: int, work: Path, cpu: bool) -> dict:
    """One training run in this process; returns its figures."""
    from raypar import Trainer, load_config

    data = [] if kind == "small" else [f"data.path={corpus_path(work)}"]  # in-memory: the same corpus
    if kind == "stream-no-prefetch":
        data.append("data.prefetch=false")
    cfg = load_config(str(ROOT / "configs" / "gpt-1b.yaml"),
                      [*(CPU_MODEL if cpu else []), *data, f"train.steps={steps}",
                       f"runtime.run_dir={work / kind}", "runtime.log_every=100"])
    if kind != "small":
        drop_from_page_cache(corpus_path(work))
    t0 = time.perf_counter()
    s = Trainer(cfg, log=lambda m: None).fit()
    run_s = time.perf_counter() - t0
    steady = s.records[2:] if len(s.records) > 3 else s.records[1:]
    step_s = statistics.median(r.step_time_s for r in steady)
    waits = [getattr(r, "data_wait_s", 0.0) for r in steady]  # a baseline's records may not have it
    return {"kind": kind, "tokens_per_s": cfg.train.global_batch_size * cfg.data.seq_len / step_s,
            "step_ms": step_s * 1000, "steps_ms": [round(r.step_time_s * 1000) for r in s.records],
            "data_wait_ms": statistics.median(waits) * 1000, "data_wait_max_ms": max(waits) * 1000,
            "data_wait_share": sum(waits) / sum(r.step_time_s for r in steady),
            "data_wait_first_ms": getattr(s.records[0], "data_wait_s", 0.0) * 1000, "run_s": run_s,
            "window_bytes": max(max(getattr(r, "data_window_bytes", None) or [0]) for r in s.records)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--corpus-gb", type=float, default=4.0)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"which of {','.join(KINDS)} each round launches")
    ap.add_argument("--work", type=Path, default=Path("/tmp/data-stream"))
    ap.add_argument("--cpu", action="store_true", help="a tiny model on CPU workers (checks the script)")
    ap.add_argument("--baseline", type=Path, help=f"another checkout whose reader each round also launches ({BASELINE})")
    ap.add_argument("--launch", help=argparse.SUPPRESS)  # internal: run one launch, print its JSON
    args = ap.parse_args()
    if args.launch:
        print("LAUNCH " + json.dumps(launch(args.launch, args.steps, args.work, args.cpu)), flush=True)
        return
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS + (BASELINE,)]
    if unknown:
        raise SystemExit(f"unknown kinds {unknown}; choose from {list(KINDS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    corpus = write_corpus(args.work, args.corpus_gb, args.cpu)
    print(f"corpus: {corpus['samples']:,} samples, {corpus['bytes'] / 2**30:.2f} GiB in {corpus['files']} files, "
          f"written in {corpus['write_s']:.1f} s", flush=True)
    # Imported here: a launch runs this file under the baseline's `bench` package, which may lack it.
    from bench.launches import run_launch

    results = []
    kinds += [BASELINE] if args.baseline else []
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            tree = args.baseline.resolve() if kind == BASELINE else ROOT
            res = {**run_launch([str(Path(__file__).resolve()), "--out", str(args.out), "--launch", kind,
                                 "--steps", str(args.steps), "--work", str(args.work), *(["--cpu"] if args.cpu else [])],
                                tree, f"{kind} of round {r}"), "round": r}
            results.append(res)
            # After every launch, so that a call cut short still leaves what it measured.
            (args.out / "data_stream.json").write_text(json.dumps({"corpus": corpus, "launches": results}, indent=1))
            print(f"round {r} {kind}: {res['tokens_per_s']:,.0f} tokens/s, step {res['step_ms']:.0f} ms, "
                  f"data wait {res['data_wait_ms']:.2f} ms median ({res['data_wait_share']:.2%} of the steps), "
                  f"window {res['window_bytes'] / 2**20:.0f} MiB, run {res['run_s']:.0f} s", flush=True)
    (args.out / "data_stream.md").write_text(table(corpus, results))
    print(table(corpus, results))


def table(corpus: dict, results: list[dict]) -> str:
    """Per kind: medians over rounds, and throughput against the corpus that fits in memory."""
    by_kind: dict[str, list[dict]] = {}
    for r in results:
        by_kind.setdefault(r["kind"], []).append(r)
    med = {k: statistics.median(x["tokens_per_s"] for x in rs) for k, rs in by_kind.items()}
    lines = [f"Streamed corpus: {corpus['samples']:,} samples, {corpus['bytes'] / 2**30:.2f} GiB in "
             f"{corpus['files']} Parquet files.", "",
             "| launch | tokens/s (each round) | vs small | step ms | data wait ms (median / max) "
             "| data wait share of steps | corpus kept per worker MiB | run s |", "|---|---|---|---|---|---|---|---|"]
    for k, rs in by_kind.items():
        each = " / ".join(f"{x['tokens_per_s']:,.0f}" for x in rs)
        vs = f"{med[k] / med['small']:.3f}" if "small" in med else ""
        lines.append(f"| {k} | {each} | {vs} | {statistics.median(x['step_ms'] for x in rs):.0f} "
                     f"| {statistics.median(x['data_wait_ms'] for x in rs):.2f} / {max(x['data_wait_max_ms'] for x in rs):.2f} "
                     f"| {'(not recorded)' if k == BASELINE else format(max(x['data_wait_share'] for x in rs), '.3%')} "
                     f"| {max(x['window_bytes'] for x in rs) / 2**20:.0f} "
                     f"| {statistics.median(x['run_s'] for x in rs):.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
