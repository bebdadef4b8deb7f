"""ETH level 1 beyond one template per pool: per-type TP, hybrid layouts, split pools (docs/design.md §2.1).

The per-pool search gives every pool one homogeneous template. Three families widen it without
enumerating the whole heterogeneous space:

* per-type TP inside mixed pipelines (``mixed_candidates``, ``interleaved``): each pool's stages
  take their own TP degree, e.g. TP 2 on a smaller-memory or slower type and TP 1 on the fast
  one, so the small type holds more layers and its stages keep pace. The degree vectors (product
  over the pools of their valid degrees) are screened by memory (a relaxed capacity that only
  drops vectors that cannot hold the model) and ranked by an analytic pre-score (1F1B at b=1 on
  the memory-capped balanced bottleneck): the common degrees as before, plus the best few
  per-type vectors, are partitioned.
* hybrid layouts (``hybrid_sets``): type-interleaved pipelines over a pair of pools adjacent in
  speed order (each pipeline takes an equal slice of both), the other pools keeping their own
  pipelines. Also when every pool could stand alone: the pair's pipelines sync ~1/depth of the
  model per node while the others stay shallow and bubble-free.
* split pools (``devices/split_pools.py``): a pool's nodes shared by its two best shapes.

``every=True`` enumerates a family without its pruning (every vector, order and micro-batch size):
what ``exhaustive.py`` searches to measure what the pruning loses.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

from ethpipe.cost.model import CostModel
from ethpipe.planner.search.bounds import LowerBounds
from ethpipe.planner.search.memo import shared_bounds
from ethpipe.planner.devices.grouping import (
    Group, Structures, cluster_memo, link_structures, make_group, with_templates,
)
from ethpipe.planner.search.options import PlannerOptions
from ethpipe.planner.devices.templates import (MICRO_BATCH_CANDIDATES, Pool, Template, build_template, divisors,
                                               micro_batch_candidates, slots_for, template_flush_bound_s)
from ethpipe.planner.layers.timing import StageSlot, link_key

MIXED_TP_VECTORS = 2  # per-type TP vectors (beyond the common degrees) a mixed family partitions
INTERLEAVED_SHAPES = 3  # (pipelines, TP vector) pairs of the type-interleaved family tried with every order
# ... and on clusters this small, where a shape costs little: the pre-score ranks shapes at micro-batch 1 on
# a bound, and with kernel launch floors a many-way TP shape can rank 4th-6th and still win (measured with an
# earlier fit of the roofline constants: 4 A100-40 + 4 L4 + 4 T4, llama2-7b, 96 samples, 6% slower than the
# exhaustive search with 3 shapes, equal with 6).
INTERLEAVED_SHAPES_SMALL, SMALL_CLUSTER_DEVICES = 6, 16
ALL_ORDERS_UP_TO = 3  # pools; with more, a few type orders (by speed, by memory, the smallest memory first)


def tp_degrees(cost: CostModel, pool: Pool, max_tp: int) -> list[int]:
    """TP degrees a pool's stages may use: they divide its node size, within max_tp, valid for the model."""
    return [t for t in divisors(pool.gpus_per_node) if t <= max_tp and cost.model.tp_problem(t) is None]


def tp_vectors(cost: CostModel, pools: Sequence[Pool], max_tp: int, per_type: bool) -> list[tuple[int, ...]]:
    """One TP degree per pool: every degree common to all pools, then (``per_type``) every other product."""
    degrees = [tp_degrees(cost, p, max_tp) for p in pools]
    common = [(t,) * len(pools) for t in degrees[0] if all(t in d for d in degrees)]
    return common + ([v for v in itertools.product(*degrees) if len(set(v)) > 1] if per_type else [])


def held_curve(bounds: LowerBounds, stages: Counter, recompute: str
               ) -> tuple[Callable[[float], float], list[float]] | None:
    """How many layers these (device, TP) stages hold, each as a last stage (continuous layers), when every
    layer may cost up to x seconds per sample, and the kinks of that piecewise-linear, non-decreasing function
    (where an option fills up or one option overtakes another); None if even all of it cannot hold the model."""
    num_layers = bounds.cost.model.num_layers
    opts = [(n, bounds.position_options(d, t, 1, 1, recompute)) for (d, t), n in stages.items()]
    caps = [max(fit for _, fit in o) for _, o in opts]
    if sum(n * cap for (n, _), cap in zip(opts, caps)) < num_layers or min(caps) < 1:
        return None

    def held(x: float) -> float:
        return sum(n * max(min(fit, x / per) for per, fit in o) for n, o in opts)
    kinks = sorted({0.0} | {per * fit for _, o in opts for per, fit in o} | {
        per * fit for _, o in opts for per, _ in o for _, fit in o})
    return held, kinks


def crossing_s(lo: float, hi: float, held_lo: float, held_hi: float, num_layers: int) -> float:
    """Where a held curve reaches ``num_layers`` between consecutive kinks ``lo`` < ``hi`` (linear there), given
    what it holds at both."""
    return lo + (hi - lo) * (num_layers - held_lo) / max(held_hi - held_lo, 1e-300)


class _KinkTable:
    """``held_curve``'s parts that do not depend on the stage counts, for (device, TP) types in one order: each
    type's cap, the kinks, and what one stage of each type holds at a kink (the same floats ``held`` computes),
    filled in as the bisections ask (``prescore_s``: the same types come back at every pipeline count)."""

    def __init__(self, bounds: LowerBounds, types: tuple[tuple[str, int], ...], recompute: str) -> None:
        self.opts = [bounds.position_options(d, t, 1, 1, recompute) for d, t in types]
        self.caps = [max(fit for _, fit in o) for o in self.opts]
        self.kinks = sorted({0.0} | {per * fit for o in self.opts for per, fit in o} | {
            per * fit for o in self.opts for per, _ in o for _, fit in o})
        self._columns: list[tuple[float, ...] | None] = [None] * len(self.kinks)

    def column(self, i: int) -> tuple[float, ...]:
        """What one stage of each type holds at kink i."""
        col = self._columns[i]
        if col is None:
            x = self.kinks[i]
            col = self._columns[i] = tuple(max(min(fit, x / per) for per, fit in o) for o in self.opts)
        return col


def prescore_s(bounds: LowerBounds, stages: Counter, num_samples: float, recompute: str) -> float:
    """1F1B at b=1 on the balanced per-sample bottleneck of these (device, TP) stages, each holding at most
    what fits as a last stage (``held_curve``, from a memoised ``_KinkTable``); inf if even that cannot hold
    the model."""
    num_layers = bounds.cost.model.num_layers
    types = tuple(stages)
    key = ("held_table", types, recompute)
    memo = bounds.device_memo
    table = memo.get(key)
    if table is None:
        table = memo[key] = _KinkTable(bounds, types, recompute)
    counts = [stages[t] for t in types]
    if sum(n * cap for n, cap in zip(counts, table.caps)) < num_layers or min(table.caps) < 1:
        return math.inf

    def held_at(i: int) -> float:
        return sum(n * h for n, h in zip(counts, table.column(i)))
    kinks = table.kinks
    if held_at(len(kinks) - 1) < num_layers:  # held is constant past the last kink
        return math.inf
    first, last = 0, len(kinks) - 1  # the first kink that holds the model: held is non-decreasing (in floats too)
    while first < last:
        mid = (first + last) // 2
        first, last = (first, mid) if held_at(mid) >= num_layers else (mid + 1, last)
    below = max(first - 1, 0)  # kinks[0] is 0.0
    bottleneck_s = crossing_s(kinks[below], kinks[first], held_at(below), held_at(first), num_layers)
    return bottleneck_s * (num_samples + sum(stages.values()) - 1)


def _screened(scored: Sequence[tuple[float, tuple[int, ...]]], keep: int | None) -> list[tuple[int, ...]]:
    """Vectors that can hold the model: the common degrees, and the ``keep`` best per-type ones (all: None)."""
    fit = sorted((s, v) for s, v in scored if math.isfinite(s))
    common = [v for _, v in fit if len(set(v)) == 1]
    per_type = [v for _, v in fit if len(set(v)) > 1]
    return common + (per_type if keep is None else per_type[:keep])


def mixed_candidates(cost: CostModel, pools: Sequence[Pool], global_batch: int, *, max_tp: int, recompute: str,
                     options: PlannerOptions, micro_batches: Sequence[int] | None, cache: dict,
                     every: bool = False) -> list[list[Group]]:
    """Pipelines over k consecutive nodes of the pools that cannot hold a replica alone (fewest k that fits),
    each pool's stages at its own TP degree."""
    ranked = sorted(range(len(pools)), key=lambda i: -cost.device_speed(pools[i].device))
    nodes = [(i, node) for i in ranked for node in pools[i].nodes]
    bounds = shared_bounds(cost, cache)
    vectors = tp_vectors(cost, pools, max_tp, options.per_type_tp)
    for k in range(1, len(nodes) + 1):
        chunks = [nodes[i:i + k] for i in range(0, len(nodes) - len(nodes) % k, k)]
        if len(nodes) % k:
            chunks[-1] = chunks[-1] + nodes[len(nodes) - len(nodes) % k:]
        scored = []
        for tps in vectors:
            stages = Counter({(pools[i].device, tps[i]): 0 for i, _ in chunks[0]})
            for i, node in chunks[0]:
                stages[(pools[i].device, tps[i])] += len(node) // tps[i]
            scored.append((prescore_s(bounds, stages, global_batch / len(chunks), recompute), tps))
        found: list[list[Group]] = []
        for tps, b in itertools.product(_screened(scored, None if every else MIXED_TP_VECTORS),
                                        micro_batches or (MICRO_BATCH_CANDIDATES if every else (1, 2, 4, 8))):
            members: dict[tuple, list] = {}
            for chunk in chunks:
                slots = tuple(s for i, node in chunk for s in slots_for([(pools[i].device, r) for r in node], tps[i]))
                if len(slots) > cost.model.num_layers:
                    break
                tpl = build_template(cost, -1, slots, b, recompute, len(chunk), cache, options)
                if tpl is None:
                    break
                members.setdefault((tuple((s.device, s.tp) for s in slots), id(tpl.timing)), [tpl, []])[1].append(slots)
            else:
                found.append([make_group(cost, tpl, inst) for tpl, inst in members.values()])
        if found:
            return found
    return []


@dataclass(frozen=True)
class Cutoff:
    """What a family's candidate must beat to be built: the best plan so far (seconds), the whole batch, and
    the samples per second the pools outside the family take at most (0: the family spans the cluster)."""

    best_s: float = math.inf
    global_batch: int = 0
    others_per_s: float = 0.0


def interleaved(cost: CostModel, pools: Sequence[Pool], global_batch: int, *, max_tp: int, recompute: str,
                options: PlannerOptions, micro_batches: Sequence[int] | None, cache: dict,
                every: bool = False, per_type_only: bool = False, cutoff: Cutoff = Cutoff()) -> list[list[Group]]:
    """Mixed pipelines that take an equal slice of every pool (one stage run per type, each at its pool's TP
    degree, in one of a few type orders). Where few samples per GPU make sync dominate, this is how each
    node holds a small part of the model without deep pipelines; data still balances across them.
    ``per_type_only``: skip one degree for all (the replicated family searched those exactly); candidates
    whose lower bound cannot beat ``cutoff`` are not built."""
    counts = [p.num_devices for p in pools]
    model_bytes = cost.grad_sync_bytes(cost.model.num_layers, first=True, last=True)
    nic = min(cost.cluster.devices[p.nodes[0][0]].nic_gbps for p in pools) * 1e9
    bounds = shared_bounds(cost, cache)
    vectors = [v for v in tp_vectors(cost, pools, max_tp, options.per_type_tp) if not per_type_only or len(set(v)) > 1]
    shapes = []
    for dp in (k for k in divisors(min(counts)) if all(c % k == 0 for c in counts) and k <= global_batch):
        slices = [c // dp for c in counts]
        for tps in (v for v in vectors if all(s % t == 0 for s, t in zip(slices, v))):
            depth = sum(s // t for s, t in zip(slices, tps))
            if depth > cost.model.num_layers or depth < len(pools):
                continue
            stages: Counter = Counter()
            for p, s, t in zip(pools, slices, tps):
                stages[(p.device, t)] += s // t
            span = sum(-(-s // p.gpus_per_node) for s, p in zip(slices, pools))
            sync_s = 2 * model_bytes * min(span, depth) / depth / span / nic if dp > 1 else 0.0  # one: no sync
            score = prescore_s(bounds, stages, global_batch / dp, recompute) + sync_s
            if math.isfinite(score):
                shapes.append((score, dp, tps, slices))
    shapes.sort(key=lambda x: x[0])
    smallest = min(range(len(pools)), key=lambda i: cost.gpu(pools[i].device).memory_bytes)
    orders = set(itertools.permutations(range(len(pools)))) if every or len(pools) <= ALL_ORDERS_UP_TO else {
        tuple(sorted(range(len(pools)), key=key)) for key in (
            lambda i: -cost.device_speed(pools[i].device), lambda i: cost.device_speed(pools[i].device),
            lambda i: cost.gpu(pools[i].device).memory_bytes, lambda i: -cost.gpu(pools[i].device).memory_bytes,
            lambda i: (i != smallest, -cost.device_speed(pools[i].device)))}
    ranks = [[r for node in p.nodes for r in node] for p in pools]
    memo, pools_key = cluster_memo(cache, cost.cluster), tuple(pools)
    out = []
    keep = INTERLEAVED_SHAPES_SMALL if cost.cluster.num_devices <= SMALL_CLUSTER_DEVICES else INTERLEAVED_SHAPES
    for _, dp, tps, slices in (shapes if every else _per_count_first(shapes, keep)):
        # Each pool's stages once (slices start at multiples of its TP degree): pipeline k takes a run of them
        # (the cluster's memo: every pipeline count, order and round asks for the same ones).
        stages_key = ("interleaved_stages", pools_key, tuple(tps))
        stages_of = memo.get(stages_key)
        if stages_of is None:
            stages_of = memo[stages_key] = [slots_for([(p.device, r) for r in ranks[i]], tps[i])
                                            for i, p in enumerate(pools)]
        runs = [s // t for s, t in zip(slices, tps)]
        for order in sorted(orders):
            def instance(k: int, order: tuple[int, ...] = order) -> tuple[StageSlot, ...]:
                return tuple(s for i in order for s in stages_of[i][k * runs[i]:(k + 1) * runs[i]])
            first = instance(0)  # the others have the same devices: built once one micro-batch size wins

            def structures(dp: int = dp, instance: Callable = instance,
                           key: tuple = ("interleaved_structures", pools_key, dp, tuple(tps), tuple(slices), order)
                           ) -> Structures:
                """The layout's pipelines by structure (``link_structures``; the cluster's memo: rounds share it)."""
                if key not in memo:
                    memo[key] = link_structures(cost, [instance(k) for k in range(dp)])
                return memo[key]  # type: ignore[no-any-return]

            @functools.cache
            def linked(dp: int = dp, instance: Callable = instance) -> list[tuple[StageSlot, ...]]:
                """One pipeline of each link structure (what the bound of their layer splits needs)."""
                if not options.balance_layers:
                    return []
                return list({link_key(cost, inst): inst for inst in map(instance, range(dp))}.values())

            @functools.cache
            def crossing(dp: int = dp, first: tuple[StageSlot, ...] = first, instance: Callable = instance) -> bool:
                """Whether the first and the last pipeline share no node (every block's holders span nodes)."""
                devs = cost.cluster.devices
                nodes_first, nodes_last = ({devs[r].node for slot in inst for r in slot.ranks}
                                           for inst in (first, instance(dp - 1)))
                return not nodes_first & nodes_last

            heads = [ranks[order[0]][k * slices[order[0]]] for k in range(dp)]
            share = -(-global_batch // dp)
            if every:
                for b in micro_batches or micro_batch_candidates(share):
                    groups = structure_groups(cost, structures(), b, recompute, options, cache)
                    out += [groups] if groups is not None else []
                continue

            def fastest(samples: int, below: int | None = None) -> tuple[float, int, Template] | None:
                """The flush, micro-batch size (under ``below`` if given) and template of the pipeline that flushes
                ``samples`` soonest (called in this iteration only: the loop's names are current)."""
                best = None
                for b in micro_batches or micro_batch_candidates(max(1, -(-share // len(first)))):
                    if below is not None and b >= below:
                        break
                    if _cannot_beat(cost, bounds, cutoff, (first, crossing, heads, linked), b, share, recompute, cache):
                        continue
                    if best is not None and template_flush_bound_s(cost, first, b, recompute, samples, cache,
                                                                   options) >= best[0]:
                        break  # as below, without building it
                    tpl = build_template(cost, -1, first, b, recompute, 0, cache, options)  # the others: same memory
                    if tpl is None:
                        break  # memory only grows with the micro-batch size
                    flush_s = float(tpl.timing.finish_s(samples)[0])
                    if best is not None and flush_s >= best[0]:
                        break  # unimodal in b, as for a pool's own shapes
                    best = (flush_s, b, tpl)
                return best

            best = fastest(share)
            sizes = [] if best is None else [best[1]]
            if best is not None and cutoff.others_per_s:
                # A hybrid's pair gets its share of the batch by peak speed, but level 3 balances by flush: where
                # the pools outside take more, each pipeline here runs fewer samples, and a smaller micro-batch
                # may flush those sooner (and another type order win with it).
                balanced = _balanced_share(best[2], dp, share, best[0], cutoff)
                other = fastest(balanced, below=best[1]) if balanced < share else None
                if other is not None and other[0] < float(best[2].timing.finish_s(balanced)[0]):
                    sizes.append(other[1])
            for b in sizes:
                groups = structure_groups(cost, structures(), b, recompute, options, cache)
                out += [groups] if groups is not None else []
    return out


def _cannot_beat(cost: CostModel, bounds: LowerBounds, cutoff: Cutoff,
                 pipelines: tuple[tuple, Callable[[], bool], list[int], Callable[[], list[tuple]]], b: int, share: int,
                 recompute: str, cache: dict) -> bool:
    """True if these identical-device pipelines (the first, whether the first and the last share no node, every
    first stage's head rank, one of each link structure on demand: none if their splits are not level 2's)
    cannot fit, or no layout with them can beat the cutoff: the batch over the most samples per second they and
    the other pools take (each pipeline at its memory-aware bottleneck), and, spanning the cluster, the flush of
    one with ceil(B/P) samples (the device order's bound, then its layer split's, ``flush_lower_bound_s``) plus
    its first stage's sync."""
    first, crossing, heads, linked = pipelines
    stages = [(s.device, s.tp) for s in first]
    per_sample = bounds.stages_bottleneck_s(stages, b, recompute)
    if math.isinf(per_sample):
        return True
    if not math.isfinite(cutoff.best_s):
        return False
    if cutoff.global_batch / (len(heads) / per_sample + cutoff.others_per_s) >= cutoff.best_s:
        return True
    if cutoff.others_per_s:
        return False
    sync_s = bounds.first_stage_sync_s(heads, stages[0][1], len(stages), crossing(), 1)
    if sync_s + bounds.ordered_flush_s(stages, b, share, None, recompute) >= cutoff.best_s:
        return True
    return bool(linked()) and sync_s + min(template_flush_bound_s(cost, inst, b, recompute, share, cache)
                                           for inst in linked()) >= cutoff.best_s


def _balanced_share(tpl: Template, dp: int, share: int, flush_s: float, cutoff: Cutoff) -> int:
    """About the samples per pipeline of ``dp`` pipelines like ``tpl``'s where they flush together with the pools
    outside (at most ``cutoff.others_per_s`` samples per second), at most ``share``: ``dp n + others_per_s T(n) =
    B`` with T(n) taken linear from ``flush_s`` = T(share) at the pipelines' per-sample floor (an estimate that
    only picks a candidate: the search prices it exactly)."""
    slope_s = tpl.timing.per_sample_floor_s()
    fixed_s = flush_s - slope_s * share
    n = (cutoff.global_batch - cutoff.others_per_s * fixed_s) / (dp + cutoff.others_per_s * slope_s)
    return min(share, max(1, math.ceil(n)))


def _per_count_first(shapes: list[tuple], keep: int) -> list[tuple]:
    """The best-scored shape of each pipeline count first (the pre-score's sync term is crude), then the rest."""
    firsts: dict[int, tuple] = {}
    for shape in shapes:
        firsts.setdefault(shape[1], shape)
    kept = sorted(firsts.values(), key=lambda x: x[0])[:keep]
    return kept + [x for x in shapes if x not in kept][:keep - len(kept)]


def structure_groups(cost: CostModel, structures: Structures, b: int, recompute: str, options: PlannerOptions,
                     cache: dict) -> list[Group] | None:
    """Pipelines with the same devices and links under one template (``link_structures``); None if one does
    not fit."""
    return with_templates(structures, lambda slots: build_template(cost, -1, slots, b, recompute, 0, cache, options))


def mixed_sets(cost: CostModel, pools: Sequence[Pool], standalone: Sequence[int]) -> list[tuple[int, ...]]:
    """Which pools form consecutive-node mixed pipelines: none if every pool stands alone; else the pools
    that cannot, alone or joined by one self-sufficient donor pool (each tried), or by all of them."""
    needy = tuple(i for i in range(len(pools)) if i not in standalone)
    if not needy:
        return [()]
    donors = sorted(standalone, key=lambda i: -cost.gpu(pools[i].device).memory_bytes)
    sets = [needy] + [tuple(sorted(needy + (d,))) for d in donors] + [tuple(range(len(pools)))]
    return list(dict.fromkeys(sets))  # one donor: the needy pools and it are all of them


def hybrid_sets(cost: CostModel, pools: Sequence[Pool], standalone: Sequence[int]) -> list[tuple[int, ...]]:
    """Pairs of pools adjacent in speed order whose other pools all stand alone (3+ pools: with two, the
    pair is the whole cluster, which the interleaved family covers)."""
    if len(pools) < 3:
        return []
    ranked = sorted(range(len(pools)), key=lambda i: (-cost.device_speed(pools[i].device), i))
    return [tuple(sorted(pair)) for pair in pairwise(ranked)
            if all(i in standalone for i in range(len(pools)) if i not in pair)]


def batch_share(cost: CostModel, pools: Sequence[Pool], subset: Sequence[int], global_batch: int) -> int:
    """The samples a subset of pools would get in proportion to its speed (at least one)."""
    speed = [cost.device_speed(p.device) * p.num_devices for p in pools]
    return max(1, round(global_batch * sum(speed[i] for i in subset) / sum(speed)))
