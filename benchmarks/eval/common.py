"""Shared by every section: machine facts, planning + simulating one case, describing a plan."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ethpipe.cluster import Cluster
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Plan
from ethpipe.planner import CostModel, ideal_time_s, make_plan
from ethpipe.sim import simulate

from eval.scenarios import short

METHODS = ("eth", "layer-balanced", "uniform")
BASELINES = ("layer-balanced", "uniform")


@dataclass(frozen=True)
class Job:
    """One unit of work of a section (one progress-bar step); ``run`` returns a JSON-able row."""

    label: str
    run: Callable[[], dict[str, Any]]


def machine() -> str:
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
            f"load average at start {os.getloadavg()[0]:.2f}")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def median_time_s(fn: Callable[[], Any], runs: int) -> tuple[float, list[float], Any]:
    """Median wall time of ``runs`` calls after one warm-up call (imports, caches)."""
    out = fn()
    times = []
    for _ in range(runs):
        t, out = timed(fn)
        times.append(t)
    return statistics.median(times), times, out


def plan_shape(plan: Plan) -> dict[str, Any]:
    """Pipelines grouped by (device types along the pipeline, depth, tp): what the planner chose."""
    groups: dict[str, int] = {}
    for pipe in plan.pipelines:
        types = list(dict.fromkeys(short(s.device) for s in pipe.stages))
        tps = sorted({s.tp for s in pipe.stages})
        key = f"{'+'.join(types)} d{pipe.depth}" + (f" tp{tps[0]}" if tps != [1] else "")
        groups[key] = groups.get(key, 0) + 1
    depths = [p.depth for p in plan.pipelines]
    return {
        "num_pipelines": len(plan.pipelines),
        "depth_min": min(depths), "depth_max": max(depths),
        "mixed_pipelines": sum(1 for p in plan.pipelines if len({s.device for s in p.stages}) > 1),
        "summary": ", ".join(f"{n}x {k}" for k, n in groups.items()),
    }


def evaluate_plan(plan: Plan, cost: CostModel, *, flat_sync: bool = False) -> dict[str, Any]:
    """Simulated throughput, efficiency against the physical limit, and per-device memory headroom."""
    report = simulate(plan, cost, flat_sync=flat_sync)
    ideal = ideal_time_s(cost, plan.global_batch_size)
    headroom: dict[str, float] = {}
    headroom_gib = float("inf")
    for r in report.ranks:
        capacity = cost.gpu(r.device).memory_bytes
        frac = 1.0 - r.peak_memory_bytes / capacity
        name = short(r.device)
        headroom[name] = min(headroom.get(name, 1.0), frac)
        headroom_gib = min(headroom_gib, (capacity - r.peak_memory_bytes) / 2**30)
    return {
        "feasible": True,
        "tokens_per_s": report.tokens_per_s,
        "iteration_s": report.iteration_time_s,
        "estimate_tokens_per_s": plan.predicted["tokens_per_s"],
        "makespan_s": max(report.pipeline_flush_s),
        "exposed_comm_s": report.exposed_comm_s,
        "balance_efficiency": ideal / report.iteration_time_s,
        "min_headroom_frac": min(headroom.values()),
        "min_headroom_gib": headroom_gib,
        "headroom_by_type": headroom,
        **plan_shape(plan),
    }


def run_method(cluster: Cluster, spec: ModelSpec, batch: int, seq_len: int, method: str, *,
               budget_s: float | None = None, options: Any = None, flat_sync: bool = False) -> dict[str, Any]:
    """Plan with ``method`` (and PlannerOptions ``options`` when given), then simulate. Infeasible -> the reason."""
    kwargs: dict[str, Any] = {}
    if method == "layer-balanced" and budget_s is not None:
        kwargs["time_budget_s"] = budget_s
    if options is not None:
        kwargs["options"] = options
    try:
        planning_s, plan = timed(lambda: make_plan(cluster, spec, batch, seq_len, method, **kwargs))
    except UserError as err:  # no feasible plan (a bug would propagate)
        return {"feasible": False, "error": str(err)}
    cost = CostModel.for_plan(plan)
    return {**evaluate_plan(plan, cost, flat_sync=flat_sync), "planning_s": planning_s,
            "search": plan.extra.get("search", {})}


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically so a crashed run never leaves half a results file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
