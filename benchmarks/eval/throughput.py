"""Section 1: simulated throughput on realistic clusters at 1, 4 and 16 samples per GPU, at nominal
speeds and where one device type runs slower than the cost model believed, each plan replayed
without and with the runtime's online data rebalancing (``eval/replay.py``).

Seven methods, every plan made with the nominal cost model: eth (every schedule allowed), eth with
``robust=True`` (the best worst case under per-type speed perturbations among eth's best candidates),
eth with 1F1B only, layer-balanced and uniform (both 1F1B, their published schedule) on every device, and the
same two on the best homogeneous subset (each GPU type alone, the fastest kept: what a Megatron user would run;
``planner/baselines/homogeneous.py``). ``best baseline`` is, per case and condition, the fastest of the four.
Every method's plan gets the same rebalancing; what it can do depends on its pipelines.
"""

from __future__ import annotations

from typing import Any

from ethpipe.errors import UserError
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Plan
from ethpipe.planner import CostModel, ideal_time_s, make_plan
from ethpipe.planner.baselines.homogeneous import best_homogeneous
from ethpipe.sim import simulate

from eval import replay as rp
from eval import scenarios as sc
from eval.common import Job, describe, layout_signature, timed

ROBUST = "eth-robust"
ONE_F_ONE_B = "eth-1f1b"  # eth with --schedules 1f1b: what the schedule choice buys
UNIFORM_BEST, LB_BEST = "uniform-best-type", "layer-balanced-best-type"  # on the best homogeneous subset
BASELINES = ("layer-balanced", "uniform", LB_BEST, UNIFORM_BEST)
BEST = "best-baseline"  # per case and condition, the fastest of BASELINES
MATRIX_METHODS = ("eth", ROBUST, ONE_F_ONE_B, *BASELINES)
PAIRS = (("eth", BEST), ("eth", "layer-balanced"), ("eth", "uniform"), ("eth", LB_BEST), ("eth", UNIFORM_BEST),
         (ROBUST, "layer-balanced"), (ROBUST, "uniform"), (ROBUST, "eth"), ("eth", ONE_F_ONE_B))
MODES = ("static", "rebalanced")
# The layer-balanced baseline's exhaustive search gets more than the search section's budget here, so that
# the baseline is its best plan, not a timed-out one (a timeout would still be recorded and reported).
LB_BUDGET_S = 120.0


def pair_key(a: str, b: str) -> str:
    return f"{a} / {b}"


def _plan(cluster: Any, spec: Any, batch: int, seq_len: int, method: str,
          budget_s: float) -> tuple[Plan | None, dict[str, Any]]:
    kwargs: dict[str, Any] = {}
    name = method
    if method == "layer-balanced":
        kwargs["time_budget_s"] = budget_s
    if method == ROBUST:
        name, kwargs["robust"] = "eth", True
    if method == ONE_F_ONE_B:
        name, kwargs["schedules"] = "eth", ("1f1b",)
    if method in (UNIFORM_BEST, LB_BEST):
        name = "uniform" if method == UNIFORM_BEST else "layer-balanced"
        if method == LB_BEST:
            kwargs["time_budget_s"] = budget_s
        planning_s, plan = timed(lambda: best_homogeneous(
            cluster, lambda sub: make_plan(sub, spec, batch, seq_len, name, **kwargs), name))
        if plan is None:
            return None, {"feasible": False, "error": f"{name} fits no GPU type of the cluster alone"}
        return plan, {"feasible": True, "planning_s": planning_s,
                      "search_timed_out": bool((plan.extra.get("search") or {}).get("timed_out", False))}
    try:
        planning_s, plan = timed(lambda: make_plan(cluster, spec, batch, seq_len, name, **kwargs))
    except UserError as err:  # no feasible plan (a bug would propagate)
        return None, {"feasible": False, "error": str(err)}
    return plan, {"feasible": True, "planning_s": planning_s,
                  "search_timed_out": bool((plan.extra.get("search") or {}).get("timed_out", False))}


def run_plan(plan: Plan, slowed: dict[str, str | None]) -> dict[str, Any]:
    """The plan's nominal description, layout signature and its replay under every condition."""
    cost = CostModel.for_plan(plan)
    nominal_report = simulate(plan, cost)
    replays = {}
    for cond in rp.CONDITIONS:
        true_cost = rp.cost_under(cost, cond, slowed[cond.key])
        replays[cond.key] = rp.replay(plan, true_cost, nominal_report if true_cost is cost else None)
    return {"nominal": describe(plan, cost, nominal_report), "signature": layout_signature(plan), "replay": replays}


def _tokens_per_s(methods: dict[str, dict[str, Any]], method: str, cond: str, mode: str) -> float | None:
    """A method's simulated tokens/s (``BEST``: the fastest baseline's); None where it does not fit."""
    if method == BEST:
        fits = [_tokens_per_s(methods, b, cond, mode) for b in BASELINES]
        return max((t for t in fits if t is not None), default=None)
    m = methods[method]
    return m["replay"][cond][mode]["tokens_per_s"] if m["feasible"] else None


def best_baseline(methods: dict[str, dict[str, Any]], cond: str = "nominal", mode: str = "static") -> str | None:
    """The fastest of ``BASELINES`` in one case (None where none fits)."""
    fits = {b: _tokens_per_s(methods, b, cond, mode) for b in BASELINES}
    fits = {b: t for b, t in fits.items() if t is not None}
    return max(fits, key=lambda b: fits[b]) if fits else None


def speedup_table(methods: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, float | None]]]:
    """mode -> condition -> "a / b" -> a's simulated tokens/s over b's; None where either does not fit."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for mode in MODES:
        out[mode] = {}
        for cond in rp.CONDITIONS:
            row: dict[str, float | None] = {}
            for a, b in PAIRS:
                ta, tb = _tokens_per_s(methods, a, cond.key, mode), _tokens_per_s(methods, b, cond.key, mode)
                row[pair_key(a, b)] = ta / tb if ta is not None and tb is not None else None
            out[mode][cond.key] = row
    return out


def _case(cluster_key: str, model_name: str, samples_per_gpu: int, budget_s: float) -> dict[str, Any]:
    scenario = sc.cluster_scenario(cluster_key)
    cluster, model = sc.load(scenario), sc.model_scenario(model_name)
    spec = load_model_spec(model.name)
    batch = samples_per_gpu * cluster.num_devices
    base = CostModel(cluster, spec, model.seq_len)
    slowed = {c.key: rp.device_type_for(base, c) for c in rp.CONDITIONS}
    methods: dict[str, dict[str, Any]] = {}
    for method in MATRIX_METHODS:
        plan, record = _plan(cluster, spec, batch, model.seq_len, method, budget_s)
        methods[method] = {**record, **(run_plan(plan, slowed) if plan is not None else {})}
    return {"cluster": cluster_key, "cluster_label": scenario.label, "model": model.name,
            "params_b": spec.num_params() / 1e9, "samples_per_gpu": samples_per_gpu, "global_batch": batch,
            "seq_len": model.seq_len, "ideal_tokens_per_s": batch * model.seq_len / ideal_time_s(base, batch),
            "slowed_types": {k: (sc.short(v) if v else None) for k, v in slowed.items()},
            "condition_labels": {c.key: c.label(slowed[c.key]) for c in rp.CONDITIONS},
            "methods": methods, "speedup": speedup_table(methods), "best_baseline": best_baseline(methods)}


def cases(quick: bool) -> list[tuple[str, str, int]]:
    clusters = [c.key for c in sc.CLUSTERS if not quick or c.key in sc.QUICK_CLUSTERS]
    spgs = sc.QUICK_SAMPLES_PER_GPU if quick else sc.SAMPLES_PER_GPU
    out = []
    for c in clusters:
        models = sc.QUICK_MODELS if quick else sc.THROUGHPUT_MODELS.get(c, tuple(m.name for m in sc.MODELS))
        out += [(c, m, n) for m in models for n in spgs]
    return out


def jobs(quick: bool) -> list[Job]:
    return [Job(f"throughput {c} {m} {n}/GPU", lambda c=c, m=m, n=n: _case(c, m, n, LB_BUDGET_S))
            for c, m, n in cases(quick)]


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


def finish(rows: list[dict[str, Any]], quick: bool) -> dict[str, Any]:
    keys = list(dict.fromkeys(r["cluster"] for r in rows))
    all_models = [m.name for m in sc.MODELS]
    subsets = {c: list(sc.THROUGHPUT_MODELS[c]) for c in keys if not quick and c in sc.THROUGHPUT_MODELS}
    return {"section": "throughput", "clusters": cluster_facts(keys), "models": all_models,
            "model_subsets": subsets,
            "samples_per_gpu": list(sc.QUICK_SAMPLES_PER_GPU if quick else sc.SAMPLES_PER_GPU),
            "methods": list(MATRIX_METHODS), "pairs": [pair_key(a, b) for a, b in PAIRS], "modes": list(MODES),
            "conditions": [{"key": c.key, "which": c.which, "speed": c.speed} for c in rp.CONDITIONS],
            "rebalance": {"threshold": rp.THRESHOLD, "max_rounds": rp.MAX_ROUNDS + 1},
            "layer_balanced_budget_s": LB_BUDGET_S,
            "figures": {"speedups": "figures/eval_speedups.png", "rebalance": "figures/eval_rebalance.png"},
            "rows": rows}

