"""What optimizer sharding (ZeRO-1 across pipelines) changes in eth's plans, on the evaluation's throughput cases.

    .venv/bin/python benchmarks/zero_eval.py [--quick]

For every case of docs/evaluation.md's throughput section (clusters x models x 1 / 4 / 16 samples per GPU),
eth plans twice: with sharding allowed (the default: the planner keeps the faster of sharded and not) and
with ``shard_optimizer=False``. Both plans are simulated under the cost model they were made with. Writes
docs/benchmarks/zero_eval.json and docs/benchmarks/zero_eval.md: which plans changed (sharded or not,
pipelines, depth, recompute stages, micro-batch sizes), simulated tokens/s of each, and the cases that
fit only with sharding.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval import scenarios as sc  # noqa: E402
from eval.common import machine  # noqa: E402
from eval.throughput import cases  # noqa: E402  (the evaluation's throughput cases)

from ethpipe.errors import UserError  # noqa: E402
from ethpipe.model_load import load_model_spec  # noqa: E402
from ethpipe.plan import Plan  # noqa: E402
from ethpipe.planner import CostModel, make_plan  # noqa: E402
from ethpipe.sim import simulate  # noqa: E402

OUT = sc.REPO / "docs" / "benchmarks"


def _shape(plan: Plan) -> dict[str, Any]:
    cost = CostModel.for_plan(plan)
    report = simulate(plan, cost)
    return {"sharded": plan.shard_optimizer, "num_pipelines": len(plan.pipelines),
            "depth_max": max(p.depth for p in plan.pipelines),
            "recompute_stages": sum(s.recompute for p in plan.pipelines for s in p.stages),
            "num_stages": sum(p.depth for p in plan.pipelines),
            "micro_batch_max": max(max(p.micro_batch_sizes) for p in plan.pipelines),
            "idle_devices": len(plan.idle_devices),
            "tokens_per_s": report.tokens_per_s,
            "predicted_tokens_per_s": plan.predicted["tokens_per_s"],
            "planning_s": plan.predicted["planning_time_s"]}


def _plan(cluster: Any, spec: Any, batch: int, seq_len: int, shard: bool) -> dict[str, Any]:
    try:
        return {"feasible": True, **_shape(make_plan(cluster, spec, batch, seq_len, shard_optimizer=shard))}
    except UserError as err:
        return {"feasible": False, "error": str(err)}


def _changed(on: dict[str, Any], off: dict[str, Any]) -> list[str]:
    if not (on["feasible"] and off["feasible"]):
        return []
    keys = ("num_pipelines", "depth_max", "recompute_stages", "micro_batch_max", "idle_devices")
    return [k for k in keys if on[k] != off[k]]


def run(quick: bool) -> dict[str, Any]:
    rows = []
    t0 = time.perf_counter()
    for key, model_name, spg in cases(quick):
        scenario = sc.cluster_scenario(key)
        cluster, model = sc.load(scenario), sc.model_scenario(model_name)
        spec = load_model_spec(model.name)
        batch = spg * cluster.num_devices
        on = _plan(cluster, spec, batch, model.seq_len, True)
        off = _plan(cluster, spec, batch, model.seq_len, False)
        ratio = on["tokens_per_s"] / off["tokens_per_s"] if on["feasible"] and off["feasible"] else None
        rows.append({"cluster": scenario.label, "model": model.name, "samples_per_gpu": spg, "global_batch": batch,
                     "seq_len": model.seq_len, "sharding": on, "no_sharding": off, "speedup": ratio,
                     "changed": _changed(on, off)})
        print(f"{key} {model_name} {spg}/GPU: sharded={on.get('sharded')} speedup={ratio}", flush=True)
    feasible_both = [r for r in rows if r["speedup"] is not None]
    return {"meta": {"command": "python benchmarks/zero_eval.py" + (" --quick" if quick else ""),
                     "machine": machine(), "started": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                     "duration_s": time.perf_counter() - t0},
            "num_cases": len(rows),
            "num_sharded": sum(1 for r in rows if r["sharding"].get("sharded")),
            "num_changed": sum(1 for r in rows if r["sharding"].get("sharded") and r["changed"]),
            "fit_only_sharded": [f"{r['model']} on {r['cluster']} at {r['samples_per_gpu']}/GPU" for r in rows
                                 if r["sharding"]["feasible"] and not r["no_sharding"]["feasible"]],
            "fit_neither": sum(1 for r in rows if not r["sharding"]["feasible"] and not r["no_sharding"]["feasible"]),
            "speedup_min": min((r["speedup"] for r in feasible_both), default=None),
            "speedup_max": max((r["speedup"] for r in feasible_both), default=None),
            "rows": rows}


def _by_samples(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for spg in sorted({r["samples_per_gpu"] for r in rows}):
        both = [r for r in rows if r["samples_per_gpu"] == spg and r["speedup"] is not None]
        sharded = [r for r in both if r["sharding"]["sharded"]]
        geo = math.exp(sum(math.log(r["speedup"]) for r in both) / len(both)) if both else float("nan")
        out.append(f"| {spg} | {len(both)} | {len(sharded)} | {sum(1 for r in sharded if r['changed'])} | "
                   f"{geo:.4f} | {max((r['speedup'] for r in both), default=float('nan')):.4f} |")
    return out


def render(data: dict[str, Any]) -> str:
    meta = data["meta"]
    lines = ["# Optimizer sharding in eth's plans (ZeRO-1 across pipelines)", "",
             f"Command: `{meta['command']}` on {meta['machine']}, {meta['started']}, {meta['duration_s']:.0f} s. "
             "Simulated tokens/s of eth's plan with sharding allowed (the default) over the same planner with "
             "`--no-shard-optimizer`, each under the cost model it was made with; the cases of "
             "docs/evaluation.md's throughput section.", "",
             f"- {data['num_sharded']} of {data['num_cases']} plans shard the optimizer; "
             f"{data['num_changed']} of those also changed shape (pipelines, depth, recompute, micro-batch "
             "size or idle devices), the others keep the unsharded layout and only price the sync differently.",
             f"- Speedup over the unsharded plan: {data['speedup_min']:.4f} .. {data['speedup_max']:.4f} "
             "(never below 1 beyond simulation noise: the planner keeps the faster).",
             f"- Cases that fit only with sharding: {len(data['fit_only_sharded'])}"
             + (f" ({'; '.join(data['fit_only_sharded'])})" if data["fit_only_sharded"] else "")
             + f"; fitting neither way: {data['fit_neither']}.", "",
             "| samples/GPU | cases (both fit) | sharded | shape changed | geo-mean speedup | max speedup |",
             "|---|---|---|---|---|---|",
             *_by_samples(data["rows"]), "",
             "| cluster | model | samples/GPU | sharded | changed | pipelines | max depth | recompute stages | "
             "max micro-batch | tokens/s sharded | tokens/s unsharded | speedup |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        on, off = r["sharding"], r["no_sharding"]

        def pair(key: str) -> str:
            a = on.get(key, "-") if on["feasible"] else "-"
            b = off.get(key, "-") if off["feasible"] else "-"
            return f"{a}" if a == b else f"{b} -> {a}"

        tps = (lambda d: f"{d['tokens_per_s']:,.0f}" if d["feasible"] else "does not fit")
        speed = f"{r['speedup']:.4f}" if r["speedup"] is not None else "-"
        lines.append(f"| {r['cluster']} | {r['model']} | {r['samples_per_gpu']} | {on.get('sharded', '-')} | "
                     f"{', '.join(r['changed']) or '-'} | {pair('num_pipelines')} | {pair('depth_max')} | "
                     f"{pair('recompute_stages')} | {pair('micro_batch_max')} | {tps(on)} | {tps(off)} | {speed} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=OUT)
    parser.add_argument("--render-only", action="store_true", help="rewrite the .md from the existing .json")
    args = parser.parse_args()
    data = json.loads((args.out_dir / "zero_eval.json").read_text()) if args.render_only else run(args.quick)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "zero_eval.json").write_text(json.dumps(data, indent=1) + "\n")
    (args.out_dir / "zero_eval.md").write_text(render(data))
    print(f"wrote {args.out_dir / 'zero_eval.md'}")


if __name__ == "__main__":
    main()
