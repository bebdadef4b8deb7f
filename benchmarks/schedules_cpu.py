"""Schedules on CPU: measured step time of one 2-pipeline, 4-stage plan under 1F1B, zb-h1 and interleaved, paced.

Eight local ranks (gloo) train the tiny model's layers, 16 of them, on an emulated cluster of 4 "fast" and
4 "slow" devices (4x slower): pipeline 0 runs fast, fast, slow, slow stages with 6, 6, 2, 2 layers,
pipeline 1 the mirror image, 8 micro-batches of 2 each; interleaved, each stage's layers are 2 chunks
(the planner's ``interleaved_of``: 3 + 3 and 1 + 1). Every forward, backward, input-gradient (B) and
weight-gradient (W) pass lasts its time in the emulated cost model (this CPU's per-layer profile x
time_scale / speed; W: the weight GEMMs' share of the backward, ``CostModel.weight_grad_s``; a chunk:
its own layers), so what is measured is the schedule, the communication and the runtime's overheads,
which the simulator predicts from the same numbers. All schedules run in one invocation, in rotating
order, ``--repeats`` times. Results: docs/benchmarks/schedules_cpu.{md,json}.

    .venv/bin/python benchmarks/schedules_cpu.py [--steps 8] [--repeats 3]
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
from ethpipe.model_spec import ModelSpec
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.planner.layers.interleave import interleaved_of
from ethpipe.tokens.texts import builtin_text, prepare_tokens
from ethpipe.runtime.adapt.emulate import with_emulation
from ethpipe.runtime.start.launch import run_local
from ethpipe.runtime.train import TrainConfig
from ethpipe.sim import simulate

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
SCHEDULES = ("1f1b", "zb-h1", "interleaved")
WARMUP_STEPS = 2
CLUSTER = {"nodes": [
    {"gpu": {"id": "fast", "memory_gib": 0.05, "peak_tflops": 4.0, "intra_node_gbps": 2.0}, "num_nodes": 1,
     "gpus_per_node": 4, "nic_gbit_s": 16},
    {"gpu": {"id": "slow", "memory_gib": 0.05, "peak_tflops": 1.0, "intra_node_gbps": 2.0}, "num_nodes": 1,
     "gpus_per_node": 4, "nic_gbit_s": 16}],
    "intra_node_latency_us": 200, "inter_node_latency_us": 200}
LAYERS = ((0, 6), (6, 12), (12, 14), (14, 16))
MIRROR = ((0, 2), (2, 4), (4, 10), (10, 16))
NUM_MICROBATCHES = 8


def model() -> ModelSpec:
    return dataclasses.replace(load_model_spec(MODEL), name=f"{MODEL}-16", num_layers=16)


def base_plan(schedule: str) -> Plan:
    """Ranks 0-3 fast, 4-7 slow; pipeline 0: fast, fast, slow, slow; pipeline 1: slow, slow, fast, fast."""
    spec = model()
    p0 = tuple(Stage((r,), d, lay) for r, d, lay in zip((0, 1, 4, 5), ("fast", "fast", "slow", "slow"), LAYERS))
    p1 = tuple(Stage((r,), d, lay) for r, d, lay in zip((6, 7, 2, 3), ("slow", "slow", "fast", "fast"), MIRROR))
    flat = (Pipeline(p0, (2,) * NUM_MICROBATCHES, schedule), Pipeline(p1, (2,) * NUM_MICROBATCHES, schedule))
    pipes = tuple(interleaved_of(p) for p in flat) if schedule == "interleaved" else flat
    assert all(p is not None for p in pipes)
    return Plan("custom", spec.name, 4 * NUM_MICROBATCHES, SEQ_LEN, pipes, compute_blocks(pipes), spec,  # type: ignore[arg-type]
                cluster=CLUSTER, extra={"device_speeds": {"fast": 1.0, "slow": 0.25}})


def build() -> tuple[dict[str, Plan], dict[str, float], float, str]:
    spec, cluster = model(), cluster_from_dict(CLUSTER)
    speeds = demo.cluster_speeds(cluster, spec, SEQ_LEN)
    scale = demo.cluster_time_scale(cluster, speeds)
    profile = demo.measure_profile(spec, SEQ_LEN, PROFILE_SIZES, rounds=2, repeats=5)
    cost = demo.emulated_cost(cluster, spec, SEQ_LEN, demo.emulated_profiles(profile, speeds, scale))
    plans, simulated = {}, {}
    for schedule in SCHEDULES:
        plan = base_plan(schedule)
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
            for schedule in SCHEDULES[r % 3:] + SCHEDULES[:r % 3]:
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
        "plan": "16 layers; pipeline 0: fast 0-6, fast 6-12, slow 12-14, slow 14-16; pipeline 1: slow 0-2, "
                "slow 2-4, fast 4-10, fast 10-16; 8 micro-batches of 2 each; interleaved: each stage's layers in 2 "
                "chunks (pipeline 0: [0-3, 8-11], [3-6, 11-14], [6-7, 14-15], [7-8, 15-16])",
        "schedules": {s: {"measured_step_s": measured[s], "runs_s": runs[s], "simulated_s": simulated[s],
                          "measured_over_simulated": measured[s] / simulated[s]} for s in SCHEDULES},
        "speedup_over_1f1b": {s: {"measured": measured["1f1b"] / measured[s],
                                  "simulated": simulated["1f1b"] / simulated[s]} for s in SCHEDULES[1:]},
    }


def render(data: dict[str, Any]) -> str:
    lines = ["# Schedules on CPU (generated by `benchmarks/schedules_cpu.py`)", "",
             f"Machine: {data['machine']}. Profile: {data['profile_device']}; emulation time scale "
             f"{data['time_scale']:.2f}; {data['steps']} steps per run, the first {data['warmup_steps_left_out']} left "
             f"out of each run's median step; {data['repeats']} runs per schedule, in rotating order.", "",
             f"Plan (8 ranks, the tiny model's layers, batch 32): {data['plan']}. Paced: every F, B, W lasts its emulated "
             "cost-model time, so the measured numbers test the schedule, communication and runtime overheads "
             "against the simulator, not the compute model.", "",
             "| schedule | measured step s | simulated s | measured / simulated |", "|---|---|---|---|"]
    for s, r in data["schedules"].items():
        lines.append(f"| {s} | {r['measured_step_s']:.3f} | {r['simulated_s']:.3f} | "
                     f"{r['measured_over_simulated']:.3f} |")
    lines.append("")
    for s, sp in data["speedup_over_1f1b"].items():
        lines.append(f"{s} over 1f1b: measured {sp['measured']:.3f}x, simulated {sp['simulated']:.3f}x.")
    lines += ["",
              "Reproduce: `.venv/bin/python benchmarks/schedules_cpu.py --steps "
              f"{data['steps']} --repeats {data['repeats']}`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data = run(args.steps, args.repeats)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "schedules_cpu.json").write_text(json.dumps(data, indent=2) + "\n")
    (OUT / "schedules_cpu.md").write_text(render(data))
    print(render(data))


if __name__ == "__main__":
    main()
