"""Headline numbers and case classes of the throughput section: pure functions of its rows.

A row is one (cluster, model, samples per GPU) case; ``row["speedup"][mode][condition]["a / b"]``
is method a's simulated tokens/s over method b's (None where either plan does not fit), ``mode``
"static" (the plan's own split) or "rebalanced" (after the runtime's online re-split), and each
method's ``signature`` says what its nominal plan looks like (``common.layout_signature``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from typing import Any

from eval.throughput import BASELINES

TIE_TOLERANCE = 0.01  # |speedup - 1| within this is a tie
NOMINAL = "nominal"
STATIC, REBALANCED = "static", "rebalanced"
OUTCOMES = ("win", "tie", "loss")
STRUCTURES = ("same plan", "same layout", "data-balanced kinds", "idle devices + data-balanced kinds", "idle devices",
              "other layout")
MECHANISMS = ("widened", "unchanged", "narrowed")


def geomean(values: Iterable[float]) -> float:
    vals = list(values)
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def where(row: dict[str, Any]) -> dict[str, Any]:
    return {"cluster": row["cluster"], "model": row["model"], "samples_per_gpu": row["samples_per_gpu"]}


def speedup(row: dict[str, Any], pair: str, cond: str, mode: str) -> float | None:
    return row["speedup"][mode][cond][pair]


def stats(rows: list[dict[str, Any]], pair: str, cond: str, mode: str, tol: float = TIE_TOLERANCE) -> dict[str, Any]:
    """Max, geometric mean, min and losses of one speedup over the rows where both plans fit."""
    cases = [(speedup(r, pair, cond, mode), r) for r in rows if speedup(r, pair, cond, mode) is not None]
    if not cases:
        return {"num_cases": 0}
    best, worst = max(cases, key=lambda c: c[0]), min(cases, key=lambda c: c[0])
    return {"num_cases": len(cases), "geomean": geomean(v for v, _ in cases),
            "max": {"value": best[0], **where(best[1])}, "min": {"value": worst[0], **where(worst[1])},
            "num_slower": sum(1 for v, _ in cases if v < 1.0),
            "num_slower_beyond_tolerance": sum(1 for v, _ in cases if v < 1.0 - tol),
            "num_faster_beyond_tolerance": sum(1 for v, _ in cases if v > 1.0 + tol)}


def grid(rows: list[dict[str, Any]], pairs: list[str], conds: list[str], modes: list[str],
         spgs: list[int]) -> list[dict[str, Any]]:
    """``stats`` for every pair x condition x mode x samples per GPU (and over all samples per GPU: 0)."""
    out = []
    for pair in pairs:
        for cond in conds:
            for mode in modes:
                for spg in list(spgs) + [0]:
                    sel = [r for r in rows if spg in (0, r["samples_per_gpu"])]
                    out.append({"pair": pair, "condition": cond, "mode": mode, "samples_per_gpu": spg,
                                **stats(sel, pair, cond, mode)})
    return out


def nominal_losses(rows: list[dict[str, Any]], method: str, baselines: list[str]) -> list[dict[str, Any]]:
    """Every case where ``method``'s own plan is simulated slower than a baseline's at nominal speed."""
    return [{**where(r), "baseline": b, "value": v} for r in rows for b in baselines
            if (v := speedup(r, f"{method} / {b}", NOMINAL, STATIC)) is not None and v < 1.0]


def estimate_losses(rows: list[dict[str, Any]], method: str, baselines: list[str]) -> list[dict[str, Any]]:
    """The same check on the planner's closed-form estimates (what the planner itself compares)."""
    out = []
    for r in rows:
        m = r["methods"][method]
        for b in baselines:
            mb = r["methods"][b]
            if m["feasible"] and mb["feasible"]:
                value = m["nominal"]["estimate_tokens_per_s"] / mb["nominal"]["estimate_tokens_per_s"]
                if value < 1.0:
                    out.append({**where(r), "baseline": b, "value": value})
    return out


def outcome(value: float, tol: float = TIE_TOLERANCE) -> str:
    return "win" if value > 1.0 + tol else ("loss" if value < 1.0 - tol else "tie")


def structure(a: dict[str, Any], b: dict[str, Any]) -> str:
    """How plan a's nominal layout relates to plan b's (signatures of ``common.layout_signature``)."""
    if a["plan"] == b["plan"]:
        return "same plan"
    if a["layout"] == b["layout"]:
        return "same layout"
    idle = a.get("devices_used", 0) < b.get("devices_used", 0)
    data = a["kinds"] > 1 and a["unequal_data"]
    if idle and data:
        return "idle devices + data-balanced kinds"
    if idle or data:
        return "idle devices" if idle else "data-balanced kinds"
    return "other layout"


def gain(method: dict[str, Any], cond: str) -> float:
    """Tokens/s after online rebalancing over before, for one method under one condition."""
    r = method["replay"][cond]
    return r[REBALANCED]["tokens_per_s"] / r[STATIC]["tokens_per_s"]


def mechanism(static: float, rebalanced: float, tol: float = TIE_TOLERANCE) -> str:
    """What rebalancing did to the gap between two methods."""
    if rebalanced > static * (1.0 + tol):
        return "widened"
    return "narrowed" if rebalanced < static * (1.0 - tol) else "unchanged"


def classify(row: dict[str, Any], a: str, b: str, cond: str, mode: str) -> dict[str, Any] | None:
    pair = f"{a} / {b}"
    value = speedup(row, pair, cond, mode)
    if value is None:
        return None
    ma, mb = row["methods"][a], row["methods"][b]
    out = {**where(row), "value": value, "outcome": outcome(value),
           "structure": structure(ma["signature"], mb["signature"]),
           "a_kinds": ma["signature"]["kinds"], "b_kinds": mb["signature"]["kinds"],
           "a_gain": gain(ma, cond), "b_gain": gain(mb, cond), "mechanism": None}
    if mode == REBALANCED:
        out["mechanism"] = mechanism(speedup(row, pair, cond, STATIC), value)  # type: ignore[arg-type]
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def classes(rows: list[dict[str, Any]], a: str, b: str, cond: str, mode: str, spgs: list[int]) -> list[dict[str, Any]]:
    """Cases grouped by (outcome, structure[, mechanism]) with counts per samples per GPU, the speedup's
    median and range, the methods' rebalancing gains, and one example (the largest |speedup - 1|)."""
    groups: dict[tuple[str, str, str | None], list[dict[str, Any]]] = {}
    for row in rows:
        item = classify(row, a, b, cond, mode)
        if item is not None:
            groups.setdefault((item["outcome"], item["structure"], item["mechanism"]), []).append(item)
    order = {k: i for i, k in enumerate(OUTCOMES + STRUCTURES + MECHANISMS)}
    out = []
    for key in sorted(groups, key=lambda k: tuple(order.get(x, 99) for x in k)):
        items = groups[key]
        values = [i["value"] for i in items]
        example = max(items, key=lambda i: abs(math.log(i["value"])))
        out.append({"outcome": key[0], "structure": key[1], "mechanism": key[2], "count": len(items),
                    "by_samples_per_gpu": {str(s): sum(1 for i in items if i["samples_per_gpu"] == s) for s in spgs},
                    "median": statistics.median(values), "min": min(values), "max": max(values),
                    "a_kinds": [min(i["a_kinds"] for i in items), max(i["a_kinds"] for i in items)],
                    "b_kinds": [min(i["b_kinds"] for i in items), max(i["b_kinds"] for i in items)],
                    "median_a_gain": _median([i["a_gain"] for i in items]),
                    "median_b_gain": _median([i["b_gain"] for i in items]),
                    "b_could_rebalance": sum(1 for i in items if i["b_kinds"] > 1),
                    "example": example})
    return out


def rebalance_ability(rows: list[dict[str, Any]], method: str, conds: list[str]) -> dict[str, Any]:
    """What online rebalancing did for one method: plans with more than one pipeline kind, checks that
    applied a re-split, stops for memory, and the tokens/s gain per condition."""
    feasible = [r for r in rows if r["methods"][method]["feasible"]]
    per_cond = {}
    for cond in conds:
        recs = [r["methods"][method]["replay"][cond][REBALANCED] for r in feasible]
        gains = [gain(r["methods"][method], cond) for r in feasible]
        per_cond[cond] = {"num_cases": len(feasible), "num_applied": sum(1 for x in recs if x["applied"] > 0),
                          "num_memory_stops": sum(1 for x in recs if x["stop"] == "re-split would exceed memory"),
                          "num_below_threshold": sum(1 for x in recs if x["applied"] == 0 and
                                                     (x["first_predicted_gain"] or 0.0) > 0.0),
                          "median_gain": _median(gains), "max_gain": max(gains) if gains else None,
                          "max_gain_where": (where(max(feasible, key=lambda r: gain(r["methods"][method], cond)))
                                             if feasible else None)}
    return {"num_cases": len(feasible),
            "num_multi_kind": sum(1 for r in feasible if r["methods"][method]["signature"]["kinds"] > 1),
            "num_single_pipeline": sum(1 for r in feasible if r["methods"][method]["nominal"]["num_pipelines"] == 1),
            "num_unequal_data": sum(1 for r in feasible if r["methods"][method]["signature"]["unequal_data"]),
            "conditions": per_cond}


def different_plans(rows: list[dict[str, Any]], a: str, b: str) -> dict[str, int]:
    """In how many cases (both fit) method a's nominal plan differs from method b's."""
    both = [r for r in rows if r["methods"][a]["feasible"] and r["methods"][b]["feasible"]]
    return {"num_cases": len(both), "num_different": sum(1 for r in both if structure(
        r["methods"][a]["signature"], r["methods"][b]["signature"]) != "same plan")}


def best_baseline_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case: the fastest baseline at nominal speeds (no rebalancing) and eth's speedup over it."""
    out = []
    for r in rows:
        best = r.get("best_baseline")
        value = r["speedup"][STATIC][NOMINAL].get("eth / best-baseline")
        if best is not None and value is not None:
            out.append({**where(r), "baseline": best, "value": value,
                        "baseline_plan": r["methods"][best]["nominal"]["summary"]})
    return out


def summarize_matrix(section: dict[str, Any]) -> dict[str, Any]:
    """Everything the headline and the class tables print, from the throughput section."""
    rows, spgs = section["rows"], section["samples_per_gpu"]
    conds = [c["key"] for c in section["conditions"]]
    main = [("eth", "layer-balanced"), ("eth", "uniform")]
    # nominal plans as made; each speed error with every method rebalancing online (the static speed-error
    # numbers are in the grid)
    class_sets = [(NOMINAL, STATIC)] + [(c, REBALANCED) for c in conds if c != NOMINAL]
    return {
        "tie_tolerance": TIE_TOLERANCE,
        "grid": grid(rows, section["pairs"], conds, section["modes"], spgs),
        "nominal_losses": {m: nominal_losses(rows, m, [b for b in BASELINES if f"{m} / {b}" in section["pairs"]])
                           for m in ("eth", "eth-robust")},
        "nominal_estimate_losses": estimate_losses(rows, "eth", [b for b in BASELINES
                                                                 if f"eth / {b}" in section["pairs"]]),
        "best_baselines": best_baseline_rows(rows),
        "classes": [{"a": a, "b": b, "condition": c, "mode": m, "classes": classes(rows, a, b, c, m, spgs)}
                    for a, b in main for c, m in class_sets],
        "rebalance_ability": {m: rebalance_ability(rows, m, conds) for m in section["methods"]},
        "robust_plans": different_plans(rows, "eth-robust", "eth"),
        "infeasible": [{**where(r), "method": m, "error": r["methods"][m]["error"]}
                       for r in rows for m in section["methods"] if not r["methods"][m]["feasible"]],
    }
