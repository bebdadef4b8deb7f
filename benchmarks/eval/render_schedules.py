"""docs/evaluation.md's schedule section: eth with every schedule vs eth with 1F1B only vs layer-balanced.

Pure function of eval_throughput.json: bubble factor (the planner's decomposition, ``efficiency_factors``)
and simulated tokens/s per case, which schedules eth's pipelines run, and the 128-GPU H100/A100/L4
llama2-7b case the schedule work was aimed at.
"""

from __future__ import annotations

from typing import Any

from eval import fmt
from eval.render_headline import case_name, labels_of

TARGET = ("h100_a100_l4_128", "llama2-7b", 1)  # the case: 1F1B's bubble 0.80 there
METHODS = ("eth", "eth-1f1b", "layer-balanced")


def _bubble(m: dict[str, Any]) -> float | None:
    return m["nominal"]["efficiency_factors"].get("bubble") if m["feasible"] else None


def _cell(m: dict[str, Any]) -> str:
    if not m["feasible"]:
        return "does not fit"
    b = _bubble(m)
    return f"{fmt.ktok(m['replay']['nominal']['static']['tokens_per_s'])} ({b:.2f})" if b is not None else "-"


def _schedules(m: dict[str, Any]) -> str:
    if not m["feasible"]:
        return "-"
    return ", ".join(f"{n} x{k}" for n, k in m["nominal"].get("schedules", {}).items())


def section(results: dict[str, dict[str, Any]]) -> list[str]:
    th = results["throughput"]
    rows = [r for r in th["rows"] if all(m in r["methods"] for m in METHODS)]
    if not rows:
        return []
    labels = labels_of(results)
    lines = ["## Schedules: zb-h1 and interleaved beside 1F1B, per pipeline", "",
             "eth may give each pipeline the fastest schedule its memory allows (docs/design.md §2.4: 1F1B, zb-h1, "
             "the zero-bubble schedule whose weight-gradient passes fill the drain, or interleaved 1F1B with 2-4 model "
             "chunks per stage, tried on eth's final plan where it fits, and inside its search where zb-h1 is not "
             "allowed); *eth 1F1B only* is the same "
             "planner told `--schedules 1f1b`; the baselines run 1F1B, their published schedule. Each cell: simulated "
             "k tokens/s at nominal speeds (the planner's bubble factor in brackets: the flush with compute only over "
             "the slowest stage's compute, capacity-weighted over pipelines; 1.00 = no bubble).", ""]
    body = []
    for r in rows:
        m = r["methods"]
        body.append(f"| {case_name(r, labels)} | " + " | ".join(_cell(m[x]) for x in METHODS)
                    + f" | {_schedules(m['eth'])} |")
    gain = results["summary"].get("schedule_gain")
    if gain:
        lines += [f"eth over eth 1F1B only (simulated tokens/s): median {gain['median']:.3f}x, range "
                  f"{gain['min']:.3f}x to {gain['max']:.3f}x over {gain['num_cases']} cases; eth never chooses a schedule it "
                  f"predicts slower, so a ratio under 1 is the simulator disagreeing with the planner's estimate.", ""]
    lines += ["| case | eth | eth 1F1B only | layer-balanced | eth's pipelines run |", "|---|---|---|---|---|", *body, ""]
    target = next((r for r in rows if (r["cluster"], r["model"], r["samples_per_gpu"]) == TARGET), None)
    if target is not None and target["methods"]["eth"]["feasible"]:
        zb, one = _bubble(target["methods"]["eth"]), _bubble(target["methods"]["eth-1f1b"])
        verdict = ("reaches" if zb is not None and zb >= 0.90 else "stays below")
        lines += [f"The case the schedule work aimed at, {case_name(target, labels)}: the bubble factor is "
                  f"{one:.3f} with 1F1B only and {zb:.3f} with every schedule allowed ({verdict} 0.90; eth's pipelines run "
                  f"{_schedules(target['methods']['eth'])}). Interleaving that plan does not fit there: its "
                  "2-stage pipelines' first stage would hold 2.5 micro-batches of activations instead of 2 "
                  "(tests/unit/test_planner_schedules.py).", ""]
    return lines
