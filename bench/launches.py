"""One benchmark launch in its own process (a fresh Ray, fresh workers), shared by the
scripts that alternate launches of several kinds in one call (data_stream, moe_speed,
sharded_optimizer): the script re-runs itself with `--launch KIND`, which prints one
`LAUNCH {json}` line (written out in each script: a launch may run under another checkout's
`bench` package, for a baseline)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

PREFIX = "LAUNCH "
ROOT = Path(__file__).resolve().parent.parent


def tree_env(tree: Path) -> dict[str, str]:
    """The environment that imports the project from `tree` (another checkout, for a baseline)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}


def run_launch(argv: list[str], tree: Path, what: str) -> dict:
    """Run `python argv...` in `tree`; its printed result. A launch that prints none ends the
    script with its output's tail (`what` names it: kind and round)."""
    proc = subprocess.run([sys.executable, *argv], cwd=tree, env=tree_env(tree), capture_output=True, text=True)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(PREFIX)), None)
    if line is None:
        print(proc.stdout[-3000:], proc.stderr[-6000:], file=sys.stderr)
        raise SystemExit(f"launch {what} failed (exit {proc.returncode})")
    return json.loads(line[len(PREFIX):])



def launch_parser(doc: str, kinds: list[str], default_kinds: list[str], steps: int, work: str,
                  options: dict[str, dict] | None = None) -> argparse.ArgumentParser:
    """The options every alternating-launch script takes: --out, --rounds, --steps, --kinds,
    --work, --cpu, and the internal --launch KIND that runs one launch in this process; then
    the script's own `options` (flag: `add_argument`'s keywords), which every launch gets too."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--kinds", default=",".join(default_kinds), help=f"which of {','.join(kinds)} each round launches")
    ap.add_argument("--work", type=Path, default=Path(work))
    ap.add_argument("--cpu", action="store_true", help="a tiny model on CPU workers (checks the script)")
    ap.add_argument("--launch", help=argparse.SUPPRESS)
    for flag, spec in (options or {}).items():
        ap.add_argument(flag, **spec)
    return ap


def option_values(args: argparse.Namespace, options: dict[str, dict] | None) -> dict[str, object]:
    """The script's own options as parsed, by their argparse names (`--pp` -> "pp")."""
    return {_dest(flag): getattr(args, _dest(flag)) for flag in options or {}}


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def chosen_kinds(text: str, kinds: list[str]) -> list[str]:
    """The comma-separated `text` as kinds, each one of `kinds` (else the script ends, naming them)."""
    chosen = [k for k in text.split(",") if k]
    unknown = [k for k in chosen if k not in kinds]
    if unknown:
        raise SystemExit(f"unknown kinds {unknown}; choose from {kinds}")
    return chosen


def each_launch(module: str, args: argparse.Namespace, kinds: list[str], tree: Path,
                options: dict[str, dict] | None = None) -> Iterator[dict]:
    """Every launch of `kinds` over `args.rounds` rounds, each `python -m module --launch KIND`
    (with `launch_parser`'s --steps, --work of its round and --cpu, and the script's own
    `options`) in its own process; yields each result with its round. Odd rounds run the kinds
    in reverse order, so no kind always runs first on a machine that warms up or tires."""
    own = [x for flag in options or {} for x in (flag, str(getattr(args, _dest(flag))))]
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            argv = ["-m", module, "--out", str(args.out), "--launch", kind, "--steps", str(args.steps),
                    "--work", str(args.work / f"round{r}"), *(["--cpu"] if args.cpu else []), *own]
            yield {**run_launch(argv, tree, f"{kind} of round {r}"), "round": r}


def alternate(module: str, doc: str, kinds: list[str], default_kinds: list[str], steps: int, work: str,
              launch: Callable[[str, int, Path, bool], dict], describe: Callable[[dict], str],
              table: Callable[[list[dict]], str], stem: str, options: dict[str, dict] | None = None) -> None:
    """The main of a script that alternates launches: with the internal --launch KIND, run
    `launch(kind, steps, work, cpu, **its options)` here and print its result; else every
    round's launches (`each_launch`), each described by `describe` as it ends, and after each
    one OUT/<stem>.json and OUT/<stem>.md (`table`), so that a call cut short keeps what it
    measured."""
    args = launch_parser(doc, kinds, default_kinds, steps=steps, work=work, options=options).parse_args()
    if args.launch:
        result = launch(args.launch, args.steps, args.work, args.cpu, **option_values(args, options))
        print(PREFIX + json.dumps(result), flush=True)
        return
    chosen = chosen_kinds(args.kinds, kinds)
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    for res in each_launch(module, args, chosen, ROOT, options):
        results.append(res)
        print(f"round {res['round']} {res['kind']}: {describe(res)}", flush=True)
        (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1) + "\n")
        (args.out / f"{stem}.md").write_text(table(results))
    print(table(results))
