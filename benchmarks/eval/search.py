"""Section 2: planning time of eth vs exhaustive searches as the cluster grows, and plan quality.

Two exhaustive searches, both capped by the same time budget (a capped search keeps its best plan
so far and says it timed out): the layer-balanced baseline's own exhaustive search (one mixed
shape replicated), and an exhaustive search over eth's own space (``ethpipe.planner.baselines.exhaustive``:
one template per pool, every shape, span and micro-batch). Plan quality compares the planner's
closed-form iteration times, the objective all three searches minimise.
"""

from __future__ import annotations

from typing import Any

from ethpipe.cluster import cluster_from_dict
from ethpipe.errors import UserError
from ethpipe.model_load import load_model_spec
from ethpipe.planner import CostModel, make_plan
from ethpipe.planner.baselines.exhaustive import exhaustive_eth

from eval import scenarios as sc
from eval.common import Job, median_time_s, timed

ETH_RUNS = 3
QUALITY_MAX_GPUS = 64


def _exhaustive(cost: CostModel, batch: int, budget_s: float, eth_iteration_s: float) -> dict[str, Any]:
    wall_s, res = timed(lambda: exhaustive_eth(cost, batch, time_budget_s=budget_s))
    if res.plan is None:
        status = "timeout" if res.timed_out else ("outside space" if res.combinations == 0 else "no feasible plan")
        return {"planning_s": wall_s, "status": status, "timed_out": res.timed_out, "evaluated": res.evaluated,
                "combinations": res.combinations, "iteration_s": None, "eth_quality": None}
    it = res.plan.predicted["iteration_time_s"]
    return {"planning_s": wall_s, "status": "timeout" if res.timed_out else "finished", "timed_out": res.timed_out,
            "evaluated": res.evaluated, "combinations": res.combinations, "iteration_s": it,
            "eth_quality": it / eth_iteration_s}


def _scale(num_gpus: int, budget_s: float, runs: int) -> dict[str, Any]:
    model = sc.SEARCH_MODEL
    spec, cluster = load_model_spec(model.name), cluster_from_dict(sc.search_cluster_spec(num_gpus))
    batch = sc.batch_for(model, num_gpus)
    eth_s, eth_runs, eth = median_time_s(lambda: make_plan(cluster, spec, batch, model.seq_len), runs)
    eth_it = eth.predicted["iteration_time_s"]
    lb_s, lb = timed(lambda: make_plan(cluster, spec, batch, model.seq_len, "layer-balanced", time_budget_s=budget_s))
    lb_it = lb.predicted["iteration_time_s"]
    return {
        "gpus": num_gpus, "gpu_types": len(cluster.gpu_types), "model": model.name, "global_batch": batch,
        "seq_len": model.seq_len,
        "eth": {"planning_s": eth_s, "runs_s": eth_runs, "iteration_s": eth_it,
                "balance_efficiency": eth.predicted["balance_efficiency"]},
        "layer_balanced": {"planning_s": lb_s, "timed_out": bool(lb.extra["search"].get("timed_out", False)),
                           "candidates": lb.extra["search"].get("candidates_evaluated"), "iteration_s": lb_it,
                           "eth_speedup": lb_it / eth_it},
        "exhaustive_eth": _exhaustive(CostModel(cluster, spec, model.seq_len), batch, budget_s, eth_it),
    }


def _quality(cluster_key: str, model_name: str, budget_s: float) -> dict[str, Any]:
    cluster, model = sc.load(sc.cluster_scenario(cluster_key)), sc.model_scenario(model_name)
    spec, batch = load_model_spec(model.name), sc.batch_for(model, cluster.num_devices)
    row: dict[str, Any] = {"cluster": cluster_key, "cluster_label": sc.cluster_scenario(cluster_key).label,
                           "model": model.name, "gpus": cluster.num_devices}
    try:
        eth_s, eth = timed(lambda: make_plan(cluster, spec, batch, model.seq_len))
    except UserError as err:  # no feasible plan (a bug would propagate)
        return {**row, "error": str(err)}
    it = eth.predicted["iteration_time_s"]
    return {**row, "eth": {"planning_s": eth_s, "iteration_s": it},
            "exhaustive_eth": _exhaustive(CostModel(cluster, spec, model.seq_len), batch, budget_s, it)}


def jobs(quick: bool, budget_s: float) -> list[Job]:
    sizes = sc.QUICK_SEARCH_SIZES if quick else sc.SEARCH_SIZES
    runs = 1 if quick else ETH_RUNS
    out = [Job(f"search time {n} GPUs", lambda n=n: {"kind": "scale", **_scale(n, budget_s, runs)}) for n in sizes]
    small = [c.key for c in sc.CLUSTERS if sc.load(c).num_devices <= QUALITY_MAX_GPUS]
    clusters = [c for c in small if not quick or c in sc.QUICK_CLUSTERS[:1]]
    models = [m.name for m in sc.MODELS if not quick or m.name in sc.QUICK_MODELS[:1]]
    out += [Job(f"plan quality {c} {m}", lambda c=c, m=m: {"kind": "quality", **_quality(c, m, budget_s)})
            for c in clusters for m in models]
    return out


def finish(rows: list[dict[str, Any]], budget_s: float, quick: bool) -> dict[str, Any]:
    small, large = sc.search_cluster_spec(sc.QUICK_SEARCH_SIZES[0]), sc.search_cluster_spec(4096)
    names = [", ".join(sc.short(n["gpu"]) for n in spec["nodes"]) for spec in (small, large)]
    clusters = (f"{small['nodes'][0]['gpus_per_node']} GPUs per node, equal node shares of {names[0]} at "
                f"{sc.QUICK_SEARCH_SIZES[0]} GPUs and of {names[1]} above")
    return {"section": "search", "budget_s": budget_s, "clusters": clusters, "eth_runs": 1 if quick else ETH_RUNS,
            "model": sc.SEARCH_MODEL.name, "figure": "figures/eval_search_time.png",
            "scale": [r for r in rows if r["kind"] == "scale"], "quality": [r for r in rows if r["kind"] == "quality"]}
