"""Template of the throughput section of docs/evaluation.md (per-cluster tables), from its JSON only."""

from __future__ import annotations

from typing import Any

from eval import fmt
from eval.render_headline import (ability_table, case_name, class_tables, cond_name, grid_table, labels_of,
                                  method_name, spg_name)


def intro(results: dict[str, dict[str, Any]]) -> list[str]:
    th = results["throughput"]
    spgs = " / ".join(str(s) for s in th["samples_per_gpu"])
    subsets = "; ".join(f"{labels_of(results).get(c, c)}: {', '.join(ms)}" for c, ms in th["model_subsets"].items())
    conds = ", ".join(cond_name(results, c["key"]) for c in th["conditions"])
    lines = ["## Throughput on realistic clusters", "",
             f"Each cluster runs each model at {spgs} samples per GPU (global batch = samples per GPU x GPUs; the "
             "models' published recipe batches are not used here, so every cluster is seen with little and with much "
             f"data per GPU). Models: {', '.join(th['models'])}"
             + (f"; clusters with a subset (to bound the run time): {subsets}" if subsets else "") + ". "
             f"Methods: {', '.join(method_name(m) for m in th['methods'])}; every plan is made with the shipped, "
             f"calibrated cost model at nominal speeds. Each plan is then replayed by the simulator under: {conds}. "
             "'Slowest' and 'fastest' are by the cost model's own speeds; a slowed type's compute takes 1/speed as "
             "long (links, all-reduces and the optimizer step keep their nominal prices), as in "
             "`planner/robust.py`. Each replay is reported without rebalancing (the plan's own split) and with the "
             "runtime's online data rebalancing (`runtime/adapt/rebalance.py`, below). eth --robust plans for the best worst "
             "case over `planner/robust.py`'s perturbation set, which includes both slowdowns replayed here.", ""]
    return lines + ability_table(results) + class_tables(results) + grid_table(results)


def _pipes(m: dict[str, Any]) -> str:
    return m["nominal"]["summary"] if m["feasible"] else "-"


def _tok(m: dict[str, Any], cond: str = "nominal", mode: str = "static") -> str:
    return fmt.ktok(m["replay"][cond][mode]["tokens_per_s"]) if m["feasible"] else "does not fit"


def _pair(row: dict[str, Any], pair: str, cond: str) -> str:
    s, r = row["speedup"]["static"][cond][pair], row["speedup"]["rebalanced"][cond][pair]
    if s is None:
        return "n/a"
    return fmt.x(s) if fmt.x(s) == fmt.x(r) else f"{fmt.x(s)} -> {fmt.x(r)}"


def _same(row: dict[str, Any], a: str, b: str) -> bool:
    ma, mb = row["methods"][a], row["methods"][b]
    return ma["feasible"] and mb["feasible"] and ma["signature"]["plan"] == mb["signature"]["plan"]


def cluster_tables(results: dict[str, dict[str, Any]]) -> list[str]:
    th = results["throughput"]
    miss = [c["key"] for c in th["conditions"] if c["which"] is not None]
    losses = {(x["cluster"], x["model"], x["samples_per_gpu"], x["baseline"]): x
              for x in results["summary"]["nominal_loss_causes"]}
    lines = ["### Per cluster", "",
             "Nominal table: simulated thousands of tokens/s of each method's plan at nominal speeds, eth's speedups, "
             "eth's balance efficiency (physical limit / simulated iteration time, docs/design.md §4), eth's smallest "
             "memory headroom, and the pipelines of eth and of eth --robust and layer-balanced where they differ "
             "from eth's ('= eth': the same plan). Speed-error table: speedups without -> with online rebalancing "
             "(one number where rebalancing changed nothing); the slowed type is named in the header.", ""]
    for cluster in th["clusters"]:
        rows = [r for r in th["rows"] if r["cluster"] == cluster["key"]]
        counts = ", ".join(f"{n}x {t}" for t, n in cluster["gpu_counts"].items())
        lines += [f"#### {cluster['label']}", "", f"{cluster['gpus']} GPUs ({counts}); `{cluster['file']}`.", ""]
        body, notes, err_body = [], [], []
        for r in rows:
            m = r["methods"]
            key = [r["model"], str(r["samples_per_gpu"])]
            if not any(v["feasible"] for v in m.values()):
                notes.append(f"- {r['model']} at {spg_name(r['samples_per_gpu'])}: no method fits "
                             f"({m['eth']['error']}).")
                continue
            eth = m["eth"]
            nom = eth.get("nominal", {})
            head = f"{fmt.pct(nom['min_headroom_frac'])} ({fmt.gib(nom['min_headroom_gib'])} GiB)" if nom else "-"
            others = "; ".join(f"{method_name(o)}: {'= eth' if _same(r, o, 'eth') else _pipes(m[o])}"
                               for o in ("eth-robust", "layer-balanced"))
            body.append([*key, str(r["global_batch"]), *[_tok(m[x]) for x in th["methods"]],
                         _pair(r, "eth / layer-balanced", "nominal").split(" ->")[0],
                         _pair(r, "eth / uniform", "nominal").split(" ->")[0],
                         fmt.pct(eth["nominal"]["balance_efficiency"]) if eth["feasible"] else "-", head,
                         _pipes(eth), others])
            err_body.append([*key, *[_pair(r, p, c) for c in miss
                                    for p in ("eth / layer-balanced", "eth / uniform", "eth-robust / eth")]])
            for method, v in m.items():
                if v["feasible"] and v.get("search_timed_out"):
                    notes.append(f"- {r['model']} at {spg_name(r['samples_per_gpu'])}: {method_name(method)}'s search "
                                 f"hit its {fmt.sec(th['layer_balanced_budget_s'])} s budget; its best plan so far "
                                 "is used.")
                if not v["feasible"] and any(x["feasible"] for x in m.values()):
                    notes.append(f"- {r['model']} at {spg_name(r['samples_per_gpu'])}: {method_name(method)} does "
                                 f"not fit ({v['error']}).")
            for b in ("layer-balanced", "uniform"):
                x = losses.get((r["cluster"], r["model"], r["samples_per_gpu"], b))
                if x is not None:
                    notes.append(f"- **eth is slower than {b} at nominal speed on {r['model']} at "
                                 f"{spg_name(r['samples_per_gpu'])}** ({fmt.x(x['value'])}): eth's slowest pipeline "
                                 f"flushes at {fmt.sec(x['eth_makespan_s'])} s vs "
                                 f"{fmt.sec(x['baseline_makespan_s'])} s, "
                                 f"exposed gradient sync {fmt.sec(x['eth_exposed_comm_s'])} s vs "
                                 f"{fmt.sec(x['baseline_exposed_comm_s'])} s; most of the gap is {x['cause']}.")
        toks = [f"{method_name(x)} k tok/s" for x in th["methods"]]
        lines += fmt.table(["model", "samples/GPU", "global batch", *toks,
                            "eth / layer-bal.", "eth / uniform", "eth bal. eff.", "eth min headroom", "eth pipelines",
                            "others' pipelines"], body, "lrr" + "r" * len(th["methods"]) + "rrrlll")
        slowed = rows[0]["condition_labels"] if rows else {}
        tags = {c: chr(ord("A") + i) for i, c in enumerate(miss)}
        header = [f"{tags[c]}: {p}" for c in miss for p in ("eth / layer-bal.", "eth / uniform", "eth --robust / eth")]
        lines += ["", "Speed errors, without -> with rebalancing (" + "; ".join(f"{tags[c]}: {slowed.get(c, c)}"
                                                                        for c in miss) + "):", ""]
        lines += fmt.table(["model", "samples/GPU", *header], err_body, "lr" + "r" * len(header))
        lines += ["", f"![throughput on {cluster['label']}]({cluster['figure']})", ""] + notes + ([""] if notes else [])
    return lines


def losses_under_errors(results: dict[str, dict[str, Any]]) -> list[str]:
    """Every case where eth is slower than a baseline beyond the tolerance under a speed error."""
    th, labels = results["throughput"], labels_of(results)
    tol = results["summary"]["matrix"]["tie_tolerance"]
    out = []
    for r in th["rows"]:
        for c in (c["key"] for c in th["conditions"] if c["which"] is not None):
            for b in ("layer-balanced", "uniform"):
                s, rb = r["speedup"]["static"][c][f"eth / {b}"], r["speedup"]["rebalanced"][c][f"eth / {b}"]
                if s is None or min(s, rb) >= 1.0 - tol:
                    continue
                out.append([case_name({**r}, labels), r["condition_labels"][c], b, fmt.x(s), fmt.x(rb)])
    if not out:
        return [f"- Under the speed errors, eth is never slower than a baseline by more than {fmt.pct(tol)}, with or "
                "without rebalancing."]
    return ([f"- Under the speed errors, eth is slower than a baseline by more than {fmt.pct(tol)} in {len(out)} "
             "case(s) (without or with rebalancing): the plan was made for nominal speeds, and the baseline's "
             "plan happens to be hit less by that slowdown, or re-splits better.", ""]
            + fmt.table(["case", "speeds", "baseline", "without rebalancing", "with rebalancing"], out, "lllrr") + [""])
