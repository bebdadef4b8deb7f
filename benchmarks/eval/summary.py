"""Headline numbers, computed from the section results (never typed in)."""

from __future__ import annotations

import statistics
from typing import Any

from eval.headline import summarize_matrix

HEADLINE_SIZES = (1024, 4096)
GAP_THRESHOLD = 0.05  # estimate vs simulation differences worth flagging


def _where(row: dict[str, Any], value: float) -> dict[str, Any]:
    return {"value": value, "cluster": row["cluster"], "model": row["model"], "samples_per_gpu": row["samples_per_gpu"]}


def efficiency_range(rows: list[dict[str, Any]], method: str) -> dict[str, Any] | None:
    """Balance efficiency of one method's nominal plans, simulated at nominal speed."""
    cases = [r for r in rows if r["methods"][method]["feasible"]]
    if not cases:
        return None
    lo = min(cases, key=lambda r: r["methods"][method]["nominal"]["balance_efficiency"])
    hi = max(cases, key=lambda r: r["methods"][method]["nominal"]["balance_efficiency"])
    return {"min": _where(lo, lo["methods"][method]["nominal"]["balance_efficiency"]),
            "max": _where(hi, hi["methods"][method]["nominal"]["balance_efficiency"])}


def estimate_gap(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Largest |estimate / simulated - 1| of eth's plans: how far the planner's own objective is off."""
    cases = [r for r in rows if r["methods"]["eth"]["feasible"]]
    if not cases:
        return None

    def gap(r: dict[str, Any]) -> float:
        nominal = r["methods"]["eth"]["nominal"]
        return nominal["estimate_tokens_per_s"] / nominal["tokens_per_s"] - 1.0

    worst = max(cases, key=lambda r: abs(gap(r)))
    return {**_where(worst, gap(worst)), "threshold": GAP_THRESHOLD,
            "num_over_threshold": sum(1 for r in cases if abs(gap(r)) > GAP_THRESHOLD), "num_cases": len(cases)}


def planning_at(scale: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in scale:
        if row["gpus"] in HEADLINE_SIZES:
            out.append({"gpus": row["gpus"], "eth_s": row["eth"]["planning_s"],
                        "layer_balanced_s": row["layer_balanced"]["planning_s"],
                        "layer_balanced_timed_out": row["layer_balanced"]["timed_out"],
                        "exhaustive_eth_s": row["exhaustive_eth"]["planning_s"],
                        "exhaustive_eth_status": row["exhaustive_eth"]["status"]})
    return out


def loss_cause(eth: dict[str, Any], base: dict[str, Any]) -> str:
    """Which part of the simulated iteration grew most from the baseline's to eth's."""
    def rest(v: dict[str, Any]) -> float:
        return v["iteration_s"] - v["makespan_s"] - v["exposed_comm_s"]
    deltas = {"the pipelines' flush": eth["makespan_s"] - base["makespan_s"],
              "exposed gradient sync": eth["exposed_comm_s"] - base["exposed_comm_s"],
              "the optimizer step": rest(eth) - rest(base)}
    return max(deltas, key=lambda k: deltas[k])


def nominal_loss_causes(rows: list[dict[str, Any]], losses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each nominal loss of eth with the part of the simulated iteration that grew most, and both plans."""
    out = []
    for item in losses:
        row = next(r for r in rows if r["cluster"] == item["cluster"] and r["model"] == item["model"]
                   and r["samples_per_gpu"] == item["samples_per_gpu"])
        eth, base = row["methods"]["eth"]["nominal"], row["methods"][item["baseline"]]["nominal"]
        out.append({**item, "cause": loss_cause(eth, base), "eth_plan": eth["summary"],
                    "baseline_plan": base["summary"],
                    "eth_makespan_s": eth["makespan_s"], "baseline_makespan_s": base["makespan_s"],
                    "eth_exposed_comm_s": eth["exposed_comm_s"], "baseline_exposed_comm_s": base["exposed_comm_s"]})
    return out


def plan_quality(search: dict[str, Any]) -> dict[str, Any]:
    """eth vs the exhaustive search over its own space, where that search finished within its budget.

    Below one: eth left throughput on the table. Above one: eth's plan lies outside the exhaustive
    search's one-template-per-pool space (e.g. mixed pipelines) and beats that space's optimum.
    Timed-out searches are counted apart: above one there only says the search had not yet
    reached a plan as good as eth's.
    """
    rows = [r for r in search["scale"] + search["quality"] if "exhaustive_eth" in r]
    done = [r for r in rows if r["exhaustive_eth"]["status"] == "finished"]
    ratios = [r["exhaustive_eth"]["eth_quality"] for r in done]
    below = [{"cluster": r.get("cluster_label", f"the {r['gpus']}-GPU search cluster"), "model": r["model"],
              "value": r["exhaustive_eth"]["eth_quality"]} for r in done if r["exhaustive_eth"]["eth_quality"] < 1.0]
    cut = [r["exhaustive_eth"]["eth_quality"] for r in rows
           if r["exhaustive_eth"]["timed_out"] and r["exhaustive_eth"]["eth_quality"] is not None]
    return {"num_finished": len(done), "num_timed_out": sum(1 for r in rows if r["exhaustive_eth"]["timed_out"]),
            "min": min(ratios) if ratios else None, "max": max(ratios) if ratios else None,
            "num_below": len(below), "below": below, "num_above": sum(1 for v in ratios if v > 1.0),
            "num_timed_out_with_plan": len(cut), "num_above_timed_out": sum(1 for v in cut if v > 1.0)}


def schedule_gain(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """eth's simulated tokens/s over eth told 1F1B only, where both fit: median, range, count (the schedule
    section prints these, so they live in the JSON)."""
    gains = [r["methods"]["eth"]["replay"]["nominal"]["static"]["tokens_per_s"]
             / r["methods"]["eth-1f1b"]["replay"]["nominal"]["static"]["tokens_per_s"]
             for r in rows if all(r["methods"].get(m, {}).get("feasible") for m in ("eth", "eth-1f1b"))
             and "layer-balanced" in r["methods"]]  # the rows the schedule section's table shows
    if not gains:
        return None
    return {"median": statistics.median(gains), "min": min(gains), "max": max(gains), "num_cases": len(gains)}


def summarize(throughput: dict[str, Any], search: dict[str, Any]) -> dict[str, Any]:
    rows = throughput["rows"]
    matrix = summarize_matrix(throughput)
    return {"matrix": matrix, "nominal_loss_causes": nominal_loss_causes(rows, matrix["nominal_losses"]["eth"]),
            "balance_efficiency": {m: efficiency_range(rows, m) for m in throughput["methods"]},
            "estimate_vs_simulated": estimate_gap(rows), "schedule_gain": schedule_gain(rows),
            "planning": planning_at(search["scale"]), "plan_quality": plan_quality(search),
            "infeasible": matrix["infeasible"]}
