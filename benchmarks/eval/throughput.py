"""Section 1: simulated throughput of eth and the baselines on realistic clusters and models."""

from __future__ import annotations

from typing import Any

from ethpipe.model_spec import load_model_spec
from ethpipe.planner import CostModel, ideal_time_s

from eval import scenarios as sc
from eval.common import BASELINES, METHODS, Job, run_method


def speedups(methods: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """eth's simulated tokens/s over each baseline's; None where either plan is infeasible."""
    eth = methods["eth"]
    return {b: (eth["tokens_per_s"] / methods[b]["tokens_per_s"]
                if eth["feasible"] and methods[b]["feasible"] else None) for b in BASELINES}


def _case(cluster_key: str, model_name: str, budget_s: float) -> dict[str, Any]:
    scenario = sc.cluster_scenario(cluster_key)
    cluster, model = sc.load(scenario), sc.model_scenario(model_name)
    spec = load_model_spec(model.name)
    batch = sc.batch_for(model, cluster.num_devices)
    ideal_s = ideal_time_s(CostModel(cluster, spec, model.seq_len), batch)
    methods = {m: run_method(cluster, spec, batch, model.seq_len, m, budget_s=budget_s) for m in METHODS}
    return {"cluster": cluster_key, "cluster_label": scenario.label, "model": model.name,
            "params_b": spec.num_params() / 1e9,
            "global_batch": batch, "seq_len": model.seq_len, "ideal_tokens_per_s": batch * model.seq_len / ideal_s,
            "methods": methods, "speedup": speedups(methods)}


def jobs(quick: bool, budget_s: float) -> list[Job]:
    clusters = [c.key for c in sc.CLUSTERS if not quick or c.key in sc.QUICK_CLUSTERS]
    models = [m.name for m in sc.MODELS if not quick or m.name in sc.QUICK_MODELS]
    return [Job(f"throughput {c} {m}", lambda c=c, m=m: _case(c, m, budget_s)) for c in clusters for m in models]


def cluster_facts(keys: list[str]) -> list[dict[str, Any]]:
    facts = []
    for key in keys:
        scenario = sc.cluster_scenario(key)
        cluster = sc.load(scenario)
        counts: dict[str, int] = {}
        for d in cluster.devices:
            counts[sc.short(d.gpu.id)] = counts.get(sc.short(d.gpu.id), 0) + 1
        facts.append({"key": key, "label": scenario.label, "file": f"examples/clusters/{scenario.file}",
                      "gpus": cluster.num_devices, "gpu_counts": counts,
                      "figure": f"figures/eval_throughput_{key}.png"})
    return facts


def finish(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = list(dict.fromkeys(r["cluster"] for r in rows))
    return {"section": "throughput", "clusters": cluster_facts(keys), "rows": rows}
