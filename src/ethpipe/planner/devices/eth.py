"""The ETH planner: hierarchical workload balance (docs/design.md §2.1).

Level 1, per pool of identical nodes: every pipeline shape that tiles the pool (depth, TP
degree, packed into nodes or spanning k nodes, up to one layer per stage), each with the
micro-batch size that processes the pool's fair share fastest (levels 2 and 3 on that shape),
is scored by the iteration time of the pool alone *with its gradient sync* (``SyncShape``
pricing: a deeper, node-spanning pipeline pushes 1/k of a replica through each NIC, an
in-node one a whole replica). The best few shapes per pool are combined across pools (every
combination when few, else coordinate descent), balanced (level 3) and priced exactly as the
estimator prices the final plan. A pool may also split its nodes between its two best shapes.
Types mix in three places (``hybrid.py``, each pool's stages at its own TP degree): pools that
cannot hold a model replica alone are merged into pipelines over consecutive nodes; a small
type-interleaved family (every pipeline takes an equal slice of every pool, a few pipeline counts
/ TP vectors by an analytic pre-score, four type orders) is tried too, because with few samples
per GPU a slow type's own pipelines are either shallow (a whole replica of sync per node) or
bubble-bound; and hybrid layouts interleave a pair of pools adjacent in speed order while the
others keep their own pipelines. The replicated family (``replicated.py``): every layout of the
layer-balanced and uniform baselines' spaces, searched best-first by lower bound against the
best plan so far and priced with level-3 data balance too, so ETH is never predicted slower
than either baseline (the layer-balanced space first, as the incumbent of the others; the uniform
space's rank-order replicas last and apart, ``_rank_order_bar_s``). Cost is a sum of small searches:
templates are shared by all their pipelines and identical pipelines priced once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections import Counter
from collections.abc import Sequence

from ethpipe.cost.model import CostModel
from ethpipe.errors import Infeasible
from ethpipe.plan import Pipeline, Plan, Stage
from ethpipe.planner.assemble import Found, assemble_plan, found_pipelines, memory_error, unpriced_plan
from ethpipe.planner.search.memo import shared_bounds
from ethpipe.planner.estimate import estimate_iteration_s
from ethpipe.planner.layers.schedules import choose_schedules, flush_past_under_any
from ethpipe.schedule import DEFAULT_SCHEDULE
from ethpipe.planner.devices.grouping import (
    ROUNDING, Group, capacity_per_s, group_iteration_s, homogeneous_group, sync_shapes,
)
from ethpipe.planner.devices.hybrid import Cutoff, batch_share, hybrid_sets, interleaved, mixed_candidates, mixed_sets
from ethpipe.planner.devices.combine import MAX_COMBINATIONS, search_combinations
from ethpipe.planner.devices.split_pools import split_candidates
from ethpipe.planner.search.options import PlannerOptions
from ethpipe.planner.devices.replicated import search_replicated
from ethpipe.planner.robust import robust_record
from ethpipe.planner.devices.templates import (MICRO_BATCH_CANDIDATES, Pool, build_template, micro_batch_candidates,
                                       pool_shapes, pools_of, shape_slots, template_flush_bound_s)

MIN_SHAPES_PER_POOL = 3
SHAPES_BUILT_PER_POOL = 6  # shapes partitioned and scored exactly, after the analytic pre-score
ROBUST_CANDIDATES = 4  # best layouts by nominal time priced under the speed perturbations (robust=True)
HYBRID_PASSES = 1  # coordinate-descent passes of a hybrid layout (its other pools start at their best shapes)


def _prescore_s(cost: CostModel, pool: Pool, depth: int, tp: int, span: int, share: int) -> float:
    """Rough iteration time of a shape: 1F1B at b=1 with a perfect layer split, plus the first
    stage's sync (later stages sync while it drains) with the node's NIC carrying 1/span of a replica."""
    per_sample = sum(cost.layer_times_s(pool.device, 1, tp)) * cost.model.num_layers / depth
    model_bytes = cost.grad_sync_bytes(cost.model.num_layers, first=True, last=True)
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
    bounds = shared_bounds(cost, cache)
    for _, depth, tp, span, count, share in shapes:
        if built >= SHAPES_BUILT_PER_POOL:
            break
        sizes = micro_batches or micro_batch_candidates(max(1, -(-share // depth)))
        if math.isinf(bounds.stages_bottleneck_s([(pool.device, tp)] * depth, sizes[0], recompute)):
            continue  # cannot hold the model (the pre-score ignores memory): no partition tried
        slots = shape_slots(pool, depth, tp, span)
        best = None
        for b in sizes:
            if best is not None and template_flush_bound_s(cost, slots, b, recompute, share, cache, options) >= best[0]:
                break  # as below, without building it
            tpl = build_template(cost, i, slots, b, recompute, span, cache, options)
            if tpl is None:
                break  # memory only grows with the micro-batch size
            flush_s = float(tpl.timing.finish_s(share)[0])  # the score's own formula: no T(n) table yet
            if best is not None and flush_s >= best[0]:
                break  # T(share) is unimodal in b: fewer, larger micro-batches until the bubble grows
            best = (flush_s, tpl)
        if best is None:
            continue
        built += 1
        group = homogeneous_group(cost, best[1], pool, cache)
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


def plan_eth(cost: CostModel, global_batch: int, *, max_tp: int = 8, recompute: str = "auto",
             options: PlannerOptions | None = None, robust: bool = False, cache: dict | None = None,
             incumbent_s: float = math.inf,
             schedules: Sequence[str] = (DEFAULT_SCHEDULE,)) -> Plan | None:
    """``robust``: of the best ``ROBUST_CANDIDATES`` layouts by nominal time and the best rank-order replicas,
    return the one with the least worst-case time under the speed perturbations of ``robust.py`` (ties: nominal
    time).

    ``cache``: templates and stage options to reuse across calls on clusters of the same node types
    (the idle search's sub-clusters): their keys hold device types, TP degrees, same-node links and
    micro-batch sizes, never ranks. The lower bounds are rebuilt (their sync part depends on ranks and nodes;
    ``shared_bounds`` keeps their per-device memos).

    ``incumbent_s``: only a plan predicted faster matters (the idle search's best plan on another set of
    devices); every family prunes against it as against its own best, and None is returned if no plan
    beats it. Sound because a layout's search score never exceeds its final price. Not with ``robust``
    (the worst case, not the score, decides there). The replicated family searches the layer-balanced space;
    the rank-order replicas (the uniform baseline's space) are searched after every family, apart
    (``_rank_order_bar_s``).
    ``schedules``: the pipeline schedules allowed; the search prices 1F1B, then each of its best few layouts
    takes the fastest schedules that fit (``layers/schedules.py``) before they are compared."""
    assert not (robust and math.isfinite(incumbent_s)), "robust plans are compared by their worst case"
    started = time.perf_counter()
    options = options or PlannerOptions()
    cache = {} if cache is None else cache
    cache.pop(("lower_bounds",), None)
    pools = pools_of(cost)
    # Whole micro-batches only: one micro-batch size for the plan, so whole ones add up to the batch.
    mb_sets: list[tuple[int, ...] | None] = [None] if options.fine_grained else [
        (b,) for b in MICRO_BATCH_CANDIDATES if global_batch % b == 0]
    keep = max(MIN_SHAPES_PER_POOL, int(round(MAX_COMBINATIONS ** (1 / len(pools)))))
    best: Found | None = None
    layouts, error = 0, None
    finalists: list[Found] = []  # each layout's best, for robust

    def bar_s() -> float:
        """What a layout must beat: the best so far here or the incumbent; with ``robust``, the
        ``ROBUST_CANDIDATES``-th best layout so far (the candidates are the best few by nominal time, so
        pruning against the best alone would drop some of them, depending on the search order)."""
        if robust:
            scores = sorted(f[0] for f in finalists)
            return scores[ROBUST_CANDIDATES - 1] if len(scores) >= ROBUST_CANDIDATES else math.inf
        return min(incumbent_s, best[0] if best else math.inf)
    for mbs in mb_sets:
        own: dict[int, list[list[Group]]] = {}
        splits: dict[int, list[list[Group]]] = {}  # each pool's nodes shared by two shapes, tried after own
        for i in range(len(pools)):
            scored = _pool_groups(cost, pools, i, global_batch, max_tp=max_tp, recompute=recompute, options=options,
                                  micro_batches=mbs, cache=cache)
            if scored:
                own[i] = [[g] for g in _diverse(scored, keep)]
                splits[i] = (split_candidates(cost, pools[i], [g for _, g in scored], cache=cache)
                             if options.split_pools else [])
        needy = [i for i in range(len(pools)) if i not in own]
        if needy and not options.allow_mixed:
            names = ", ".join(pools[i].device for i in needy)
            raise Infeasible(f"{cost.model.name} does not fit in homogeneous pipelines of {names} "
                             "(allow_mixed=False): allow mixed pipelines, use more nodes or a shorter --seq-len")
        family = {"max_tp": max_tp, "recompute": recompute, "options": options, "micro_batches": mbs, "cache": cache}

        def try_layout(per_pool: list[list[list[Group]]], extra: Sequence[list[list[Group]]] = (), passes: int = 2
                       ) -> None:
            nonlocal best, layouts, error
            layouts += 1
            try:
                found = search_combinations(cost, per_pool, global_batch, options, extra, bar_s(), passes)
            except Infeasible as err:  # e.g. more pipelines than samples: another layout may still work
                error = err
                return
            if found is not None:
                finalists.append(found)
                best = found if best is None or found[0] < best[0] else best

        # The replicated family first: exact, and the incumbent that prunes the others (the flush bound
        # of ``search_combinations`` skips most per-pool combinations' sync pricing).
        replicated, priced = search_replicated(cost, global_batch, max_tp=max_tp, recompute=recompute, options=options,
                                               micro_batches=mbs, cache=cache, incumbent=None if robust else best,
                                               incumbent_s=bar_s(), uniform_space=False)
        layouts += priced
        if replicated is not None:
            best = replicated if best is None or replicated[0] < best[0] else best
            finalists.append(replicated)
        for mixed_set in mixed_sets(cost, pools, list(own)):
            alone = [i for i in range(len(pools)) if i in own and i not in mixed_set]
            mixed = mixed_candidates(cost, [pools[i] for i in mixed_set], global_batch, **family) if mixed_set else []
            if mixed or not mixed_set:
                try_layout([own[i] for i in alone] + ([mixed] if mixed else []), [splits[i] for i in alone])
        if options.allow_mixed and len(pools) > 1:
            covered = len({p.device for p in pools}) == len(pools)  # one pool per type: interleaved = layer-balanced
            for groups in interleaved(cost, pools, global_batch, **family, per_type_only=covered,
                                      cutoff=Cutoff(bar_s(), global_batch)):
                try_layout([[groups]])
            for pair in hybrid_sets(cost, pools, list(own)) if options.hybrid else []:
                alone = [i for i in range(len(pools)) if i not in pair]
                others_per_s = sum(max(capacity_per_s(c) for c in own[i] + splits[i]) for i in alone)
                mixed = interleaved(cost, [pools[i] for i in pair], batch_share(cost, pools, pair, global_batch),
                                    **family, cutoff=Cutoff(bar_s(), global_batch, others_per_s))
                if mixed:
                    try_layout([own[i] for i in alone] + [mixed], [splits[i] for i in alone], HYBRID_PASSES)
    rank_order = functools.partial(_rank_order_found, cost, global_batch, max_tp=max_tp, recompute=recompute,
                                   options=options, cache=cache, mb_sets=mb_sets)
    searched = best is None  # the rank-order replicas may fit where no other family does
    if searched:
        found_in_order, priced = rank_order(incumbent_s)
        finalists += found_in_order
        layouts += priced
        best = min(finalists, key=lambda f: f[0], default=None)
    if best is None and math.isfinite(incumbent_s):
        return None  # nothing priced under the incumbent (or nothing fits: not faster either)
    if best is None:
        raise error if error is not None else memory_error(cost, recompute)
    search = {"pools": len(pools), "layouts_evaluated": layouts, "templates_evaluated": len(cache),
              "options": options.to_dict()}
    if not robust:  # the search's score misses what only the final pricing sees (p2p NIC sharing)
        candidates = sorted(finalists, key=lambda f: f[0])[:ROBUST_CANDIDATES]
        candidates += [best] if all(f is not best for f in candidates) else []
        final, final_s = None, math.inf
        split = tuple(schedules) != (DEFAULT_SCHEDULE,)
        for found in sorted(candidates, key=lambda f: f[0]):
            if found[0] >= final_s and not split:
                break  # the sharing only slows a plan down: no later candidate can price under final_s
            if found[0] >= final_s and _beaten(cost, global_batch, found, final_s, schedules):
                continue  # its own split prices at least its score, and no schedule's re-split gets under final_s
            pipelines, estimate_s = _pipelines(cost, global_batch, found, search, options, schedules,
                                               cache.get(("schedule_timings",)))
            final, final_s = ((found, pipelines), estimate_s) if estimate_s < final_s else (final, final_s)
        assert final is not None
        if not searched:
            found_in_order, priced = rank_order(min(incumbent_s, _rank_order_bar_s(finalists, final_s, split)))
            search["layouts_evaluated"] += priced
            for found in found_in_order:  # kept where its own final price is lower: never a found plan's place
                pipelines, found_s = _pipelines(cost, global_batch, found, search, options, schedules,
                                                cache.get(("schedule_timings",)))
                final, final_s = ((found, pipelines), found_s) if found_s < final_s else (final, final_s)
        if final_s >= incumbent_s:
            return None
        return _build(cost, global_batch, final[0], final[1], search, started, options)
    candidates = sorted(finalists, key=lambda f: f[0])[:ROBUST_CANDIDATES]
    if not searched:  # as above, one more candidate (robust plans are compared by their worst case: no bar)
        found_in_order, priced = rank_order(math.inf)
        candidates += found_in_order
        search["layouts_evaluated"] += priced
    return _most_robust(cost, global_batch, candidates, search, started, options, schedules)


def _rank_order_bar_s(finalists: Sequence[Found], final_s: float, split: bool) -> float:
    """What the rank-order replicas (the uniform baseline's space) must score under, searched after every other
    family and apart from them (as one more family, their 1F1B scores became the bar that pruned layouts only
    zb-h1 made the fastest: docs/design.md §4.1): the best plan's final price; where a split schedule may re-split
    them, at least the score of the ``ROBUST_CANDIDATES``-th best finalist (inf if fewer), under which a layout
    was among the finalists the schedules re-price, so a layout zb-h1 takes under the final price is not missed."""
    if not split:
        return final_s  # 1F1B only: a score is at most its plan's price
    scores = sorted(f[0] for f in finalists)
    return max(final_s, scores[ROBUST_CANDIDATES - 1] if len(scores) >= ROBUST_CANDIDATES else math.inf)


def _rank_order_found(cost: CostModel, global_batch: int, bar_s: float, *, max_tp: int, recompute: str,
                      options: PlannerOptions, cache: dict, mb_sets: Sequence[tuple[int, ...] | None]
                      ) -> tuple[list[Found], int]:
    """The best rank-order replicas scored under ``bar_s``, per micro-batch set, and the candidates priced."""
    out, priced = [], 0
    for mbs in mb_sets:
        found, count = search_replicated(cost, global_batch, max_tp=max_tp, recompute=recompute, options=options,
                                         micro_batches=mbs, cache=cache, incumbent=None, incumbent_s=bar_s,
                                         layer_balanced_space=False)
        priced += count
        if found is not None:
            out.append(found)
            bar_s = min(bar_s, found[0])
    return out, priced


def _beaten(cost: CostModel, global_batch: int, found: Found, time_s: float, schedules: Sequence[str]) -> bool:
    """Whether no schedule's re-split of a search result's pipelines (each group's template) can price under
    ``time_s``: at least a pipeline's flush plus what follows its first stage's (``_after_flush_s``), whatever
    the split and schedule (``layers.schedules.flush_past_under_any``)."""
    _, groups, samples = found
    margin_s = time_s * ROUNDING
    shapes = []
    for g, row, extra_s in zip(groups, samples, _after_flush_s(cost, groups)):
        tpl = g.template
        # A re-split keeps each pipeline's micro-batch size as the search's split left it: smaller than the
        # template's where that pipeline got fewer samples (``layers.schedules._resplit``).
        for size, count in Counter(min(tpl.micro_batch, n) for n in row).items():
            shapes.append((tpl.slots, tpl.partition.num_layers, tpl.partition.recompute, size, count,
                           time_s + margin_s - extra_s))
    return flush_past_under_any(cost, shapes, global_batch, schedules)


def _after_flush_s(cost: CostModel, groups: Sequence[Group]) -> list[float]:
    """Per group, what its pipelines' first stage does after its flush: it syncs its blocks one after another,
    steps its optimizer and, sharded, gathers those blocks again (``grouping.group_iteration_s``, the
    estimator's arithmetic), whatever the samples and the schedule."""
    after_s = []
    for g in groups:
        tpl = g.template
        slot, layers = tpl.slots[0], tpl.partition.num_layers[0]
        stage = Stage(slot.ranks, slot.device, (0, layers), slot.tp, tpl.partition.recompute[0])
        after_s.append(cost.optimizer_s(stage, first=True, last=tpl.depth == 1))
    for holders, shape in sync_shapes(cost, groups):
        for g, stage_index in enumerate(holders):
            if stage_index == 0:  # sharded: the reduce, then the gather after the optimizer
                after_s[g] += cost.sync_s(shape) + cost.gather_s(shape)
    return after_s


def _pipelines(cost: CostModel, global_batch: int, found: Found, search: dict, options: PlannerOptions,
               schedules: Sequence[str], timings: dict | None = None) -> tuple[tuple[Pipeline, ...], float]:
    """A search result's pipelines with the fastest schedules allowed, and the plan's predicted seconds
    (``timings``: the planning run's memo of pipelines' T(n), ``layers/schedules.pipeline_timings``)."""
    plan = unpriced_plan("eth", cost, global_batch, found_pipelines(found), search)
    flat = not options.block_sync
    if tuple(schedules) == (DEFAULT_SCHEDULE,):
        return plan.pipelines, estimate_iteration_s(plan, cost, flat_sync=flat)
    chosen, chosen_s = choose_schedules(plan, cost, schedules, flat_sync=flat, timings=timings)
    return chosen.pipelines, chosen_s


def _build(cost: CostModel, global_batch: int, found: Found, pipelines: Sequence[Pipeline], search: dict,
           started: float, options: PlannerOptions) -> Plan:
    return assemble_plan("eth", cost, global_batch, pipelines, started_s=started,
                         search={**search, "estimated_iteration_s": found[0]}, flat_sync=not options.block_sync)


def _most_robust(cost: CostModel, global_batch: int, finalists: list[Found],
                 search: dict, started: float, options: PlannerOptions, schedules: Sequence[str]) -> Plan:
    """The finalist with the least worst case; the nominal best is always priced, so robust never
    has a worse worst case than the nominal plan."""
    plans: list[tuple[float, float, Plan, dict]] = []
    for found in finalists:
        pipelines, _ = _pipelines(cost, global_batch, found, search, options, schedules)
        plan = _build(cost, global_batch, found, pipelines, {**search, "robust": True}, started, options)
        record = robust_record(plan, cost)
        plans.append((record["worst_case_time_s"], plan.predicted["iteration_time_s"], plan, record))
    _, _, plan, record = min(plans, key=lambda x: (x[0], x[1]))
    predicted = {**plan.predicted, **record, "planning_time_s": time.perf_counter() - started}
    return dataclasses.replace(plan, predicted=predicted)
