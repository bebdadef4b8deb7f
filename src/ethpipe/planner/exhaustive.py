"""Exhaustive search over ETH's own space, for small clusters: how much level 1's pruning loses.

ETH's space: one template per pool (every shape that tiles the pool - depth, TP degree, node
span - with every micro-batch size, not just the few the heuristic keeps), pipelines balanced
by level 3. Every combination
across pools is priced with the same group evaluator; a time budget bounds it honestly. When
a pool cannot hold a replica alone (ETH mixes it), the space is empty and no plan is returned.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from ethpipe.cost.model import CostModel
from ethpipe.errors import Infeasible
from ethpipe.plan import Plan
from ethpipe.planner.assemble import assemble_plan, make_pipeline
from ethpipe.planner.grouping import evaluate_groups, homogeneous_group
from ethpipe.planner.templates import build_template, micro_batch_candidates, pool_shapes, pools_of, shape_slots


@dataclass(frozen=True)
class ExhaustiveResult:
    plan: Plan | None
    combinations: int
    evaluated: int
    timed_out: bool


def exhaustive_eth(cost: CostModel, global_batch: int, *, max_tp: int = 8, recompute: str = "auto",
                   time_budget_s: float = 60.0) -> ExhaustiveResult:
    started = time.perf_counter()
    pools = pools_of(cost)
    cache: dict = {}
    per_pool = []
    for i, pool in enumerate(pools):
        groups = []
        for depth, tp, span in pool_shapes(cost, pool, max_tp):
            if pool.num_devices // (depth * tp) > global_batch:
                continue
            for b in micro_batch_candidates(global_batch):
                tpl = build_template(cost, i, shape_slots(pool, depth, tp, span), b, recompute, span, cache)
                if tpl is not None:
                    groups.append(homogeneous_group(cost, tpl, pool))
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
    _, groups, samples = best
    pipelines = [make_pipeline(slots, gr.template.partition, n, gr.template.micro_batch)
                 for gr, row in zip(groups, samples) for slots, n in zip(gr.instances, row)]
    search = {"combinations": total, "evaluated": evaluated, "timed_out": timed_out}
    plan = assemble_plan("eth-exhaustive", cost, global_batch, pipelines, started_s=started, search=search)
    return ExhaustiveResult(plan, total, evaluated, timed_out)
