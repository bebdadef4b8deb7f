"""Fidelity: predicted (simulator and planner estimate) vs measured iteration time of real CPU runs.

Runs the runtime on this machine (6 gloo ranks, ``--emulate``: ranks of the slow device type
sleep to run at its relative speed) for eth / uniform / layer-balanced plans of two models,
priced by a profile measured here first. Writes docs/benchmarks/fidelity.md and .json.

    .venv/bin/python benchmarks/fidelity.py [--steps 6] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ethpipe.cluster import cluster_from_dict
from ethpipe.cost.profile import LayerTiming, MeasuredProfile
from ethpipe.model_spec import load_model_spec
from ethpipe.planner import CostModel, estimate_iteration_s, make_plan
from ethpipe.profiler import ProfileSettings, profile_model
from ethpipe.runtime.data import builtin_text, prepare_tokens
from ethpipe.runtime.launch import run_local
from ethpipe.runtime.train import TrainConfig
from ethpipe.sim import simulate

SLOW_FACTOR = 2.0  # the emulated slow device type runs at half the measured speed
# Localhost gloo links, as a cluster spec sees them (per-direction GB/s, latency).
CLUSTER = {
    "nodes": [
        {"gpu": {"id": "cpu_fast", "memory_gib": 8, "peak_tflops": 2.0, "intra_node_gbps": 2.0},
         "num_nodes": 1, "gpus_per_node": 3, "nic_gbit_s": 16},
        {"gpu": {"id": "cpu_slow", "memory_gib": 8, "peak_tflops": 1.0, "intra_node_gbps": 2.0},
         "num_nodes": 1, "gpus_per_node": 3, "nic_gbit_s": 16},
    ],
    "inter_node_latency_us": 100.0,
    "intra_node_latency_us": 50.0,
}
CASES = [("tiny", 128, 24), ("small", 128, 24)]  # (model, seq_len, global batch)
METHODS = ("eth", "uniform", "layer-balanced")


def _scaled(profile: MeasuredProfile, factor: float) -> MeasuredProfile:
    layers = {k: {b: LayerTiming(t.fwd_s * factor, t.bwd_s * factor) for b, t in pts.items()}
              for k, pts in profile.layers.items()}
    return dataclasses.replace(profile, layers=layers, optimizer_s_per_param=profile.optimizer_s_per_param * factor)


def _measure(plan: object, data: Path, steps: int) -> float:
    records = run_local(plan, TrainConfig(data=str(data), steps=steps, emulate=True, progress=False))  # type: ignore[arg-type]
    return statistics.median(r["iteration_time_s"] for r in records[1:])  # step 0 warms up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="first case and method only (smoke test)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "tokens.bin"
        prepare_tokens(builtin_text(2_000_000), data)
        for model_name, seq_len, batch in CASES[:1] if args.quick else CASES:
            spec = load_model_spec(model_name)
            measured_profile = profile_model(spec, ProfileSettings(seq_len, (1, 2, 4), repeats=5, warmup=2))
            profiles = {"cpu_fast": measured_profile, "cpu_slow": _scaled(measured_profile, SLOW_FACTOR)}
            cluster = cluster_from_dict(CLUSTER)
            for method in METHODS[:1] if args.quick else METHODS:
                plan = make_plan(cluster, spec, batch, seq_len, method, profiles=profiles, max_tp=1)
                cost = CostModel.for_plan(plan, profiles=profiles)
                predicted = simulate(plan, cost).iteration_time_s
                estimate = estimate_iteration_s(plan, cost)
                start = time.perf_counter()
                measured = _measure(plan, data, args.steps)
                rows.append({
                    "model": model_name, "seq_len": seq_len, "batch": batch, "method": method,
                    "pipelines": [[len(p.stages), list(p.micro_batch_sizes)] for p in plan.pipelines],
                    "simulated_s": predicted, "estimate_s": estimate, "measured_s": measured,
                    "error": (predicted - measured) / measured, "run_s": time.perf_counter() - start,
                })
                print(json.dumps(rows[-1]), flush=True)
    _write(rows, " ".join(sys.argv))


def _write(rows: list[dict], command: str) -> None:
    errors = [abs(r["error"]) for r in rows]
    lines = [
        "# Fidelity: simulated vs measured iteration time",
        "",
        f"Command: `.venv/bin/python {command}`  ",
        f"Machine: {platform.processor() or platform.machine()}, {platform.system()}, python {platform.python_version()}",
        "",
        "| model | method | pipelines (depth, micro-batches) | simulated ms | estimate ms | measured ms | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['method']} | {r['pipelines']} | {r['simulated_s'] * 1e3:.1f} | "
                     f"{r['estimate_s'] * 1e3:.1f} | {r['measured_s'] * 1e3:.1f} | {r['error'] * 100:+.1f}% |")
    lines += ["", f"Median |error| {statistics.median(errors) * 100:.1f}%, worst {max(errors) * 100:.1f}%."]
    for model in dict.fromkeys(r["model"] for r in rows):
        sub = [r for r in rows if r["model"] == model]
        by_sim = [r["method"] for r in sorted(sub, key=lambda r: r["simulated_s"])]
        by_real = [r["method"] for r in sorted(sub, key=lambda r: r["measured_s"])]
        lines.append(f"{model}: ranking simulated {by_sim}, measured {by_real}: {'same' if by_sim == by_real else 'DIFFERENT'}.")
    out = Path("docs/benchmarks")
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.md").write_text("\n".join(lines) + "\n")
    (out / "fidelity.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
