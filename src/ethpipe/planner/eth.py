"""The ETH planner: hierarchical workload balance (docs/design.md §2.1).

Level 1, per pool of identical nodes: every pipeline shape that tiles the pool (depth, TP
degree, packed into nodes or spanning k nodes, up to one layer per stage), each with the
micro-batch size that processes the pool's fair share fastest (levels 2 and 3 on that shape),
is scored by the iteration time of the pool alone *with its gradient sync* (``SyncShape``
pricing: a deeper, node-spanning pipeline pushes 1/k of a replica through each NIC, an
in-node one a whole replica). The best few shapes per pool are combined across pools (every
combination when few, else coordinate descent), balanced (level 3) and priced exactly as the
estimator prices the final plan. Types mix in two places: pools that cannot hold a model
replica alone are merged into pipelines over consecutive nodes; and a small type-interleaved
family (every pipeline takes an equal slice of every pool, a few pipeline counts / TP degrees
by an analytic pre-score, four type orders) is tried too, because with few samples per GPU a
slow type's own pipelines are either shallow (a whole replica of sync per node) or
bubble-bound. Finally the replicated family (``replicated.py``): every layout of the
layer-balanced and uniform baselines' spaces, searched best-first by lower bound against the
best plan so far and priced with level-3 data balance too, so ETH is never predicted slower
than either baseline. Cost is a sum of small searches: templates are shared by all their
pipelines and identical pipelines priced once.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence

from ethpipe.cost.model import CostModel
from ethpipe.errors import Infeasible
from ethpipe.plan import Pipeline, Plan
from ethpipe.planner.assemble import assemble_plan, make_pipeline, memory_error, unpriced_plan
from ethpipe.planner.estimate import estimate_iteration_s
from ethpipe.planner.grouping import Group, evaluate_groups, group_iteration_s, homogeneous_group, make_group
from ethpipe.planner.options import PlannerOptions
from ethpipe.planner.replicated import search_replicated
from ethpipe.planner.robust import robust_record
from ethpipe.planner.templates import (MICRO_BATCH_CANDIDATES, Pool, build_template, divisors, micro_batch_candidates,
                                       pool_shapes, pools_of, shape_slots, slots_for)

MIN_SHAPES_PER_POOL = 3
MAX_COMBINATIONS = 27
SHAPES_BUILT_PER_POOL = 6  # shapes partitioned and scored exactly, after the analytic pre-score
ROBUST_CANDIDATES = 4  # best layouts by nominal time priced under the speed perturbations (robust=True)


def _prescore_s(cost: CostModel, pool: Pool, depth: int, tp: int, span: int, share: int) -> float:
    """Rough iteration time of a shape: 1F1B at b=1 with a perfect layer split, plus the first
    stage's sync (later stages sync while it drains) with the node's NIC carrying 1/span of a replica."""
    per_sample = sum(cost.layer_times_s(pool.device, 1, tp)) * cost.model.num_layers / depth
    model_bytes = cost.stage_params(cost.model.num_layers, first=True, last=True) * cost.dtype_bytes
    nic = cost.cluster.devices[pool.nodes[0][0]].nic_gbps * 1e9
    sync = 2 * model_bytes / depth / nic if len(pool.nodes) > 1 or span > 1 else 0.0
    return (share + depth - 1) * per_sample + sync


def _pool_groups(cost: CostModel, pools: Sequence[Pool], i: int, global_batch: int, *, max_tp: int, recompute: str,
                 options: PlannerOptions, micro_batches: Sequence[int] | None, cache: dict) -> list[tuple[float, Group]]:
    """Every shape of pool i with its best micro-batch size, scored by the pool's own iteration time."""
    pool = pools[i]
    speeds = cost.device_speeds()
    total_speed = sum(speeds[d.gpu.id] for d in cost.cluster.devices)
    pool_share = global_batch * speeds[pool.device] * pool.num_devices / total_speed
    scored = []
    shapes = []
    for depth, tp, span in pool_shapes(cost, pool, max_tp):
        count = pool.num_devices // (depth * tp)
        if count <= global_batch:
            share = max(1, round(pool_share / count))
            shapes.append((_prescore_s(cost, pool, depth, tp, span, share), depth, tp, span, count, share))
    shapes.sort()
    built = 0
    for _, depth, tp, span, count, share in shapes:
        if built >= SHAPES_BUILT_PER_POOL:
            break
        slots = shape_slots(pool, depth, tp, span)
        best = None
        for b in micro_batches or micro_batch_candidates(max(1, -(-share // depth))):
            tpl = build_template(cost, i, slots, b, recompute, span, cache, options)
            if tpl is None:
                continue
            if best is not None and tpl.timing.time_s(share) >= best[0]:
                break  # T(share) is unimodal in b: fewer, larger micro-batches until the bubble grows
            best = (tpl.timing.time_s(share), tpl)
        if best is None:
            continue
        built += 1
        group = homogeneous_group(cost, best[1], pool)
        score = group_iteration_s(cost, [group], [[share] * count], flat_sync=not options.block_sync)
        scored.append((score, group))
    scored.sort(key=lambda sg: (sg[0], -sg[1].template.devices_per_pipeline))
    return scored


def _diverse(scored: list[tuple[float, Group]], keep: int) -> list[Group]:
    """The best shape of each node span first (the combination may need the sync relief of spanning
    shapes even where the pool alone prefers packing its nodes), then the next best."""
    kept: list[Group] = []
    spans: set[int] = set()
    for _, g in scored:
        if len(kept) < keep and g.template.nodes_per_pipeline not in spans:
            spans.add(g.template.nodes_per_pipeline)
            kept.append(g)
    kept += [g for _, g in scored if g not in kept][:keep - len(kept)]
    return kept


def _mixed_candidates(cost: CostModel, pools: Sequence[Pool], *, max_tp: int, recompute: str,
                      options: PlannerOptions, micro_batches: Sequence[int] | None, cache: dict) -> list[list[Group]]:
    """Pipelines over k consecutive nodes of the pools that cannot hold a replica alone (fewest k that fits)."""
    nodes = [(p.device, node) for p in sorted(pools, key=lambda p: -cost.device_speed(p.device)) for node in p.nodes]
    tps = [t for t in divisors(min(p.gpus_per_node for p in pools)) if t <= max_tp and
           all(p.gpus_per_node % t == 0 for p in pools) and cost.model.tp_problem(t) is None]
    for k in range(1, len(nodes) + 1):
        chunks = [nodes[i:i + k] for i in range(0, len(nodes) - len(nodes) % k, k)]
        if len(nodes) % k:
            chunks[-1] = chunks[-1] + nodes[len(nodes) - len(nodes) % k:]
        options_found: list[list[Group]] = []
        for t, b in itertools.product(tps, micro_batches or (1, 2, 4, 8)):
            members: dict[tuple, list] = {}
            for chunk in chunks:
                slots = slots_for([(dev, r) for dev, node in chunk for r in node], t)
                if len(slots) > cost.model.num_layers:
                    break
                tpl = build_template(cost, -1, slots, b, recompute, len(chunk), cache, options)
                if tpl is None:
                    break
                members.setdefault((tuple((s.device, s.tp) for s in slots), id(tpl.timing)), [tpl, []])[1].append(slots)
            else:
                options_found.append([make_group(cost, tpl, inst) for tpl, inst in members.values()])
        if options_found:
            return options_found
    return []


INTERLEAVED_SHAPES = 3  # (pipelines, tp) pairs of the type-interleaved family tried with every order


def _interleaved(cost: CostModel, pools: Sequence[Pool], global_batch: int, *, max_tp: int, recompute: str,
                 options: PlannerOptions, micro_batches: Sequence[int] | None, cache: dict) -> list[list[Group]]:
    """Mixed pipelines that take an equal slice of every pool (one stage run per type, in one of a few
    type orders). Where few samples per GPU make sync dominate, this is how each node holds a small
    part of the model without deep pipelines; data still balances across the resulting pipelines."""
    counts = [p.num_devices for p in pools]
    g = min(p.gpus_per_node for p in pools)
    model_bytes = cost.stage_params(cost.model.num_layers, first=True, last=True) * cost.dtype_bytes
    nic = min(cost.cluster.devices[p.nodes[0][0]].nic_gbps for p in pools) * 1e9
    speed = sum(cost.achievable_flops(p.device) * p.num_devices for p in pools)
    per_sample_s = sum(cost.layer_times_s(pools[0].device, 1)) * cost.model.num_layers * cost.achievable_flops(
        pools[0].device)
    shapes = []
    for dp in (k for k in divisors(min(counts)) if all(c % k == 0 for c in counts) and k <= global_batch):
        slices = [c // dp for c in counts]
        for t in (x for x in divisors(g) if x <= max_tp and all(s % x == 0 for s in slices)
                  and cost.model.tp_problem(x) is None):
            depth = sum(slices) // t
            if depth > cost.model.num_layers or depth < len(pools):
                continue
            share = global_batch / dp
            work = per_sample_s * global_batch / speed  # perfectly balanced compute
            span = sum(-(-s // p.gpus_per_node) for s, p in zip(slices, pools))
            score = work * (share + depth - 1) / share + 2 * model_bytes * min(span, depth) / depth / span / nic
            shapes.append((score, dp, t, slices))
    shapes.sort(key=lambda x: x[0])
    orders = {tuple(sorted(range(len(pools)), key=key)) for key in (
        lambda i: -cost.device_speed(pools[i].device), lambda i: cost.device_speed(pools[i].device),
        lambda i: cost.gpu(pools[i].device).memory_bytes, lambda i: -cost.gpu(pools[i].device).memory_bytes)}
    ranks = [[r for node in p.nodes for r in node] for p in pools]
    out = []
    for _, dp, t, slices in shapes[:INTERLEAVED_SHAPES]:
        for order in sorted(orders):
            instances = [slots_for([(pools[i].device, r) for i in order
                                    for r in ranks[i][k * slices[i]:(k + 1) * slices[i]]], t) for k in range(dp)]
            best = None
            for b in micro_batches or micro_batch_candidates(max(1, -(-global_batch // (dp * len(instances[0]))))):
                groups = _structure_groups(cost, instances, b, recompute, options, cache)
                if groups is None:
                    continue
                t_s = groups[0].template.timing.time_s(-(-global_batch // dp))
                if best is not None and t_s >= best[0]:
                    break
                best = (t_s, groups)
            if best is not None:
                out.append(best[1])
    return out


def _structure_groups(cost: CostModel, instances: Sequence[tuple], b: int, recompute: str, options: PlannerOptions,
                      cache: dict) -> list[Group] | None:
    """Group pipelines with the same devices and links under one template; None if one does not fit."""
    members: dict[tuple, list] = {}
    for slots in instances:
        tpl = build_template(cost, -1, slots, b, recompute, 0, cache, options)
        if tpl is None:
            return None
        members.setdefault((tuple((s.device, s.tp) for s in slots), id(tpl.timing)), [tpl, []])[1].append(slots)
    return [make_group(cost, tpl, inst) for tpl, inst in members.values()]


def plan_eth(cost: CostModel, global_batch: int, *, max_tp: int = 8, recompute: str = "auto",
             options: PlannerOptions | None = None, robust: bool = False) -> Plan:
    """``robust``: of the best ``ROBUST_CANDIDATES`` layouts by nominal time, return the one with the
    least worst-case time under the speed perturbations of ``robust.py`` (ties: nominal time)."""
    started = time.perf_counter()
    options = options or PlannerOptions()
    cache: dict = {}
    pools = pools_of(cost)
    # Whole micro-batches only: one micro-batch size for the plan, so whole ones add up to the batch.
    mb_sets: list[tuple[int, ...] | None] = [None] if options.fine_grained else [
        (b,) for b in MICRO_BATCH_CANDIDATES if global_batch % b == 0]
    keep = max(MIN_SHAPES_PER_POOL, int(round(MAX_COMBINATIONS ** (1 / len(pools)))))
    best: tuple[float, list[Group], list[list[int]]] | None = None
    layouts, error = 0, None
    finalists: list[tuple[float, list[Group], list[list[int]]]] = []  # each layout's best, for robust
    for mbs in mb_sets:
        own: dict[int, list[list[Group]]] = {}
        for i in range(len(pools)):
            scored = _pool_groups(cost, pools, i, global_batch, max_tp=max_tp, recompute=recompute, options=options,
                                  micro_batches=mbs, cache=cache)
            if scored:
                own[i] = [[g] for g in _diverse(scored, keep)]
        needy = [i for i in range(len(pools)) if i not in own]
        if needy and not options.allow_mixed:
            names = ", ".join(pools[i].device for i in needy)
            raise Infeasible(f"{cost.model.name} does not fit in homogeneous pipelines of {names} "
                             "(allow_mixed=False): allow mixed pipelines, use more nodes or a shorter --seq-len")
        for mixed_set in _mixed_sets(cost, pools, own):
            per_pool = [own[i] for i in range(len(pools)) if i in own and i not in mixed_set]
            if mixed_set:
                mixed = _mixed_candidates(cost, [pools[i] for i in mixed_set], max_tp=max_tp, recompute=recompute,
                                          options=options, micro_batches=mbs, cache=cache)
                if not mixed:
                    continue
                per_pool.append(mixed)
            layouts += 1
            try:
                found = _search(cost, per_pool, global_batch, options)
            except Infeasible as err:  # e.g. more pipelines than samples: another layout may still work
                error = err
                continue
            finalists.append(found)
            if best is None or found[0] < best[0]:
                best = found
        if options.allow_mixed and len(pools) > 1:
            for groups in _interleaved(cost, pools, global_batch, max_tp=max_tp, recompute=recompute,
                                       options=options, micro_batches=mbs, cache=cache):
                layouts += 1
                try:
                    found = _search(cost, [[groups]], global_batch, options)
                except Infeasible as err:
                    error = err
                    continue
                finalists.append(found)
                if best is None or found[0] < best[0]:
                    best = found
        replicated, priced = search_replicated(cost, global_batch, max_tp=max_tp, recompute=recompute, options=options,
                                               micro_batches=mbs, cache=cache, incumbent=best)
        layouts += priced
        if replicated is not None:
            best = replicated
            finalists.append(replicated)
    if best is None:
        raise error if error is not None else memory_error(cost, recompute)
    search = {"pools": len(pools), "layouts_evaluated": layouts, "templates_evaluated": len(cache),
              "options": options.to_dict()}
    if not robust:  # the search's score misses what only the final pricing sees (p2p NIC sharing)
        candidates = sorted(finalists, key=lambda f: f[0])[:ROBUST_CANDIDATES]
        candidates += [best] if all(f is not best for f in candidates) else []
        final = min(candidates, key=lambda f: estimate_iteration_s(
            unpriced_plan("eth", cost, global_batch, _pipelines(f), search), cost, flat_sync=not options.block_sync))
        return _build(cost, global_batch, final, search, started, options)
    return _most_robust(cost, global_batch, sorted(finalists, key=lambda f: f[0]), search, started, options)


def _build(cost: CostModel, global_batch: int, found: tuple[float, list[Group], list[list[int]]], search: dict,
           started: float, options: PlannerOptions) -> Plan:
    return assemble_plan("eth", cost, global_batch, _pipelines(found), started_s=started,
                         search={**search, "estimated_iteration_s": found[0]}, flat_sync=not options.block_sync)


def _pipelines(found: tuple[float, list[Group], list[list[int]]]) -> list[Pipeline]:
    _, groups, samples = found
    return [make_pipeline(slots, gr.template.partition, n, gr.template.micro_batch)
            for gr, row in zip(groups, samples) for slots, n in zip(gr.instances, row)]


def _most_robust(cost: CostModel, global_batch: int, finalists: list[tuple[float, list[Group], list[list[int]]]],
                 search: dict, started: float, options: PlannerOptions) -> Plan:
    """The finalist with the least worst case; the nominal best is always priced, so robust never
    has a worse worst case than the nominal plan."""
    plans: list[tuple[float, float, Plan, dict]] = []
    for found in finalists[:ROBUST_CANDIDATES]:
        plan = _build(cost, global_batch, found, {**search, "robust": True}, started, options)
        record = robust_record(plan, cost)
        plans.append((record["worst_case_time_s"], plan.predicted["iteration_time_s"], plan, record))
    _, _, plan, record = min(plans, key=lambda x: (x[0], x[1]))
    predicted = {**plan.predicted, **record, "planning_time_s": time.perf_counter() - started}
    return dataclasses.replace(plan, predicted=predicted)


def _mixed_sets(cost: CostModel, pools: Sequence[Pool], own: dict[int, list[list[Group]]]) -> list[tuple[int, ...]]:
    """Which pools form mixed pipelines: none if every pool stands alone; else the pools that cannot,
    alone or joined by one self-sufficient donor pool (each tried), or by all of them."""
    needy = tuple(i for i in range(len(pools)) if i not in own)
    if not needy:
        return [()]
    donors = sorted(own, key=lambda i: -cost.gpu(pools[i].device).memory_bytes)
    return [needy] + [tuple(sorted(needy + (d,))) for d in donors] + [tuple(range(len(pools)))]


def _search(cost: CostModel, per_pool: list[list[list[Group]]], global_batch: int, options: PlannerOptions
            ) -> tuple[float, list[Group], list[list[int]]]:
    """Every combination when few, else coordinate descent from each pool's best candidate."""
    best: tuple[float, list[Group], list[list[int]]] | None = None
    last_error: Infeasible | None = None
    seen: set[tuple[int, ...]] = set()

    def consider(choice: Sequence[int]) -> None:
        nonlocal best, last_error
        if tuple(choice) in seen:
            return
        seen.add(tuple(choice))
        groups = [g for pool, c in zip(per_pool, choice) for g in pool[c]]
        try:
            score, samples = evaluate_groups(cost, groups, global_batch, equal_data=not options.balance_data,
                                             flat_sync=not options.block_sync)
        except Infeasible as err:
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
