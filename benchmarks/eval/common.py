"""Shared by every section: machine facts, planning + simulating one case, describing a plan."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ethpipe.cluster import Cluster, cluster_from_dict
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Plan
from ethpipe.planner import CostModel, ideal_time_s, make_plan
from ethpipe.sim import SimReport, simulate

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
        tps = list(dict.fromkeys(s.tp for s in pipe.stages))  # along the pipeline: "tp1/4" = a degree per type
        key = f"{'+'.join(types)} d{pipe.depth}" + (f" tp{'/'.join(map(str, tps))}" if tps != [1] else "")
        groups[key] = groups.get(key, 0) + 1
    depths = [p.depth for p in plan.pipelines]
    idle = len(getattr(plan, "idle_devices", ()) or ())  # plans may leave devices out (recorded there)
    return {
        "num_pipelines": len(plan.pipelines),
        "depth_min": min(depths), "depth_max": max(depths),
        "mixed_pipelines": sum(1 for p in plan.pipelines if len({s.device for s in p.stages}) > 1),
        "idle_devices": idle,
        "summary": ", ".join(f"{n}x {k}" for k, n in groups.items()) + (f" ({idle} GPUs idle)" if idle else ""),
    }


def layout_signature(plan: Plan) -> dict[str, Any]:
    """What two plans must share to count as "the same layout" / "the same plan", independent of ranks.

    ``layout``: pipeline kinds (device, layers, tp of every stage) with their counts; ``plan``: the same
    with each pipeline's micro-batch size, recomputation and sample count (the data split) added.
    ``kinds``: distinct device-type sequences (pipelines a per-type slowdown can hit differently);
    ``unequal_data``: pipelines get different sample counts; ``devices_used``: GPUs holding a stage.
    """
    layout: dict[str, int] = {}
    full: dict[str, int] = {}
    for pipe in plan.pipelines:
        key = " | ".join(f"{short(s.device)}:{s.num_layers}" + (f"/tp{s.tp}" if s.tp > 1 else "") for s in pipe.stages)
        layout[key] = layout.get(key, 0) + 1
        extra = "".join("r" if s.recompute else "-" for s in pipe.stages)
        long_key = f"{key} b{max(pipe.micro_batch_sizes)} {extra} n{pipe.num_samples}" + (
            f" {pipe.schedule}" if pipe.schedule != "1f1b" else "")
        full[long_key] = full.get(long_key, 0) + 1
    kinds = {tuple((s.device, s.tp) for s in pipe.stages) for pipe in plan.pipelines}
    samples = {pipe.num_samples for pipe in plan.pipelines}
    return {"layout": dict(sorted(layout.items())), "plan": dict(sorted(full.items())), "kinds": len(kinds),
            "devices_used": sum(len(s.ranks) for pipe in plan.pipelines for s in pipe.stages),
            "unequal_data": len(samples) > 1,
            "schedules": sorted({pipe.schedule for pipe in plan.pipelines}),
            "uneven_layers": any(len({s.num_layers for s in pipe.stages}) > 1 for pipe in plan.pipelines)}


def cluster_ideal_s(plan: Plan, cost: CostModel) -> float:
    """The physical limit of the plan's whole cluster, idle devices included (``CostModel.for_plan``
    prices only the devices the plan runs on, which would flatter a plan that leaves some idle)."""
    if not getattr(plan, "idle_devices", ()) or plan.cluster is None:
        return ideal_time_s(cost, plan.global_batch_size)
    return ideal_time_s(dataclasses.replace(cost, cluster=cluster_from_dict(plan.cluster)), plan.global_batch_size)


def describe(plan: Plan, cost: CostModel, report: SimReport) -> dict[str, Any]:
    """Simulated throughput, efficiency against the physical limit, and per-device memory headroom."""
    ideal = cluster_ideal_s(plan, cost)
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
        "efficiency_factors": (plan.predicted or {}).get("efficiency_factors", {}),
        "schedules": {name: sum(p.schedule == name for p in plan.pipelines)
                      for name in sorted({p.schedule for p in plan.pipelines})},
        **plan_shape(plan),
    }


def evaluate_plan(plan: Plan, cost: CostModel, *, flat_sync: bool = False) -> dict[str, Any]:
    """``describe`` of the plan's simulated iteration."""
    return describe(plan, cost, simulate(plan, cost, flat_sync=flat_sync))


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
