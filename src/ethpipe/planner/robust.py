"""Robust pricing: a plan's iteration time when a device type is slower or faster than modelled.

The cost model's per-type speed is an estimate (docs/benchmarks/calibration.md: many pairwise
speed ratios are 10-30% off), and the error is systematic per type, not random noise. So a
plan is also priced under a fixed set of per-type speed perturbations (``scenarios``): every
device type's compute at -30% and at +30% speed, one type at a time, and, with three or more
types, every type but the fastest at -30% together. Under a perturbation the plan may only do
what the runtime can do online (``runtime/adapt/rebalance.py``): re-split the global batch across
its pipelines (level-3 water-filling, same micro-batch size, so within the memory the plan was
checked for; whole micro-batches where the plan was made with them). Layers never move. The
priced time is the better of keeping the split and re-splitting. Only compute is perturbed
(links, all-reduces and the optimizer step keep their nominal prices).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ethpipe.cost.model import CostModel
from ethpipe.plan import Pipeline, Plan
from ethpipe.planner.samples.balance import balance_samples
from ethpipe.planner.search.options import options_record
from ethpipe.planner.estimate import estimate_iteration_s
from ethpipe.planner.layers.timing import PipelineTiming, StageSlot, layer_count, split_sizes, timing_of_layers

SLOW_SPEED = 0.7  # -30%
FAST_SPEED = 1.3  # +30%


@dataclass(frozen=True)
class Scenario:
    """Per device type, its compute speed relative to the cost model (absent = 1.0)."""

    name: str
    speeds: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class _PerturbedCost(CostModel):
    """The cost model with each type's compute seconds divided by its scenario speed."""

    speed_factors: tuple[tuple[str, float], ...] = ()

    def _compute_s(self, device_type: str, kind: str, micro_batch: int, tp: int) -> tuple[float, float]:
        fwd, bwd = super()._compute_s(device_type, kind, micro_batch, tp)
        speed = dict(self.speed_factors).get(device_type, 1.0)
        return fwd / speed, bwd / speed


def scenarios(cost: CostModel) -> list[Scenario]:
    """The perturbation set (module docstring), fastest type first."""
    types = sorted(cost.cluster.gpu_types, key=lambda t: -cost.device_speed(t))
    out = [Scenario(f"{t} {pct}", ((t, speed),)) for t in types
           for pct, speed in (("-30%", SLOW_SPEED), ("+30%", FAST_SPEED))]
    if len(types) >= 3:
        out.append(Scenario("all but the fastest -30%", tuple((t, SLOW_SPEED) for t in types[1:])))
    return out


def perturbed(cost: CostModel, scenario: Scenario) -> CostModel:
    base = {f.name: getattr(cost, f.name) for f in dataclasses.fields(CostModel) if f.init}
    return _PerturbedCost(**base, speed_factors=scenario.speeds)


def resplit(plan: Plan, cost: CostModel) -> Plan:
    """The plan with its global batch re-split across pipelines by level 3 under ``cost`` (layers kept). An
    interleaved pipeline keeps its samples (its micro-batch count is constrained: ``schedule.interleaved_fits``)."""
    whole = options_record(plan).get("fine_grained", True) is False
    groups: dict[tuple, list[int]] = {}
    timings: list[PipelineTiming] = []
    for p, pipe in enumerate(plan.pipelines):
        if pipe.num_chunks > 1:
            continue
        slots = tuple(StageSlot(s.device, s.tp, s.ranks) for s in pipe.stages)
        links = tuple((cost.cluster.link_gbps(a.ranks[0], b.ranks[0]), cost.cluster.link_latency_s(a.ranks[0], b.ranks[0]))
                      for a, b in zip(slots, slots[1:]))
        b = max(pipe.micro_batch_sizes)
        layers = [layer_count(s) for s in pipe.stages]
        key = (tuple((s.device, s.tp, n, s.recompute) for s, n in zip(pipe.stages, layers)), links, b, pipe.schedule)
        if key not in groups:
            groups[key] = []
            rc = [s.recompute for s in pipe.stages]
            timings.append(timing_of_layers(cost, slots, layers, rc, b, b if whole else 1, pipe.schedule))
        groups[key].append(p)
    members = list(groups.values())
    if not members:
        return plan
    kept = sum(p.num_samples for p in plan.pipelines if p.num_chunks > 1)
    samples = balance_samples(timings, [len(m) for m in members], plan.global_batch_size - kept)
    assert samples is not None, "nothing to give up at"
    pipelines = list(plan.pipelines)
    for idx, row in zip(members, samples):
        for p, n in zip(idx, row):
            pipe = plan.pipelines[p]
            pipelines[p] = Pipeline(pipe.stages, split_sizes(n, max(pipe.micro_batch_sizes)), pipe.schedule)
    return dataclasses.replace(plan, pipelines=tuple(pipelines))


def price_under(plan: Plan, cost: CostModel, scenario: Scenario) -> float:
    """Iteration seconds under ``scenario``: the better of the plan's own split and a re-split."""
    flat = options_record(plan).get("block_sync", True) is False
    pc = perturbed(cost, scenario)
    kept = estimate_iteration_s(plan, pc, flat_sync=flat)
    if len(plan.pipelines) == 1:
        return kept
    return min(kept, estimate_iteration_s(resplit(plan, pc), pc, flat_sync=flat))


def robust_record(plan: Plan, cost: CostModel, scenario_set: Sequence[Scenario] | None = None) -> dict:
    """What the plan's ``predicted`` records: per scenario time, the worst case and which scenario it is."""
    nominal = float(plan.predicted["iteration_time_s"]) if plan.predicted else estimate_iteration_s(plan, cost)
    times = {s.name: price_under(plan, cost, s) for s in (scenario_set if scenario_set is not None else scenarios(cost))}
    worst = max(times, key=lambda k: times[k], default=None)
    if worst is None or times[worst] <= nominal:
        return {"worst_case_time_s": nominal, "worst_scenario": "nominal", "scenario_times_s": times}
    return {"worst_case_time_s": times[worst], "worst_scenario": worst, "scenario_times_s": times}
