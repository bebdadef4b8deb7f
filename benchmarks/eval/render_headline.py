"""Template of the headline numbers and the why-tables: every figure comes from the summary's matrix
(``eval/headline.py``), every sentence states the condition its numbers hold under."""

from __future__ import annotations

from typing import Any

from eval import fmt
from eval.throughput import BASELINES

METHOD_NAMES = {"eth": "eth", "eth-robust": "eth --robust", "eth-1f1b": "eth 1F1B only",
                "layer-balanced": "layer-balanced", "uniform": "uniform",
                "layer-balanced-best-type": "layer-balanced (best type)", "uniform-best-type": "uniform (best type)",
                "best-baseline": "the best baseline"}
BASELINE_CAN = {
    "layer-balanced": "replicates one pipeline shape holding an equal share of every GPU type, with equal data",
    "uniform": "uses equal layers per stage and equal data on replicas taken in rank order",
}


def method_name(m: str) -> str:
    return METHOD_NAMES.get(m, m)


def pair_name(pair: str) -> str:
    a, b = pair.split(" / ")
    return f"{method_name(a)} vs {method_name(b)}"


def cond_name(results: dict[str, dict[str, Any]], key: str) -> str:
    c = next(c for c in results["throughput"]["conditions"] if c["key"] == key)
    return "nominal speeds" if c["which"] is None else f"{c['which']} type at {fmt.num(c['speed'])}x"


def labels_of(results: dict[str, dict[str, Any]]) -> dict[str, str]:
    return {c["key"]: c["label"] for c in results["throughput"]["clusters"]}


def spg_name(spg: int) -> str:
    return "all samples/GPU" if spg == 0 else f"{spg} sample{'' if spg == 1 else 's'}/GPU"


def case_name(item: dict[str, Any], labels: dict[str, str]) -> str:
    return f"{item['model']} on {labels.get(item['cluster'], item['cluster'])}, {spg_name(item['samples_per_gpu'])}"


def cell(results: dict[str, dict[str, Any]], pair: str, cond: str, mode: str, spg: int) -> dict[str, Any]:
    return next(g for g in results["summary"]["matrix"]["grid"] if g["pair"] == pair and g["condition"] == cond
                and g["mode"] == mode and g["samples_per_gpu"] == spg)


def _stat_text(st: dict[str, Any], labels: dict[str, str], where: bool = True) -> str:
    if not st["num_cases"]:
        return "no case where both plans fit"
    text = f"max **{fmt.x(st['max']['value'])}**"
    if where:
        text += f" ({case_name(st['max'], labels)})"
    return text + f", geo-mean **{fmt.x(st['geomean'])}**, min {fmt.x(st['min']['value'])} over {st['num_cases']} cases"


def _series(results: dict[str, dict[str, Any]], pair: str, cond: str, mode: str) -> str:
    spgs = results["throughput"]["samples_per_gpu"]
    vals = [cell(results, pair, cond, mode, s) for s in spgs]
    geo = " / ".join(fmt.x(v["geomean"]) if v["num_cases"] else "n/a" for v in vals)
    return f"geo-mean {geo} at {' / '.join(str(s) for s in spgs)} samples/GPU"


def nominal_check(results: dict[str, dict[str, Any]]) -> str:
    s, labels = results["summary"], labels_of(results)
    losses = s["nominal_loss_causes"]
    baselines = [b for b in BASELINES if f"eth / {b}" in results["throughput"]["pairs"]]
    total = sum(cell(results, f"eth / {b}", "nominal", "static", 0)["num_cases"] for b in baselines)
    est = s["matrix"].get("nominal_estimate_losses", [])
    est_text = ("; by the planner's own closed-form estimate eth is never slower either" if not est else
                f"; **by the planner's own estimate eth is slower in {len(est)} comparison(s)**: "
                + "; ".join(f"{case_name(x, labels)} vs {x['baseline']}: {fmt.x(x['value'])}" for x in est))
    if not losses:
        return (f"- **At nominal speeds eth is never simulated slower than any baseline** ("
                f"{', '.join(method_name(b) for b in baselines)}): none of the "
                f"{total} comparisons where both plans fit is below one (every samples/GPU, no rebalancing)"
                f"{est_text}.")
    items = "; ".join(f"{case_name(x, labels)} vs {x['baseline']}: {fmt.x(x['value'])} (most of the gap: {x['cause']})"
                      for x in losses)
    return (f"- **At nominal speeds eth is simulated slower than a baseline in {len(losses)} of {total} comparisons** "
            f"(a planner bug or an estimate/simulator gap; listed under *Where eth does not win*): {items}{est_text}.")


def headline(results: dict[str, dict[str, Any]]) -> list[str]:
    th, labels = results["throughput"], labels_of(results)
    tol = results["summary"]["matrix"]["tie_tolerance"]
    lines = ["## Headline numbers", "",
             "Every number below holds under the condition stated with it: samples per GPU (global batch = samples "
             "per GPU x GPUs), nominal speeds or one device type slower than the cost model believed (plans are "
             "always made for nominal speeds), and without or with the runtime's online data rebalancing. Speedups "
             "are simulated tokens/s ratios over the cases where both plans fit.", "", nominal_check(results)]
    best = "best-baseline" if "eth / best-baseline" in th["pairs"] else None
    for spg in th["samples_per_gpu"]:
        parts = [f"vs {method_name(b)}: {_stat_text(cell(results, f'eth / {b}', 'nominal', 'static', spg), labels)}"
                 for b in ((best,) if best else ()) + ("layer-balanced", "uniform")]
        lines.append(f"- eth at {spg_name(spg)}, nominal speeds: " + "; ".join(parts) + ".")
    for c in (c["key"] for c in th["conditions"] if c["which"] is not None):
        name = cond_name(results, c)
        for b in ("layer-balanced", "uniform"):
            pair = f"eth / {b}"
            lines.append(f"- eth vs {b}, {name}, every method rebalancing online: "
                         f"{_series(results, pair, c, 'rebalanced')} (all: "
                         f"{_stat_text(cell(results, pair, c, 'rebalanced', 0), labels)}); without rebalancing "
                         f"{_series(results, pair, c, 'static')}.")
    for b in ("layer-balanced", "uniform"):
        pair = f"eth / {b}"
        st, rb = cell(results, pair, "nominal", "static", 0), cell(results, pair, "nominal", "rebalanced", 0)
        if st["num_cases"] and abs(rb["geomean"] / st["geomean"] - 1.0) > tol:
            before, after = _series(results, pair, "nominal", "static"), _series(results, pair, "nominal", "rebalanced")
            lines.append(f"- Online rebalancing at nominal speeds changes eth vs {b} to {after} (from {before}): "
                         f"with {b}'s equal split its faster pipelines wait for the slower ones, and re-splitting "
                         "recovers part of that.")
    nominal_robust = cell(results, "eth-robust / eth", "nominal", "static", 0)
    if nominal_robust["num_cases"]:
        parts = [f"{cond_name(results, c['key'])} {_series(results, 'eth-robust / eth', c['key'], 'rebalanced')} "
                 f"with rebalancing ({_series(results, 'eth-robust / eth', c['key'], 'static')} without)"
                 for c in th["conditions"] if c["which"] is not None]
        diff = results["summary"]["matrix"]["robust_plans"]
        lowest = nominal_robust["min"]["value"]
        price = (f"min {fmt.x(lowest)}: nominal time given up to hedge" if lowest < 1.0 - tol
                 else f"never more than {fmt.pct(tol)} slower")
        nominal = _series(results, "eth-robust / eth", "nominal", "static")
        lines.append(f"- eth --robust chose a plan other than eth's in {diff['num_different']} of {diff['num_cases']} "
                     f"cases. eth --robust vs eth: at nominal speeds {nominal} ({price}); " + "; ".join(parts) + ".")
    lines += [class_summary(results, block) for block in results["summary"]["matrix"]["classes"]
              if block["b"] == "layer-balanced"]
    flat = [g for g in results["summary"]["matrix"]["grid"] if g["pair"] == "eth / layer-balanced"
            and g["samples_per_gpu"] and g["num_cases"] and g["geomean"] < 1.0 + tol]
    if flat:
        where = "; ".join(f"{spg_name(g['samples_per_gpu'])}, {cond_name(results, g['condition'])}, "
                          f"{'with' if g['mode'] == 'rebalanced' else 'without'} rebalancing ({fmt.x(g['geomean'])})"
                          for g in flat)
        lines.append(f"- eth does not gain over layer-balanced on average (geo-mean under {fmt.pct(tol)} above 1) "
                     f"at: {where}.")
    return lines


def best_baseline_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """Per case, eth's speedup over the fastest of the four baselines (nominal speeds, no rebalancing)."""
    rows = results["summary"]["matrix"].get("best_baselines")
    if not rows:
        return []
    labels = labels_of(results)
    lines = ["### eth over the best baseline, per case", "",
             "Nominal speeds, no rebalancing. The best baseline is the fastest of layer-balanced and uniform on "
             "every device and the same two on the best homogeneous subset (each GPU type alone, the fastest kept, "
             "the other devices idle: what a Megatron or torchtitan user would run).", "",
             "| case | best baseline | its plan | eth speedup |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {case_name(r, labels)} | {method_name(r['baseline'])} | {r['baseline_plan']} | "
                     f"{fmt.x(r['value'])} |")
    return lines + [""]


def class_summary(results: dict[str, dict[str, Any]], block: dict[str, Any]) -> str:
    """One line: where eth's wins over a baseline come from, by class, under one condition."""
    spgs = results["throughput"]["samples_per_gpu"]
    mode = "without" if block["mode"] == "static" else "with every method"
    total = sum(c["count"] for c in block["classes"])
    parts = []
    for outcome in ("win", "tie", "loss"):
        items = [c for c in block["classes"] if c["outcome"] == outcome]
        if not items:
            continue
        by: dict[str, list[int]] = {}
        for c in items:
            counts = by.setdefault(c["structure"], [0] * len(spgs))
            for i, spg in enumerate(spgs):
                counts[i] += c["by_samples_per_gpu"][str(spg)]
        text = ", ".join(f"{sum(n)} {structure} ({' / '.join(map(str, n))})" for structure, n in by.items())
        plural = "es" if outcome == "loss" else "s"
        parts.append(f"{sum(c['count'] for c in items)} {outcome}{plural}: {text}")
    return (f"- Where eth's result vs {block['b']} comes from, {cond_name(results, block['condition'])}, {mode} "
            f"rebalancing ({total} cases; per class the cases at {' / '.join(map(str, spgs))} samples/GPU): "
            + "; ".join(parts) + ". Classes and their reasons: *Why eth wins or ties*.")


def grid_table(results: dict[str, dict[str, Any]]) -> list[str]:
    th = results["throughput"]
    spgs = th["samples_per_gpu"] + [0]
    body = []
    for pair in th["pairs"]:
        for c in th["conditions"]:
            for mode in th["modes"]:
                cells = []
                for spg in spgs:
                    st = cell(results, pair, c["key"], mode, spg)
                    cells.append("-" if not st["num_cases"] else
                                 f"{fmt.x(st['geomean'])} ({fmt.x(st['min']['value'])}-{fmt.x(st['max']['value'])}, "
                                 f"n={st['num_cases']})")
                body.append([pair_name(pair), cond_name(results, c["key"]), "yes" if mode == "rebalanced" else "no",
                             *cells])
    head = ["speedup", "speeds", "rebalancing", *[spg_name(s) for s in spgs]]
    return (["Geometric mean (min-max, number of cases) of each speedup, per condition, rebalancing and "
             "samples/GPU:", ""] + fmt.table(head, body, "lll" + "r" * len(spgs)) + [""])


def _why(cls: dict[str, Any], b: str, mode: str, tol: float) -> str:
    """One sentence: how eth's plan relates to the baseline's, and (rebalanced) what rebalancing did."""
    s = cls["structure"]
    if s == "same plan":
        text = f"eth chose exactly the {b} plan"
    elif s == "same layout":
        text = f"eth used {b}'s pipelines and layer split with another data split, micro-batch size or recomputation"
    elif s in ("idle devices", "data-balanced kinds", "idle devices + data-balanced kinds"):
        k = cls["a_kinds"]
        kinds = str(k[0]) if k[0] == k[1] else f"{k[0]}-{k[1]}"
        data = f"feeds {kinds} pipeline kinds on different device types unequal data, which {b} cannot express"
        idle = f"leaves GPUs idle that {b}'s plan uses"
        text = "eth " + {"idle devices": idle, "data-balanced kinds": data}.get(s, f"{idle} and {data}")
    else:
        text = "eth chose another layout with one pipeline kind or equal data (depth, tensor-parallel degree, layers)"
    if cls["outcome"] == "tie" and s != "same plan":
        text += f", for a difference under {fmt.pct(tol)}"
    elif cls["outcome"] == "loss":
        text += ", and that plan is slower here"
    if mode == "rebalanced" and cls["mechanism"] is not None:
        ga, gb = cls["median_a_gain"], cls["median_b_gain"]
        could = f"{b} had >1 pipeline kind in {cls['b_could_rebalance']} of {cls['count']}"
        if cls["mechanism"] == "unchanged" and fmt.x(ga) == fmt.x(gb) == fmt.x(1.0):
            text += "; neither plan re-split"
        else:
            verb = {"widened": "widened", "narrowed": "narrowed", "unchanged": "kept"}[cls["mechanism"]]
            text += (f"; rebalancing {verb} the gap (median re-split gain eth {fmt.x(ga)}, {b} {fmt.x(gb)}; "
                     f"{could})")
    return text + "."


def class_tables(results: dict[str, dict[str, Any]]) -> list[str]:
    labels, tol = labels_of(results), results["summary"]["matrix"]["tie_tolerance"]
    spgs = results["throughput"]["samples_per_gpu"]
    lines = ["### Why eth wins or ties", "",
             f"Each case is classed by its outcome (win / tie within {fmt.pct(tol)} / loss) and by how eth's nominal "
             "plan relates to the baseline's, compared structurally: same plan (pipelines, layers, micro-batches and "
             "split), same layout (pipelines and layers), eth feeding several pipeline kinds unequal data (data "
             "balancing), eth leaving GPUs idle, both, or another layout. What the baselines cannot express: "
             + "; ".join(f"{b} {can}" for b, can in BASELINE_CAN.items()) + ". Speed errors are classed with every "
             "method rebalancing online, and the class also says whether re-splitting widened, kept or narrowed the "
             f"static gap. Cases per samples/GPU are listed as {' / '.join(str(s) for s in spgs)}.", ""]
    for block in results["summary"]["matrix"]["classes"]:
        b, mode = block["b"], block["mode"]
        title = (f"eth vs {b}, {cond_name(results, block['condition'])}, "
                 f"{'with' if mode == 'rebalanced' else 'without'} rebalancing")
        body = []
        for cls in block["classes"]:
            counts = " / ".join(str(cls["by_samples_per_gpu"][str(s)]) for s in spgs)
            rng = fmt.x(cls["median"]) + (f" ({fmt.x(cls['min'])}-{fmt.x(cls['max'])})" if cls["count"] > 1 else "")
            body.append([cls["outcome"], cls["structure"] + (f", {cls['mechanism']}" if cls["mechanism"] else ""),
                         f"{cls['count']} ({counts})", rng, _why(cls, b, mode, tol),
                         f"{case_name(cls['example'], labels)}: {fmt.x(cls['example']['value'])}"])
        lines += [f"*{title}*", ""]
        lines += fmt.table(["outcome", "eth's plan", "cases", "speedup median (range)", "why", "most extreme case"],
                           body, "llrrll") + [""]
    return lines


def ability_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """What online rebalancing could do for each method, from the replays."""
    th, ab = results["throughput"], results["summary"]["matrix"]["rebalance_ability"]
    labels = labels_of(results)
    conds = [c["key"] for c in th["conditions"]]
    body = []
    for m in th["methods"]:
        a = ab[m]
        if not a["num_cases"]:
            continue
        cells = []
        for c in conds:
            x = a["conditions"][c]
            cells.append(f"{x['num_applied']} re-split; gain median {fmt.x(x['median_gain'])}, max "
                         f"{fmt.x(x['max_gain'])}" + (f"; {x['num_memory_stops']} stopped by memory"
                                                      if x["num_memory_stops"] else ""))
        body.append([method_name(m), str(a["num_cases"]), str(a["num_single_pipeline"]), str(a["num_multi_kind"]),
                     str(a["num_unequal_data"]), *cells])
    reb = th["rebalance"]
    lines = ["### What online rebalancing can do for each method", "",
             "Rebalancing re-splits the global batch across a plan's pipelines (layers stay, micro-batch sizes stay, "
             "memory checked). It can only help where pipelines are hit differently: a plan with one pipeline has "
             "nothing to re-split, and replicas that all hold the same share of every GPU type slow down alike. The "
             f"runtime's rule is replayed: re-split only when the fitted model predicts more than "
             f"{fmt.pct(reb['threshold'])} saving, at most {reb['max_rounds']} checks. Per method, over the cases "
             "where it fits: plans with a single pipeline, with more than one pipeline kind (device-type sequence), "
             "with unequal data; per condition: cases where a re-split was applied and the tokens/s gain "
             "(rebalanced / static).", ""]
    lines += fmt.table(["method", "cases", "one pipeline", ">1 kind", "unequal data",
                        *[cond_name(results, c) for c in conds]], body, "lrrrr" + "l" * len(conds))
    for m in th["methods"]:
        for c in conds:
            x = ab[m]["conditions"][c]
            if x["num_below_threshold"]:
                lines.append(f"- {method_name(m)}, {cond_name(results, c)}: {x['num_below_threshold']} case(s) "
                             "predicted a saving at or under the threshold and kept their split.")
            if x["max_gain_where"] and x["max_gain"] > 1.0:
                lines.append(f"- {method_name(m)}, {cond_name(results, c)}: largest gain {fmt.x(x['max_gain'])} on "
                             f"{case_name(x['max_gain_where'], labels)}.")
    return lines + [""]
