"""`raypar` command line: a thin layer over the Python API."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from raypar.config import ConfigError, load_config

USAGE_ERRORS = (ConfigError,)


def _train(args: argparse.Namespace) -> int:
    from raypar.driver.exporter import build_exporter
    from raypar.driver.trainer import Trainer

    overrides = list(args.overrides)
    if args.resume:
        overrides.append(f"checkpoint.resume={args.resume}")
    if args.init_from:
        overrides.append(f"model.init_from={args.init_from}")
    cfg = load_config(args.config, overrides)
    exporter = build_exporter(cfg)  # a standalone endpoint binds its port now, before Ray starts
    try:
        summary = Trainer(cfg, callbacks=[exporter]).fit()
    finally:
        exporter.close()
    print("\nsummary\n" + summary.format(), flush=True)
    return 0


def _prepare_data(args: argparse.Namespace) -> int:
    from raypar.data import prepare_data, write_synthetic_corpus

    if args.synthetic:
        path = write_synthetic_corpus(args.out, args.samples, args.seq_len, args.vocab_size, seed=args.seed)
        print(f"wrote {args.samples} samples of {args.seq_len + 1} tokens to {path}")
        return 0
    if not args.inputs:
        print("raypar prepare-data: give text inputs (--input PATH ...) or --synthetic", file=sys.stderr)
        return 2
    shard_bytes = int(args.shard_mb * 2**20)
    progress = _PrepareProgress(args.seq_len, shard_bytes if not args.out.lower().endswith(".parquet") else None)
    try:
        path = prepare_data(args.inputs, args.out, args.seq_len, tokenizer=args.tokenizer,
                            text_column=args.text_column, add_eos=not args.no_eos, progress=progress,
                            workers=args.workers, shard_bytes=shard_bytes,
                            row_group_bytes=int(args.row_group_kb * 2**10), overwrite=args.overwrite)
    finally:
        progress.close()
    print(f"wrote {path}")
    return 0


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}"


class _PrepareProgress:
    """One stderr line, rewritten in place: documents, tokens, tokens/s, shards."""

    _EVERY_S = 0.2  # small documents finish thousands of batches a second

    def __init__(self, seq_len: int, shard_bytes: int | None) -> None:
        self._seq_len = seq_len
        self._shard_bytes = shard_bytes  # None: a single-file output
        self._start = time.monotonic()
        self._shown = 0.0
        self._line = ""
        self._unshown = False

    def __call__(self, done: int, total: int | None, tokens: int) -> None:
        from raypar.data.prepare import rows_fitting

        rows = tokens // (self._seq_len + 1)
        if self._shard_bytes is None:
            shards = int(rows > 0)
        else:
            shards = -(-rows // rows_fitting(self._shard_bytes, self._seq_len))
        rate = tokens / max(time.monotonic() - self._start, 1e-9)
        documents = f"{done:,}/{total:,}" if total is not None else f"{done:,}"
        self._line = (f"\r  {documents} documents  {_count(tokens)} tokens  {_count(rate)} tokens/s  "
                      f"{shards} shard{'s' if shards != 1 else ''}")
        self._unshown = True
        now = time.monotonic()
        if now - self._shown >= self._EVERY_S:
            self._shown = now
            self._unshown = False
            print(self._line, end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._line:  # the last state may have been skipped by the rate limit
            print(self._line if self._unshown else "", file=sys.stderr, flush=True)


def _export(args: argparse.Namespace) -> int:
    import re
    from pathlib import Path

    from raypar.checkpoint import export_hf, is_committed, is_model_weight, resolve

    src = Path(args.checkpoint)
    path = src if is_committed(src) else resolve(src, args.step)
    drops = [re.compile(d) for d in args.drop]
    keep = lambda name: is_model_weight(name) and not any(d.search(name) for d in drops)  # noqa: E731
    max_bytes = int(args.max_shard_gb * 2**30) if args.max_shard_gb else None
    if args.hf:
        from raypar.hf import export_checkpoint_to_hf

        index = export_checkpoint_to_hf(path, args.out, ema=args.ema, drop=args.drop, max_shard_bytes=max_bytes)
    else:
        index = export_hf(path, args.out, include=keep, max_shard_bytes=max_bytes)
    print(f"exported {path} -> {index}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from raypar.driver.progress import format_status, read_status

    try:
        print(format_status(read_status(args.run_dir)))
    except FileNotFoundError as e:
        print(f"raypar: error: {e}", file=sys.stderr)
        return 2
    return 0


def _shared_memory(args: argparse.Namespace) -> int:
    from raypar.runtime.shared_copies import SHM_ROOT, remove_ended_runs, run_areas

    root = Path(args.root) if args.root else SHM_ROOT
    if not root.is_dir():
        print(f"raypar: error: {root} is not a directory (shared memory is at {SHM_ROOT})", file=sys.stderr)
        return 2
    areas = run_areas(root)
    if not areas:
        print(f"no run keeps states in {root}")
        return 0
    for a in areas:
        state = f"{a.running} of {a.processes} processes running" if a.running else f"ended ({a.processes} processes)"
        print(f"{a.path}  {a.bytes / 2**30:.2f} GiB  {state}  run_dir {a.run_dir or '(not noted)'}")
    if args.remove:
        removed = remove_ended_runs(root)
        print(f"removed {len(removed)} run(s) no running process has files in, "
              f"{sum(a.bytes for a in removed) / 2**30:.2f} GiB")
    elif any(not a.running for a in areas):
        print("runs marked ended have no running process on this machine; --remove deletes them (not while a run of "
              "theirs is recovering from memory, which reads a lost process's files)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raypar", description="Pipeline-parallel training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model",
                           description="Train with a YAML config; override any field as section.key=value.")
    train.add_argument("--config", "-c", default=None, help="YAML config file (default: built-in defaults)")
    train.add_argument("--resume", default=None, metavar="latest|PATH|STEP",
                       help="continue from a committed checkpoint (same as checkpoint.resume=...)")
    train.add_argument("--init-from", default=None, metavar="HF_DIR",
                       help="start from a Hugging Face Llama/Mixtral safetensors folder (same as model.init_from=...)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.pp=2 parallel.schedule=fthenb")
    train.set_defaults(func=_train)

    export = sub.add_parser("export", help="write a checkpoint's weights as Hugging Face style safetensors",
                            description="Export model weights (not optimizer state, master weights or RNG) "
                                        "to OUT/model.safetensors and OUT/model.safetensors.index.json.")
    export.add_argument("checkpoint", help="a checkpoint directory, or a checkpoints root plus --step")
    export.add_argument("out", help="output directory")
    export.add_argument("--step", default="latest", help="with a checkpoints root: latest or a step number")
    export.add_argument("--drop", action="append", default=[], metavar="REGEX",
                        help="leave out weights whose name matches (repeatable)")
    export.add_argument("--max-shard-gb", type=float, default=None, help="split into files of at most this size")
    export.add_argument("--hf", action="store_true",
                        help="name tensors as transformers' Llama/Mixtral and write config.json (loadable by from_pretrained)")
    export.add_argument("--ema", action="store_true", help="export the EMA weights instead (with --hf)")
    export.set_defaults(func=_export)

    status = sub.add_parser("status", help="show a run's grid, state, step and last checkpoint",
                            description="Reads RUN_DIR/status.json, which a run rewrites after every step.")
    status.add_argument("run_dir", help="the run's runtime.run_dir")
    status.set_defaults(func=_status)

    shm = sub.add_parser("shared-memory", help="list the runs' states in this machine's /dev/shm; remove ended ones",
                         description="With elastic.memory_shared, workers keep copies of their states in files in "
                                     "/dev/shm/raypar-*. A run removes its own when it ends, and a run of the same "
                                     "run directory clears what ended processes left; a run that crashed leaves "
                                     "them otherwise. Lists every run's directory on this machine with its size and "
                                     "whether any process that wrote it still runs.")
    shm.add_argument("--remove", action="store_true",
                     help="remove the run directories no running process has files in")
    shm.add_argument("--root", default=None, help=argparse.SUPPRESS)  # tests: another directory than /dev/shm
    shm.set_defaults(func=_shared_memory)

    from raypar.timeline import add_parser as add_timeline_parser

    add_timeline_parser(sub)
    from raypar.plan import add_parser as add_plan_parser

    add_plan_parser(sub)

    prep = sub.add_parser("prepare-data", help="write a token dataset in raypar's Parquet format",
                          description="Tokenize text (files, JSON lines, Parquet or Arrow text columns, Hugging Face "
                                      "datasets folders) into fixed-length samples, or generate a synthetic corpus.")
    prep.add_argument("out", help="output folder (shards + manifest.json) or a .parquet file")
    prep.add_argument("--input", dest="inputs", action="append", default=[], metavar="PATH",
                      help=".txt (one document per file), .jsonl/.json (one per line), .parquet or .arrow (one per "
                           "row), a Hugging Face datasets folder (save_to_disk), or a folder of such files (repeatable)")
    prep.add_argument("--tokenizer", default="bytes",
                      help='"bytes" (built in, vocab 257) or a local folder/file with a Hugging Face tokenizer.json')
    prep.add_argument("--text-column", default="text",
                      help="the text column (Parquet, Arrow, datasets) or field (JSON lines) of the inputs")
    prep.add_argument("--no-eos", action="store_true", help="do not append an end-of-document token")
    prep.add_argument("--workers", type=int, default=None, metavar="N",
                      help="tokenizer processes (default: one per CPU core; 1: none, tokenize in this process)")
    prep.add_argument("--shard-mb", type=float, default=256, metavar="MB",
                      help="largest shard of a folder output, in MiB of tokens (default 256)")
    prep.add_argument("--row-group-kb", type=float, default=1024, metavar="KB",
                      help="largest Parquet row group, in KiB of tokens (default 1024): a random sample reads one")
    prep.add_argument("--overwrite", action="store_true",
                      help="replace the shards and manifest.json already in the output folder")
    prep.add_argument("--synthetic", action="store_true", help="generate a learnable synthetic corpus")
    prep.add_argument("--samples", type=int, default=4096)
    prep.add_argument("--seq-len", type=int, default=32)
    prep.add_argument("--vocab-size", type=int, default=256)
    prep.add_argument("--seed", type=int, default=0)
    prep.set_defaults(func=_prepare_data)
    return parser


def main(argv: list[str] | None = None) -> int:
    from raypar.data import DataError
    from raypar.model import PartitionError
    from raypar.resources import ResourceError
    from raypar.checkpoint import CheckpointError
    from raypar.schedule import ScheduleError

    parser = build_parser()
    # Overrides may stand before or after options (`train --resume latest parallel.pp=2`).
    args, extra = parser.parse_known_args(argv)
    if extra and (args.command not in ("train", "plan") or any("=" not in x or x.startswith("-") for x in extra)):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        return args.func(args)
    except (ConfigError, DataError, PartitionError, ResourceError, ScheduleError, CheckpointError) as e:
        print(f"raypar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
