"""Level 1 building blocks: node pools and pipeline templates (docs/design.md §2.1).

A *pool* is the set of nodes with one GPU type and node size. A *template* is a pipeline
shape: its stage slots (device, TP degree, ranks of the first instance), micro-batch size b,
the nodes it spans, and its layer split (level 2) and timing, computed once and shared by
every pipeline cut from it. On a pool, a shape (d, t, k) cuts every k consecutive nodes into
``P = k g / (d t)`` pipelines, each putting ``d / k`` consecutive stages on each of the k nodes
(k = 1: pipelines packed inside a node). Spanning k nodes cuts the gradient bytes each node's
NIC carries to ``1/k`` of a replica - what wins when sync dominates (small per-GPU batches) -
and striding (P > 1) does so without making the pipeline deeper: the same trick that lets a
layer-balanced replica (one node of each type) sync little, without mixing types. Depth is
bounded by the number of layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ethpipe.cost.model import CostModel
from ethpipe.planner.search.options import PlannerOptions
from ethpipe.planner.layers.partition import (
    Partition, Prepared, StageOption, _choose, flush_lower_bound_s, partition_layers, prepare,
)
from ethpipe.planner.layers.timing import PipelineTiming, StageSlot, link_key, stage_options, timing_of_partition

MICRO_BATCH_CANDIDATES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class Pool:
    device: str
    gpus_per_node: int
    nodes: tuple[tuple[int, ...], ...]  # ranks of each node, in rank order

    @property
    def num_devices(self) -> int:
        return self.gpus_per_node * len(self.nodes)


@dataclass(frozen=True)
class Template:
    pool_index: int
    depth: int
    tp: int
    micro_batch: int
    nodes_per_pipeline: int  # > 1: the pipeline spans nodes; pipelines per node otherwise given by the shape
    slots: tuple[StageSlot, ...]  # of the first instance (links are the same for every instance)
    partition: Partition
    timing: PipelineTiming

    @property
    def devices_per_pipeline(self) -> int:
        return self.depth * self.tp


def pools_of(cost: CostModel) -> list[Pool]:
    """Group the cluster's nodes by (GPU type, GPUs per node), in first-seen order."""
    by_node: dict[int, list[int]] = {}
    for d in cost.cluster.devices:
        by_node.setdefault(d.node, []).append(d.rank)
    pools: dict[tuple[str, int], list[tuple[int, ...]]] = {}
    for ranks in by_node.values():
        key = (cost.cluster.devices[ranks[0]].gpu.id, len(ranks))
        pools.setdefault(key, []).append(tuple(ranks))
    return [Pool(dev, g, tuple(nodes)) for (dev, g), nodes in pools.items()]


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def slots_for(devices: Sequence[tuple[str, int]], tp: int) -> tuple[StageSlot, ...]:
    """Consecutive ``tp``-rank stages over (device type, rank) pairs."""
    ranks = tuple([r for _, r in devices])
    return tuple(StageSlot(devices[i][0], tp, ranks[i:i + tp]) for i in range(0, len(devices), tp))


def equal_layers(num_layers: int, depth: int) -> list[int]:
    """Equal layers; the remainder goes to the earliest stages but never to the last (it holds the head)."""
    if depth == 1:
        return [num_layers]
    rest = num_layers - num_layers // depth
    base, extra = divmod(rest, depth - 1)
    return [base + (1 if i < extra else 0) for i in range(depth - 1)] + [num_layers // depth]


def fixed_partition(cost: CostModel, slots: Sequence[StageSlot], counts: Sequence[int], micro_batch: int,
                    recompute: str, memo: dict | None = None) -> Partition | None:
    """A given layer split (per-stage recomputation only where memory needs it); None if it does not fit."""
    options = stage_options(cost, slots, micro_batch, recompute, memo)
    chosen = []
    for opts, k in zip(options, counts):
        if not any(o.max_layers >= k for o in opts):
            return None
        chosen.append(_choose(opts, k))
    return Partition(tuple(counts), tuple(o.recompute for o in chosen), max(o.time_s(k) for o, k in zip(chosen, counts)))


def build_template(cost: CostModel, pool_index: int, slots: Sequence[StageSlot], micro_batch: int,
                   recompute: str, nodes_per_pipeline: int, cache: dict,
                   options: PlannerOptions = PlannerOptions()) -> Template | None:
    """Partition and time one pipeline shape; None if it does not fit memory."""
    key = (tuple((s.device, s.tp) for s in slots), link_key(cost, slots), micro_batch, recompute)
    if key not in cache:
        if options.balance_layers:
            part = level2_partition(cost, slots, micro_batch, recompute, cache)
        else:
            part = fixed_partition(cost, slots, equal_layers(cost.model.num_layers, len(slots)), micro_batch, recompute,
                                   cache)
        granularity = 1 if options.fine_grained else micro_batch
        cache[key] = None if part is None else (part, _timing(cost, slots, part, micro_batch, granularity, key, cache))
    hit = cache[key]
    if hit is None:
        return None
    return Template(pool_index, len(slots), slots[0].tp, micro_batch, nodes_per_pipeline, tuple(slots), *hit)


def level2_partition(cost: CostModel, slots: Sequence[StageSlot], micro_batch: int, recompute: str, cache: dict
                     ) -> Partition | None:
    """Level 2's split of a shape (``build_template``'s, without its timing), kept in ``cache`` by devices, TP
    degrees and links; None if it does not fit memory."""
    key = ("level2", tuple((s.device, s.tp) for s in slots), link_key(cost, slots), micro_batch, recompute)
    if key not in cache:
        stages = _options(cost, slots, micro_batch, recompute, cache)
        cache[key] = partition_layers(stages, cost.model.num_layers, _prepared(stages, cost.model.num_layers, cache))
    return cache[key]  # type: ignore[no-any-return]


def _timing(cost: CostModel, slots: Sequence[StageSlot], part: Partition, micro_batch: int, granularity: int,
            key: tuple, cache: dict) -> PipelineTiming:
    """The shape's T(n) and finishes for this split, kept for the planning run where the caller's cache has a
    ``("template_timings",)`` memo (``planner.make_plan``): they depend on devices, links and the split, not on
    memory, so a sharding round whose split of a shape did not move reuses the tables and finish times."""
    shared = cache.get(("template_timings",))
    if shared is None:
        return timing_of_partition(cost, slots, part, micro_batch, granularity)
    timing_key = (key[:3], part.num_layers, part.recompute, granularity)
    if timing_key not in shared:
        shared[timing_key] = timing_of_partition(cost, slots, part, micro_batch, granularity)
    return shared[timing_key]


def template_flush_bound_s(cost: CostModel, slots: Sequence[StageSlot], micro_batch: int, recompute: str,
                           num_samples: int, cache: dict, options: PlannerOptions = PlannerOptions()) -> float:
    """A lower bound on ``build_template(...).timing.finish_s(num_samples)[0]`` without partitioning or timing
    (``partition.flush_lower_bound_s``; a smaller last micro-batch drops the fill); inf if the shape cannot
    hold the model, 0.0 where level 2 does not split the layers (``balance_layers`` off)."""
    if not options.balance_layers:
        return 0.0
    stages = _options(cost, slots, micro_batch, recompute, cache)
    key = ("flush_bound", stages, num_samples // micro_batch, num_samples % micro_batch == 0)
    if key not in cache:  # replicas whose links differ often have the same options (memoised per slot)
        # a hair under: the flush's own arithmetic (action times, stage_finish_s) rounds differently
        num_layers = cost.model.num_layers
        cache[key] = flush_lower_bound_s(stages, num_layers, *key[2:],
                                         prepared=_prepared(stages, num_layers, cache)) * (1 - 1e-12)
    return cache[key]


def _options(cost: CostModel, slots: Sequence[StageSlot], micro_batch: int, recompute: str, cache: dict
             ) -> tuple[tuple[StageOption, ...], ...]:
    """``stage_options`` of a shape, kept in ``cache`` (its flush is bounded, then it is partitioned) by its devices,
    TP degrees and links like ``build_template``'s templates, never by ranks: the idle search's sub-clusters share
    the cache and number their ranks anew."""
    key = ("options", tuple((s.device, s.tp) for s in slots), link_key(cost, slots), micro_batch, recompute)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = tuple(map(tuple, stage_options(cost, slots, micro_batch, recompute, cache)))
    return hit  # type: ignore[no-any-return]


def _prepared(stages: tuple[tuple[StageOption, ...], ...], num_layers: int, cache: dict) -> Prepared | None:
    """``partition.prepare`` of these options, kept in ``cache``: a shape's flush is bounded before it is
    partitioned, by the same options (None where ``partition_layers`` answers without it)."""
    if not 0 < len(stages) <= num_layers:
        return None
    key = ("prepared", stages)
    hit = cache.get(key)
    if hit is None:
        hit = cache[key] = prepare(stages, num_layers)
    return hit  # type: ignore[no-any-return]


def pool_shapes(cost: CostModel, pool: Pool, max_tp: int) -> list[tuple[int, int, int]]:
    """(depth, tp, nodes spanned) of every pipeline shape that tiles the pool."""
    g, num_layers = pool.gpus_per_node, cost.model.num_layers
    shapes = []
    for t in (t for t in divisors(g) if t <= max_tp and cost.model.tp_problem(t) is None):
        for k in divisors(len(pool.nodes)):
            shapes += [(d, t, k) for d in divisors(k * g // t) if d % k == 0 and d <= num_layers]
    return shapes


def span_instances(pool: Pool, depth: int, tp: int, span: int) -> list[list[int]]:
    """Ranks of every pipeline of a shape, in stage order (``d / k`` stages on each of k nodes)."""
    per_node = depth // span * tp
    out = []
    for first in range(0, len(pool.nodes), span):
        nodes = pool.nodes[first:first + span]
        out += [[r for node in nodes for r in node[p * per_node:(p + 1) * per_node]]
                for p in range(pool.gpus_per_node // per_node)]
    return out


def shape_slots(pool: Pool, depth: int, tp: int, span: int) -> tuple[StageSlot, ...]:
    return slots_for([(pool.device, r) for r in span_instances(pool, depth, tp, span)[0]], tp)


def micro_batch_candidates(max_micro_batch: int) -> list[int]:
    return [b for b in MICRO_BATCH_CANDIDATES if b <= max_micro_batch] or [1]
