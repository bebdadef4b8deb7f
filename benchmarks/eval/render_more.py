"""Template of the later sections of docs/evaluation.md (ablations, measured, sensitivity, losses)."""

from __future__ import annotations

from typing import Any

from eval import fmt
from eval.render_headline import case_name, labels_of
from eval.render_throughput import losses_under_errors

SWEEP_TITLES = {"speed_ratio": ("Speed ratio between the two GPU types", "fast / slow"),
                "nic_gbit_s": ("Inter-node bandwidth", "NIC Gbit/s")}


def _options(fields: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in fields.items()) or "-"


def ablation(results: dict[str, dict[str, Any]]) -> list[str]:
    sec = results["ablation"]
    lines = ["## Ablations", "",
             "eth with one idea switched off through `PlannerOptions`, each plan replayed by the simulator (the "
             "flat-sync variant is also replayed with flat sync). \"eth plan replayed with flat sync\" keeps the "
             "full eth plan and only removes block-wise overlap at run time. Relative = tokens/s over full eth's.", ""]
    if sec["planner_options_missing"]:
        lines += [f"**Planner-level ablations could not run:** {sec['planner_options_missing']}. Only the run-time "
                  "flat-sync replay below is a real measurement of an ablation.", ""]
    for r in sec["rows"]:
        lines += [f"### {r['model']} on {r['cluster_label']}", ""]
        eth = r["eth"]
        if not eth["feasible"]:
            lines += [f"eth does not fit: {eth['error']}", ""]
            continue
        body = [["full eth", "-", fmt.ktok(eth["tokens_per_s"]), fmt.x(1.0 if eth["feasible"] else None),
                 fmt.pct(eth["balance_efficiency"]), eth["summary"]]]
        for name in sec["variant_names"]:
            v = r["variants"][name]
            if v["feasible"]:
                body.append([name, _options(v.get("options", {})), fmt.ktok(v["tokens_per_s"]), fmt.x(v["relative"]),
                             fmt.pct(v["balance_efficiency"]), v["summary"]])
            else:
                body.append([name, _options(v.get("options", {})), "-", "-", "-", f"not run: {v['error']}"])
        lines += fmt.table(["variant", "options", "k tok/s", "relative", "bal. eff.", "pipelines"], body, "llrrrl")
        lines.append("")
    lines += [f"![ablations]({sec['figure']})", ""]
    for name in sec["variant_names"]:
        rel = [(r, r["variants"][name]["relative"]) for r in sec["rows"]
               if name in r["variants"] and r["variants"][name].get("relative") is not None]
        if not rel:
            continue
        better = [f"{r['model']} on {r['cluster_label']} ({fmt.x(v)})" for r, v in rel if v > 1.0]
        lo, hi = fmt.x(min(v for _, v in rel)), fmt.x(max(v for _, v in rel))
        line = f"- {name}: {lo if lo == hi else f'{lo} to {hi}'} of full eth's throughput over {len(rel)} case(s)."
        if better:
            line += (f" **This restricted variant was faster** in {'; '.join(better)}: the full planner misses a plan in "
                     "this restricted space there.")
        lines.append(line)
    return lines + [""]


SKIPPED_KEYS = ("command", "machine")  # shown in the provenance line


def _scalar(v: Any) -> bool:
    return not isinstance(v, (list, dict))


def _cell(v: Any) -> str:
    """A table cell: scalars, or a list of scalars joined; anything deeper stays in the JSON."""
    if isinstance(v, list) and all(_scalar(x) for x in v):
        return ", ".join(fmt.num(x) for x in v)
    return fmt.num(v) if _scalar(v) else "(nested)"


def _foreign_table(data: Any, title: str) -> list[str]:
    """Render a foreign benchmark's JSON: lists of records and records of records become tables."""
    if isinstance(data, list) and data and all(isinstance(d, dict) for d in data):
        keys = [k for k in dict.fromkeys(k for d in data for k in d) if all(_cell(d.get(k, "")) != "(nested)"
                                                                             for d in data)]
        return [f"*{title}*", ""] + fmt.table(keys, [[_cell(d.get(k, "")) for k in keys] for d in data],
                                               "l" * len(keys)) + [""]
    if not isinstance(data, dict):
        return [f"- {title}: {_cell(data)}", ""]
    out = [f"- {title} / {k}: {_cell(v)}" for k, v in data.items()
           if k not in SKIPPED_KEYS and _cell(v) != "(nested)"]
    out += [""] if out else []
    for k, v in data.items():
        if k in SKIPPED_KEYS or _cell(v) != "(nested)":
            continue
        if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
            keys = [c for c in dict.fromkeys(c for x in v.values() for c in x)
                    if all(_cell(x.get(c, "")) != "(nested)" for x in v.values())]
            body = [[name] + [_cell(x.get(c, "")) for c in keys] for name, x in v.items()]
            out += [f"*{title} / {k}*", ""] + fmt.table([""] + keys, body, "l" * (len(keys) + 1)) + [""]
        else:
            out += _foreign_table(v, f"{title} / {k}")
    return out


def _emulation_note(sources: list[dict[str, Any]]) -> str:
    """What the runs' emulation mode makes their numbers evidence of (docs/runtime.md, "Emulation model")."""
    modes = {src["name"]: src.get("emulation_modes", []) for src in sources if src["exists"]}
    listed = "; ".join(f"{name}: {', '.join(m) or 'not recorded'}" for name, m in modes.items())
    return ("In *paced* emulation every forward/backward sleeps to the cost model's own predicted compute time "
            "(this CPU's profile x time_scale / speed), so paced figures confirm the schedule, the communication "
            "and the runtime overheads, not the compute model; in *measured* emulation each action lasts its real "
            "CPU time x time_scale / speed, and the prediction from this CPU's profile is tested on compute too. "
            f"Modes of the runs below: {listed}.")


def measured(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["## Measured on this machine", "",
             "Real runs of the runtime on CPU processes under `--emulate`, written by the runtime and fidelity "
             "benchmarks and copied here verbatim with their provenance; this suite does not re-run them. "
             f"{_emulation_note(results['measured']['sources'])}", ""]
    for src in results["measured"]["sources"]:
        lines += [f"### {src['name']}", ""]
        if not src["exists"]:
            lines += [f"`{src['path']}` does not exist in this checkout: run `{src['script']}` to produce it.", ""]
            continue
        report = f" Its own report, with its discussion of the numbers: `{src['report']}`." if src["report"] else ""
        lines += [f"From `{src['path']}` (sha256 {src['sha256']}, modified {src['modified']}), written by "
                  f"`{src['command'] or src['script'] + ' (command not recorded)'}` on "
                  f"{(src['machine'] or 'a machine it did not record').rstrip('.')}.{report}", ""]
        lines += _foreign_table(src["data"], src["name"])
        for text in src.get("derived", []):
            lines.append(f"- {text}")
        lines.append("")
    return lines


def _sweep_text(sweep: dict[str, Any], unit: str, tol: float) -> list[str]:
    out = []
    for baseline, a in sweep["analysis"].items():
        if a["min"] is None:
            out.append(f"- vs {baseline}: no point where both plans fit.")
            continue
        where = ", ".join(fmt.num(x) for x in a["no_gain_x"])
        text = (f"- vs {baseline}: speedup {fmt.x(a['min']['speedup'])} at {fmt.num(a['min']['x'])} {unit} to "
                f"{fmt.x(a['max']['speedup'])} at {fmt.num(a['max']['x'])} {unit}. ")
        if a["no_gain_x"]:
            text += f"**eth stops helping** (gain under {fmt.pct(tol)}) at {where} {unit}"
            text += (f", and is slower at {', '.join(fmt.num(x) for x in a['loss_x'])} {unit}." if a["loss_x"] else ".")
        else:
            text += f"eth gains at least {fmt.pct(tol)} at every point of the sweep."
        out.append(text)
    return out


def sensitivity(results: dict[str, dict[str, Any]]) -> list[str]:
    sec = results["sensitivity"]
    lines = ["## Sensitivity", "",
             f"{sec['model']}, batch {sec['global_batch']} x {sec['seq_len']}. Speed ratio: two nodes of 8 'fast' "
             f"GPUs ({fmt.num(sec['fast_peak_tflops'])} TFLOPS peak, same memory and links as the slow ones) and two "
             "of 8 'slow' GPUs whose peak is the fast one's divided by the ratio. Bandwidth: A100-80 + V100-32, "
             "two nodes of 8 each, every NIC at the swept rate.", ""]
    for sweep_name, sweep in sec["sweeps"].items():
        title, unit = SWEEP_TITLES[sweep_name]
        body = []
        for p in sweep["points"]:
            m = p["methods"]
            body.append([fmt.num(p["x"]), *[fmt.ktok(v["tokens_per_s"]) if v["feasible"] else "does not fit"
                                           for v in m.values()],
                         fmt.x(p["speedup"]["layer-balanced"]), fmt.x(p["speedup"]["uniform"]),
                         m["eth"].get("summary", "-")])
        lines += [f"### {title}", ""]
        lines += fmt.table([unit, "eth k tok/s", "layer-bal. k tok/s", "uniform k tok/s", "eth / layer-bal.",
                            "eth / uniform", "eth pipelines"], body, "rrrrrrl")
        lines += [""] + _sweep_text(sweep, unit, sec["tie_tolerance"]) + [""]
    lines += [f"![sensitivity]({sec['figure']})", ""]
    return lines


def where_eth_loses(results: dict[str, dict[str, Any]]) -> list[str]:
    """Every place in this run where eth did not beat a baseline, in one list."""
    labels = labels_of(results)
    lines = ["## Where eth does not win", ""]
    items = []
    for x in results["summary"]["nominal_loss_causes"]:
        items.append(f"- **Nominal speeds: eth slower than {x['baseline']}** on {case_name(x, labels)}: "
                     f"{fmt.x(x['value'])} (most of the gap: {x['cause']}; eth {x['eth_plan']}, {x['baseline']} "
                     f"{x['baseline_plan']}).")
    robust = results["summary"]["matrix"]["nominal_losses"].get("eth-robust", [])
    if robust:
        worst = min(robust, key=lambda x: x["value"])
        items.append(f"- Nominal speeds: eth --robust is slower than a baseline in {len(robust)} comparison(s), worst "
                     f"{fmt.x(worst['value'])} vs {worst['baseline']} on {case_name(worst, labels)} (it trades "
                     "nominal time for a better worst case by design).")
    items += losses_under_errors(results)
    for item in results["summary"]["plan_quality"]["below"]:
        items.append(f"- Plan quality: eth reaches {fmt.x(item['value'])} of the exhaustive optimum of its own space "
                     f"on {item['model']} ({item['cluster']}).")
    sens = results["sensitivity"]
    for sweep_name, sweep in sens["sweeps"].items():
        for baseline, a in sweep["analysis"].items():
            if a["no_gain_x"]:
                items.append(f"- Sensitivity ({SWEEP_TITLES[sweep_name][0]}): no gain over {baseline} at "
                             f"{', '.join(fmt.num(x) for x in a['no_gain_x'])} {SWEEP_TITLES[sweep_name][1]}.")
    for r in results["ablation"]["rows"]:
        for name, v in r["variants"].items():
            if v.get("relative") is not None and v["relative"] > 1.0:
                items.append(f"- Ablation: '{name}' beats full eth on {r['model']} on {r['cluster_label']} "
                             f"({fmt.x(v['relative'])}).")
    return lines + items + [""]


def closing_note(results: dict[str, dict[str, Any]]) -> list[str]:
    """The verdict in a few lines, every figure taken from the summary."""
    s = results["summary"]
    grid = s["matrix"]["grid"]
    lines = ["## Closing note", ""]
    for baseline in ("layer-balanced", "uniform"):
        for g in grid:
            # nominal speeds without rebalancing, each speed error with every method rebalancing
            wanted = "static" if g["condition"] == "nominal" else "rebalanced"
            if g["pair"] != f"eth / {baseline}" or g["samples_per_gpu"] != 0 or g["mode"] != wanted \
                    or not g["num_cases"]:
                continue
            cond = next(c for c in results["throughput"]["conditions"] if c["key"] == g["condition"])
            name = "nominal speeds" if cond["which"] is None else \
                f"{cond['which']} type at {fmt.num(cond['speed'])}x, every method rebalancing"
            lines.append(f"- Against {baseline}, {name}: eth is at least as fast in "
                         f"{g['num_cases'] - g['num_slower']} of {g['num_cases']} cases, geometric-mean speedup "
                         f"{fmt.x(g['geomean'])}, max {fmt.x(g['max']['value'])}, min {fmt.x(g['min']['value'])}.")
    for p in s["planning"]:
        lines.append(f"- Planning at {p['gpus']} GPUs: eth {fmt.sec(p['eth_s'])} s, exhaustive layer-balanced "
                     f"{fmt.sec(p['layer_balanced_s'])} s" + (" (timed out)" if p["layer_balanced_timed_out"] else "")
                     + ".")
    eff = s["balance_efficiency"]["eth"]
    if eff is not None:
        lines.append(f"- eth's balance efficiency at nominal speeds ranges from {fmt.pct(eff['min']['value'])} to "
                     f"{fmt.pct(eff['max']['value'])} of the physical limit.")
    return lines + [""]
