"""The ETH planner: hierarchical workload balance (DESIGN 2.1).

Level 1 picks, per pool of identical nodes, a few promising templates (scored by how fast a
pipeline of that template processes its fair share of the batch), then evaluates every
combination across pools with levels 2 and 3 and the block-wise sync. Pools that cannot hold a
model replica alone are merged into mixed pipelines over consecutive nodes (the only place
types mix). Cost is a sum of small searches: templates are shared by all their pipelines.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from ethpipe.cost.model import CostModel
from ethpipe.plan import Plan
from ethpipe.planner.assemble import assemble_plan, make_pipeline, memory_error
from ethpipe.planner.grouping import Group, evaluate_groups, homogeneous_group
from ethpipe.planner.templates import Pool, Template, build_template, divisors, pool_templates, pools_of, slots_for

TOP_TEMPLATES_PER_POOL = 3
MAX_COMBINATIONS = 81


def _fair_share(cost: CostModel, tpl: Template, global_batch: int, total_speed: float) -> int:
    speed = sum(cost.device_speed(s.device) * s.tp for s in tpl.slots)
    return max(1, round(global_batch * speed / total_speed))


def _pool_sync_s(cost: CostModel, pool: Pool, tpl: Template) -> float:
    """Rough block-sync time of the pool alone: each node's NIC carries its pipelines' reduced grads."""
    num_nodes = len(pool.nodes)
    if num_nodes <= 1:
        return 0.0
    model_bytes = cost.stage_params(cost.model.num_layers, first=True, last=True) * cost.dtype_bytes
    nic_gbps = cost.cluster.devices[pool.nodes[0][0]].nic_gbps
    return 2 * (num_nodes - 1) / num_nodes * model_bytes / tpl.nodes_per_pipeline / (nic_gbps * 1e9)


def _top_groups(cost: CostModel, pool: Pool, templates: Sequence[Template], global_batch: int, keep: int
                ) -> list[Group]:
    """Best micro-batch size per shape, then the best few shapes, by time to process a fair share."""
    best: dict[tuple[int, int, int], tuple[float, Template]] = {}
    fitting = [t for t in templates if pool.num_devices // t.devices_per_pipeline <= global_batch]
    speeds = cost.device_speeds()
    total_speed = sum(speeds[d.gpu.id] for d in cost.cluster.devices)
    for tpl in fitting or [max(templates, key=lambda t: t.devices_per_pipeline)]:
        score = tpl.timing.time_s(_fair_share(cost, tpl, global_batch, total_speed)) + _pool_sync_s(cost, pool, tpl)
        key = (tpl.depth, tpl.tp, tpl.nodes_per_pipeline)
        if key not in best or score < best[key][0]:
            best[key] = (score, tpl)
    ranked = sorted(best.values(), key=lambda st: (st[0], -st[1].devices_per_pipeline))
    return [homogeneous_group(tpl, pool) for _, tpl in ranked[:keep]]


def _mixed_candidates(cost: CostModel, pools: Sequence[Pool], global_batch: int, *, max_tp: int, recompute: str,
                      cache: dict) -> list[list[Group]]:
    """Pipelines over k consecutive nodes of the pools that cannot hold a replica alone (fewest k that fits)."""
    nodes = [(p.device, node) for p in sorted(pools, key=lambda p: -cost.device_speed(p.device)) for node in p.nodes]
    tps = [t for t in divisors(min(p.gpus_per_node for p in pools)) if t <= max_tp and
           all(p.gpus_per_node % t == 0 for p in pools)]
    for k in range(1, len(nodes) + 1):
        chunks = [nodes[i:i + k] for i in range(0, len(nodes) - len(nodes) % k, k)]
        if len(nodes) % k:
            chunks[-1] = chunks[-1] + nodes[len(nodes) - len(nodes) % k:]
        options: list[list[Group]] = []
        for t, b in itertools.product(tps, (1, 2, 4, 8)):
            groups: dict[tuple, Group] = {}
            for chunk in chunks:
                slots = slots_for([(dev, r) for dev, node in chunk for r in node], t)
                tpl = build_template(cost, -1, slots, b, recompute, len(chunk), cache)
                if tpl is None:
                    break
                key = tuple((s.device, s.tp) for s in slots)
                prev = groups.get(key)
                groups[key] = Group(tpl, (prev.instances if prev else ()) + (slots,),
                                    (prev.num_nodes if prev else 0) + len(chunk), 1, max(len(n) for _, n in chunk))
            else:
                options.append(list(groups.values()))
        if options:
            return options
    return []


def plan_eth(cost: CostModel, global_batch: int, *, max_tp: int = 8, recompute: str = "auto") -> Plan:
    started = time.perf_counter()
    cache: dict = {}
    pools = pools_of(cost)
    own: dict[int, list[list[Group]]] = {}  # pool index -> candidate group lists
    # As many templates per pool as MAX_COMBINATIONS allows for a full enumeration (at least 3).
    keep = max(TOP_TEMPLATES_PER_POOL, int(round(MAX_COMBINATIONS ** (1 / len(pools)))))
    for i, pool in enumerate(pools):
        templates = pool_templates(cost, pools, i, max_tp=max_tp, recompute=recompute,
                                   max_micro_batch=max(1, global_batch), cache=cache)
        if templates:
            own[i] = [[g] for g in _top_groups(cost, pool, templates, global_batch, keep)]
    best: tuple[float, list[Group], list[list[int]]] | None = None
    layouts, error = 0, None
    for mixed_set in _mixed_sets(cost, pools, own):
        per_pool = [own[i] for i in range(len(pools)) if i in own and i not in mixed_set]
        if mixed_set:
            mixed = _mixed_candidates(cost, [pools[i] for i in mixed_set], global_batch, max_tp=max_tp,
                                      recompute=recompute, cache=cache)
            if not mixed:
                continue
            per_pool.append(mixed)
        layouts += 1
        try:
            found = _search(cost, per_pool, global_batch)
        except ValueError as err:  # e.g. more pipelines than samples: another layout may still work
            error = err
            continue
        if best is None or found[0] < best[0]:
            best = found
    if best is None:
        raise error if error is not None else memory_error(cost, recompute)
    score, groups, samples = best
    pipelines = [make_pipeline(slots, gr.template.partition, n, gr.template.micro_batch)
                 for gr, row in zip(groups, samples) for slots, n in zip(gr.instances, row)]
    search = {"pools": len(pools), "layouts_evaluated": layouts, "templates_evaluated": len(cache),
              "estimated_iteration_s": score}
    return assemble_plan("eth", cost, global_batch, pipelines, started_s=started, search=search)


def _mixed_sets(cost: CostModel, pools: Sequence[Pool], own: dict[int, list[list[Group]]]) -> list[tuple[int, ...]]:
    """Which pools form mixed pipelines: none if every pool stands alone; else the pools that cannot,
    alone or joined by one self-sufficient donor pool (each tried), or by all of them."""
    needy = tuple(i for i in range(len(pools)) if i not in own)
    if not needy:
        return [()]
    donors = sorted(own, key=lambda i: -cost.gpu(pools[i].device).memory_bytes)
    return [needy] + [tuple(sorted(needy + (d,))) for d in donors] + [tuple(range(len(pools)))]


def _search(cost: CostModel, per_pool: list[list[list[Group]]], global_batch: int
            ) -> tuple[float, list[Group], list[list[int]]]:
    """Every combination when few, else coordinate descent from each pool's best candidate."""
    best: tuple[float, list[Group], list[list[int]]] | None = None
    last_error: ValueError | None = None

    def consider(choice: Sequence[int]) -> None:
        nonlocal best, last_error
        groups = [g for pool, c in zip(per_pool, choice) for g in pool[c]]
        try:
            score, samples = evaluate_groups(cost, groups, global_batch)
        except ValueError as err:
            last_error = err
            return
        if best is None or score < best[0]:
            best = (score, groups, samples)
            best_choice[:] = list(choice)

    best_choice: list[int] = [0] * len(per_pool)
    sizes = [len(c) for c in per_pool]
    total = 1
    for s in sizes:
        total *= s
    if total <= MAX_COMBINATIONS:
        for choice in itertools.product(*(range(s) for s in sizes)):
            consider(choice)
    else:
        consider(best_choice)
        for _ in range(2):
            for i, s in enumerate(sizes):
                base = list(best_choice)
                for c in range(s):
                    consider(base[:i] + [c] + base[i + 1:])
    if best is None:
        assert last_error is not None
        raise last_error
    return best
