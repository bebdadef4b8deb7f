"""Fidelity: predicted (simulator and planner closed form) vs measured iteration time of real CPU runs.

Runs the runtime on this machine (6 gloo ranks, ``--emulate``) on the demo's emulated cluster
(2 fast + 4 slow devices, ``ethpipe/data/cpu_demo.yaml``; more memory per device for the larger
model) for the eth / uniform / layer-balanced plans of the tiny and the small model, in both
emulation modes (``ethpipe.runtime.adapt.emulate``). A profile of this CPU is measured first and mapped
onto the emulated device types as ``x time_scale / speed`` (``ethpipe.demo``); the planner, the
simulator and the closed form price the plans with it.

* ``paced``: every forward/backward sleeps to the cost model's own stage time, so the emulated
  compute *is* the predicted compute and the errors measure everything else: 1F1B dependencies and
  bubbles, p2p, gradient sync, optimizer and runtime overheads. It does not test the compute model.
* ``measured``: every forward/backward lasts its real CPU time x time_scale / speed, so the errors
  also measure how well the per-layer profile predicts the stages' real compute.

Each plan runs ``--repeats`` times per mode (interleaved, to spread load drift over all plans and
modes); measured = median over runs of the median step time. Writes docs/benchmarks/fidelity.{md,json}.

    .venv/bin/python benchmarks/fidelity.py [--steps 7] [--repeats 1] [--modes paced,measured] [--quick]
    .venv/bin/python benchmarks/fidelity.py --render-only   # fidelity.md from fidelity.json

About 8 minutes on 2 cores with both modes and one repeat; each further repeat adds about as much.
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
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Plan
from ethpipe.tokens.texts import builtin_text, prepare_tokens
from ethpipe.runtime.adapt.emulate import EMULATE_MODES, local_cores
from ethpipe.runtime.start.launch import run_local
from ethpipe.runtime.train import TrainConfig
from ethpipe.sim import simulate
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


def traced_actions(plan: Plan, trace_path: Path, warmup: int = demo.WARMUP_STEPS) -> dict[str, float]:
    """Forward/backward actions of a run's trace after its first ``warmup`` steps: their summed predicted
    (the cost model's stage compute, = the plan's paced targets) and traced seconds, and how many overran
    the prediction (by more than 2% and ``OVERRUN_SLACK_S``)."""
    targets = plan.extra["emulation"]["compute_s"]
    events = read_trace(trace_path).events
    ends: dict[int, list[float]] = {}
    for e in events:
        if e.name == "optimizer":
            ends.setdefault(e.tid, []).append(e.start_s + e.dur_s)
    out = {"predicted_s": 0.0, "traced_s": 0.0, "over": 0, "total": 0}
    for e in events:
        if e.name[:1] not in ("F", "B") or not e.name[1:].isdigit():
            continue
        done = sorted(ends.get(e.tid, []))
        if len(done) > warmup and warmup > 0 and e.start_s < done[warmup - 1]:
            continue
        pos = plan.position_of(e.tid)
        size = plan.pipelines[pos.pipeline].micro_batch_sizes[int(e.name[1:])]
        target = targets[str(e.tid)][str(size)][0 if e.name[0] == "F" else 1]
        out["predicted_s"] += target
        out["traced_s"] += e.dur_s
        out["total"] += 1
        out["over"] += e.dur_s > target * 1.02 + OVERRUN_SLACK_S
    return out


def critical_compute_share(plan: Plan, cost: Any) -> float:
    """Share of the simulated iteration that is forward/backward compute on its critical path: how much of
    the prediction paced emulation fixes to the cost model's own numbers."""
    report = simulate(plan, cost)
    return sum(e.dur_s for e in report.critical_path if e.kind == "compute") / report.iteration_time_s


def run_case(model_name: str, seq_len: int, batch: int, memory_gib: float, data: Path, steps: int, repeats: int,
             quick: bool, modes: tuple[str, ...]) -> list[dict[str, Any]]:
    spec, cluster = load_model_spec(model_name), case_cluster(memory_gib)
    speeds = demo.cluster_speeds(cluster, spec, seq_len)
    scale = demo.cluster_time_scale(cluster, speeds)
    profile = demo.measure_profile(spec, seq_len, (1, 2, 4), rounds=1 if quick else 3)
    profiles = demo.emulated_profiles(profile, speeds, scale)
    methods = demo.METHODS[:1] if quick else demo.METHODS
    plans = demo.make_plans(cluster, spec, batch, seq_len, profiles, scale, methods)
    cost = demo.emulated_cost(cluster, spec, seq_len, profiles)
    keys = [(mode, method) for mode in modes for method in plans]
    runs: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
    steps_s: dict[tuple[str, str], list[float]] = {k: [] for k in keys}
    actions = {k: {"predicted_s": 0.0, "traced_s": 0.0, "over": 0, "total": 0} for k in keys}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for mode, method in keys:
                trace = Path(tmp) / f"{mode}-{method}-{r}.json"
                config = TrainConfig(data=str(data), steps=steps, emulate=True, progress=False, device="cpu",
                                     trace=str(trace), emulate_mode=mode)  # type: ignore[arg-type]
                records = run_local(plans[method], config)
                runs[mode, method].append(demo.measured_step_s(records))
                steps_s[mode, method] += [float(x["iteration_time_s"]) for x in records[demo.WARMUP_STEPS:]]
                for k, v in traced_actions(plans[method], trace).items():
                    actions[mode, method][k] += v
                print(f"  {model_name} {mode} {method} run {r}: {runs[mode, method][-1] * 1e3:.1f} ms", flush=True)
    rows = []
    for mode, method in keys:
        plan, got, act = plans[method], runs[mode, method], actions[mode, method]
        pred = demo.predict(plan, cost)
        measured = statistics.median(got)
        rows.append({
            "model": model_name, "seq_len": seq_len, "batch": batch, "mode": mode, "method": method,
            "pipelines": len(plan.pipelines), "plan": demo.plan_shape(plan), "time_scale": scale,
            "simulated_s": pred.simulated_s, "estimate_s": pred.estimate_s, "measured_s": measured,
            "runs_s": got, "run_spread": (max(got) - min(got)) / measured,
            "step_spread": (max(steps_s[mode, method]) - min(steps_s[mode, method])) / measured,
            "error_sim": (pred.simulated_s - measured) / measured,
            "error_estimate": (pred.estimate_s - measured) / measured,
            "compute_error": act["predicted_s"] / act["traced_s"] - 1.0,
            "critical_path_compute_share": critical_compute_share(plan, cost),
            "overrun_fraction": act["over"] / max(1, act["total"]) if mode == "paced" else None,
            "profile_device": profile.device_name,
        })
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs_s"}), flush=True)
    return rows


def ranking(rows: list[dict[str, Any]], key: str) -> list[str]:
    return [r["method"] for r in sorted(rows, key=lambda r: r[key])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=1, help="runs per plan and mode")
    parser.add_argument("--modes", default=",".join(EMULATE_MODES), help="emulation modes, comma-separated")
    parser.add_argument("--quick", action="store_true", help="tiny, eth only, one run (smoke test; writes nothing)")
    parser.add_argument("--render-only", action="store_true", help="rewrite fidelity.md from fidelity.json (no runs)")
    args = parser.parse_args()
    if args.render_only:
        old = json.loads((OUT / "fidelity.json").read_text())
        _write(old["rows"], old["machine"], old["command"], old["repeats"])
        return
    modes = tuple(m.strip() for m in args.modes.split(","))
    if not modes or any(m not in EMULATE_MODES for m in modes):
        raise SystemExit(f"--modes must be a comma-separated subset of {','.join(EMULATE_MODES)}")
    load_before = os.getloadavg()
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens.bin"
        prepare_tokens(builtin_text(600_000), data)
        for case in CASES[:1] if args.quick else CASES:
            rows += run_case(*case, data, args.steps, 1 if args.quick else args.repeats, args.quick, modes)
    if args.quick:
        return
    machine = {"platform": platform.platform(), "cores": local_cores(), "python": platform.python_version(),
               "load_average_before": list(load_before), "load_average_after": list(os.getloadavg()),
               "wall_s": time.perf_counter() - started}
    _write(rows, machine, " ".join(["benchmarks/fidelity.py", *sys.argv[1:]]), args.repeats)


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


MODE_TEXT = {
    "paced": "Every forward/backward sleeps to its stage's time in the emulated cost model (`emulation.compute_s`, "
             "the simulator's own compute times), so the emulated compute *is* the predicted compute: these errors "
             "confirm the schedule (1F1B dependencies and bubbles), p2p, gradient sync, optimizer and runtime "
             "overheads (per-step metrics all-gather, data loading, process wake-ups), **not the compute model**.",
    "measured": "Every forward/backward runs for real and then sleeps until it has lasted its real CPU time "
                "(this thread's) x time_scale / speed, so a slower emulated device takes proportionally longer "
                "than its real compute; the prediction still comes from the per-layer profile of this CPU, so "
                "these errors also test the compute model (how per-layer times add up to a stage's, and how "
                "they hold with 6 ranks sharing the cores). The profile times each layer alone, warm, as the "
                "fastest of 3 runs at the start; a stage inside the run also pays cold caches after every other "
                "rank's action and whatever other jobs on the same cores cost it (a thread's CPU time is not "
                "load-invariant on a shared machine), and the profile sees neither.",
}


def mode_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    sim_err = [abs(r["error_sim"]) for r in rows]
    est_err = [abs(r["error_estimate"]) for r in rows]
    out: dict[str, Any] = {
        "median_abs_error_sim": statistics.median(sim_err), "worst_abs_error_sim": max(sim_err),
        "median_abs_error_estimate": statistics.median(est_err), "worst_abs_error_estimate": max(est_err),
        "median_compute_error": statistics.median(r["compute_error"] for r in rows),
        "critical_path_compute_share": [min(r["critical_path_compute_share"] for r in rows),
                                        max(r["critical_path_compute_share"] for r in rows)], "ranking": {}}
    for model in dict.fromkeys(r["model"] for r in rows):
        sub = [r for r in rows if r["model"] == model]
        by_sim, by_est, by_real = ranking(sub, "simulated_s"), ranking(sub, "estimate_s"), ranking(sub, "measured_s")
        out["ranking"][model] = {"simulated": by_sim, "closed_form": by_est, "measured": by_real,
                                 "equal": by_sim == by_real}
    return out


def _mode_lines(mode: str, rows: list[dict[str, Any]], summary: dict[str, Any]) -> list[str]:
    lines = [f"## {mode.capitalize()} emulation", "", MODE_TEXT[mode], "",
             "| model | method | plan (per pipeline: devices:layers samples/micro-batches) | simulated ms "
             "| closed form ms | measured ms | error (sim) | error (closed form) | F/B predicted vs traced "
             "| compute on critical path | step spread | overrun |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        over = "-" if r["overrun_fraction"] is None else f"{r['overrun_fraction'] * 100:.1f}%"
        lines.append(
            f"| {r['model']} | {r['method']} | {r['plan']} | {r['simulated_s'] * 1e3:.0f} "
            f"| {r['estimate_s'] * 1e3:.0f} | {r['measured_s'] * 1e3:.0f} | {_pct(r['error_sim'])} | {_pct(r['error_estimate'])} "
            f"| {_pct(r['compute_error'])} | {r['critical_path_compute_share'] * 100:.1f}% "
            f"| {r['step_spread'] * 100:.1f}% | {over} |")
    sim_ok = summary["median_abs_error_sim"] < 0.10 and summary["worst_abs_error_sim"] < 0.20
    lines += [
        "",
        f"Simulator: median |error| **{summary['median_abs_error_sim'] * 100:.1f}%**, worst "
        f"**{summary['worst_abs_error_sim'] * 100:.1f}%** (targets: < 10%, < 20%: "
        f"{'met' if sim_ok else '**not met**'}).  ",
        f"Closed form: median |error| {summary['median_abs_error_estimate'] * 100:.1f}%, worst "
        f"{summary['worst_abs_error_estimate'] * 100:.1f}%.  ",
        f"Forward/backward time, predicted vs traced (median over plans): {_pct(summary['median_compute_error'])}.",
        "",
    ]
    for model, rk in summary["ranking"].items():
        lines.append(f"Ranking ({model}), fastest first: simulated {' < '.join(rk['simulated'])}; closed form "
                     f"{' < '.join(rk['closed_form'])}; measured {' < '.join(rk['measured'])}: "
                     f"**{'equal' if rk['equal'] else 'DIFFERENT'}**.  ")
    return lines + [""]


def _write(rows: list[dict[str, Any]], machine: dict[str, Any], command: str, repeats: int) -> None:
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    summary = {mode: mode_summary([r for r in rows if r["mode"] == mode]) for mode in modes}
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
        "simulator and the closed form price each plan with that same profile in both modes. The same plans run",
        f"in each emulation mode (`--emulate-mode`, docs/runtime.md \"Emulation model\"), {repeats} run(s) per plan "
        "and mode, all interleaved.",
        "Measured = median over runs of each run's median step time (first step left out); error =",
        "(predicted - measured) / measured; \"F/B predicted vs traced\" = summed predicted stage compute of the",
        "run's forward/backward actions over their summed traced durations, minus one (first step left out; in",
        "paced mode only overruns move it); compute on critical path = share of the simulated iteration that is",
        "forward/backward compute on its critical path (the part paced emulation sets to the prediction); step",
        "spread = (max - min) / median over all measured steps; overrun (paced only) = share of forward/backward",
        "actions whose real compute exceeded their target.",
        "",
    ]
    for mode in modes:
        lines += _mode_lines(mode, [r for r in rows if r["mode"] == mode], summary[mode])
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "fidelity.md").write_text("\n".join(lines))
    (OUT / "fidelity.json").write_text(json.dumps({"command": command, "machine": machine, "repeats": repeats,
                                                   "summary": summary, "rows": rows}, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
