"""Online data rebalancing under --emulate: a straggler appears mid-run; does throughput recover?

Six CPU ranks emulate 2 "fast" (speed 1.0) and 4 "slow" (0.5) devices as three homogeneous
depth-2 pipelines (fast; slow; slow), the global batch split by speed (level 3 of ETH). From
step SLOW_AT on, rank 0 (first stage of the fast pipeline) runs 2x slower
(``--emulate-slowdown 0:2@SLOW_AT``). Three runs, same data, same steps:

- static: the launched split, no rebalancing;
- rebalance: ``--rebalance every=2``: measured rates, re-split at a step boundary;
- fresh: the plan made for the slowed cluster (the same pipelines, ETH's level-3 split solved
  for the slowed speeds before the run), slowed from step 0.

Throughput is the median over the steps after the slowdown (static), after the first applied
rebalance (rebalance; later small re-splits included), after warm-up (fresh). Results: docs/benchmarks/rebalance.{md,json}.

    .venv/bin/python benchmarks/rebalance.py [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ethpipe.model_spec import model_presets
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks, write_text_atomic
from ethpipe.tokens.texts import builtin_text, prepare_tokens
from ethpipe.runtime.adapt.emulate import Slowdown
from ethpipe.runtime.start.launch import run_local
from ethpipe.runtime.adapt.rebalance import PipelineModel, RebalanceConfig, water_fill, with_split
from ethpipe.runtime.train import TrainConfig

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
SPEEDS = {"fast": 1.0, "slow": 0.5}
BATCH, SEQ, MICRO = 48, 128, 2
SLOW_RANK, SLOW_FACTOR = 0, 2.0
LAYERS = ((0, 4), (4, 8))  # tiny has 8 layers: two stages of 4


def base_plan() -> Plan:
    devices = [("fast", (0, 1)), ("slow", (2, 3)), ("slow", (4, 5))]
    stage_work = [[lay[1] - lay[0] for lay in LAYERS] for _ in devices]
    speeds = [[SPEEDS[d]] * 2 for d, _ in devices]
    pipes = tuple(Pipeline(tuple(Stage((r,), d, lay) for r, lay in zip(ranks, LAYERS)), (MICRO,))
                  for d, ranks in devices)
    plan = Plan("eth", "tiny", BATCH, SEQ, pipes, compute_blocks(pipes), model_presets()["tiny"],
                extra={"device_speeds": SPEEDS})
    return with_split(plan, oracle_split(plan, stage_work, speeds))


def oracle_split(plan: Plan, stage_work: list[list[int]], speeds: list[list[float]]) -> tuple[int, ...]:
    """ETH level 3 with known speeds: per-sample stage time = layers / speed (any common unit)."""
    models = []
    for work, speed in zip(stage_work, speeds):
        rates = [w / s for w, s in zip(work, speed)]
        models.append(PipelineModel(max(rates), MICRO * (sum(rates) - max(rates))))
    return water_fill(models, plan.global_batch_size)


def fresh_plan() -> Plan:
    plan = base_plan()
    speeds = [[SPEEDS["fast"] / SLOW_FACTOR, SPEEDS["fast"]], [SPEEDS["slow"]] * 2, [SPEEDS["slow"]] * 2]
    return with_split(plan, oracle_split(plan, [[4, 4]] * 3, speeds))


def run(plan: Plan, data: str, steps: int, slow_at: int, rebalance: RebalanceConfig | None) -> list[dict[str, Any]]:
    config = TrainConfig(data=data, steps=steps, emulate=True, progress=False, timeout_s=120.0,
                         slowdowns=(Slowdown(SLOW_RANK, SLOW_FACTOR, slow_at),), rebalance=rebalance)
    return run_local(plan, config)


def throughput(records: list[dict[str, Any]], first: int) -> dict[str, float]:
    times = [r["iteration_time_s"] for r in records[first:]]
    median = statistics.median(times)
    return {"median_step_s": median, "tokens_per_s": BATCH * SEQ / median, "measured_steps": len(times)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--slow-at", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "tokens.bin")
        prepare_tokens(builtin_text(1_500_000), data)
        static = run(base_plan(), data, args.steps, args.slow_at, None)
        balanced = run(base_plan(), data, args.steps, args.slow_at, RebalanceConfig(every=2))
        fresh = run(fresh_plan(), data, args.steps, 0, None)
    applied = [r for r in balanced if r.get("rebalance", {}).get("applied")]
    recovered_at = (applied[0]["step"] + 1) if applied else args.steps  # the first re-split runs from here
    rows = {
        "static": throughput(static, args.slow_at + 1),
        "rebalance": throughput(balanced, recovered_at + 1) if recovered_at + 1 < args.steps else {},
        "fresh": throughput(fresh, 2),
        "before_slowdown": throughput(static[1:args.slow_at], 0),
    }
    fresh_tps = rows["fresh"]["tokens_per_s"]
    for row in rows.values():
        if row:
            row["vs_fresh"] = row["tokens_per_s"] / fresh_tps
    result = {
        "command": f"{Path(sys.executable).name} benchmarks/rebalance.py --steps {args.steps} --slow-at {args.slow_at}",
        "machine": f"{platform.platform()}, {platform.machine()}, {torch.get_num_threads()} thread/rank, "
                   f"{len(__import__('os').sched_getaffinity(0))} cores, torch {torch.__version__}",
        "plan_split": list(base_plan().pipelines[i].num_samples for i in range(3)),
        "fresh_split": list(fresh_plan().pipelines[i].num_samples for i in range(3)),
        "slowdown": f"rank {SLOW_RANK} x{SLOW_FACTOR} from step {args.slow_at}",
        "rebalances": [{"step": r["step"], **r["rebalance"]} for r in applied],
        "recovered_from_step": recovered_at,
        "results": rows,
        "per_step_s": {"static": [r["iteration_time_s"] for r in static],
                       "rebalance": [r["iteration_time_s"] for r in balanced],
                       "fresh": [r["iteration_time_s"] for r in fresh]},
        "final_loss": {"static": static[-1]["loss"], "rebalance": balanced[-1]["loss"]},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    write_text_atomic(OUT / "rebalance.json", json.dumps(result, indent=1) + "\n")
    write_text_atomic(OUT / "rebalance.md", render(result))
    print(render(result))


def render(r: dict[str, Any]) -> str:
    lines = ["# Online data rebalancing (measured)", "",
             f"Command: `{r['command']}`  ", f"Machine: {r['machine']}", "",
             "Three homogeneous depth-2 pipelines of the `tiny` model under `--emulate` (fast: speed 1.0, ranks 0-1; "
             "slow: 0.5, ranks 2-3 and 4-5), global batch 48 x 128 tokens, micro-batch 2. "
             f"Launched split {r['plan_split']}; slowdown: {r['slowdown']}. The fresh plan is the same pipelines "
             f"with ETH's level-3 split solved for the slowed speeds: {r['fresh_split']}.", "",
             "| run | median step s | tokens/s | vs fresh plan | steps measured |", "|---|---|---|---|---|"]
    for name in ("before_slowdown", "static", "rebalance", "fresh"):
        row = r["results"][name]
        if row:
            lines.append(f"| {name} | {row['median_step_s']:.3f} | {row['tokens_per_s']:.0f} | "
                         f"{100 * row['vs_fresh']:.1f}% | {row['measured_steps']} |")
    lines += ["", "Rebalances applied (step: old -> new split, predicted gain, measured busy s per sample):", ""]
    for d in r["rebalances"]:
        rates = "; ".join("/".join(f"{x * 1e3:.1f}" for x in row) for row in d["per_sample_s"])
        lines.append(f"- step {d['step']}: {d['old_split']} -> {d['new_split']}, gain {100 * d['gain']:.1f}%, "
                     f"ms/sample per stage {rates}")
    if not r["rebalances"]:
        lines.append("- none")
    lines += ["", f"Final loss static {r['final_loss']['static']:.6f}, rebalanced {r['final_loss']['rebalance']:.6f} "
              "(the same samples form every global batch; tests/dist/test_rebalance.py checks the trajectory "
              "against plain PyTorch).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
