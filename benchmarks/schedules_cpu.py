"""Schedules on CPU: measured step time of one 2-pipeline, 4-stage plan under 1F1B and zb-h1, paced.

Eight local ranks (gloo) train the tiny model on an emulated cluster of 4 "fast" and 4 "slow" devices
(4x slower): pipeline 0 runs fast, fast, slow, slow stages with 3, 3, 1, 1 layers, pipeline 1 the mirror
image, 6 micro-batches of 2 each. Every forward, backward, input-gradient (B) and weight-gradient (W) pass
lasts its time in the emulated cost model (this CPU's per-layer profile x time_scale / speed; W: the
weight GEMMs' share of the backward, ``CostModel.weight_grad_s``), so what is measured is the schedule,
the communication and the runtime's overheads, which the simulator predicts from the same numbers. Both
schedules run in one invocation, interleaved, ``--repeats`` times. Results:
docs/benchmarks/schedules_cpu.{md,json}.

    .venv/bin/python benchmarks/schedules_cpu.py [--steps 8] [--repeats 2]
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
from ethpipe.cli.demo_cmd import MODEL, PROFILE_SIZES, SEQ_LEN
from ethpipe.cluster import cluster_from_dict
from ethpipe.model_spec import load_model_spec
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.runtime.data import builtin_text, prepare_tokens
from ethpipe.runtime.emulate import with_emulation
from ethpipe.runtime.launch import run_local
from ethpipe.runtime.train import TrainConfig
from ethpipe.sim import simulate

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
SCHEDULES = ("1f1b", "zb-h1")
WARMUP_STEPS = 2
CLUSTER = {"nodes": [
    {"gpu": {"id": "fast", "memory_gib": 0.05, "peak_tflops": 4.0, "intra_node_gbps": 2.0}, "num_nodes": 1,
     "gpus_per_node": 4, "nic_gbit_s": 16},
    {"gpu": {"id": "slow", "memory_gib": 0.05, "peak_tflops": 1.0, "intra_node_gbps": 2.0}, "num_nodes": 1,
     "gpus_per_node": 4, "nic_gbit_s": 16}],
    "intra_node_latency_us": 200, "inter_node_latency_us": 200}
LAYERS = ((0, 3), (3, 6), (6, 7), (7, 8))
MIRROR = ((0, 1), (1, 2), (2, 5), (5, 8))


def base_plan() -> Plan:
    """Ranks 0-3 fast, 4-7 slow; pipeline 0: fast, fast, slow, slow; pipeline 1: slow, slow, fast, fast."""
    spec = load_model_spec(MODEL)
    assert spec.num_layers == 8
    p0 = tuple(Stage((r,), d, lay) for r, d, lay in zip((0, 1, 4, 5), ("fast", "fast", "slow", "slow"), LAYERS))
    p1 = tuple(Stage((r,), d, lay) for r, d, lay in zip((6, 7, 2, 3), ("slow", "slow", "fast", "fast"), MIRROR))
    pipes = (Pipeline(p0, (2,) * 6), Pipeline(p1, (2,) * 6))
    return Plan("custom", MODEL, 24, SEQ_LEN, pipes, compute_blocks(pipes), spec, cluster=CLUSTER,
                extra={"device_speeds": {"fast": 1.0, "slow": 0.25}})


def build() -> tuple[dict[str, Plan], dict[str, float], float, str]:
    spec, cluster = load_model_spec(MODEL), cluster_from_dict(CLUSTER)
    speeds = demo.cluster_speeds(cluster, spec, SEQ_LEN)
    scale = demo.cluster_time_scale(cluster, speeds)
    profile = demo.measure_profile(spec, SEQ_LEN, PROFILE_SIZES, rounds=2, repeats=5)
    cost = demo.emulated_cost(cluster, spec, SEQ_LEN, demo.emulated_profiles(profile, speeds, scale))
    plans, simulated = {}, {}
    for schedule in SCHEDULES:
        plan = base_plan()
        plan = dataclasses.replace(plan, pipelines=tuple(dataclasses.replace(p, schedule=schedule)
                                                         for p in plan.pipelines))
        plans[schedule] = with_emulation(plan, scale, demo.pacing_targets(plan, cost))
        simulated[schedule] = simulate(plans[schedule], cost).iteration_time_s
    return plans, simulated, scale, profile.device_name


def run(steps: int, repeats: int) -> dict[str, Any]:
    plans, simulated, scale, device = build()
    runs: dict[str, list[float]] = {s: [] for s in SCHEDULES}
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "tokens.bin")
        prepare_tokens(builtin_text(2_000_000), data)
        for r in range(repeats):
            for schedule in (SCHEDULES if r % 2 == 0 else tuple(reversed(SCHEDULES))):
                config = TrainConfig(data=data, steps=steps, emulate=True, progress=False, timeout_s=180.0,
                                     device="cpu")
                records = run_local(plans[schedule], config)
                runs[schedule].append(demo.measured_step_s(records, warmup=WARMUP_STEPS))
    measured = {s: statistics.median(v) for s, v in runs.items()}
    return {
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python "
                   f"{platform.python_version()}, load average at start {os.getloadavg()[0]:.2f}",
        "profile_device": device, "time_scale": scale, "steps": steps, "repeats": repeats,
        "warmup_steps_left_out": WARMUP_STEPS,
        "plan": "pipeline 0: fast 0-3, fast 3-6, slow 6-7, slow 7-8; pipeline 1: slow 0-1, slow 1-2, fast 2-5, "
                "fast 5-8; 6 micro-batches of 2 each",
        "schedules": {s: {"measured_step_s": measured[s], "runs_s": runs[s], "simulated_s": simulated[s],
                          "measured_over_simulated": measured[s] / simulated[s]} for s in SCHEDULES},
        "zb_h1_speedup": {"measured": measured["1f1b"] / measured["zb-h1"],
                          "simulated": simulated["1f1b"] / simulated["zb-h1"]},
    }


def render(data: dict[str, Any]) -> str:
    lines = ["# Schedules on CPU (generated by `benchmarks/schedules_cpu.py`)", "",
             f"Machine: {data['machine']}. Profile: {data['profile_device']}; emulation time scale "
             f"{data['time_scale']:.2f}; {data['steps']} steps per run, the first {data['warmup_steps_left_out']} left "
             f"out of each run's median step; {data['repeats']} runs per schedule, interleaved.", "",
             f"Plan (8 ranks, tiny model, batch 24): {data['plan']}. Paced: every F, B, W lasts its emulated "
             "cost-model time, so the measured numbers test the schedule, communication and runtime overheads "
             "against the simulator, not the compute model.", "",
             "| schedule | measured step s | simulated s | measured / simulated |", "|---|---|---|---|"]
    for s, r in data["schedules"].items():
        lines.append(f"| {s} | {r['measured_step_s']:.3f} | {r['simulated_s']:.3f} | "
                     f"{r['measured_over_simulated']:.3f} |")
    sp = data["zb_h1_speedup"]
    lines += ["", f"zb-h1 over 1f1b: measured {sp['measured']:.3f}x, simulated {sp['simulated']:.3f}x.", "",
              "Reproduce: `.venv/bin/python benchmarks/schedules_cpu.py --steps "
              f"{data['steps']} --repeats {data['repeats']}`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    data = run(args.steps, args.repeats)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "schedules_cpu.json").write_text(json.dumps(data, indent=2) + "\n")
    (OUT / "schedules_cpu.md").write_text(render(data))
    print(render(data))


if __name__ == "__main__":
    main()
