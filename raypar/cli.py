"""`raypar` command line: a thin layer over the Python API."""
from __future__ import annotations

import argparse
import sys

from raypar.config import ConfigError, load_config

USAGE_ERRORS = (ConfigError,)


def _train(args: argparse.Namespace) -> int:
    from raypar.trainer import Trainer

    cfg = load_config(args.config, args.overrides)
    summary = Trainer(cfg).fit()
    print("\nsummary\n" + summary.format(), flush=True)
    return 0


def _prepare_data(args: argparse.Namespace) -> int:
    from raypar.data import write_synthetic_corpus

    if not args.synthetic:
        print("raypar prepare-data: only --synthetic is available in this version", file=sys.stderr)
        return 2
    path = write_synthetic_corpus(args.out, args.samples, args.seq_len, args.vocab_size, seed=args.seed)
    print(f"wrote {args.samples} samples of {args.seq_len + 1} tokens to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raypar", description="Pipeline-parallel training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model",
                           description="Train with a YAML config; override any field as section.key=value.")
    train.add_argument("--config", "-c", default=None, help="YAML config file (default: built-in defaults)")
    train.add_argument("overrides", nargs="*", help="section.key=value, e.g. parallel.pp=2 parallel.schedule=fthenb")
    train.set_defaults(func=_train)

    prep = sub.add_parser("prepare-data", help="write a token dataset in raypar's Parquet format")
    prep.add_argument("out", help="output Parquet file")
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
    from raypar.schedule import ScheduleError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, DataError, PartitionError, ResourceError, ScheduleError) as e:
        print(f"raypar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
