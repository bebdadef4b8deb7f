"""Which plans an evaluation re-run changed, and what changed about them: two eval_throughput.json files in,
docs/benchmarks/eval_changes.{md,json} out.

For every case (cluster, model, samples per GPU) and method, the plan's signature (layout of pipeline kinds,
depths, TP degrees, micro-batches, devices used) is compared, and where it differs so are the predicted
numbers that explain it: the exposed gradient-sync time, the tightest stage's memory headroom, the
tokens/s. The change classes are read from the signatures and numbers, not assumed.

    .venv/bin/python benchmarks/eval_diff.py OLD_eval_throughput.json docs/benchmarks/eval_throughput.json \\
        --why "the cost model now prices ..." [--revert-calibration OLD_calibration.yaml] [--revert-schedules]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "docs" / "benchmarks"


def _cases(data: dict[str, Any]) -> dict[tuple[str, str, int, str], dict[str, Any]]:
    out = {}
    for row in data["rows"]:
        for method, rec in row["methods"].items():
            out[(row["cluster_label"], row["model"], row["samples_per_gpu"], method)] = rec
    return out


def _classes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    if old["feasible"] != new["feasible"]:
        return ["now fits" if new["feasible"] else "no longer fits"]
    if not old["feasible"]:
        return ["same plan"]  # neither fits
    a, b = old["signature"], new["signature"]
    out = []
    if a["devices_used"] != b["devices_used"]:
        out.append("devices used " + ("fewer" if b["devices_used"] < a["devices_used"] else "more"))
    if a["layout"] != b["layout"]:
        out.append("pipeline shapes")
    elif a.get("schedules", ["1f1b"]) != b.get("schedules", ["1f1b"]):
        out.append("schedules")
    elif a["plan"] != b["plan"]:
        out.append("micro-batches")
    return out or ["same plan"]


def diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    before, after = _cases(old), _cases(new)
    changed, counts = [], Counter()
    for key in sorted(set(before) & set(after)):
        a, b = before[key], after[key]
        classes = _classes(a, b)
        counts[key[3], classes[0] if classes != ["same plan"] else "same plan"] += 1
        if classes == ["same plan"]:
            continue
        an, bn = a.get("nominal") or {}, b.get("nominal") or {}
        changed.append({
            "cluster": key[0], "model": key[1], "samples_per_gpu": key[2], "method": key[3], "classes": classes,
            "old_plan": a["signature"]["plan"] if a["feasible"] else None,
            "new_plan": b["signature"]["plan"] if b["feasible"] else None,
            "old_tokens_per_s": an.get("tokens_per_s"), "new_tokens_per_s": bn.get("tokens_per_s"),
            "old_exposed_comm_s": an.get("exposed_comm_s"), "new_exposed_comm_s": bn.get("exposed_comm_s"),
            "old_headroom": an.get("min_headroom_frac"), "new_headroom": bn.get("min_headroom_frac"),
        })
    same_plan_speed = [after[k]["nominal"]["tokens_per_s"] / before[k]["nominal"]["tokens_per_s"]
                       for k in set(before) & set(after)
                       if _classes(before[k], after[k]) == ["same plan"] and before[k]["feasible"]]
    return {"cases": len(set(before) & set(after)), "changed": changed,
            "counts": {f"{m}: {c}": n for (m, c), n in sorted(counts.items())},
            "same_plan_speed_ratio": [min(same_plan_speed), max(same_plan_speed)] if same_plan_speed else None}


def attribute(changed: list[dict[str, Any]], old: dict[str, Any],
              reverts: tuple[tuple[str, dict[str, Any]], ...]) -> None:
    """Re-plan each changed eth case with this release's change reverted; the cause is the revert that brings the
    old plan back (``cause`` added to each eth entry). This release's: the compute constants (re-planned with the
    previous release's calibration file, ``--revert-calibration``) or the schedule choice (``--revert-schedules``:
    re-planned with 1F1B only); what no revert explains is put down to the
    other changes since the previous run, named in ``OTHER``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from eval.common import layout_signature

    from ethpipe.cluster import load_cluster
    from ethpipe.model_load import load_model_spec
    from ethpipe.planner import make_plan

    files = {c["label"]: c["file"] for c in old["clusters"]}
    rows = {(r["cluster_label"], r["model"], r["samples_per_gpu"]): r for r in old["rows"]}
    for c in changed:
        if c["method"] != "eth":
            continue
        row = rows[(c["cluster"], c["model"], c["samples_per_gpu"])]
        cluster, spec = load_cluster(REPO / files[c["cluster"]]), load_model_spec(c["model"])
        c["cause"] = OTHER
        for cause, kwargs in reverts:
            try:
                again = layout_signature(make_plan(cluster, spec, row["global_batch"], row["seq_len"], **kwargs))["plan"]
            except ValueError:
                again = None
            if again == c["old_plan"]:
                c["cause"] = cause
                break


OTHER = ("other: re-planning with this release's change reverted does not bring the old plan back (another change "
         "since the previous run, or a near-tie the search now breaks otherwise)")


def calibration_reverts(path: Path | None) -> tuple[tuple[str, dict[str, Any]], ...]:
    """Re-plan with the previous release's compute constants (a calibration.yaml, e.g. from `git show`)."""
    if path is None:
        return ()
    import yaml

    from ethpipe.cost.hardware import calibration_from_dict

    return (("the compute constants (16-bit / TF32 / CUDA-core efficiencies fitted to the per-op data)",
             {"calibration": calibration_from_dict(yaml.safe_load(path.read_text()), str(path))}),)


def _plan(p: dict[str, int] | None) -> str:
    return "does not fit" if p is None else ", ".join(f"{n}x {k}" for k, n in p.items())


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(result: dict[str, Any], old_label: str, new_label: str, why: str) -> str:
    changed = result["changed"]
    lo, hi = result["same_plan_speed_ratio"] or (1.0, 1.0)
    lines = ["# Evaluation: plans changed by the re-run (generated)", "",
             f"`benchmarks/eval_diff.py` between {old_label} and {new_label}: {len(changed)} of {result['cases']} "
             f"case x method plans changed. Where the plan stayed, its simulated tokens/s changed by "
             f"{lo:.3f}x to {hi:.3f}x.", "", f"Why: {why}", "",
             "eth's changed plans by cause (re-planned with this release's new planner term reverted; the cause is the "
             "revert that brings the old plan back): " + "; ".join(f"{n} {k}" for k, n in result["eth_causes"].items())
             + ".", "",
             "| method: what changed | cases |", "|---|---|"]
    lines += [f"| {k} | {n} |" for k, n in result["counts"].items()]
    lines += ["", "| case | method | changed (cause) | old plan | new plan | tokens/s old -> new | exposed sync ms old "
                  "-> new | min memory headroom old -> new |", "|---|---|---|---|---|---|---|---|"]
    for c in changed:
        tps = f"{_num(c['old_tokens_per_s'], '.0f')} -> {_num(c['new_tokens_per_s'], '.0f')}"
        sync = (f"{_num(c['old_exposed_comm_s'] and c['old_exposed_comm_s'] * 1e3, '.1f')} -> "
                f"{_num(c['new_exposed_comm_s'] and c['new_exposed_comm_s'] * 1e3, '.1f')}")
        room = f"{_num(c['old_headroom'], '.2f')} -> {_num(c['new_headroom'], '.2f')}"
        lines.append(f"| {c['model']} on {c['cluster']}, {c['samples_per_gpu']}/GPU | {c['method']} | "
                     f"{', '.join(c['classes'])}{' (' + c['cause'] + ')' if 'cause' in c else ''} | {_plan(c['old_plan'])} | {_plan(c['new_plan'])} | {tps} | {sync} | "
                     f"{room} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--old-label", default="the previous run")
    parser.add_argument("--new-label", default="this run")
    parser.add_argument("--why", required=True, help="the change of the cost model or planner between the runs")
    parser.add_argument("--revert-calibration", type=Path, default=None,
                        help="the previous release's data/calibration.yaml: changed eth plans it brings back are put "
                             "down to the constants")
    parser.add_argument("--revert-schedules", action="store_true",
                        help="re-plan changed eth cases with --schedules 1f1b: the plans it brings back are put down "
                             "to the schedule choice")
    args = parser.parse_args()
    old = json.loads(args.old.read_text())
    result = diff(old, json.loads(args.new.read_text()))
    reverts = calibration_reverts(args.revert_calibration)
    if args.revert_schedules:
        reverts += (("the schedule choice (zb-h1 allowed; --schedules 1f1b brings the old plan back)",
                     {"schedules": ("1f1b",)}),)
    attribute(result["changed"], old, reverts)
    causes = Counter(c["cause"] for c in result["changed"] if "cause" in c)
    result["eth_causes"] = dict(causes.most_common())
    (OUT / "eval_changes.json").write_text(json.dumps(result, indent=1) + "\n")
    (OUT / "eval_changes.md").write_text(render(result, args.old_label, args.new_label, args.why))
    print(f"{len(result['changed'])} of {result['cases']} plans changed")


if __name__ == "__main__":
    main()
