"""Planner scaling benchmark: planning time of eth vs the exhaustive layer-balanced search, and
eth's predicted throughput vs an exhaustive search over eth's own space (small clusters).

    .venv/bin/python benchmarks/planner_scale.py [--budget-s 20] [--sizes 16,64,256,512,1024,4096]

Writes docs/benchmarks/planner_scale.md and .json. Times are wall-clock on this machine, the
median of three runs for eth (after one warm-up) and one run for the exhaustive searches.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from ethpipe.cluster import Cluster, cluster_from_dict
from ethpipe.cost.model import CostModel
from ethpipe.model_spec import load_model_spec
from ethpipe.planner import make_plan
from ethpipe.planner.exhaustive import exhaustive_eth

MODELS = {"gpt3-1.3b": 2048, "llama2-7b": 4096, "llama2-70b": 4096}
NIC_GBIT = {"h100_sxm": 3200, "a100_80gb_sxm": 1600, "a100_40gb_sxm": 1600, "v100_32gb_sxm2": 800}


def cluster_of(num_gpus: int) -> Cluster:
    """2 GPU types at 16 GPUs, 3 at 64, 4 from 256 on; 8 GPUs per node, equal shares of nodes."""
    if num_gpus <= 16:
        types = ["a100_80gb_sxm", "v100_32gb_sxm2"]
    elif num_gpus <= 64:
        types = ["h100_sxm", "a100_80gb_sxm", "v100_32gb_sxm2"]
    else:
        types = ["h100_sxm", "a100_80gb_sxm", "a100_40gb_sxm", "v100_32gb_sxm2"]
    nodes = num_gpus // 8
    counts = [nodes // len(types) + (1 if i < nodes % len(types) else 0) for i in range(len(types))]
    return cluster_from_dict({"nodes": [{"gpu": t, "num_nodes": c, "gpus_per_node": 8, "nic_gbit_s": NIC_GBIT[t]}
                                        for t, c in zip(types, counts) if c]})


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def run(sizes: list[int], budget_s: float) -> list[dict]:
    rows = []
    for n in sizes:
        cluster = cluster_of(n)
        for name, seq in MODELS.items():
            spec, batch = load_model_spec(name), max(256, n)
            row: dict = {"gpus": n, "gpu_types": len(cluster.gpu_types), "model": name, "global_batch": batch,
                         "seq_len": seq}
            try:
                make_plan(cluster, spec, batch, seq)  # warm-up
            except ValueError as err:
                row["error"] = str(err)
                rows.append(row)
                print(row, flush=True)
                continue
            runs = [_timed(lambda: make_plan(cluster, spec, batch, seq)) for _ in range(3)]
            eth = runs[0][1]
            row |= {"eth_planning_s": statistics.median(t for t, _ in runs),
                    "eth_iteration_s": eth.predicted["iteration_time_s"],
                    "eth_balance_efficiency": eth.predicted["balance_efficiency"]}
            t_lb, lb = _timed(lambda: make_plan(cluster, spec, batch, seq, "layer-balanced", time_budget_s=budget_s))
            row |= {"lb_planning_s": t_lb, "lb_timed_out": lb.extra["search"]["timed_out"],
                    "lb_iteration_s": lb.predicted["iteration_time_s"],
                    "lb_candidates": lb.extra["search"]["candidates_evaluated"]}
            if n <= 64:
                t_ex, ex = _timed(lambda: exhaustive_eth(CostModel(cluster, spec, seq), batch, time_budget_s=budget_s))
                row |= {"exh_planning_s": t_ex, "exh_timed_out": ex.timed_out, "exh_evaluated": ex.evaluated,
                        "exh_combinations": ex.combinations}
                if ex.plan is not None:
                    row["eth_vs_exhaustive"] = ex.plan.predicted["iteration_time_s"] / row["eth_iteration_s"]
            rows.append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def _fmt_s(value: float | None, timed_out: bool = False) -> str:
    if value is None:
        return "-"
    return f"timeout ({value:.0f} s)" if timed_out else f"{value:.3f}"


def write_report(rows: list[dict], budget_s: float, command: str, out_dir: Path) -> None:
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    lines = [
        "# Planner scaling", "",
        f"Command: `{command}`  ", f"Machine: {machine}  ",
        f"Exhaustive searches are capped at {budget_s:.0f} s; \"timeout\" means the cap was hit (the best plan found "
        "so far is what the iteration-time column shows).", "",
        "Clusters: 8 GPUs per node, equal node shares of 2 types (16 GPUs: A100-80G, V100-32G), 3 types (64: + H100) "
        "or 4 types (>= 256: H100, A100-80G, A100-40G, V100-32G); NICs 3200/1600/1600/800 Gbit/s per node. "
        "Global batch max(256, #GPUs); seq 2048 (gpt3-1.3b) or 4096 (llama2).", "",
        "| GPUs | types | model | eth plan s | eth iter s | eth bal. eff. | layer-bal. plan s | layer-bal. iter s "
        "| eth speedup | exh.(eth space) plan s | eth / exhaustive throughput |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['gpus']} | {r['gpu_types']} | {r['model']} | infeasible: {r['error']} |||||||")
            continue
        ratio = f"{r['eth_vs_exhaustive']:.3f}x" if "eth_vs_exhaustive" in r else "-"
        exh = _fmt_s(r.get("exh_planning_s"), r.get("exh_timed_out", False))
        lines.append(
            f"| {r['gpus']} | {r['gpu_types']} | {r['model']} | {r['eth_planning_s']:.3f} | {r['eth_iteration_s']:.3f} "
            f"| {r['eth_balance_efficiency']:.3f} | {_fmt_s(r['lb_planning_s'], r['lb_timed_out'])} "
            f"| {r['lb_iteration_s']:.3f} | {r['lb_iteration_s'] / r['eth_iteration_s']:.2f}x | {exh} | {ratio} |")
    lines += ["", "eth / exhaustive throughput = exhaustive plan's iteration time / eth's (>= 0.98 is the target; 1.0 "
              "means the heuristic found the best plan of its space)."]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "planner_scale.md").write_text("\n".join(lines) + "\n")
    (out_dir / "planner_scale.json").write_text(json.dumps(
        {"command": command, "machine": machine, "budget_s": budget_s, "rows": rows}, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=20.0)
    parser.add_argument("--sizes", default="16,64,256,512,1024,4096")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args()
    rows = run([int(s) for s in args.sizes.split(",")], args.budget_s)
    write_report(rows, args.budget_s, "python " + " ".join(sys.argv), args.out_dir)


if __name__ == "__main__":
    main()
