"""Planning on clusters the planner was never tuned on: seeded random mixed clusters of 512-4096 GPUs.

    .venv/bin/python benchmarks/planner_random.py [--seed 0] [--clusters 20] [--out-dir docs/benchmarks]

Draws ``--clusters`` clusters (seeded): 512-4096 GPUs, 3-5 GPU types drawn from the catalog's NVIDIA GPUs, each
type on a random number of nodes of 4 or 8 GPUs with a random NIC (50-3200 Gbit/s per node). Plans five models at
two global batches each (one and four samples per GPU) with eth, and once more at one sample per GPU with the
gradient sync summed in bf16 (``--grad-reduce bf16``: the lever's ablation), and reports the worst and median
planning time (one run per case after a warm-up, wall clock, in this process) and balance efficiency with its
factors (``planner/efficiency.py``). A pure-Python reference loop is timed before and after, so the times can be
read against this machine's speed at the moment. Writes planner_random.json and planner_random.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from ethpipe.catalog import gpu_catalog
from ethpipe.cluster import Cluster, cluster_from_dict
from ethpipe.cost.hardware import has_hardware_model
from ethpipe.errors import UserError
from ethpipe.model_load import load_model_spec
from ethpipe.planner import make_plan
from ethpipe.planner.efficiency import FACTORS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from planner_scale import reference_loop_s  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODELS = {"gpt3-1.3b": 2048, "llama2-7b": 4096, "llama3-8b": 4096, "llama2-13b": 4096, "qwen2.5-14b": 4096}
SAMPLES_PER_GPU = (1, 4)  # a 4M-token batch is one 4096-token sample per GPU at 1024 GPUs, a quarter at 4096
BF16_SYNC = "1/GPU, bf16 sync"  # the ablation of `--grad-reduce bf16` (off by default): 1 sample per GPU again
SIZES = (512, 1024, 2048, 4096)
NICS_GBIT = (50, 100, 200, 400, 800, 1600, 3200)
TARGET_WORST_S, TARGET_MEDIAN_S, TARGET_EFFICIENCY = 1.0, 0.5, 0.6  # issue 45's bar


def cases_of(num_gpus: int) -> list[tuple[str, int, str]]:
    """(label, global batch, grad_reduce) of each case of one cluster and model."""
    return [(f"{n}/GPU", n * num_gpus, "fp32") for n in SAMPLES_PER_GPU] + [(BF16_SYNC, num_gpus, "bf16")]


def gpu_pool() -> list[str]:
    """The catalog's NVIDIA GPUs the cost model can price (an architecture and a memory bandwidth)."""
    return sorted(k for k, g in gpu_catalog().items() if g.vendor == "NVIDIA" and has_hardware_model(g))


def random_cluster(rng: random.Random, pool: list[str]) -> tuple[str, Cluster, list[dict]]:
    """One cluster: a size, 3-5 distinct types, each a random share of the nodes with its own NIC."""
    num_gpus = rng.choice(SIZES)
    types = rng.sample(pool, rng.randint(3, 5))
    per_node = {t: rng.choice((4, 8)) for t in types}
    per_node[types[-1]] = 4  # the last type takes what is left, a multiple of 4
    weights = [rng.uniform(0.2, 1.0) for _ in types]
    left, nodes = num_gpus, []
    for i, t in enumerate(types):
        last = i == len(types) - 1
        share = left if last else max(per_node[t], int(num_gpus * weights[i] / sum(weights)) // per_node[t] * per_node[t])
        share = min(share, left - sum(per_node[u] for u in types[i + 1:]))  # leave a node for each later type
        count = max(1, share // per_node[t])
        nodes.append({"gpu": t, "num_nodes": count, "gpus_per_node": per_node[t], "nic_gbit_s": rng.choice(NICS_GBIT)})
        left -= count * per_node[t]
    name = " + ".join(f"{n['num_nodes'] * n['gpus_per_node']}x{n['gpu']}" for n in nodes)
    return name, cluster_from_dict({"nodes": nodes}), nodes


def plan_case(cluster: Cluster, model: str, seq: int, batch: int, grad_reduce: str = "fp32") -> dict:
    spec = load_model_spec(model)
    start = time.perf_counter()
    try:
        plan = make_plan(cluster, spec, batch, seq, grad_reduce=grad_reduce)
    except UserError as err:
        return {"error": str(err), "planning_s": time.perf_counter() - start}
    planning_s = time.perf_counter() - start
    p = plan.predicted
    return {"planning_s": planning_s, "iteration_s": p["iteration_time_s"], "balance_efficiency": p["balance_efficiency"],
            "factors": {k: p["efficiency_factors"][k] for k in FACTORS if k in p["efficiency_factors"]},
            "num_pipelines": len(plan.pipelines), "idle_devices": len(plan.idle_devices),
            "shard_optimizer": plan.shard_optimizer, "sublayer_cuts": plan.extra["search"].get("sublayer_cuts")}


def run(seed: int, num_clusters: int, show: bool = True) -> dict:
    rng, pool = random.Random(seed), gpu_pool()
    clusters = [random_cluster(rng, pool) for _ in range(num_clusters)]
    plan_case(clusters[0][1], "gpt3-1.3b", 2048, clusters[0][1].num_devices)  # warm-up: imports, caches
    reference_before = reference_loop_s()
    rows = []
    for name, cluster, nodes in clusters:
        for model, seq in MODELS.items():
            for label, batch, reduce in cases_of(cluster.num_devices):
                row = {"cluster": name, "gpus": cluster.num_devices, "types": len(nodes), "nodes": nodes,
                       "model": model, "seq_len": seq, "batch": label, "global_batch": batch,
                       **plan_case(cluster, model, seq, batch, reduce)}
                rows.append(row)
                if show:
                    eff = f"eff {row['balance_efficiency']:.2f}" if "error" not in row else "no plan"
                    print(f"{name[:60]:60s} {model:12s} {label:9s} {row['planning_s']:.2f} s {eff}", flush=True)
    return {"seed": seed, "num_clusters": num_clusters, "machine": f"{platform.machine()}, {platform.python_version()}",
            "reference_loop_s": [reference_before, reference_loop_s()], "rows": rows}


def summary(data: dict) -> dict:
    rows = [r for r in data["rows"] if "error" not in r]
    times = [r["planning_s"] for r in data["rows"] if r["batch"] != BF16_SYNC]  # the default planner's cases
    out = {"num_cases": len(times), "num_planned": sum(1 for r in rows if r["batch"] != BF16_SYNC),
           "planning_s": {"median": statistics.median(times), "worst": max(times)}, "by_batch": {}}
    for label in [f"{n}/GPU" for n in SAMPLES_PER_GPU] + [BF16_SYNC]:
        mine = [r for r in rows if r["batch"] == label]
        if not mine:
            continue
        worst = min(mine, key=lambda r: r["balance_efficiency"])
        out["by_batch"][label] = {
            "median_efficiency": statistics.median(r["balance_efficiency"] for r in mine),
            "worst_efficiency": worst["balance_efficiency"], "worst_case": f"{worst['model']} on {worst['cluster']}",
            "median_factors": {k: statistics.median(r["factors"][k] for r in mine if k in r["factors"]) for k in FACTORS},
            "worst_factors": {k: min(r["factors"][k] for r in mine if k in r["factors"]) for k in FACTORS}}
    one = {(r["cluster"], r["model"]): r for r in rows if r["batch"] == "1/GPU"}
    gains = [r["balance_efficiency"] / one[(r["cluster"], r["model"])]["balance_efficiency"]
             for r in rows if r["batch"] == BF16_SYNC and (r["cluster"], r["model"]) in one]
    if gains:  # the same case planned with a bf16 sync over its default plan: the lever's ablation
        pairs = [(r, one[(r["cluster"], r["model"])]) for r in rows
                 if r["batch"] == BF16_SYNC and (r["cluster"], r["model"]) in one]
        losses = [(r, d) for r, d in pairs if r["balance_efficiency"] < 0.99 * d["balance_efficiency"]]
        out["bf16_sync_gain"] = {"median": statistics.median(gains), "min": min(gains), "max": max(gains),
                                 "num_cases": len(gains), "num_losses": len(losses),
                                 "losses_unsharded": sum(1 for r, _ in losses if not r.get("shard_optimizer", False)),
                                 "losses_default_sharded": sum(1 for _, d in losses if d.get("shard_optimizer", False))}
    cut = {}
    for label in [f"{n}/GPU" for n in SAMPLES_PER_GPU]:  # each plan against itself in whole layers (its record)
        records = [r["sublayer_cuts"] for r in rows if r["batch"] == label and r.get("sublayer_cuts")]
        kept = [c["whole_layers_s"] / c["half_layers_s"] for c in records if c["kept"]]
        if records:
            cut[label] = {"num_cases": len(records), "num_kept": len(kept),
                          "median_gain": statistics.median([*kept, *[1.0] * (len(records) - len(kept))]),
                          "median_gain_kept": statistics.median(kept) if kept else 1.0, "max_gain": max(kept, default=1.0),
                          "why_not": dict(collections.Counter(c["why_not"].split(":")[0] for c in records
                                                              if not c["kept"]))}
    if cut:
        out["sublayer_cut_gain"] = cut
    return out


def write_report(data: dict, command: str, out_dir: Path) -> None:
    s = data["summary"]
    ref = data["reference_loop_s"]
    lines = ["# eth on random mixed clusters (generated)", "",
             f"`{command}` (seed {data['seed']}; {data['machine']}; reference loop {ref[0]:.2f} s before, "
             f"{ref[1]:.2f} s after: `planner_scale.reference_loop_s`, a fixed pure-Python loop that reads this "
             "machine's speed at the moment).", "",
             f"{data['num_clusters']} clusters of 512-4096 GPUs, 3-5 GPU types drawn from the catalog, random node "
             f"sizes (4 or 8 GPUs) and NICs (50-3200 Gbit/s per node); {len(MODELS)} models "
             f"({', '.join(MODELS)}); two global batches (1 and 4 samples per GPU), and 1 sample per GPU again "
             "with `--grad-reduce bf16` (the gradient sync summed in bf16: the lever's ablation). Each case is "
             "planned once by `make_plan` after one warm-up, in this process; times are wall clock.", "",
             f"- Planning time over {s['num_cases']} cases: median **{s['planning_s']['median']:.2f} s**, worst "
             f"**{s['planning_s']['worst']:.2f} s** (target: median < {TARGET_MEDIAN_S} s, worst < "
             f"{TARGET_WORST_S} s).",
             f"- Planned: {s['num_planned']} of {s['num_cases']} (the rest: no plan fits memory; the error is in the "
             "JSON).", ""]
    for label, b in s["by_batch"].items():
        lines.append(f"- Balance efficiency at {label}: median **{b['median_efficiency']:.2f}**, worst "
                     f"{b['worst_efficiency']:.2f} ({b['worst_case']})"
                     + (f" (target: median >= {TARGET_EFFICIENCY})" if label == "1/GPU" else "") + ".")
    gain = s.get("bf16_sync_gain")
    if gain:
        lines.append(f"- `--grad-reduce bf16` (the gradient sync summed in bf16; off by default), the same "
                     f"{gain['num_cases']} cases at 1/GPU: efficiency x{gain['median']:.3f} median over the default "
                     f"plan (min x{gain['min']:.3f}, max x{gain['max']:.3f}); {gain['num_losses']} cases lose more than "
                     f"1%: in {gain['losses_unsharded']} of them the bf16 plan is unsharded, and in "
                     f"{gain['losses_default_sharded']} the default plan shards its optimizer (the bf16 copy's 2 bytes "
                     "per parameter, counted for the whole step, take memory a sharded plan needed).")
    for label, c in s.get("sublayer_cut_gain", {}).items():
        why = ", ".join(f"{n} {k}" for k, n in sorted(c["why_not"].items(), key=lambda kv: -kv[1]))
        lines.append(f"- Sub-layer cuts at {label} (stages may end between a layer's attention and its MLP; each "
                     f"plan against itself in whole layers, `search.sublayer_cuts`): kept in {c['num_kept']} of "
                     f"{c['num_cases']} cases, x{c['median_gain_kept']:.3f} median where kept (max "
                     f"x{c['max_gain']:.3f}), x{c['median_gain']:.3f} median over all; whole layers stayed: {why}.")
    lines += ["", "Efficiency factors (each in (0, 1]; their product is the balance efficiency; "
              "`docs/cost-model.md`, \"Efficiency factors\"): median and worst over the cases.", "",
              "| batch | " + " | ".join(FACTORS) + " |", "|---|" + "---|" * len(FACTORS)]
    for label, b in s["by_batch"].items():
        lines.append(f"| {label} median | " + " | ".join(f"{b['median_factors'][k]:.2f}" for k in FACTORS) + " |")
        lines.append(f"| {label} worst | " + " | ".join(f"{b['worst_factors'][k]:.2f}" for k in FACTORS) + " |")
    slow = sorted(data["rows"], key=lambda r: -r["planning_s"])[:5]
    lines += ["", "Slowest five cases:", "", "| cluster | model | batch | planning s | efficiency |", "|---|---|---|---|---|"]
    lines += [f"| {r['cluster']} | {r['model']} | {r['batch']} | {r['planning_s']:.2f} | "
              f"{r.get('balance_efficiency', float('nan')):.2f} |" for r in slow]
    (out_dir / "planner_random.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clusters", type=int, default=20)
    ap.add_argument("--out-dir", type=Path, default=REPO / "docs" / "benchmarks")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args()
    data = run(args.seed, args.clusters, show=not args.quiet)
    data["summary"] = summary(data)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "planner_random.json").write_text(json.dumps(data, indent=1) + "\n")
    command = "python benchmarks/planner_random.py" + "".join(f" {a}" for a in sys.argv[1:])
    write_report(data, command, args.out_dir)
    s = data["summary"]
    print(f"planning median {s['planning_s']['median']:.2f} s, worst {s['planning_s']['worst']:.2f} s; "
          + "; ".join(f"{k} efficiency median {v['median_efficiency']:.2f}" for k, v in s["by_batch"].items()))


if __name__ == "__main__":
    main()
