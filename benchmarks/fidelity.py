"""Fidelity: predicted (simulator and planner closed form) vs measured iteration time of real CPU runs.

Runs the runtime on this machine (6 gloo ranks, ``--emulate``) on the demo's emulated cluster
(2 fast + 4 slow devices, ``ethpipe/data/cpu_demo.yaml``; more memory per device for the larger
model) for the eth / uniform / layer-balanced plans of the tiny and the small model. A profile
of this CPU is measured first and mapped onto the emulated device types exactly as the
emulation paces them (``ethpipe.demo``), so the emulated compute is the predicted compute and the
errors measure everything else: 1F1B dependencies and bubbles, p2p, gradient sync, optimizer and
runtime overheads. Each plan runs ``--repeats`` times (interleaved, to spread load drift over all
plans); measured = median over runs of the median step time. Writes docs/benchmarks/fidelity.{md,json}.

    .venv/bin/python benchmarks/fidelity.py [--steps 8] [--repeats 2] [--quick]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from ethpipe import demo
from ethpipe.cluster import cluster_from_dict
from ethpipe.model_spec import load_model_spec
from ethpipe.plan import Plan
from ethpipe.runtime.data import builtin_text, prepare_tokens
from ethpipe.runtime.emulate import local_cores
from ethpipe.runtime.launch import run_local
from ethpipe.runtime.train import TrainConfig
from ethpipe.sim.trace import read_trace

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
# (model, seq_len, global batch, memory per emulated device in GiB)
CASES = [("tiny", 128, 24, 0.02), ("small", 128, 24, 0.1)]
OVERRUN_SLACK_S = 0.5e-3  # an action longer than its target by more than this (and 2%) overran


def case_cluster(memory_gib: float) -> Any:
    data = yaml.safe_load(demo.demo_cluster_path().read_text())
    data = copy.deepcopy(data)
    for group in data["nodes"]:
        group["gpu"]["memory_gib"] = memory_gib
    return cluster_from_dict(data)


def overruns(plan: Plan, trace_path: Path) -> tuple[int, int]:
    """(overrunning, all) paced forward/backward actions of a run's trace."""
    targets = plan.extra["emulation"]["compute_s"]
    over = total = 0
    for e in read_trace(trace_path).events:
        if e.name[:1] not in ("F", "B") or not e.name[1:].isdigit():
            continue
        pos = plan.position_of(e.tid)
        size = plan.pipelines[pos.pipeline].micro_batch_sizes[int(e.name[1:])]
        target = targets[str(e.tid)][str(size)][0 if e.name[0] == "F" else 1]
        total += 1
        over += e.dur_s > target * 1.02 + OVERRUN_SLACK_S
    return over, total


def run_case(model_name: str, seq_len: int, batch: int, memory_gib: float, data: Path, steps: int, repeats: int,
             quick: bool) -> list[dict[str, Any]]:
    spec, cluster = load_model_spec(model_name), case_cluster(memory_gib)
    speeds = demo.cluster_speeds(cluster, spec, seq_len)
    scale = demo.cluster_time_scale(cluster, speeds)
    profile = demo.measure_profile(spec, seq_len, (1, 2, 4), rounds=1 if quick else 3)
    profiles = demo.emulated_profiles(profile, speeds, scale)
    methods = demo.METHODS[:1] if quick else demo.METHODS
    plans = demo.make_plans(cluster, spec, batch, seq_len, profiles, scale, methods)
    cost = demo.emulated_cost(cluster, spec, seq_len, profiles)
    runs: dict[str, list[float]] = {m: [] for m in plans}
    over: dict[str, list[int]] = {m: [0, 0] for m in plans}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for method, plan in plans.items():
                trace = Path(tmp) / f"{method}-{r}.json"
                config = TrainConfig(data=str(data), steps=steps, emulate=True, progress=False, device="cpu",
                                     trace=str(trace))
                runs[method].append(demo.measured_step_s(run_local(plan, config)))
                o, t = overruns(plan, trace)
                over[method][0] += o
                over[method][1] += t
                print(f"  {model_name} {method} run {r}: {runs[method][-1] * 1e3:.1f} ms", flush=True)
    rows = []
    for method, plan in plans.items():
        pred = demo.predict(plan, cost)
        measured = statistics.median(runs[method])
        rows.append({
            "model": model_name, "seq_len": seq_len, "batch": batch, "method": method,
            "pipelines": len(plan.pipelines), "plan": demo.plan_shape(plan), "time_scale": scale,
            "simulated_s": pred.simulated_s, "estimate_s": pred.estimate_s, "measured_s": measured,
            "runs_s": runs[method], "run_spread": (max(runs[method]) - min(runs[method])) / measured,
            "error_sim": (pred.simulated_s - measured) / measured,
            "error_estimate": (pred.estimate_s - measured) / measured,
            "overrun_fraction": over[method][0] / max(1, over[method][1]),
            "profile_device": profile.device_name,
        })
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs_s"}), flush=True)
    return rows


def ranking(rows: list[dict[str, Any]], key: str) -> list[str]:
    return [r["method"] for r in sorted(rows, key=lambda r: r[key])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny, eth only, one run (smoke test; writes nothing)")
    args = parser.parse_args()
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens.bin"
        prepare_tokens(builtin_text(600_000), data)
        for case in CASES[:1] if args.quick else CASES:
            rows += run_case(*case, data, args.steps, 1 if args.quick else args.repeats, args.quick)
    if args.quick:
        return
    machine = {"platform": platform.platform(), "cores": local_cores(), "python": platform.python_version(),
               "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
               "wall_s": time.perf_counter() - started}
    _write(rows, machine, " ".join(["benchmarks/fidelity.py", *sys.argv[1:]]))


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _write(rows: list[dict[str, Any]], machine: dict[str, Any], command: str) -> None:
    sim_err = [abs(r["error_sim"]) for r in rows]
    est_err = [abs(r["error_estimate"]) for r in rows]
    lines = [
        "# Fidelity: predicted vs measured iteration time (CPU, 6 emulated devices)",
        "",
        f"Command: `.venv/bin/python {command}`  ",
        f"Machine: {machine['platform']}, {machine['cores']} cores, python {machine['python']}; load average "
        f"{machine['load_average_before'][0]:.1f} before, {machine['load_average_after'][0]:.1f} after "
        f"(the machine was shared with other jobs); {machine['wall_s']:.0f} s in all.",
        "",
        "Cluster: `ethpipe/data/cpu_demo.yaml` (2 fast + 4 slow at 1/4 speed, 20 MiB each; 100 MiB each for",
        "`small`). Plans from `make_plan(..., max_tp=1)` priced with a profile of this CPU taken at the start",
        "(fastest of 3 `ethpipe profile` runs), mapped onto the device types as `x time_scale / speed`; the",
        "runs pace every forward/backward to those same stage times (`emulation.compute_s` in each plan), so",
        "errors come from what is *not* emulated: schedule dependencies, p2p, gradient sync, optimizer and",
        "runtime overheads (per-step metrics all-gather, data loading, process wake-ups).",
        "Measured = median over runs of each run's median step time (first step left out); error =",
        "(predicted - measured) / measured; spread = (max - min) / median over runs; overrun = share of",
        "forward/backward actions whose real compute exceeded their target.",
        "",
        "| model | method | plan (per pipeline: devices:layers samples/micro-batches) | simulated ms | closed form ms "
        "| measured ms | error (sim) | error (closed form) | run spread | overrun |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['method']} | {r['plan']} | {r['simulated_s'] * 1e3:.0f} | {r['estimate_s'] * 1e3:.0f} "
            f"| {r['measured_s'] * 1e3:.0f} | {_pct(r['error_sim'])} | {_pct(r['error_estimate'])} "
            f"| {r['run_spread'] * 100:.1f}% | {r['overrun_fraction'] * 100:.1f}% |")
    lines += [
        "",
        f"Simulator: median |error| **{statistics.median(sim_err) * 100:.1f}%**, worst **{max(sim_err) * 100:.1f}%** "
        "(targets: < 10%, < 20%).  ",
        f"Closed form: median |error| {statistics.median(est_err) * 100:.1f}%, worst {max(est_err) * 100:.1f}%.",
        "",
    ]
    summary = {"median_abs_error_sim": statistics.median(sim_err), "worst_abs_error_sim": max(sim_err),
               "median_abs_error_estimate": statistics.median(est_err), "worst_abs_error_estimate": max(est_err),
               "ranking": {}}
    for model in dict.fromkeys(r["model"] for r in rows):
        sub = [r for r in rows if r["model"] == model]
        by_sim, by_est, by_real = ranking(sub, "simulated_s"), ranking(sub, "estimate_s"), ranking(sub, "measured_s")
        same = by_sim == by_real
        summary["ranking"][model] = {"simulated": by_sim, "closed_form": by_est, "measured": by_real, "equal": same}
        lines.append(f"Ranking ({model}), fastest first: simulated {' < '.join(by_sim)}; closed form "
                     f"{' < '.join(by_est)}; measured {' < '.join(by_real)}: **{'equal' if same else 'DIFFERENT'}**.  ")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fidelity.md").write_text("\n".join(lines) + "\n")
    (OUT / "fidelity.json").write_text(json.dumps({"command": command, "machine": machine, "summary": summary,
                                                   "rows": rows}, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
