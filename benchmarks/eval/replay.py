"""Replaying a plan where one device type is slower than the cost model believed, with and without
the runtime's online data rebalancing.

Every plan is made with the nominal (shipped, calibrated) cost model. A *condition* names one
device type whose compute runs at ``speed`` x its modelled speed; the plan is replayed by the
simulator under ``planner/robust.py``'s perturbed cost model (compute only: links, all-reduces
and the optimizer step keep their nominal prices).

Online rebalancing is the runtime's own (``runtime/adapt/rebalance.py``): from the replayed iteration's
per-stage forward/backward busy seconds per sample it fits each pipeline's time model, water-fills
the global batch over the pipelines and applies the re-split only where it predicts a saving above
the runtime's default threshold; the new split is replayed, measured again and re-checked, as the
runtime re-checks every K steps, until a check applies nothing. Layers never move and each pipeline
keeps its micro-batch size; a re-split whose replayed peak memory exceeds a device's usable memory
is not applied (the previous split is kept and the stop reason recorded). A plan with one pipeline,
or whose pipelines all slow down alike, has nothing to re-split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ethpipe.planner import CostModel
from ethpipe.plan import Plan
from ethpipe.planner.robust import SLOW_SPEED, Scenario, perturbed
from ethpipe.runtime.adapt.rebalance import RebalanceConfig, decide, split_of, with_split
from ethpipe.sim import SimReport, simulate

from eval.scenarios import short

MAX_ROUNDS = 4  # re-checks after the first; the loop stops earlier as soon as a check applies nothing
THRESHOLD = RebalanceConfig(every=1).threshold  # the runtime's default for --rebalance every=K


@dataclass(frozen=True)
class Condition:
    """Which device type runs at ``speed`` x its modelled compute speed ("nominal": none)."""

    key: str
    which: str | None  # "slowest" / "fastest" type by the cost model's speeds; None = nominal
    speed: float = 1.0

    def label(self, device_type: str | None) -> str:
        if self.which is None:
            return "nominal speeds"
        return f"{self.which} type ({short(device_type or '?')}) at {self.speed:g}x"


CONDITIONS = (Condition("nominal", None), Condition("slowest_slow", "slowest", SLOW_SPEED),
              Condition("fastest_slow", "fastest", SLOW_SPEED))
MISESTIMATED = tuple(c.key for c in CONDITIONS if c.which is not None)


def condition(key: str) -> Condition:
    return next(c for c in CONDITIONS if c.key == key)


def device_type_for(cost: CostModel, cond: Condition) -> str | None:
    """The type a condition slows: the slowest or fastest by the cost model's (nominal) speeds."""
    if cond.which is None:
        return None
    speeds = cost.device_speeds()
    pick = min if cond.which == "slowest" else max
    return pick(sorted(speeds), key=lambda t: speeds[t])


def cost_under(cost: CostModel, cond: Condition, device_type: str | None) -> CostModel:
    if device_type is None or cond.speed == 1.0:
        return cost
    return perturbed(cost, Scenario(cond.key, ((device_type, cond.speed),)))


def stage_rates_s(plan: Plan, report: SimReport) -> tuple[tuple[float, ...], ...]:
    """Per pipeline, per stage: forward/backward busy seconds per sample, as the runtime measures them
    (``busy = flush - bubble - recv`` of the simulated rank; a stage's slowest rank)."""
    busy: dict[tuple[int, int], float] = {}
    for r in report.ranks:
        key = (r.pipeline, r.stage)
        busy[key] = max(busy.get(key, 0.0), max(0.0, r.flush_s - r.bubble_s - r.recv_s))
    return tuple(tuple(busy[(p, s)] / pipe.num_samples for s in range(pipe.depth))
                 for p, pipe in enumerate(plan.pipelines))


def memory_fits(report: SimReport, cost: CostModel) -> bool:
    return all(r.peak_memory_bytes <= cost.usable_memory_bytes(r.device) for r in report.ranks)


def timing(report: SimReport) -> dict[str, float]:
    return {"tokens_per_s": report.tokens_per_s, "iteration_s": report.iteration_time_s,
            "makespan_s": max(report.pipeline_flush_s), "exposed_comm_s": report.exposed_comm_s}


def moved_samples(old: tuple[int, ...], new: tuple[int, ...]) -> int:
    """Samples that changed pipeline between two splits of the same batch."""
    return sum(max(0, n - o) for o, n in zip(old, new))


def rebalance(plan: Plan, cost: CostModel, report: SimReport) -> tuple[SimReport, dict[str, Any]]:
    """The runtime's check-and-re-split loop replayed under ``cost`` from ``report`` (the plan's own
    split replayed under ``cost``); the final report and what the loop did."""
    record: dict[str, Any] = {"applied": 0, "checks": 0, "moved_samples": 0, "first_predicted_gain": None,
                              "stop": "single pipeline"}
    if len(plan.pipelines) < 2:
        return report, record
    current, current_report = plan, report
    record["stop"] = "rounds exhausted"
    for _ in range(MAX_ROUNDS + 1):
        decision = decide(plan, current, stage_rates_s(current, current_report), THRESHOLD)
        record["checks"] += 1
        if record["first_predicted_gain"] is None:
            record["first_predicted_gain"] = decision.gain
        if not decision.applied:
            record["stop"] = "no gain above threshold"
            break
        candidate = with_split(plan, decision.new_split)
        candidate_report = simulate(candidate, cost)
        if not memory_fits(candidate_report, cost):
            record["stop"] = "re-split would exceed memory"
            break
        current, current_report = candidate, candidate_report
        record["applied"] += 1
    record["moved_samples"] = moved_samples(split_of(plan), split_of(current))
    return current_report, record


def replay(plan: Plan, cost: CostModel, report: SimReport | None = None) -> dict[str, Any]:
    """Static and rebalanced timings of ``plan`` under ``cost`` (``report``: its replay, when at hand)."""
    report = report if report is not None else simulate(plan, cost)
    final, record = rebalance(plan, cost, report)
    return {"static": timing(report), "rebalanced": {**timing(final), **record}}
