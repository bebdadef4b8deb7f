"""Exhaustive searches over ETH's spaces, for small clusters: how much level 1's pruning loses.

``exhaustive_eth``, ETH's original space: one template per pool (every shape that tiles the pool -
depth, TP degree, node span - with every micro-batch size, not just the few the heuristic keeps),
pipelines balanced by level 3. Every combination across pools is priced with the same group
evaluator; a time budget bounds it honestly. When a pool cannot hold a replica alone (ETH mixes
it), the space is empty and no plan is returned.

``exhaustive_widened``, ETH's widened space (``hybrid.py``), every family without its pruning:
per pool, every template or any two of them on a split of its nodes (every split point); the
consecutive-node mixed pipelines of ETH's mixed sets and the type-interleaved pipelines over all
pools or over each pair adjacent in speed order (the others on their own candidates), with every
per-type TP vector, type order and micro-batch size; and the replicated family, whose search is
exact already. Combinations are searched depth-first with a valid bound (the batch over the
pipelines' summed per-sample floors, ``PipelineTiming.per_sample_floor_s``) against the best so
far; the final pick re-prices the best layouts like ETH does.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from ethpipe.cost.model import CostModel
from ethpipe.errors import Infeasible
from ethpipe.plan import Plan
from ethpipe.planner.assemble import Found, assemble_plan, found_pipelines, unpriced_plan
from ethpipe.planner.estimate import estimate_iteration_s
from ethpipe.planner.devices.grouping import Group, capacity_per_s, evaluate_groups, homogeneous_group
from ethpipe.planner.devices.hybrid import batch_share, hybrid_sets, interleaved, mixed_candidates, mixed_sets
from ethpipe.planner.devices.split_pools import split_candidates
from ethpipe.planner.search.options import PlannerOptions
from ethpipe.planner.devices.replicated import search_replicated
from ethpipe.planner.devices.templates import (Pool, build_template, micro_batch_candidates, pool_shapes, pools_of,
                                       shape_slots)

FINALISTS = 4  # best layouts re-priced by the estimator, as ETH does (``eth.ROBUST_CANDIDATES``)


@dataclass(frozen=True)
class ExhaustiveResult:
    plan: Plan | None
    combinations: int
    evaluated: int
    timed_out: bool


def _every_pool_group(cost: CostModel, pools: list[Pool], i: int, global_batch: int, max_tp: int, recompute: str,
                      cache: dict, options: PlannerOptions) -> list[Group]:
    """Pool i's every homogeneous shape at every micro-batch size that fits memory, unpruned."""
    pool, groups = pools[i], []
    for depth, tp, span in pool_shapes(cost, pool, max_tp):
        if pool.num_devices // (depth * tp) > global_batch:
            continue
        for b in micro_batch_candidates(global_batch):
            tpl = build_template(cost, i, shape_slots(pool, depth, tp, span), b, recompute, span, cache, options)
            if tpl is not None:
                groups.append(homogeneous_group(cost, tpl, pool))
    return groups


def exhaustive_eth(cost: CostModel, global_batch: int, *, max_tp: int = 8, recompute: str = "auto",
                   time_budget_s: float = 60.0) -> ExhaustiveResult:
    started = time.perf_counter()
    pools = pools_of(cost)
    cache: dict = {}
    per_pool = []
    for i, pool in enumerate(pools):
        groups = _every_pool_group(cost, pools, i, global_batch, max_tp, recompute, cache, PlannerOptions())
        if not groups:  # the pool needs mixed pipelines: outside the one-template-per-pool space
            return ExhaustiveResult(None, 0, 0, False)
        per_pool.append(groups)
    total = 1
    for c in per_pool:
        total *= len(c)
    best, evaluated, timed_out = None, 0, False
    for combo in itertools.product(*per_pool):
        if time.perf_counter() - started > time_budget_s:
            timed_out = True
            break
        evaluated += 1
        try:
            score, samples = evaluate_groups(cost, list(combo), global_batch)
        except Infeasible:
            continue
        if best is None or score < best[0]:
            best = (score, list(combo), samples)
    if best is None:
        return ExhaustiveResult(None, total, evaluated, timed_out)
    search = {"combinations": total, "evaluated": evaluated, "timed_out": timed_out}
    plan = assemble_plan("eth-exhaustive", cost, global_batch, found_pipelines(best), started_s=started, search=search)
    return ExhaustiveResult(plan, total, evaluated, timed_out)


def exhaustive_widened(cost: CostModel, global_batch: int, *, max_tp: int = 8, recompute: str = "auto",
                       time_budget_s: float = 60.0) -> ExhaustiveResult:
    """The best plan of ETH's widened space (module docstring), for clusters small enough to enumerate it."""
    started = time.perf_counter()
    deadline = started + time_budget_s
    options, cache, pools = PlannerOptions(), {}, pools_of(cost)
    own: dict[int, list[list[Group]]] = {}
    for i, pool in enumerate(pools):
        whole = _every_pool_group(cost, pools, i, global_batch, max_tp, recompute, cache, options)
        if whole:
            own[i] = [[g] for g in whole] + split_candidates(cost, pool, whole, every=True)
        if time.perf_counter() > deadline:  # building the candidates alone can exceed the budget
            return ExhaustiveResult(None, 0, 0, True)
    family = {"max_tp": max_tp, "recompute": recompute, "options": options, "micro_batches": None, "cache": cache,
              "every": True}
    layouts = []
    for mixed_set in mixed_sets(cost, pools, list(own)):
        per_pool = [own[i] for i in range(len(pools)) if i in own and i not in mixed_set]
        if mixed_set:
            per_pool.append(mixed_candidates(cost, [pools[i] for i in mixed_set], global_batch, **family))
        layouts.append(per_pool)
    if len(pools) > 1:
        layouts.append([interleaved(cost, pools, global_batch, **family)])
        for pair in hybrid_sets(cost, pools, list(own)):
            layouts.append([own[i] for i in range(len(pools)) if i not in pair] + [interleaved(
                cost, [pools[i] for i in pair], batch_share(cost, pools, pair, global_batch), **family)])
    finalists: list[Found] = []
    combinations, evaluated, timed_out = 0, 0, False
    for per_pool in (layout for layout in layouts if layout and all(layout)):
        total = 1
        for candidates in per_pool:
            total *= len(candidates)
        combinations += total
        best = min(finalists, key=lambda f: f[0], default=None)
        found, count, out_of_time = _branch_and_bound(cost, per_pool, global_batch, best[0] if best else math.inf,
                                                      deadline)
        evaluated, timed_out = evaluated + count, timed_out or out_of_time
        finalists += [found] if found is not None else []
    best = min(finalists, key=lambda f: f[0], default=None)
    replicated, priced = search_replicated(cost, global_batch, max_tp=max_tp, recompute=recompute, options=options,
                                           micro_batches=None, cache=cache, incumbent=best)
    evaluated += priced
    finalists += [replicated] if replicated is not None else []
    search = {"combinations": combinations, "evaluated": evaluated, "timed_out": timed_out, "space": "widened"}
    if not finalists:
        return ExhaustiveResult(None, combinations, evaluated, timed_out)
    final = min(sorted(finalists, key=lambda f: f[0])[:FINALISTS], key=lambda f: estimate_iteration_s(
        unpriced_plan("eth-exhaustive", cost, global_batch, found_pipelines(f), search), cost))
    plan = assemble_plan("eth-exhaustive", cost, global_batch, found_pipelines(final), started_s=started, search=search)
    return ExhaustiveResult(plan, combinations, evaluated, timed_out)


def _branch_and_bound(cost: CostModel, per_pool: list[list[list[Group]]], global_batch: int, incumbent_s: float,
                      deadline: float) -> tuple[Found | None, int, bool]:
    """Best combination (one candidate per pool) strictly better than ``incumbent_s``, depth-first: a branch
    is cut when the batch over the most capacity it can still reach is no faster (a valid bound: some
    pipeline runs n_p samples at its floor or slower). Returns (best or None, priced, timed out)."""
    ranked = [sorted(c, key=capacity_per_s, reverse=True) for c in per_pool]
    caps = [[capacity_per_s(c) for c in pool] for pool in ranked]
    reach = [sum(c[0] for c in caps[i:]) for i in range(len(caps))] + [0.0]
    best: list = [incumbent_s, None]
    counts = [0, False]

    def visit(i: int, chosen: list[Group], capacity: float) -> None:
        if counts[1]:
            return
        if i == len(ranked):
            if time.perf_counter() > deadline:
                counts[1] = True
                return
            counts[0] += 1
            try:
                score, samples = evaluate_groups(cost, chosen, global_batch)
            except Infeasible:
                return
            if score < best[0]:
                best[:] = [score, (score, list(chosen), samples)]
            return
        for candidate, cap in zip(ranked[i], caps[i]):
            if global_batch / (capacity + cap + reach[i + 1]) >= best[0]:
                break  # sorted by capacity: every later candidate reaches less
            visit(i + 1, chosen + candidate, capacity + cap)

    visit(0, [], 0.0)
    return best[1], counts[0], bool(counts[1])
