"""ETH's replicated-shape family: the baselines' spaces, searched by branch and bound (DESIGN 2.1).

A layout that replicates one shape (the layer-balanced space: every replica takes an equal
share of every GPU type, any type order; the uniform space: replicas in rank order, equal or
balanced layers) is also an ETH layout, and with few samples per GPU it is often the best one:
each node then holds ~1/depth of the model and syncs that much through its NIC. ETH searches
the same (DP degree, TP degree, type order, micro-batch size) space as the exhaustive
layer-balanced baseline, but prices a candidate only if a cheap lower bound on its pipeline
time (no partition, no sync: ``n L / sum_i 1/c_i`` for the bottleneck stage, and one
micro-batch's whole forward+backward chain) beats the best plan found so far. Candidates are
visited in bound order, so the search stops at the first bound above the incumbent. Each
priced candidate gets both equal data (the baseline's plan, so ETH never loses to it) and
level-3 data balance. Partitions are memoised by shape (identical replicas share one), and a
layout's node statistics are computed once for all its micro-batch sizes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from ethpipe.cost.model import CostModel
from ethpipe.cost.sync import SyncShape
from ethpipe.plan import Stage
from ethpipe.planner.grouping import Group, evaluate_groups, make_group
from ethpipe.planner.options import PlannerOptions
from ethpipe.planner.templates import (MICRO_BATCH_CANDIDATES, Template, build_template, divisors, equal_layers,
                                       fixed_partition, pools_of, slots_for)
from ethpipe.planner.timing import StageSlot, timing_of_partition

Found = tuple[float, list[Group], list[list[int]]]
Layout = tuple[tuple[StageSlot, ...], ...]


# (DP, TP, replica device sequences, first stages' head ranks, replicas on demand, and the first
# replica's slots when every replica has the same structure, else None)
LazyLayout = tuple[int, int, Counter, list[int], Callable[[], Layout], tuple[StageSlot, ...] | None]


def layer_balanced_layouts(cost: CostModel, global_batch: int, max_tp: int) -> Iterator[LazyLayout]:
    """Every layout the layer-balanced baseline enumerates, lazily."""
    by_type: dict[str, list[int]] = {}
    pools = pools_of(cost)
    for p in pools:
        by_type.setdefault(p.device, []).extend(r for node in p.nodes for r in node)
    types = list(by_type)
    counts = [len(by_type[t]) for t in types]
    node_sizes = [p.gpus_per_node for p in pools]
    type_node = {t: {p.gpus_per_node for p in pools if p.device == t} for t in types}
    for dp in (k for k in divisors(min(counts)) if all(c % k == 0 for c in counts) and k <= global_batch):
        for t in (x for x in divisors(min(node_sizes)) if x <= max_tp and all(g % x == 0 for g in node_sizes)):
            if any((c // dp) % t for c in counts) or sum(c // dp for c in counts) // t > cost.model.num_layers:
                continue
            for order in itertools.permutations(range(len(types))):
                kinds = Counter({tuple(types[i] for i in order for _ in range(counts[i] // dp // t)): dp})

                def build(dp: int = dp, t: int = t, order: tuple[int, ...] = order) -> Layout:
                    return tuple(
                        slots_for([(types[i], rank) for i in order
                                   for rank in by_type[types[i]][r * counts[i] // dp:(r + 1) * counts[i] // dp]], t)
                        for r in range(dp))
                heads = [by_type[types[order[0]]][r * counts[order[0]] // dp] for r in range(dp)]
                # Slices of whole nodes, or inside one node each: every replica has the same links.
                aligned = all(len(type_node[types[i]]) == 1 and (
                    (counts[i] // dp) % min(type_node[types[i]]) == 0 or min(type_node[types[i]]) % (counts[i] // dp) == 0)
                    for i in range(len(types)))
                first = slots_for([(types[i], rank) for i in order for rank in by_type[types[i]][:counts[i] // dp]], t)
                yield dp, t, kinds, heads, build, first if aligned else None


def uniform_layouts(cost: CostModel, global_batch: int, max_tp: int) -> Iterator[LazyLayout]:
    """The same for every uniform baseline layout (replicas in rank order)."""
    n = cost.cluster.num_devices
    node_sizes = {len(p.nodes[0]) for p in pools_of(cost)}
    ranked = [(cost.cluster.devices[r].gpu.id, r) for r in range(n)]
    for t in (t for t in divisors(min(node_sizes)) if t <= max_tp and all(g % t == 0 for g in node_sizes)):
        for d in divisors(n // t):
            replicas = n // (d * t)
            if d <= cost.model.num_layers and replicas <= global_batch:
                kinds = Counter(tuple(ranked[i * d * t + j * t][0] for j in range(d)) for i in range(replicas))

                def build(d: int = d, t: int = t, replicas: int = replicas) -> Layout:
                    return tuple(slots_for(ranked[i * d * t:(i + 1) * d * t], t) for i in range(replicas))
                yield replicas, t, kinds, [i * d * t for i in range(replicas)], build, None


class _Bounds:
    """Order-free lower bounds on a replica's pipeline time (compute only, memoised per device)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self._per_sample: dict[tuple[str, int, int], float] = {}
        self._memo: dict[tuple, float] = {}

    def per_sample_s(self, device: str, tp: int, b: int) -> float:
        """Cheapest fwd+bwd seconds per sample and layer over micro-batches of at most b samples."""
        key = (device, tp, b)
        if key not in self._per_sample:
            self._per_sample[key] = min(sum(self.cost.layer_times_s(device, x, tp)) / x for x in range(1, b + 1))
        return self._per_sample[key]

    def per_sample_bottleneck_s(self, devices: Sequence[str], tp: int, b: int) -> float:
        """Whole layers, at least one per stage: the bottleneck stage's time per sample is at least the
        L-th smallest ``k c_i`` and the slowest ``c_i`` (c_i: stage i's per-layer, per-sample time)."""
        key = ("bottleneck", tuple(sorted(Counter(devices).items())), tp, b)
        if key not in self._memo:
            per = [self.per_sample_s(d, tp, b) for d in devices]
            num_layers = self.cost.model.num_layers
            steps = heapq.nsmallest(num_layers, (k * c for c in per for k in range(1, num_layers + 1)))
            self._memo[key] = max(steps[-1], max(per))
        return self._memo[key]

    def chain_s(self, devices: Sequence[str], tp: int, b: int, num_samples: int) -> float:
        """One micro-batch of x samples crosses every layer (at least one per stage), the embedding and head."""
        x = min(b, num_samples)
        key = ("chain", tuple(sorted(Counter(devices).items())), devices[0], devices[-1], len(devices), tp, b, x)
        if key not in self._memo:
            per = [self.per_sample_s(d, tp, b) for d in devices]
            ends = sum(self.cost.end_times_s(devices[0], x, tp, first=True, last=len(devices) == 1)) + (
                sum(self.cost.end_times_s(devices[-1], x, tp, first=False, last=True)) if len(devices) > 1 else 0.0)
            self._memo[key] = x * (sum(per) + (self.cost.model.num_layers - len(per)) * min(per)) + ends
        return self._memo[key]

    def makespan_s(self, kinds: Counter, tp: int, b: int, global_batch: int) -> float:
        """Any split of the batch (equal or balanced): pipeline p needs >= n_p X_p, so the makespan is at
        least B / sum_p 1/X_p (one kind: ceil(B/P) X); and some pipeline runs a whole micro-batch."""
        num_pipes = sum(kinds.values())
        x = {k: self.per_sample_bottleneck_s(k, tp, b) for k in kinds}
        if len(kinds) == 1:
            steady = -(-global_batch // num_pipes) * next(iter(x.values()))
        else:
            steady = global_batch / sum(c / x[k] for k, c in kinds.items())
        share = -(-global_batch // num_pipes)
        return max(steady, min(self.chain_s(k, tp, b, share) for k in kinds))

    def first_stage_sync_s(self, heads: Sequence[int], tp: int, depth: int, num_layers: int = 1) -> float:
        """The first stages' blocks are all-reduced after the pipeline flushes: at least the embedding
        and ``num_layers`` layers (the whole model at depth 1), at the NIC's full bandwidth (no sharing)."""
        if len(heads) < 2:
            return 0.0
        devs = self.cost.cluster.devices
        here: dict[int, int] = {}
        nic: dict[int, float] = {}
        for r in heads:
            here[devs[r].node] = here.get(devs[r].node, 0) + 1
            nic[devs[r].node] = devs[r].nic_gbps
        num_layers = num_layers if depth > 1 else self.cost.model.num_layers
        num_bytes = self.cost.stage_params(num_layers, first=True, last=depth == 1) * self.cost.dtype_bytes / tp
        intra = min(devs[r].gpu.intra_node_gbps for r in heads)
        return self.cost.sync_s(SyncShape(num_bytes, len(heads), len(here), max(here.values()), intra, min(nic.values())))


def _links(cost: CostModel, slots: Sequence[StageSlot]) -> tuple[bool, ...]:
    devs = cost.cluster.devices
    return tuple(devs[a.ranks[0]].node == devs[b.ranks[0]].node for a, b in zip(slots, slots[1:]))


def _structure(cost: CostModel, layout: Layout) -> list[tuple[tuple[StageSlot, ...], Group]]:
    """Replicas grouped by structure (devices, TP, links), with node statistics (template filled in later)."""
    members: dict[tuple, list[tuple[StageSlot, ...]]] = {}
    for slots in layout:
        members.setdefault((tuple((s.device, s.tp) for s in slots), _links(cost, slots)), []).append(slots)
    return [(inst[0], make_group(cost, _placeholder(inst[0]), inst)) for inst in members.values()]


def _placeholder(slots: tuple[StageSlot, ...]) -> Template:
    """make_group only reads the depth; the real template replaces this one per micro-batch size."""
    return Template(-1, len(slots), slots[0].tp, 1, 1, slots, None, None)  # type: ignore[arg-type]


def _equal_template(cost: CostModel, slots: tuple[StageSlot, ...], b: int, recompute: str, granularity: int,
                    cache: dict) -> Template | None:
    """The uniform baseline's equal-layer split of a shape (memoised like ``build_template``)."""
    key = ("equal", tuple((s.device, s.tp) for s in slots), _links(cost, slots), b, recompute, granularity)
    if key not in cache:
        part = fixed_partition(cost, slots, equal_layers(cost.model.num_layers, len(slots)), b, recompute)
        cache[key] = None if part is None else (part, timing_of_partition(cost, slots, part, b, granularity))
    hit = cache[key]
    return None if hit is None else Template(-1, len(slots), slots[0].tp, b, 1, slots, *hit)


def search_replicated(cost: CostModel, global_batch: int, *, max_tp: int, recompute: str, options: PlannerOptions,
                      micro_batches: Sequence[int] | None, cache: dict, incumbent: Found | None
                      ) -> tuple[Found | None, int]:
    """Best plan of the baselines' spaces (priced with ETH's data balance too) that beats ``incumbent``.

    Returns (best found or None, candidates priced)."""
    bounds = _Bounds(cost)
    heap: list[tuple[float, int, int, tuple]] = []
    counter = itertools.count()
    structures: dict[int, list[tuple[tuple[StageSlot, ...], Group]]] = {}
    spaces: list[tuple[Iterator[LazyLayout], bool]] = [(uniform_layouts(cost, global_batch, max_tp), True)]
    if options.allow_mixed and len(cost.cluster.gpu_types) > 1:
        spaces.append((layer_balanced_layouts(cost, global_batch, max_tp), False))
    for layouts, uniform in spaces:
        for dp, t, kinds, heads, layout, first in layouts:
            share = -(-global_batch // dp)
            key = next(counter)
            sync_s = bounds.first_stage_sync_s(heads, t, len(next(iter(kinds))))
            for b in micro_batches or [x for x in MICRO_BATCH_CANDIDATES if x <= share]:
                bound = sync_s + bounds.makespan_s(kinds, t, b, global_batch)
                heapq.heappush(heap, (bound, next(counter), 0 if first is not None else 1,
                                      (key, layout, first, heads, share, b, uniform)))
    best, priced = incumbent, 0
    while heap:
        bound, _, stage, item = heapq.heappop(heap)
        if best is not None and bound >= best[0]:
            break
        key, layout, first, heads, share, b, uniform = item
        if stage == 0:  # refine: the exact pipeline time of the (single) replica structure, then its first stage's sync
            tpl = build_template(cost, -1, first, b, recompute, 0, cache, options)
            if tpl is not None:
                lo, hi = tpl.partition.ranges()[0]
                stage0 = Stage(first[0].ranks, first[0].device, (lo, hi), first[0].tp, tpl.partition.recompute[0])
                refined = (tpl.timing.time_s(share) + bounds.first_stage_sync_s(heads, first[0].tp, len(first), hi - lo)
                           + cost.optimizer_s(stage0, first=True, last=len(first) == 1))
                heapq.heappush(heap, (max(bound, refined), next(counter), 1, item))
            continue
        for found in _pricer(cost, global_batch, layout, key, b, uniform, recompute, options, cache, structures)():
            priced += 1
            if best is None or found[0] < best[0]:
                best = found
    return (None if best is incumbent else best), priced


def _pricer(cost: CostModel, global_batch: int, layout: Callable[[], Layout], key: int, b: int, uniform: bool, recompute: str,
            options: PlannerOptions, cache: dict, structures: dict) -> Callable[[], list[Found]]:
    """Deferred pricing of one (layout, micro-batch size): balanced layers (and equal ones for uniform)."""

    def price() -> list[Found]:
        if key not in structures:
            structures[key] = _structure(cost, layout())
        granularity = 1 if options.fine_grained else b
        makers = [lambda s: build_template(cost, -1, s, b, recompute, 0, cache, options)]
        if uniform:
            makers.append(lambda s: _equal_template(cost, s, b, recompute, granularity, cache))
        out = []
        for make in makers:
            groups = []
            for slots, group in structures[key]:
                tpl = make(slots)
                if tpl is None:
                    break
                groups.append(replace(group, template=tpl))
            else:
                out += _evaluations(cost, groups, global_batch, options, b)
        return out

    return price


def _evaluations(cost: CostModel, groups: list[Group], global_batch: int, options: PlannerOptions, b: int
                 ) -> list[Found]:
    """Equal data (the baselines' split) and, where allowed, level-3 balance; whole micro-batches if required."""
    out = []
    modes = [True, False] if options.balance_data else [True]
    for equal in modes:
        try:
            score, samples = evaluate_groups(cost, groups, global_batch, equal_data=equal,
                                             flat_sync=not options.block_sync)
        except ValueError:
            continue
        if not options.fine_grained and any(n % b for row in samples for n in row):
            continue
        if math.isfinite(score):
            out.append((score, groups, samples))
    return out
