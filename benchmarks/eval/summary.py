"""Headline numbers, computed from the section results (never typed in)."""

from __future__ import annotations

import math
from typing import Any

from eval.common import BASELINES, METHODS

HEADLINE_SIZES = (1024, 4096)
TIE_TOLERANCE = 0.01  # a loss smaller than this is reported, but called a tie
GAP_THRESHOLD = 0.05  # estimate vs simulation differences worth flagging


def _where(row: dict[str, Any], value: float) -> dict[str, Any]:
    return {"value": value, "cluster": row["cluster"], "model": row["model"]}


def speedup_stats(rows: list[dict[str, Any]], baseline: str) -> dict[str, Any]:
    cases = [r for r in rows if r["speedup"][baseline] is not None]
    if not cases:
        return {"num_cases": 0}
    values = [r["speedup"][baseline] for r in cases]
    best = max(cases, key=lambda r: r["speedup"][baseline])
    worst = min(cases, key=lambda r: r["speedup"][baseline])
    slower = [_where(r, r["speedup"][baseline]) for r in cases if r["speedup"][baseline] < 1.0]
    return {"num_cases": len(cases), "tie_tolerance": TIE_TOLERANCE,
            "num_slower_beyond_tolerance": sum(1 for s in slower if s["value"] < 1.0 - TIE_TOLERANCE),
            "geomean": math.exp(sum(math.log(v) for v in values) / len(values)),
            "max": _where(best, best["speedup"][baseline]), "min": _where(worst, worst["speedup"][baseline]),
            "num_slower": len(slower), "num_not_slower": len(cases) - len(slower), "slower": slower}


def efficiency_range(rows: list[dict[str, Any]], method: str) -> dict[str, Any] | None:
    cases = [r for r in rows if r["methods"][method]["feasible"]]
    if not cases:
        return None
    lo = min(cases, key=lambda r: r["methods"][method]["balance_efficiency"])
    hi = max(cases, key=lambda r: r["methods"][method]["balance_efficiency"])
    return {"min": _where(lo, lo["methods"][method]["balance_efficiency"]),
            "max": _where(hi, hi["methods"][method]["balance_efficiency"])}


def estimate_gap(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Largest |estimate / simulated - 1| of eth's plans: how far the planner's own objective is off."""
    cases = [r for r in rows if r["methods"]["eth"]["feasible"]]
    if not cases:
        return None

    def gap(r: dict[str, Any]) -> float:
        return r["methods"]["eth"]["estimate_tokens_per_s"] / r["methods"]["eth"]["tokens_per_s"] - 1.0

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


def losses(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"cluster": r["cluster"], "model": r["model"], "baseline": b, "speedup": sp,
             "cause": loss_cause(r["methods"]["eth"], r["methods"][b])}
            for r in rows for b, sp in r["speedup"].items() if sp is not None and sp < 1.0]


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


def summarize(throughput: dict[str, Any], search: dict[str, Any]) -> dict[str, Any]:
    rows = throughput["rows"]
    infeasible = [{"cluster": r["cluster"], "model": r["model"], "method": m, "error": r["methods"][m]["error"]}
                  for r in rows for m in METHODS if not r["methods"][m]["feasible"]]
    lost = losses(rows)
    causes: dict[str, int] = {}
    for item in lost:
        causes[item["cause"]] = causes.get(item["cause"], 0) + 1
    return {"speedup": {b: speedup_stats(rows, b) for b in BASELINES}, "losses": lost, "loss_causes": causes,
            "balance_efficiency": {m: efficiency_range(rows, m) for m in METHODS},
            "estimate_vs_simulated": estimate_gap(rows),
            "planning": planning_at(search["scale"]), "plan_quality": plan_quality(search), "infeasible": infeasible}
