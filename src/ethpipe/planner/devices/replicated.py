"""ETH's replicated-shape family: the baselines' spaces, searched by branch and bound (docs/design.md §2.1).

A layout that replicates one shape (the layer-balanced space: every replica takes an equal
share of every GPU type, in any type order; the uniform space: replicas in rank order with
equal layers, and with one aligned level-2 split, ``aligned_split``) is also an ETH layout, and with few
samples per GPU it is often the best one:
each node then holds ~1/depth of the model and syncs that much through its NIC. ETH searches
the same (DP degree, TP degree, type order, micro-batch size) space as the exhaustive
baselines, best-first by a lower bound (``bounds.py``), in steps per candidate, each popped
again before the next: an analytic bound at enumeration (no partition, no replicas built; an
aligned candidate then builds its replicas and its one split, and is bounded with it), its
type order's (the memory-aware bottleneck, fill and drain), its layer split's before the split
is made (``partition.flush_lower_bound_s`` on one replica per structure: level 2 minimises the
bottleneck, which fixes more than any split's bound), one replica per structure partitioned and
timed exactly plus its first stage's sync, and exact pricing. The search
stops at the first bound above the best plan found (the incumbent comes from ETH's other
layouts). A priced candidate gets equal data (the baseline's own plan, so ETH never loses to
it) and level-3 data balance. Templates and stage options are memoised by shape, and a
layout's replicas and node statistics are built once for all its micro-batch sizes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import replace
from itertools import pairwise

import numpy as np

from ethpipe.cost.model import CostModel
from ethpipe.errors import Infeasible
from ethpipe.plan import Stage
from ethpipe.planner.assemble import Found
from ethpipe.planner.search.bounds import LowerBounds
from ethpipe.planner.search.memo import shared_bounds
from ethpipe.planner.devices.grouping import (
    Group, cluster_memo, evaluate_groups, rank_structures, sync_shapes, with_templates,
)
from ethpipe.planner.search.options import PlannerOptions
from ethpipe.planner.devices.templates import (
    MICRO_BATCH_CANDIDATES,
    Template,
    build_template,
    divisors,
    equal_layers,
    fixed_partition,
    level2_partition,
    pools_of,
    slots_for,
    template_flush_bound_s,
)
from ethpipe.planner.layers.timing import StageSlot, link_key, rank_link, timing_of_partition

Structures = list[tuple[tuple[StageSlot, ...], int]]
# (DP, TP, replica device sequences, first stages' head ranks, whether every block's all-reduce crosses
# nodes, the replicas' ranks on demand (one row each, stage by stage), one replica of each structure
# (devices, links) with its count, on demand)
LazyLayout = tuple[int, int, Counter, list[int], bool, Callable[[], np.ndarray], Callable[[], Structures]]


def _disjoint(cost: CostModel, a: Sequence[int], b: Sequence[int]) -> bool:
    """No node holds ranks of both: then every block's holders span nodes (the first and last replica)."""
    devs = cost.cluster.devices
    return not {devs[r].node for r in a} & {devs[r].node for r in b}


def layer_balanced_layouts(cost: CostModel, global_batch: int, max_tp: int) -> Iterator[LazyLayout]:
    """Every layout the layer-balanced baseline enumerates, lazily."""
    by_type: dict[str, list[int]] = {}
    pools = pools_of(cost)
    for p in pools:
        by_type.setdefault(p.device, []).extend(r for node in p.nodes for r in node)
    types = list(by_type)
    counts = [len(by_type[t]) for t in types]
    node_sizes = [p.gpus_per_node for p in pools]
    type_pools = {t: [p for p in pools if p.device == t] for t in types}
    for dp in (k for k in divisors(min(counts)) if all(c % k == 0 for c in counts) and k <= global_batch):
        for t in (x for x in divisors(min(node_sizes)) if x <= max_tp and all(g % x == 0 for g in node_sizes)
                  and cost.model.tp_problem(x) is None):
            if any((c // dp) % t for c in counts) or sum(c // dp for c in counts) // t > cost.model.num_layers:
                continue
            # Replica 0 and the last one hold the same ranks in every type order.
            first_ranks = [r for i in range(len(types)) for r in by_type[types[i]][:counts[i] // dp]]
            last = [r for i in range(len(types)) for r in by_type[types[i]][counts[i] - counts[i] // dp:]]
            crossing = _disjoint(cost, first_ranks, last)
            for order in itertools.permutations(range(len(types))):
                kinds = Counter({tuple(types[i] for i in order for _ in range(counts[i] // dp // t)): dp})

                def replica(r: int, dp: int = dp, t: int = t, order: tuple[int, ...] = order) -> tuple[StageSlot, ...]:
                    return slots_for([(types[i], rank) for i in order
                                      for rank in by_type[types[i]][r * counts[i] // dp:(r + 1) * counts[i] // dp]], t)

                def build(dp: int = dp, order: tuple[int, ...] = order) -> np.ndarray:
                    return np.concatenate([np.asarray(by_type[types[i]], dtype=np.int64).reshape(dp, counts[i] // dp)
                                           for i in order], axis=1)

                def reps(dp: int = dp, replica: Callable = replica) -> Structures:
                    # A replica's links depend only on where its slices start inside their nodes (one pool
                    # per type: same NICs); types spread over several pools: every replica on its own.
                    r = np.arange(dp)
                    keys = np.stack([(r * counts[i] // dp) % type_pools[types[i]][0].gpus_per_node
                                     if len(type_pools[types[i]]) == 1 else r for i in range(len(types))], axis=1)
                    _, first, num = np.unique(keys, axis=0, return_index=True, return_counts=True)
                    return [(replica(int(first[j])), int(num[j])) for j in np.argsort(first)]  # first seen first
                heads = [by_type[types[order[0]]][r * counts[order[0]] // dp] for r in range(dp)]
                yield dp, t, kinds, heads, crossing, build, reps


def uniform_layouts(cost: CostModel, global_batch: int, max_tp: int) -> Iterator[LazyLayout]:
    """The same for every uniform baseline layout (replicas in rank order)."""
    n = cost.cluster.num_devices
    node_sizes = {len(p.nodes[0]) for p in pools_of(cost)}
    ranked = [(cost.cluster.devices[r].gpu.id, r) for r in range(n)]
    devs = cost.cluster.devices
    for t in (t for t in divisors(min(node_sizes)) if t <= max_tp and all(g % t == 0 for g in node_sizes)
              and cost.model.tp_problem(t) is None):
        for d in divisors(n // t):
            replicas = n // (d * t)
            if d <= cost.model.num_layers and replicas <= global_batch:
                kinds = Counter(tuple(ranked[i * d * t + j * t][0] for j in range(d)) for i in range(replicas))

                def build(d: int = d, t: int = t, replicas: int = replicas) -> np.ndarray:
                    return np.arange(n, dtype=np.int64).reshape(replicas, d * t)

                def reps(d: int = d, t: int = t, replicas: int = replicas) -> Structures:
                    keys: dict[tuple, list] = {}
                    for i in range(replicas):
                        ranks = range(i * d * t, (i + 1) * d * t, t)
                        key = (tuple(ranked[r][0] for r in ranks),
                               tuple(rank_link(devs, a, b) for a, b in pairwise(ranks)))  # ``link_key``'s
                        keys.setdefault(key, [i, 0])[1] += 1
                    return [(slots_for(ranked[i * d * t:(i + 1) * d * t], t), c) for i, c in keys.values()]
                crossing = _disjoint(cost, range(d * t), range(n - d * t, n))
                yield replicas, t, kinds, [i * d * t for i in range(replicas)], crossing, build, reps


def _layouts(memo: dict, enumerate_fn: Callable[[CostModel, int, int], Iterator[LazyLayout]], cost: CostModel,
             global_batch: int, max_tp: int) -> list[LazyLayout]:
    """A space's layouts, enumerated once per cluster (``memo``: its ``cluster_memo``; they depend on its devices,
    the batch and the TP cap alone, so every holder count's round, and a round searched ahead, reuses them)."""
    key = ("replicated_layouts", enumerate_fn.__name__, global_batch, max_tp)
    if key not in memo:
        memo[key] = list(enumerate_fn(cost, global_batch, max_tp))
    return memo[key]  # type: ignore[no-any-return]


def _fixed_template(cost: CostModel, slots: tuple[StageSlot, ...], counts: tuple[int, ...], b: int,
                    recompute: str, granularity: int, cache: dict) -> Template | None:
    """A shape with a given layer split (the uniform baseline's equal layers, or an aligned split), memoised like
    ``build_template``."""
    key = ("fixed", tuple((s.device, s.tp) for s in slots), link_key(cost, slots), counts, b, recompute, granularity)
    if key not in cache:
        part = fixed_partition(cost, slots, counts, b, recompute, cache)
        cache[key] = None if part is None else (part, timing_of_partition(cost, slots, part, b, granularity))
    hit = cache[key]
    return None if hit is None else Template(-1, len(slots), slots[0].tp, b, 1, slots, *hit)


def search_replicated(cost: CostModel, global_batch: int, *, max_tp: int, recompute: str, options: PlannerOptions,
                      micro_batches: Sequence[int] | None, cache: dict, incumbent: Found | None,
                      incumbent_s: float = math.inf, uniform_space: bool = True,
                      layer_balanced_space: bool = True) -> tuple[Found | None, int]:
    """Best plan of the baselines' spaces (priced with ETH's data balance too) that beats ``incumbent``
    and ``incumbent_s`` (a time to beat without a layout: another cluster's plan, for the idle search).
    ``uniform_space`` / ``layer_balanced_space``: which spaces (ETH searches each apart: ``eth._rank_order_bar_s``).

    Returns (best found or None, candidates priced)."""
    bounds = shared_bounds(cost, cache)
    heap: list[tuple[float, int, int, tuple]] = []
    counter = itertools.count()
    memo = cluster_memo(cache, cost.cluster)  # a layout's replicas depend on the cluster alone: shared by rounds
    structures: dict[tuple, list[tuple[tuple[StageSlot, ...], Group]]] = memo.setdefault("replicated_structures", {})
    representatives: dict[tuple, Structures] = memo.setdefault("replicated_representatives", {})
    # (layouts, in rank order, splits): the uniform space's rank-order replicas with the baseline's equal layers
    # and with one aligned split (``aligned_split``; made at stage -2); the layer-balanced space's replicas in
    # every type order, each structure with level 2's split (stage -1: the memory-aware bound of its multiset).
    splits = ("equal", "aligned") if options.balance_layers else ("equal",)
    spaces: list[tuple[Iterable[LazyLayout], bool, tuple[str, ...]]] = [
        (_layouts(memo, uniform_layouts, cost, global_batch, max_tp), True, splits)] if uniform_space else []
    if layer_balanced_space and options.allow_mixed and len(cost.cluster.gpu_types) > 1:
        spaces.append((_layouts(memo, layer_balanced_layouts, cost, global_batch, max_tp), False, ("level2",)))
    entry_stage = {"equal": 0, "aligned": -2, "level2": -1}  # the heap step each split's candidates start at
    for layouts, in_order, layer_splits in spaces:
        for dp, t, kinds, heads, crossing, layout, reps in layouts:
            share = -(-global_batch // dp)
            key = (in_order, dp, t, tuple(kinds.items()))  # the layout (its devices' order): its memo key
            depth = len(next(iter(kinds)))
            for split in layer_splits:
                layers = equal_layers(cost.model.num_layers, depth) if split == "equal" else None
                sync_s = bounds.first_stage_sync_s(heads, t, depth, crossing, layers[0] if layers else 1)
                for b in micro_batches or [x for x in MICRO_BATCH_CANDIDATES if x <= share]:  # once per shape
                    bound = sync_s + bounds.makespan_s(kinds, t, b, global_batch, layers, None, any_order=not in_order)
                    heapq.heappush(heap, (bound, next(counter), entry_stage[split],
                                          (key, layout, reps, heads, crossing, share, b, in_order,
                                           (kinds, t, layers, sync_s))))
    best, priced = incumbent, 0

    def bar_s() -> float:
        """What a candidate must beat: the best found so far or ``incumbent_s``."""
        return min(incumbent_s, best[0] if best is not None else math.inf)
    while heap:
        bound, _, stage, item = heapq.heappop(heap)
        if bound >= bar_s():
            break
        key, layout, reps, heads, crossing, share, b, in_order, (kinds, t, layers, sync_s) = item
        if stage == -2:  # the aligned split, made now: then bounded like the equal split (dropped where it is that)
            structures_of = _replicas(key, reps, representatives, global_batch)[0]
            counts = aligned_split(cost, structures_of, b, recompute, cache)
            if counts is None or list(counts) == equal_layers(cost.model.num_layers, len(counts)):
                continue
            sync_s = bounds.first_stage_sync_s(heads, t, len(counts), crossing, counts[0])
            aligned = sync_s + bounds.makespan_s(kinds, t, b, global_batch, counts, None)
            item = (*item[:-1], (kinds, t, counts, sync_s))
            heapq.heappush(heap, (max(bound, aligned), next(counter), 0, item))
            continue
        if stage == -1:
            memory_s = sync_s + bounds.makespan_s(kinds, t, b, global_batch, layers, recompute, any_order=True)
            heapq.heappush(heap, (max(bound, memory_s), next(counter), 0, item))
            continue
        if stage == 0:  # the device order's own bounds first: no templates
            cutoff_s = bar_s()

            def enough(flush_s: float, bound: float = bound, sync_s: float = sync_s, cutoff_s: float = cutoff_s) -> bool:
                """``_past_bar`` for this candidate."""
                return _past_bar(bound, sync_s, flush_s, cutoff_s)
            flush_s = _order_bound(bounds, kinds, t, b, share, layers, recompute, enough)
            if flush_s is not None and not enough(flush_s):
                ordered_s = flush_s if in_order else max(flush_s, bounds.makespan_s(kinds, t, b, global_batch, layers,
                                                                                    recompute))
                to_split = layers is None and options.balance_layers  # level 2 splits the layers: bound that split
                heapq.heappush(heap, (max(bound, sync_s + ordered_s), next(counter), 1 if to_split else 2, item))
            continue
        if stage == 1:  # the layer split's own bound: no templates yet
            split_s = _split_bound(cost, bounds, key, reps, heads, crossing, b, global_batch, recompute, options,
                                   cache, representatives)
            if split_s is not None:
                heapq.heappush(heap, (max(bound, split_s), next(counter), 2, item))
            continue
        if stage == 2:
            refined = _refined_bound(cost, bounds, key, reps, heads, crossing, b, layers, global_batch, recompute,
                                     options, cache, representatives, bar_s())
            if refined is not None:
                heapq.heappush(heap, (max(bound, refined), next(counter), 3, item))
            continue
        for found in _price(cost, global_batch, layout, t, key, b, _make(cost, layers, b, recompute, options, cache),
                            options, cache, structures, bar_s()):
            priced += 1
            if found[0] < bar_s():
                best = found
    return (None if best is incumbent else best), priced


def _past_bar(bound: float, sync_s: float, flush_s: float, bar_s: float) -> bool:
    """Whether a candidate whose device order flushes no sooner than ``flush_s`` is at or past the bar: pushed
    back, it would be where the search stops (the bar only falls), so the rest of its bound is not needed and it
    is dropped (the same search: the heap pops the others in the same order)."""
    return max(bound, sync_s + flush_s) >= bar_s


def _order_bound(bounds: LowerBounds, kinds: Counter, tp: int, b: int, share: int, layers: Sequence[int] | None,
                 recompute: str, enough: Callable[[float], bool] = lambda _: False) -> float | None:
    """A pipeline of ceil(B/P) samples flushes no sooner than its kind's bound in its own device order (the
    memory-aware bottleneck, the fill and drain); None if some kind cannot fit. Where a kind's bottleneck alone is
    ``enough`` (the candidate cannot beat the bar), its fill and drain are not bounded: the result is then still
    ``enough``, and exact otherwise."""
    if layers is not None and not all(bounds.fits([(d, tp) for d in kind], layers, b, recompute) for kind in kinds):
        return None
    flush_s = math.inf
    for kind in kinds:
        stages = [(d, tp) for d in kind]
        per_sample = 0.0 if layers is not None else bounds.stages_bottleneck_s(stages, b, recompute)
        flush_s = min(flush_s, per_sample * share if enough(per_sample * share) else
                      max(per_sample * share, bounds.ordered_flush_s(stages, b, share, layers, recompute)))
    return None if math.isinf(flush_s) else flush_s


def _make(cost: CostModel, layers: Sequence[int] | None, b: int, recompute: str, options: PlannerOptions, cache: dict
          ) -> Callable[[tuple[StageSlot, ...]], Template | None]:
    """The template maker of a layer split: ``layers`` for every structure (the uniform baseline's equal layers,
    or ``aligned_split``), or None: each structure its own ``build_template`` split (level 2's; equal layers
    where ``options.balance_layers`` is off)."""
    if layers is None:
        return lambda s: build_template(cost, -1, s, b, recompute, 0, cache, options)
    granularity = 1 if options.fine_grained else b
    return lambda s: _fixed_template(cost, s, tuple(layers), b, recompute, granularity, cache)


def aligned_split(cost: CostModel, structures: Structures, b: int, recompute: str, cache: dict
                  ) -> tuple[int, ...] | None:
    """One split for every structure of a rank-order layout: level 2's split of the structure most replicas have
    (None if it does not fit). Why one: equal layers leave the head's stage slowest where the head outweighs a
    layer (llama3-8b: ~1.8 layers), and each structure's own split would stagger the block boundaries across
    pipelines, so each block's sync would wait for the previous one's holders (``grouping.group_iteration_s``)
    instead of running beside it. A structure of weaker GPUs that cannot hold this split drops the candidate
    (``fixed_partition``): the equal split's candidate stays."""
    part = level2_partition(cost, max(structures, key=lambda sc: sc[1])[0], b, recompute, cache)
    return None if part is None else part.num_layers


def _replicas(key: Hashable, reps: Callable[[], Structures], representatives: dict, global_batch: int
              ) -> tuple[Structures, int, int]:
    """One replica per structure (built once per layout), the number of pipelines and ceil(B/P)."""
    if key not in representatives:
        representatives[key] = reps()
    structures = representatives[key]
    num_pipes = sum(c for _, c in structures)
    return structures, num_pipes, -(-global_batch // num_pipes)


def _split_bound(cost: CostModel, bounds: LowerBounds, key: Hashable, reps: Callable[[], Structures],
                 heads: Sequence[int], crossing: bool, b: int, global_batch: int, recompute: str,
                 options: PlannerOptions, cache: dict, representatives: dict) -> float | None:
    """Some pipeline runs >= ceil(B/P) samples: its flush is at least the fastest structure's
    ``flush_lower_bound_s`` (the split level 2 will make, bounded before it is made), plus the first stage's
    sync; None if some structure cannot hold the model or the batch is too small."""
    structures, num_pipes, share = _replicas(key, reps, representatives, global_batch)
    if global_batch < num_pipes:
        return None
    flush_s = [template_flush_bound_s(cost, slots, b, recompute, share, cache, options) for slots, _ in structures]
    if any(math.isinf(f) for f in flush_s):
        return None
    slots = structures[0][0]
    return min(flush_s) + bounds.first_stage_sync_s(heads, slots[0].tp, len(slots), crossing, 1)


def _refined_bound(cost: CostModel, bounds: LowerBounds, key: Hashable, reps: Callable[[], Structures],
                   heads: Sequence[int], crossing: bool, b: int, layers: Sequence[int] | None, global_batch: int,
                   recompute: str,
                   options: PlannerOptions, cache: dict, representatives: dict, cutoff_s: float) -> float | None:
    """A bound from one replica per structure: first the memory-aware bottleneck (no templates), then the
    exact flush at ceil(B/P) samples, the first stage's sync and its optimizer step. None: the layout
    cannot hold the model or the batch."""
    structures, num_pipes, share = _replicas(key, reps, representatives, global_batch)
    devices = {tuple(s.device for s in slots) for slots, _ in structures}
    if len(devices) == 1 and layers is None:
        per_sample = bounds.memory_bottleneck_s(next(iter(devices)), structures[0][0][0].tp, b, recompute)
        if per_sample * share >= cutoff_s:
            return per_sample * share
    if global_batch < num_pipes:
        return None
    make = _make(cost, layers, b, recompute, options, cache)
    templates = [make(slots) for slots, _ in structures]
    if any(t is None for t in templates):
        return None
    # Some pipeline runs >= ceil(B/P) samples, equal data or balanced; its flush (the estimator's exact
    # formula, non-decreasing in the samples) is at least the fastest structure's at ceil(B/P). And some
    # pipeline's flush is at least the batch over the structures' summed capacity (``capacity_per_s``):
    # what bounds rank-order replicas of unequal devices, whose fastest structure says little.
    # The capacity bound first: where it alone reaches ``cutoff_s`` the candidate can never be priced (the bar only
    # falls), so the flush tables are not extended to ceil(B/P) for it; the search pops the others in the same order.
    first_layers = min(t.partition.num_layers[0] for t in templates)
    slot = templates[0].slots[0]
    stage0 = Stage(slot.ranks, slot.device, (0, first_layers), slot.tp, True)
    depth = templates[0].depth
    sync_s = bounds.first_stage_sync_s(heads, slot.tp, depth, crossing, first_layers)
    step_s = min(cost.optimizer_s(replace(stage0, device=t.slots[0].device), first=True, last=depth == 1)
                 for t in templates)
    capacity_s = global_batch / sum(c / t.timing.per_sample_floor_s() for t, (_, c) in zip(templates, structures))
    if capacity_s + sync_s + step_s >= cutoff_s:
        return capacity_s + sync_s + step_s
    return max(min(float(t.timing.finish_s(share)[0]) for t in templates), capacity_s) + sync_s + step_s


def _price(cost: CostModel, global_batch: int, layout: Callable[[], np.ndarray], tp: int, key: Hashable, b: int,
           make: Callable[[tuple[StageSlot, ...]], Template | None], options: PlannerOptions, cache: dict,
           structures: dict, cutoff_s: float = math.inf) -> list[Found]:
    """Price one (layout, micro-batch size) exactly: its replicas grouped by structure, node statistics
    computed once per layout; an evaluation whose slowest flush alone reaches ``cutoff_s`` (the search's bar, which
    it could not beat) is dropped before its sync is priced."""
    if key not in structures:
        structures[key] = rank_structures(cost, layout(), tp)
    groups = with_templates(structures[key], make)
    return [] if groups is None else _evaluations(cost, groups, global_batch, options, b, cutoff_s)


def _evaluations(cost: CostModel, groups: list[Group], global_batch: int, options: PlannerOptions, b: int,
                 cutoff_s: float = math.inf) -> list[Found]:
    """Equal data (the baselines' split) and, where allowed, level-3 balance; whole micro-batches if required;
    past ``cutoff_s`` by the flush alone, not priced (``evaluate_groups``)."""
    out = []
    modes = [True, False] if options.balance_data else [True]
    shapes = sync_shapes(cost, groups)  # the same for both data splits
    for equal in modes:
        try:
            score, samples = evaluate_groups(cost, groups, global_batch, equal_data=equal,
                                             flat_sync=not options.block_sync, shapes=shapes, cutoff_s=cutoff_s)
        except Infeasible:
            continue
        if not options.fine_grained and any(n % b for row in samples for n in row):
            continue
        if math.isfinite(score):
            out.append((score, groups, samples))
    return out
