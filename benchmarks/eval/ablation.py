"""Section 3: what each of eth's ideas is worth, by switching it off through ``PlannerOptions``.

Every variant is planned by eth with one option changed and replayed by the simulator (the flat-sync
variant with ``flat_sync=True``, as the runtime would run it). One more row needs no planner option:
the full eth plan replayed with flat sync, i.e. block-wise overlap switched off at run time only.
"""

from __future__ import annotations

from typing import Any

import ethpipe.planner as planner
from ethpipe.model_load import load_model_spec
from ethpipe.planner import CostModel, make_plan

from eval import scenarios as sc
from eval.common import Job, evaluate_plan, run_method

# (name, PlannerOptions fields, replay with flat sync)
VARIANTS: tuple[tuple[str, dict[str, Any], bool], ...] = (
    ("no fine-grained balance", {"fine_grained": False}, False),
    ("flat sync after flush", {"block_sync": False}, True),
    ("homogeneous pipelines only", {"allow_mixed": False}, False),
    ("data balancing alone", {"balance": "data"}, False),
    ("layer balancing alone", {"balance": "layers"}, False),
    ("whole layers only (no sub-layer cuts)", {"sublayer_cuts": False}, False),
)
REPLAY_FLAT = "eth plan replayed with flat sync"


def options_available() -> str | None:
    """None when ``ethpipe.planner.PlannerOptions`` exists, else why the planner-level ablations are missing."""
    if getattr(planner, "PlannerOptions", None) is None:
        return "ethpipe.planner exports no PlannerOptions in this checkout"
    return None


def _variant(cluster: Any, spec: Any, batch: int, seq_len: int, fields: dict[str, Any], flat: bool) -> dict[str, Any]:
    missing = options_available()
    if missing is not None:
        return {"feasible": False, "available": False, "error": missing}
    try:
        options = planner.PlannerOptions(**fields)
    except (TypeError, ValueError) as err:
        return {"feasible": False, "available": False, "error": f"PlannerOptions({fields}) rejected: {err}"}
    try:
        return {**run_method(cluster, spec, batch, seq_len, "eth", options=options, flat_sync=flat), "available": True}
    except TypeError as err:  # make_plan without an ``options`` parameter
        return {"feasible": False, "available": False, "error": f"make_plan(options=...) rejected: {err}"}


def _case(cluster_key: str, model_name: str) -> dict[str, Any]:
    cluster, model = sc.load(sc.cluster_scenario(cluster_key)), sc.model_scenario(model_name)
    spec, batch = load_model_spec(model.name), sc.batch_for(model, cluster.num_devices)
    full = run_method(cluster, spec, batch, model.seq_len, "eth")
    variants: dict[str, dict[str, Any]] = {}
    if full["feasible"]:
        plan = make_plan(cluster, spec, batch, model.seq_len)
        variants[REPLAY_FLAT] = {**evaluate_plan(plan, CostModel.for_plan(plan), flat_sync=True), "available": True}
    for name, fields, flat in VARIANTS:
        variants[name] = {**_variant(cluster, spec, batch, model.seq_len, fields, flat), "options": fields}
    for v in variants.values():
        v["relative"] = v["tokens_per_s"] / full["tokens_per_s"] if v["feasible"] and full["feasible"] else None
    return {"cluster": cluster_key, "cluster_label": sc.cluster_scenario(cluster_key).label, "model": model.name,
            "global_batch": batch, "seq_len": model.seq_len,
            "eth": full, "variants": variants}


def jobs(quick: bool) -> list[Job]:
    cases = sc.QUICK_ABLATION_CASES if quick else sc.ABLATION_CASES
    return [Job(f"ablation {c} {m}", lambda c=c, m=m: _case(c, m)) for c, m in cases]


def finish(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {"section": "ablation", "planner_options_missing": options_available(),
            "variant_names": [REPLAY_FLAT] + [v[0] for v in VARIANTS], "figure": "figures/eval_ablation.png",
            "rows": rows}
