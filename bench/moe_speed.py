"""MoE against dense in one call (issue 24): MFU by active parameters of
`configs/moe-scale.yaml` at ep=2 against `configs/gpt-1b.yaml`, CUDA graphs on against off
(`-eager` kinds: runtime.cuda_graphs=false), custom kernels on against off, padded
all-to-alls (no host wait) against exact split sizes, and how much of an MoE step the
all-to-all leaves exposed.

    python -m bench.moe_speed --out DIR [--rounds 2] [--steps 10] [--baseline TREE]
        [--kinds dense,moe-kernels-on,...] [--variant LABEL=KEY=VALUE[,KEY=VALUE]]...
        [--set KEY=VALUE[,KEY=VALUE]] [--profile-step N[,N...]]

Every launch is its own process (a fresh Ray, fresh workers): one round is a dense launch
and a launch of each other kind asked for (`--kinds`), whose order reverses between
rounds. With `--baseline TREE` each round also launches the kernels-on MoE run from
another checkout of the project (e.g. `git worktree add TREE <commit>`), for a
before/after ratio in the same call; each `--variant` adds a kernels-on MoE launch with its
config overrides (e.g. `mb4=parallel.microbatches=4`); `--set` overrides every MoE
launch's config (e.g. a longer run's `data.synthetic_samples`).

Each launch profiles the steps of `--profile-step` on every worker (`runtime.profile_step`)
and reads the traces back: the exposed all-to-all is the time its kernels (NCCL
send/receive; pp=1, so no pipeline transfers share that name) run while no compute kernel
does, as a share of the worker's step on the device; "of it, transfer" leaves out the time
a worker waited for its peer to enter each exchange (`runtime.profile.exchange_waits`: the
workers' traces share one host's clock); "on the busiest worker" is the share on the worker
with the most compute, whose step the other waits for; "busier worker's rows" is that
step's routed rows on the worker that got more, over all layers, as a multiple of an even
share; "layers' busier rows" sums each layer's busier worker's rows instead (each layer's
exchanges wait for its own busier worker), over the same even share. The table gives each
launch's worst profiled step, a line below it every profiled step. Each launch also says
how long two graph replays ran at once (`runtime.profile.graph_replays`): the micro-batch
overlap at work. Writes DIR/moe_speed.json and DIR/moe_speed.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from bench.launches import run_launch

ROOT = Path(__file__).resolve().parent.parent
MOE = ["parallel.pp=1", "parallel.ep=2", "train.global_batch_size=32"]
KINDS = ["dense", "dense-eager", "moe-kernels-on", "moe-eager", "moe-kernels-off", "moe-exact"]
PROFILED_STEP = 6


def launch(kind: str, steps: int, work: Path, overrides: list[str] = (),
           profiled: Sequence[int] = (PROFILED_STEP,)) -> dict:
    """One training run in this process; returns its figures."""
    from raypar import Trainer, load_config
    from raypar.expert_placement import identity, loads_by_layer

    run_dir = work / kind
    common = [f"train.steps={steps}", f"runtime.run_dir={run_dir}", "runtime.log_every=100",
              f"runtime.profile_step=[{','.join(map(str, profiled))}]"]
    eager = ["runtime.cuda_graphs=false"] if kind.endswith("-eager") else []
    if kind.startswith("dense"):
        cfg = load_config(str(ROOT / "configs" / "gpt-1b.yaml"), [*common, *eager])
    else:
        kernels = "false" if kind == "moe-kernels-off" else "true"
        alltoall = "exact" if kind == "moe-exact" else "padded"
        cfg = load_config(str(ROOT / "configs" / "moe-scale.yaml"),
                          [*MOE, *common, f"runtime.kernels={kernels}", f"runtime.moe_alltoall={alltoall}",
                           *eager, *overrides])
    s = Trainer(cfg, log=lambda m: None).fit()
    # The profiler starts at the end of the step before a profiled one and stops in the
    # profiled one: leave out the three steps its work slows.
    slowed = {x for p in profiled for x in (p - 1, p, p + 1)}
    steady = [r for r in s.records[1:] if r.step not in slowed]
    step_s = statistics.median(r.step_time_s for r in steady)
    losses = [r.loss for r in s.records]
    out = {"kind": kind, "tokens_per_s": cfg.train.global_batch_size * cfg.data.seq_len / step_s,
           "step_ms": step_s * 1000, "steps_ms": [round(r.step_time_s * 1000) for r in s.records],
           "mfu": statistics.median(r.mfu for r in steady), "alltoall_host_ms": s.alltoall_s_per_step * 1000,
           "losses": losses, "loss_last_10": statistics.fmean(losses[-10:]), "expert_moves": s.expert_moves,
           "profiled_steps": list(profiled)}
    if cfg.model.n_experts and not s.expert_moves:
        # Each worker's routed rows over the step's layers, as a multiple of an even share: the
        # compute that one worker's exchanges wait for when the other got fewer.
        placement = cfg.parallel.expert_placement or identity(cfg.model)
        loads = {str(r.step): loads_by_layer(cfg.model, r.expert_tokens) for r in s.records}
        out["worker_rows_by_step"] = {step: worker_shares(placement, layers, cfg.parallel.ep)
                                      for step, layers in loads.items()}
        # Each layer's exchanges wait for that layer's busier worker: workers busier in
        # different layers leave both waiting where their totals look even.
        out["layer_busiest_rows_by_step"] = {step: layer_busiest_share(placement, layers, cfg.parallel.ep)
                                             for step, layers in loads.items()}
    out["profiles"] = [p for p in (profile(run_dir, step, moe=not kind.startswith("dense")) for step in profiled) if p]
    for p in out["profiles"]:
        if "worker_rows_by_step" in out:
            p["busier_rows"] = max(out["worker_rows_by_step"][str(p["step"])], default=None)
            p["layers_busier_rows"] = out["layer_busiest_rows_by_step"][str(p["step"])]
    if out["profiles"] and "exposed_alltoall_share" in out["profiles"][0]:
        # The launch's figure is its worst profiled step's.
        for key in ("exposed_alltoall_share", "exposed_alltoall_share_busiest", "exposed_transfer_share"):
            shares = [p[key] for p in out["profiles"] if key in p]
            if shares:
                out[key] = max(shares)
    return out


def profile(run_dir: Path, step: int, moe: bool) -> dict | None:
    """The figures of profiled step `step`'s traces (one per worker), None without traces."""
    from raypar.runtime.profile import device_time, exchange_waits, replay_overlap

    traces = sorted((run_dir / "profile").glob(f"rank*-step{step}.json"))
    if not traces:
        return None
    workers = [device_time(t) for t in traces]
    out = {"step": step,
           "workers": [{"span_ms": w["span_ms"], "busy_ms": w["busy_ms"], "compute_busy_ms": w["compute_busy_ms"],
                        "exposed_ms": w["exposed_ms"], "top_kernels": w["top_kernels"],
                        "by_kind": {k: round(v["ms"], 1) for k, v in w["by_kind"].items()},
                        "graphs": replay_overlap(t)} for w, t in zip(workers, traces)]}
    if not moe or not all(w["kernels"] for w in workers):  # a CPU run's traces have no kernels
        return out
    shares = [w["exposed_ms"].get("SendRecv", 0.0) / w["span_ms"] for w in workers]
    out["exposed_alltoall_share"] = max(shares)
    # The worker with the most compute sets the step's pace; the other's exposed time is
    # mostly its wait for that one.
    out["exposed_alltoall_share_busiest"] = shares[max(range(len(workers)), key=lambda i: workers[i]["compute_busy_ms"])]
    # The same without the time a worker waited for its peer to enter each exchange.
    try:
        waits = exchange_waits(traces)
    except ValueError as e:
        out["exchange_waits_error"] = str(e)
    else:
        for w, split in zip(out["workers"], waits):
            w.update(split)
        out["exposed_transfer_share"] = max(x["exposed_transfer_ms"] / w["span_ms"] for x, w in zip(waits, workers))
    return out


def worker_shares(placement: list[list[int]], loads: list[list[int]], ep: int) -> list[float]:
    """Each of `ep` workers' rows over all layers, divided by an even share of them."""
    from raypar.expert_placement import worker_loads

    totals = [sum(w) for w in zip(*(worker_loads(order, layer, ep) for order, layer in zip(placement, loads)))]
    even = sum(totals) / ep if totals else 0
    return [round(t / even, 4) for t in totals] if even else []


def layer_busiest_share(placement: list[list[int]], loads: list[list[int]], ep: int) -> float | None:
    """Each layer's busiest worker's rows, summed over layers, divided by an even share of all
    rows: the rows the step's exchanges wait for (1.0 when every layer is even)."""
    from raypar.expert_placement import busiest

    total = sum(sum(layer) for layer in loads)
    return round(busiest(placement, loads, ep) / (total / ep), 4) if total else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile-step", type=steps_list, default=[PROFILED_STEP], metavar="N[,N...]",
                    help="the steps each launch profiles (timings leave out them and the steps either side)")
    ap.add_argument("--set", default="", metavar="KEY=VALUE[,KEY=VALUE]",
                    help="config overrides of every MoE launch (variants' come after them)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/moe-speed"))
    ap.add_argument("--baseline", type=Path, help="another checkout whose kernels-on MoE run each round also launches")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"which of {','.join(KINDS)} each round launches")
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=KEY=VALUE[,KEY=VALUE]",
                    help="also launch the kernels-on MoE run with these config overrides each round")
    ap.add_argument("--launch", help=argparse.SUPPRESS)  # internal: run one launch, print its JSON
    ap.add_argument("--overrides", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.launch:
        every_moe = [] if args.launch.startswith("dense") else [o for o in args.set.split(",") if o]
        overrides = every_moe + [o for o in args.overrides.split(",") if o]
        print("LAUNCH " + json.dumps(launch(args.launch, args.steps, args.work, overrides, args.profile_step)),
              flush=True)
        return
    variants = dict(v.split("=", 1) for v in args.variant)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for r in range(args.rounds):
        kinds = [k for k in args.kinds.split(",") if k]
        moe = [k for k in kinds if k != "dense"] + (["moe-baseline"] if args.baseline else []) + list(variants)
        moe = moe if r % 2 == 0 else moe[::-1]
        for kind in ["dense", *moe] if "dense" in kinds else moe:
            tree = args.baseline.resolve() if kind == "moe-baseline" else ROOT
            res = {**run_launch(["-m", "bench.moe_speed", "--out", str(args.out),
                                 "--launch", "moe-kernels-on" if kind == "moe-baseline" or kind in variants else kind,
                                 *(["--overrides", variants[kind]] if kind in variants else []),
                                 "--steps", str(args.steps), "--set", args.set,
                                 "--profile-step", ",".join(map(str, args.profile_step)),
                                 "--work", str(args.work / f"round{r}" / kind)],
                                tree, f"{kind} of round {r}"), "round": r, "kind": kind}
            results.append(res)
            print(f"round {r} {kind}: {res['tokens_per_s']:,.0f} tokens/s, step {res['step_ms']:.0f} ms, "
                  f"MFU {res['mfu']:.3f}, exposed all-to-all {res.get('exposed_alltoall_share', 0):.1%}", flush=True)
    (args.out / "moe_speed.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "moe_speed.md").write_text(table(results))
    print(table(results))


def largest_share(profiles: list[dict], key: str) -> str:
    """The largest of the profiled steps' `key` (a multiple of an even share), "" where a
    step lacks it."""
    values = [p.get(key) for p in profiles]
    return f"{max(values):.3f}x" if values and None not in values else ""


def steps_list(text: str) -> list[int]:
    """`--profile-step`'s steps: "6" or "6,100,200"."""
    try:
        steps = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a step or a comma-separated list of steps (e.g. 6,100)")
    return sorted(set(steps))


def table(results: list[dict]) -> str:
    """Each launch's figures, then the ratios of launches of the same round."""
    lines = ["| round | run | tokens/s | step (ms) | MFU | MFU / dense | exposed all-to-all | of it, transfer "
             "| on the busiest worker | busier worker's rows | layers' busier rows | loss, last 10 steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios = []
    for r in sorted({x["round"] for x in results}):
        got = {x["kind"]: x for x in results if x["round"] == r}
        dense = got.get("dense")
        for kind, x in got.items():
            rel = f"{x['mfu'] / dense['mfu']:.2f}" if dense and kind != "dense" else ""
            exposed = f"{x['exposed_alltoall_share']:.1%}" if "exposed_alltoall_share" in x else ""
            transfer = f"{x['exposed_transfer_share']:.1%}" if "exposed_transfer_share" in x else ""
            busiest = f"{x['exposed_alltoall_share_busiest']:.1%}" if "exposed_alltoall_share_busiest" in x else ""
            rows = largest_share(x.get("profiles", []), "busier_rows")
            layers = largest_share(x.get("profiles", []), "layers_busier_rows")
            lines.append(f"| {r + 1} | {kind} | {x['tokens_per_s']:,.0f} | {x['step_ms']:.0f} | {x['mfu']:.3f} | {rel} | "
                         f"{exposed} | {transfer} | {busiest} | {rows} | {layers} | {x['loss_last_10']:.4f} |")
        on = got.get("moe-kernels-on")
        for label, mine, other in [("dense, CUDA graphs on / off", "dense", "dense-eager"),
                                   ("MoE, CUDA graphs on / off", "moe-kernels-on", "moe-eager"),
                                   ("kernels on / off", "moe-kernels-on", "moe-kernels-off"),
                                   ("padded / exact sizes", "moe-kernels-on", "moe-exact"),
                                   ("this tree / baseline", "moe-kernels-on", "moe-baseline")]:
            if mine in got and other in got:
                ratios.append(f"- round {r + 1}, {label}: "
                              f"{got[mine]['tokens_per_s'] / got[other]['tokens_per_s']:.3f} (tokens/s)")
        for kind in got:
            profiles = [p for p in got[kind].get("profiles", []) if "exposed_alltoall_share" in p]
            if len(profiles) > 1:
                ratios.append(f"- round {r + 1}, {kind}, by profiled step: "
                              + "; ".join(f"step {p['step']}: exposed {p['exposed_alltoall_share']:.1%}, on the busiest "
                                          f"worker {p['exposed_alltoall_share_busiest']:.1%}, busier worker's rows "
                                          f"{largest_share([p], 'busier_rows')}, layers' busier rows "
                                          f"{largest_share([p], 'layers_busier_rows')}" for p in profiles))
            if on and kind not in KINDS and kind != "moe-baseline":
                ratios.append(f"- round {r + 1}, {kind} / kernels on: "
                              f"{got[kind]['tokens_per_s'] / on['tokens_per_s']:.3f} (tokens/s)")
                if got[kind].get("losses") and on.get("losses"):
                    worst = max(abs(a - b) / abs(b) for a, b in zip(got[kind]["losses"], on["losses"]))
                    ratios.append(f"- round {r + 1}, {kind}: losses within {worst:.1e} (relative) of kernels on's")
            first = (got[kind].get("profiles") or [{}])[0]
            replays = [w["graphs"] for w in first.get("workers", []) if w.get("graphs", {}).get("replays")]
            if replays:
                ratios.append(f"- round {r + 1}, {kind}: in step {first['step']}, graph replays ran two at once for "
                              + ", ".join(f"{g['concurrent_ms']:.0f} of {g['replay_ms']:.0f} ms" for g in replays)
                              + " (per worker)")
            for m in got[kind].get("expert_moves", []):
                ratios.append(f"- round {r + 1}, {kind}: {m['experts_moved']} experts moved before step {m['step']}, "
                              f"busiest workers {m['busiest_before']:.3f}x -> {m['busiest_after']:.3f}x an even share "
                              f"of the rows; move {m['total_s']:.2f} s (rebuild {m['rebuild_s']:.2f}, load "
                              f"{m['load_s']:.2f}), step after it {got[kind]['steps_ms'][m['step']]} ms")
    return "\n".join(lines + [""] + ratios) + "\n"


if __name__ == "__main__":
    main()
