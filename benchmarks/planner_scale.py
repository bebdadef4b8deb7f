"""Planner benchmark: eth vs the layer-balanced (exhaustive) and uniform baselines, in one cost model.

    .venv/bin/python benchmarks/planner_scale.py [--budget-s 20] [--sizes 16,64,256,512,1024,4096] [--no-realistic]
        [--no-widened]

For each cluster and model, two global batches: ~4M tokens (a realistic LLM batch) and one
sample per GPU (harsh, but what very large clusters see). Reports predicted iteration time
of eth, layer-balanced and uniform, eth's speedups, eth's planning time (median of five runs
after a warm-up), the exhaustive layer-balanced search's time, and on small clusters eth's
quality against an exhaustive search over eth's original space (one template per pool). Then,
on small clusters (2-3 types, 4-16 GPUs), eth against an exhaustive search of its widened
space (``exhaustive_widened``: per-type TP, hybrid layouts, split pools), with the distribution
of the ratio (``--no-widened`` skips it). Writes docs/benchmarks/planner_scale.md and .json.
Times are wall-clock on this machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from ethpipe.cluster import Cluster, cluster_from_dict
from ethpipe.cost.model import CostModel, dtype_bytes
from ethpipe.errors import UserError
from ethpipe.model_load import load_model_spec
from ethpipe.planner import PlannerOptions, make_plan
from ethpipe.planner.baselines.exhaustive import exhaustive_eth, exhaustive_widened

MODELS = {"gpt3-1.3b": 2048, "llama2-7b": 4096, "llama2-70b": 4096}
NIC_GBIT = {"h100_sxm": 3200, "a100_80gb_sxm": 1600, "a100_40gb_sxm": 1600, "v100_32gb_sxm2": 800,
            "v100_16gb": 800, "t4": 200, "l4": 400}
TOKENS_PER_BATCH = 4 * 1024 * 1024
ETH_RUNS = 5  # eth planning time: the median of this many runs after a warm-up (this machine is noisy)
REFERENCE_FROM_GPUS = 1024  # rows from this size record the machine's speed just before eth is timed
# Clusters users have (issue 6): name -> [(gpu, num_gpus)], 8 GPUs per node.
REALISTIC = {
    "8xA100-80 + 8xV100-32": [("a100_80gb_sxm", 8), ("v100_32gb_sxm2", 8)],
    "16xA100-40 + 16xV100-16 + 16xT4": [("a100_40gb_sxm", 16), ("v100_16gb", 16), ("t4", 16)],
    "32xH100 + 64xA100-80 + 32xL4": [("h100_sxm", 32), ("a100_80gb_sxm", 64), ("l4", 32)],
    "1024: 384xH100 + 256xA100-80 + 256xL4 + 128xV100-32": [("h100_sxm", 384), ("a100_80gb_sxm", 256), ("l4", 256),
                                                            ("v100_32gb_sxm2", 128)],
    "32xA100-80 + 32xA100-40": [("a100_80gb_sxm", 32), ("a100_40gb_sxm", 32)],
}


# Small clusters for the widened-space exhaustive search: name -> [(gpu, nodes, gpus per node)].
SMALL = {
    "4xA100-80 + 4xV100-32": [("a100_80gb_sxm", 1, 4), ("v100_32gb_sxm2", 1, 4)],
    "2x2 A100-80 + 2x2 V100-32": [("a100_80gb_sxm", 2, 2), ("v100_32gb_sxm2", 2, 2)],
    "2x4 A100-80 + 2x4 V100-16": [("a100_80gb_sxm", 2, 4), ("v100_16gb", 2, 4)],
    "4xH100 + 4xA100-40 + 4xT4": [("h100_sxm", 1, 4), ("a100_40gb_sxm", 1, 4), ("t4", 1, 4)],
    "2x2 H100 + 2xA100-80 + 2xV100-32": [("h100_sxm", 2, 2), ("a100_80gb_sxm", 1, 2), ("v100_32gb_sxm2", 1, 2)],
    "4xA100-40 + 4xL4 + 4xT4": [("a100_40gb_sxm", 1, 4), ("l4", 1, 4), ("t4", 1, 4)],
}
SMALL_MODELS = {"gpt3-1.3b": 2048, "llama2-7b": 2048}


def _cluster(parts: list[tuple[str, int]]) -> Cluster:
    return cluster_from_dict({"nodes": [{"gpu": g, "num_nodes": n // 8, "gpus_per_node": 8, "nic_gbit_s": NIC_GBIT[g]}
                                        for g, n in parts if n]})


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
    return _cluster([(t, 8 * c) for t, c in zip(types, counts)])


def _loop() -> None:
    sum(i * i for i in range(10**7))


def reference_loop_s() -> float:
    """Seconds of a fixed pure-Python loop: this machine's speed at the moment (it varies 2-3x between hours,
    more than any planner change), so planning times can be read against it."""
    start = time.perf_counter()
    _loop()
    return time.perf_counter() - start


def reference_pair_s() -> float | None:
    """Wall-clock seconds of the same loop in this process and a forked one at once: whether the second CPU is
    there at the moment (eth plans in two processes from 256 GPUs; on a shared VM the pair can take up to twice
    the single loop). None without ``fork``."""
    if not hasattr(os, "fork"):
        return None
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            _loop()
        finally:
            os._exit(0)
    _loop()
    os.waitpid(pid, 0)
    return time.perf_counter() - start


def _timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _row(name: str, cluster: Cluster, model: str, seq: int, batch: int, batch_label: str, budget_s: float,
         exhaustive: bool) -> dict:
    spec = load_model_spec(model)
    row: dict = {"cluster": name, "gpus": cluster.num_devices, "gpu_types": len(cluster.gpu_types), "model": model,
                 "seq_len": seq, "global_batch": batch, "batch": batch_label}
    try:
        make_plan(cluster, spec, batch, seq)  # warm-up
    except UserError as err:  # no feasible plan (a bug would propagate)
        return row | {"error": str(err)}
    if cluster.num_devices >= REFERENCE_FROM_GPUS:
        row |= {"reference_loop_s": reference_loop_s(), "reference_pair_s": reference_pair_s()}
    runs = [_timed(lambda: make_plan(cluster, spec, batch, seq)) for _ in range(ETH_RUNS)]
    if "reference_loop_s" in row:  # and just after: a slow spell during the timing shows as a slow loop
        row |= {"reference_loop_after_s": reference_loop_s(), "reference_pair_after_s": reference_pair_s()}
    eth = runs[0][1]
    row |= {"eth_planning_s": statistics.median(t for t, _ in runs), "eth_planning_runs_s": [t for t, _ in runs],
            "eth_iteration_s": eth.predicted["iteration_time_s"],
            "eth_balance_efficiency": eth.predicted["balance_efficiency"],
            "eth_sync_exposed_s": eth.predicted["grad_sync_exposed_s"], "eth_pipelines": len(eth.pipelines)}
    t_lb, lb = _timed(lambda: make_plan(cluster, spec, batch, seq, "layer-balanced", time_budget_s=budget_s))
    row |= {"lb_planning_s": t_lb, "lb_timed_out": lb.extra["search"]["timed_out"],
            "lb_iteration_s": lb.predicted["iteration_time_s"], "lb_candidates": lb.extra["search"]["candidates_evaluated"],
            "lb_sync_exposed_s": lb.predicted["grad_sync_exposed_s"]}
    uni = make_plan(cluster, spec, batch, seq, "uniform")
    row["uniform_iteration_s"] = uni.predicted["iteration_time_s"]
    if exhaustive:
        t_ex, ex = _timed(lambda: exhaustive_eth(CostModel(cluster, spec, seq), batch, time_budget_s=budget_s))
        row |= {"exh_planning_s": t_ex, "exh_timed_out": ex.timed_out, "exh_evaluated": ex.evaluated,
                "exh_combinations": ex.combinations}
        if ex.plan is not None:  # the exhaustive search prices 1F1B: compared with eth's 1F1B-only plan
            one = make_plan(cluster, spec, batch, seq, schedules=("1f1b",))
            row["eth_1f1b_iteration_s"] = one.predicted["iteration_time_s"]
            row["eth_vs_exhaustive"] = ex.plan.predicted["iteration_time_s"] / row["eth_1f1b_iteration_s"]
    return row


def run(sizes: list[int], budget_s: float, models: dict[str, int], realistic: bool) -> list[dict]:
    rows = []
    clusters = [(f"{n} GPUs", cluster_of(n)) for n in sizes]
    if realistic:
        clusters += [(name, _cluster(parts)) for name, parts in REALISTIC.items()]
    for name, cluster in clusters:
        for model, seq in models.items():
            for label, batch in (("4M tok", TOKENS_PER_BATCH // seq), ("1/GPU", cluster.num_devices)):
                row = _row(name, cluster, model, seq, batch, label, budget_s, cluster.num_devices <= 64)
                rows.append(row)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def run_widened(budget_s: float) -> list[dict]:
    """eth (every device used, as the exhaustive search plans) vs the exhaustive search of its widened space."""
    rows = []
    for name, parts in SMALL.items():
        cluster = cluster_from_dict({"nodes": [{"gpu": g, "num_nodes": n, "gpus_per_node": k, "nic_gbit_s": NIC_GBIT[g]}
                                               for g, n, k in parts]})
        for model, seq in SMALL_MODELS.items():
            spec = load_model_spec(model)
            for label, batch in (("1/GPU", cluster.num_devices), ("8/GPU", 8 * cluster.num_devices)):
                row: dict = {"cluster": name, "gpus": cluster.num_devices, "model": model, "batch": label,
                             "global_batch": batch}
                # The exhaustive search enumerates the 1F1B space: eth is compared with its 1F1B-only plan.
                t_eth, eth = _timed(lambda: make_plan(cluster, spec, batch, seq, schedules=("1f1b",),
                                                      options=PlannerOptions(allow_idle=False)))
                dtype = str(eth.extra["dtype"])
                cost = CostModel(cluster, spec, seq, dtype_bytes=dtype_bytes(dtype), dtype=dtype)
                t_ex, ex = _timed(lambda: exhaustive_widened(cost, batch, time_budget_s=budget_s))
                row |= {"eth_planning_s": t_eth, "eth_iteration_s": eth.predicted["iteration_time_s"],
                        "exh_planning_s": t_ex, "exh_timed_out": ex.timed_out, "exh_evaluated": ex.evaluated}
                if ex.plan is not None:
                    row["exh_iteration_s"] = ex.plan.predicted["iteration_time_s"]
                    row["eth_vs_exhaustive"] = row["exh_iteration_s"] / row["eth_iteration_s"]
                rows.append(row)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def _widened_report(rows: list[dict], budget_s: float) -> list[str]:
    lines = ["", "## eth vs an exhaustive search of its widened space", "",
             "Small clusters (2-3 types, 4-16 GPUs), seq 2048, every device used (no idle nodes), eth with "
             "`--schedules 1f1b` (the space the exhaustive search enumerates prices 1F1B). The exhaustive "
             "search (`planner/baselines/exhaustive.py`, `exhaustive_widened`) enumerates eth's widened space without its "
             "pruning: every template per pool and any two on a split of its nodes, the mixed, type-interleaved and "
             "hybrid families with every per-type TP vector, type order and micro-batch size, and the replicated "
             f"family; capped at {budget_s:.0f} s.", "",
             "| cluster | model | batch | eth plan s | eth iter s | exh. plan s | exh. iter s | eth / exhaustive |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['eth_vs_exhaustive']:.4f}" if "eth_vs_exhaustive" in r else "-"
        exh = f"{r['exh_iteration_s']:.4f}" if "exh_iteration_s" in r else "-"
        lines.append(f"| {r['cluster']} | {r['model']} | {r['batch']} | {r['eth_planning_s']:.3f} | "
                     f"{r['eth_iteration_s']:.4f} | {_s(r['exh_planning_s'], r['exh_timed_out'])} | {exh} | {ratio} |")
    ratios = sorted(r["eth_vs_exhaustive"] for r in rows if "eth_vs_exhaustive" in r)
    if ratios:
        lines += ["", f"eth / exhaustive over {len(ratios)} cases (exhaustive iteration time / eth's; 1 = eth found "
                  f"the optimum, >= 0.98 is the target): min {ratios[0]:.4f}, median {statistics.median(ratios):.4f}, "
                  f"max {ratios[-1]:.4f}; {sum(r >= 0.98 for r in ratios)} of {len(ratios)} within 2%."]
    return lines


def _s(value: float | None, timed_out: bool = False) -> str:
    if value is None:
        return "-"
    return f"timeout ({value:.0f} s)" if timed_out else f"{value:.3f}"


def write_report(rows: list[dict], budget_s: float, command: str, out_dir: Path, widened: list[dict] | None = None,
                 reference_s: list[float] | None = None) -> None:
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    ok = [r for r in rows if "error" not in r]
    lines = [
        "# Planner benchmark: eth vs layer-balanced vs uniform", "",
        f"Command: `{command}`  ", f"Machine: {machine}  ",
        *([f"Machine speed: a fixed pure-Python loop (`reference_loop_s`) took {reference_s[0]:.2f} s at the start and "
           f"{reference_s[-1]:.2f} s at the end (this machine's speed varies between hours, and planning times with it; rows "
           f"from {REFERENCE_FROM_GPUS} GPUs record it just before eth is timed).  "]
          if reference_s else []),
        f"Exhaustive searches are capped at {budget_s:.0f} s (\"timeout\": the cap was hit; the best plan found so far "
        "is what is reported).  ",
        f"eth plan s: wall-clock of `make_plan`, the median of {ETH_RUNS} runs after a warm-up (from 256 GPUs eth plans "
        "its first idle candidate in a second process while it plans every device, so it uses both CPUs; "
        "docs/plan-format.md, \"Idle devices\"). Rows with the same cluster, model and batch size (at seq 4096 "
        "`4M tok` = `1/GPU` = 1024 samples on 1024 GPUs) differ only by this machine's noise.", "",
        "Scaling clusters (\"N GPUs\"): 8 GPUs per node, equal node shares of 2 types (16: A100-80G, V100-32G), 3 "
        "(64: + H100) or 4 (>= 256: H100, A100-80G, A100-40G, V100-32G); NICs 3200/1600/1600/800 Gbit/s per node. "
        "Realistic clusters from issue 6 (NICs: T4 200, L4 400 Gbit/s). Batches: `4M tok` = 4Mi tokens "
        "(2048 samples at seq 2048, 1024 at seq 4096); `1/GPU` = one sample per GPU. Times are predicted iteration "
        "seconds of each method's best plan in the same cost model; speedup = baseline time / eth time.", "",
        "| cluster | model | batch | eth plan s | eth iter s | eth bal. eff. | layer-bal. plan s | layer-bal. iter s "
        "| uniform iter s | eth vs layer-bal. | eth vs uniform | exh. (one template/pool) plan s | eth / exhaustive |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['cluster']} | {r['model']} | {r['batch']} | infeasible: {r['error']} |||||||||")
            continue
        ratio = f"{r['eth_vs_exhaustive']:.3f}x" if "eth_vs_exhaustive" in r else "-"
        lines.append(
            f"| {r['cluster']} | {r['model']} | {r['batch']} | {r['eth_planning_s']:.3f} | {r['eth_iteration_s']:.3f} "
            f"| {r['eth_balance_efficiency']:.3f} | {_s(r['lb_planning_s'], r['lb_timed_out'])} | {r['lb_iteration_s']:.3f} "
            f"| {r['uniform_iteration_s']:.3f} | {r['lb_iteration_s'] / r['eth_iteration_s']:.2f}x "
            f"| {r['uniform_iteration_s'] / r['eth_iteration_s']:.2f}x "
            f"| {_s(r.get('exh_planning_s'), r.get('exh_timed_out', False))} | {ratio} |")
    losses = [r for r in ok if r["lb_iteration_s"] < r["eth_iteration_s"] * (1 - 1e-9)]
    uni_losses = [r for r in ok if r["uniform_iteration_s"] < r["eth_iteration_s"] * (1 - 1e-9)]
    lines += ["", "eth / exhaustive = exhaustive plan's iteration time / eth's with `--schedules 1f1b` (the exhaustive "
              "search prices 1F1B), the exhaustive search over eth's original space (one template per pool; eth's "
              "space is wider, so > 1 is expected). eth's own columns are its default plan (every schedule allowed); "
              "the baselines run 1F1B.", "",
              f"Summary: eth >= layer-balanced in {len(ok) - len(losses)} of {len(ok)} cases, >= uniform in "
              f"{len(ok) - len(uni_losses)} of {len(ok)}."]
    if ok:
        worst_lb = min(ok, key=lambda r: r["lb_iteration_s"] / r["eth_iteration_s"])
        worst_uni = min(ok, key=lambda r: r["uniform_iteration_s"] / r["eth_iteration_s"])
        lines += ["", (f"Worst eth vs layer-balanced: {worst_lb['lb_iteration_s'] / worst_lb['eth_iteration_s']:.3f}x "
                       f"({worst_lb['cluster']}, {worst_lb['model']}, {worst_lb['batch']}); worst eth vs uniform: "
                       f"{worst_uni['uniform_iteration_s'] / worst_uni['eth_iteration_s']:.3f}x "
                       f"({worst_uni['cluster']}, {worst_uni['model']}, {worst_uni['batch']}).")]
        by_size: dict[int, list[dict]] = {}
        for r in ok:
            by_size.setdefault(r["gpus"], []).append(r)
        lines += ["", "Slowest eth planning per cluster size (eth s / layer-balanced s, same run): " + "; ".join(
            f"{n} GPUs {max(r['eth_planning_s'] for r in rs):.3f} s / {max(r['lb_planning_s'] for r in rs):.1f} s"
            for n, rs in sorted(by_size.items())) + "."]
        timed = [r for r in ok if "reference_loop_s" in r]
        if timed:
            lines += ["", "Large rows against the machine's speed (eth s median [fastest-slowest of its runs]; reference "
                      "loop s just before / just after; the loop in two processes at once, s, before / after):", "",
                      "| cluster | model | batch | eth plan s | runs s | loop s | loop pair s |", "|---|---|---|---:|---:|---:|---:|"]
            lines += [f"| {r['cluster']} | {r['model']} | {r['batch']} | {r['eth_planning_s']:.3f} | "
                      + (f"{min(r['eth_planning_runs_s']):.2f}-{max(r['eth_planning_runs_s']):.2f}"
                         if "eth_planning_runs_s" in r else "-")
                      + f" | {r['reference_loop_s']:.2f} / {r.get('reference_loop_after_s', math.nan):.2f} | "
                      + (f"{r['reference_pair_s']:.2f} / {r['reference_pair_after_s']:.2f}"
                         if r.get("reference_pair_s") and r.get("reference_pair_after_s") else "-") + " |"
                      for r in timed]
    if losses:
        lines += ["", "Where eth loses to layer-balanced (predicted): " + "; ".join(
            f"{r['cluster']} {r['model']} {r['batch']} ({r['lb_iteration_s'] / r['eth_iteration_s']:.2f}x, eth sync "
            f"exposed {r['eth_sync_exposed_s']:.3f} s vs {r['lb_sync_exposed_s']:.3f} s)" for r in losses) + "."]
    lines += _widened_report(widened, budget_s) if widened else []
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "planner_scale.md").write_text("\n".join(lines) + "\n")
    (out_dir / "planner_scale.json").write_text(json.dumps(
        {"command": command, "machine": machine, "budget_s": budget_s, "reference_loop_s": reference_s, "rows": rows,
         "widened": widened or []},
        indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=20.0)
    parser.add_argument("--sizes", default="16,64,256,512,1024,4096")
    parser.add_argument("--no-realistic", action="store_true", help="skip the issue-6 clusters")
    parser.add_argument("--no-widened", action="store_true", help="skip eth vs the widened-space exhaustive search")
    parser.add_argument("--out-dir", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args()
    reference = [reference_loop_s()]
    rows = run([int(s) for s in args.sizes.split(",")], args.budget_s, MODELS, not args.no_realistic)
    widened = None if args.no_widened else run_widened(args.budget_s)
    reference.append(reference_loop_s())
    write_report(rows, args.budget_s, "python " + " ".join(_measured_args(sys.argv)), args.out_dir, widened, reference)


def _measured_args(argv: list[str]) -> list[str]:
    """The command line without ``--out-dir``: where the results go is not part of what was measured."""
    out, skip = [], False
    for arg in argv:
        if skip or arg.startswith("--out-dir="):
            skip = False
            continue
        skip = arg == "--out-dir"
        if not skip:
            out.append(arg)
    return out


if __name__ == "__main__":
    main()
