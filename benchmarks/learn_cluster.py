"""A planner that learns the devices from the run: `ethpipe train --replan-after N` against a device type that is
truly 2x slower than the plan believed (CPU, emulated, paced).

The demo cluster (2 "fast" + 4 "slow" emulated devices, tiny model, the demo's batch) is emulated from this CPU's
profile at the speeds the catalog gives (fast = 4x slow). Every run paces each forward/backward to the stage's
time under those believed profiles, and ``--emulate-slowdown`` makes every "fast" rank 2x slower from step 0:
the truth the plan does not know. Four runs, in one process, on the same emulated devices:

* ``believed``: the plan made for the believed speeds, as is;
* ``rebalance``: the same plan with online data rebalancing (``--rebalance every=2``);
* ``replan``: the same plan with ``--replan-after 5``: fit, re-plan, switch through a checkpoint;
* ``truth``: the plan made knowing the truth (the fast type's profile at half its believed speed).

Reported: the fitted relative speed of the fast type against the emulated truth, and each run's median step time
after its warm-up (the replan run: after the switch). Results: docs/benchmarks/learn_cluster.{md,json}.

    .venv/bin/python benchmarks/learn_cluster.py [--steps 16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch.optim  # noqa: F401  (imported before the workers fork)

from ethpipe import demo
from ethpipe.cli.demo_cmd import GLOBAL_BATCH, MODEL, PROFILE_SIZES, SEQ_LEN
from ethpipe.cli.learn import RunReplanner
from ethpipe.model_load import load_model_spec
from ethpipe.planner import make_plan
from ethpipe.tokens.texts import builtin_text, prepare_tokens
from ethpipe.runtime.adapt.emulate import Slowdown, with_emulation
from ethpipe.runtime.start.launch import run_local
from ethpipe.runtime.adapt.rebalance import parse_rebalance
from ethpipe.runtime.train import TrainConfig

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
FACTOR = 2.0  # how much slower than believed the over-estimated type truly is
SCENARIOS = ("fast", "slow")  # which type it is: each scenario is its own four runs
REPLAN_AFTER = 5
WARMUP_STEPS = 2


def _median_step_s(records: list[dict[str, Any]], first_step: int) -> float:
    return statistics.median(r["iteration_time_s"] for r in records if r["step"] >= first_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    spec = load_model_spec(MODEL)
    cluster = demo.demo_cluster()
    speeds = demo.cluster_speeds(cluster, spec, SEQ_LEN)
    time_scale = demo.cluster_time_scale(cluster, speeds)
    profile = demo.measure_profile(spec, SEQ_LEN, PROFILE_SIZES)
    scenarios = {t: scenario(t, args.steps, spec, cluster, speeds, time_scale, profile) for t in SCENARIOS}
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
               "command": f".venv/bin/python benchmarks/learn_cluster.py --steps {args.steps}",
               "believed_speeds": speeds, "scenarios": scenarios}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "learn_cluster.json").write_text(json.dumps(results, indent=2) + "\n")
    (OUT / "learn_cluster.md").write_text(report(results))
    print(report(results))


def scenario(slow_type: str, steps: int, spec: Any, cluster: Any, speeds: dict[str, float], time_scale: float,
             profile: Any) -> dict[str, Any]:
    """Four runs where ``slow_type`` is truly FACTOR x slower than the plan believes."""
    believed = demo.emulated_profiles(profile, speeds, time_scale)
    true_speeds = {t: s / FACTOR if t == slow_type else s for t, s in speeds.items()}
    truth = demo.emulated_profiles(profile, true_speeds, time_scale)

    def planned(profiles: dict) -> Any:
        plan = make_plan(cluster, spec, GLOBAL_BATCH, SEQ_LEN, "eth", max_tp=1, profiles=profiles, dtype="fp32")
        return with_emulation(plan, time_scale, profiles=believed)  # paced as the believed devices, slowed below

    plans = {"believed": planned(believed), "truth": planned(truth)}
    slowdowns = tuple(Slowdown(r, FACTOR, 0) for r, d in enumerate(cluster.devices) if d.gpu.id == slow_type)
    out: dict[str, Any] = {"slow_type": slow_type}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens.bin"
        prepare_tokens(builtin_text(2_000_000), data)
        base = TrainConfig(data=str(data), steps=steps, lr=1e-3, emulate=True, slowdowns=slowdowns,
                           progress=False, dtype="fp32")
        runs = {
            "believed": (plans["believed"], base, None),
            "rebalance": (plans["believed"], dataclasses.replace(base, rebalance=parse_rebalance("every=2")), None),
            "replan": (plans["believed"], dataclasses.replace(base, checkpoint_dir=os.path.join(tmp, "ck")),
                       RunReplanner(REPLAN_AFTER)),
            "truth": (plans["truth"], base, None),
        }
        for name, (plan, config, replanner) in runs.items():
            print(f"{slow_type} slower: run {name} ...", flush=True)
            records = run_local(plan, config, replanner=replanner)
            first = WARMUP_STEPS
            if name == "replan":
                switched = [r for r in records if r.get("replan")]
                decision = switched[0]["replan"] if switched else None
                first = REPLAN_AFTER + WARMUP_STEPS if decision and decision["switched"] else WARMUP_STEPS
                out["decision"] = decision
            if name == "rebalance":
                first = steps // 2  # after the re-splits settled
            out[name] = {"median_step_s": _median_step_s(records, first), "from_step": first,
                         "losses": [r["loss"] for r in records]}
    decision = out["decision"]
    out.update({"true_speeds": {t: s / max(true_speeds.values()) for t, s in true_speeds.items()},
                "fitted_speeds": decision["relative_speeds"] if decision else {},
                "plans": {k: plan_shape(p) for k, p in plans.items()}})
    return out


def plan_shape(plan: Any) -> str:
    return demo.plan_shape(plan)


def report(results: dict[str, Any]) -> str:
    head = f"""# Learning the cluster from the run (`--replan-after`)

Measured on {results['machine']} with `{results['command']}` (paced emulation, fp32, tiny model on the demo
cluster: 2 "fast" + 4 "slow" emulated devices, batch {GLOBAL_BATCH} x {SEQ_LEN}). The plans believed the
catalog's speeds (fast = 4x slow); in each scenario every rank of one type ran {FACTOR:g}x slower than that from
step 0 (`--emulate-slowdown`), the truth the plan does not know. Four runs per scenario on the same emulated
devices: the believed plan as is; with online data rebalancing (`--rebalance every=2`); with `--replan-after
{REPLAN_AFTER}`; and the plan made knowing the truth. Step times are medians after warm-up (rebalancing: the
second half, once its re-splits settled; the re-plan run: after its switch).
"""
    return head + "".join(_scenario_report(results["believed_speeds"], s) for s in results["scenarios"].values())


def _scenario_report(believed_speeds: dict[str, float], r: dict[str, Any]) -> str:
    d = r["decision"] or {}
    fitted, true = r["fitted_speeds"], r["true_speeds"]
    base = r["believed"]["median_step_s"]
    rows = "\n".join(f"| {name} | {r[name]['median_step_s']:.3f} | {base / r[name]['median_step_s']:.2f}x | "
                     f"{r[name]['from_step']} |" for name in ("believed", "rebalance", "replan", "truth"))
    speeds = "\n".join(f"| {t} | {believed_speeds[t]:.3f} | {true[t]:.3f} | {fitted.get(t, float('nan')):.3f} | "
                       f"{fitted.get(t, float('nan')) / true[t]:.3f} |" for t in sorted(true))
    return f"""
## "{r['slow_type']}" truly {FACTOR:g}x slower

Fit after {REPLAN_AFTER} steps (relative speeds, fastest = 1):

| device type | believed | emulated truth | fitted | fitted / truth |
|---|---|---|---|---|
{speeds}

Decision: {d.get('line', 'no decision recorded')}

| run | step s | speed-up vs believed | from step |
|---|---|---|---|
{rows}

Re-plan vs rebalancing alone: {r['rebalance']['median_step_s'] / r['replan']['median_step_s']:.2f}x; re-plan vs the
plan made knowing the truth: {100 * (r['replan']['median_step_s'] / r['truth']['median_step_s'] - 1):+.1f}% step time.
Plans: believed `{r['plans']['believed']}`; truth `{r['plans']['truth']}`; switched to `{d.get('new_shape', '-')}`.
"""


if __name__ == "__main__":
    main()
