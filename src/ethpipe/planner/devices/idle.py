"""Leave the slowest GPU types idle when a plan without them is predicted faster (``allow_idle``).

A slow type can cost more than it adds: its share of the batch may be under one sample per
pipeline, or the pipelines that must include it (memory) run at its pace. So besides the plan
on every device, the planner is run on sub-clusters without the slowest type, then the two
slowest, ... while at least one type remains (whole types, so whole nodes: a node either runs
or is not started). A candidate is skipped when its compute-only lower bound (model FLOPs over
the sub-cluster's summed achievable FLOP/s, ``ideal_time_s``) is already no better than the
best plan so far; as the bound only grows with more types idle, the search stops there. It also
stops after a candidate that is not faster than the best so far (each candidate costs a whole plan,
and a type that is needed, for memory or throughput, stays needed with fewer types), unless that
candidate came within ``NEAR`` of the best (known for the first candidate only, which is planned with
nothing to beat; later ones are told the best time and say only that they do not beat it) or the next
one raises the slowest per-GPU NIC share of the devices it keeps. Why: a type can cost through its NICs alone (a block's sync runs at its slowest
holder's share), so idling the slowest type may not pay where idling the two slowest does (gpt3-1.3b,
one sample per GPU on 624 V100 (8 per 400 Gbit/s node) + 328 A100-40 (8 per 200 Gbit/s) + 1096 H800
(4 per 3200 Gbit/s): 0.59 s without the V100s, 0.18 s without both, 0.56 s with every type); and a
candidate that nearly pays leaves types nearly balanced, which the next may tip (llama3-8b at one
sample per GPU, bf16 sync, on 176 A10 + 192 RTX 4090 + 176 A100-PCIe-80 + 240 L40 + 240 A100-80: 4.37 s
on every device, 4.45 s without the A10s, 3.42 s without the A10s and the RTX 4090s). Each
candidate's search prunes against the best time so far (it only matters if it beats it). The
fastest plan by predicted iteration time wins (ties: the plan with more devices). The idle
devices get no rank (docs/plan-format.md, "Idle devices"): the plan's ``idle_devices`` lists
them with the comparison that made them idle, and ``search.idle`` what was tried.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from ethpipe.cost.model import CostModel
from ethpipe.cost.sync import nic_share_gbps
from ethpipe.errors import Infeasible
from ethpipe.plan import Plan
from ethpipe.planner.search.ahead import MISSING, Ahead, can_run_ahead
from ethpipe.planner.search.incumbent import incumbent_bar_s
from ethpipe.planner.estimate import ideal_time_s

AHEAD_MIN_DEVICES = 256  # devices from which the first idle candidate is planned in a second process
NEAR = 1.10  # the first candidate within this of the best so far does not stop the search (module docstring)


def compared_time_s(plan: Plan) -> float:
    """What candidates are compared by: the worst case for robust plans (an idle type cannot help when a
    used type turns out slow, so idling must win there too), else the nominal iteration time."""
    predicted = plan.predicted or {}
    return float(predicted.get("worst_case_time_s", predicted["iteration_time_s"]))


def idle_candidates(cost: CostModel) -> list[tuple[str, ...]]:
    """The GPU types to leave idle, candidate by candidate: the slowest, the two slowest, ... (>= 1 type kept)."""
    slowest = sorted(cost.cluster.gpu_types, key=cost.device_speed)
    return [tuple(slowest[:k]) for k in range(1, len(slowest))]


def nic_share_by_type(cost: CostModel) -> dict[str, float]:
    """Per GPU type, the least per-GPU share (GB/s) of a node's NIC among its devices: ``nic_share_gbps`` of one
    rank on a node whose every rank syncs across nodes."""
    per_node = Counter(d.node for d in cost.cluster.devices)
    shares: dict[str, float] = {}
    for d in cost.cluster.devices:
        share = nic_share_gbps(d.nic_gbps, d.flow_gbps, 1, per_node[d.node])
        shares[d.gpu.id] = min(shares.get(d.gpu.id, math.inf), share)
    return shares


def slowest_nic_share_gbps(shares: dict[str, float], idle_types: tuple[str, ...]) -> float:
    """The least of ``nic_share_by_type``'s shares among the types not in ``idle_types``."""
    return min((s for t, s in shares.items() if t not in idle_types), default=math.inf)


def _reason(idle_types: tuple[str, ...], time_s: float, full_s: float | None, robust: bool) -> str:
    names = ", ".join(idle_types)
    pronoun = "it" if len(idle_types) == 1 else "them"
    what = "worst case" if robust else "predicted"
    if full_s is None:
        return f"idle: plan without {names} {what} {time_s:.4g} s; with {pronoun} no plan fits"
    return f"idle: plan without {names} {what} {time_s:.4g} s vs {full_s:.4g} s with {pronoun}"


def sub_cluster(cost: CostModel, idle_types: tuple[str, ...]) -> CostModel:
    """The pricing of the devices not of ``idle_types``; the same ``Cluster`` object each time
    (``Cluster.without_devices``), so the planner's memos keyed by cluster serve every search of it."""
    return cost.on_cluster(cost.cluster.without_devices([d.rank for d in cost.cluster.devices
                                                         if d.gpu.id in idle_types]))


def plan_with_idle(cost: CostModel, global_batch: int, plan_on: Callable[[CostModel, float], Plan | None],
                   *, ahead: bool | None = None) -> tuple[Plan, CostModel]:
    """The fastest of ``plan_on(cost, inf)`` and ``plan_on`` on each idle candidate's sub-cluster, with the
    cost model that priced it. ``plan_on``'s second argument is the best time so far (``incumbent_bar_s``): it may
    return None when it finds nothing faster, which saves most of a losing candidate's search. The first candidate is planned
    with nothing to beat, so that with ``ahead`` (where ``planner.ahead.can_run_ahead()``) a second process
    plans it while this one plans the whole cluster, with the same result (``ahead=None``: from
    ``AHEAD_MIN_DEVICES`` devices on, where planning takes long enough to repay the fork). Infeasible
    sub-clusters are skipped; if nothing fits, the full cluster's error."""
    started = time.perf_counter()
    candidates = idle_candidates(cost)
    if ahead is None:
        ahead = cost.cluster.num_devices >= AHEAD_MIN_DEVICES
    first = Ahead(lambda: plan_on(sub_cluster(cost, candidates[0]), math.inf)) if (
        ahead and candidates and can_run_ahead()) else None
    best: tuple[Plan, CostModel, tuple[str, ...]] | None = None
    error: Infeasible | None = None
    try:
        full = plan_on(cost, math.inf)
        assert full is not None, "with nothing to beat, a plan or Infeasible"
        best = (full, cost, ())
    except Infeasible as err:
        error = err
    except BaseException:
        if first is not None:
            first.cancel()
        raise
    full_s = compared_time_s(best[0]) if best is not None else None
    tried: list[dict[str, Any]] = []
    go_on = True  # whether the last priced candidate beat the best so far or came near it (or none was)
    shares = nic_share_by_type(cost)
    for k, idle_types in enumerate(candidates):
        if not go_on and slowest_nic_share_gbps(shares, idle_types) <= slowest_nic_share_gbps(shares, candidates[k - 1]):
            break  # idling one more type rarely helps where this one did not, unless it frees the slowest NICs
        sub = sub_cluster(cost, idle_types)
        record: dict[str, Any] = {"idle_types": list(idle_types), "lower_bound_s": ideal_time_s(sub, global_batch)}
        if best is not None and record["lower_bound_s"] >= compared_time_s(best[0]):
            tried.append({**record, "skipped": "lower bound >= best predicted iteration time"})
            break
        near_s = None  # the candidate's time where it did not beat the best but came within NEAR
        try:
            if k == 0:
                plan = first.result() if first is not None else MISSING
                first = None
                plan = plan_on(sub, math.inf) if plan is MISSING else plan
                if plan is not None and best is not None and compared_time_s(plan) >= compared_time_s(best[0]):
                    near_s = compared_time_s(plan) if compared_time_s(plan) <= NEAR * compared_time_s(best[0]) else None
                    plan = None  # as a search told the time to beat would say
            else:
                plan = plan_on(sub, incumbent_bar_s(best[0], compared_time_s(best[0])) if best is not None else math.inf)
        except Infeasible as err:
            tried.append({**record, "skipped": f"infeasible: {err}"})
            continue
        if plan is None:
            tried.append({**record, "skipped": f"no plan predicted under {compared_time_s(best[0]):.4g} s",  # type: ignore[index]
                          **({"near_s": near_s} if near_s is not None else {})})
            go_on = near_s is not None
            continue
        tried.append({**record, "iteration_time_s": float(plan.predicted["iteration_time_s"]),  # type: ignore[index]
                      **({"worst_case_time_s": compared_time_s(plan)} if "worst_case_time_s" in plan.predicted else {})})
        go_on = best is None or compared_time_s(plan) < NEAR * compared_time_s(best[0])
        if best is None or compared_time_s(plan) < compared_time_s(best[0]):
            best = (plan, sub, idle_types)
    if first is not None:  # the first candidate was skipped by its lower bound
        first.cancel()
    if best is None:
        assert error is not None, "every candidate was skipped or infeasible, and the full cluster raised"
        raise error
    plan, chosen, idle_types = best
    if not tried:
        return plan, chosen
    reason = _reason(idle_types, compared_time_s(plan), full_s, "worst_case_time_s" in (plan.predicted or {}))
    idle = tuple(dataclasses.replace(d, reason=reason) for d in plan.idle_devices)
    search = {**plan.extra.get("search", {}), "idle": {"full_cluster_iteration_time_s": full_s, "candidates": tried}}
    predicted = {**(plan.predicted or {}), "planning_time_s": time.perf_counter() - started}
    return dataclasses.replace(plan, idle_devices=idle, extra={**plan.extra, "search": search},
                               predicted=predicted), chosen
