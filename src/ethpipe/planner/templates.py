"""Level 1 building blocks: node pools and pipeline templates (DESIGN 2.1).

A *pool* is the set of nodes with one GPU type and node size. A *template* is a pipeline
shape on one pool: depth d, TP degree t, micro-batch size b, the nodes it spans (1 unless one
node cannot hold the model), and the recomputation mode; its layer split (level 2) and timing
are computed once and shared by every pipeline cut from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ethpipe.cost.model import CostModel
from ethpipe.planner.partition import Partition, partition_layers
from ethpipe.planner.timing import PipelineTiming, StageSlot, stage_options, timing_of_partition

MICRO_BATCH_CANDIDATES = (1, 2, 4, 8, 16)
# Pipelines span nodes when one node cannot hold the model, and also (up to this many nodes)
# when that cuts the gradient bytes each node's NIC must carry in the block-wise sync.
MAX_EXTRA_SPAN = 4


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
    return tuple(
        StageSlot(devices[i][0], tp, tuple(r for _, r in devices[i:i + tp])) for i in range(0, len(devices), tp)
    )


def build_template(cost: CostModel, pool_index: int, slots: Sequence[StageSlot], micro_batch: int,
                   recompute: str, nodes_per_pipeline: int, cache: dict) -> Template | None:
    """Partition and time one pipeline shape; None if it does not fit memory."""
    links = tuple(cost.cluster.devices[a.ranks[0]].node == cost.cluster.devices[b.ranks[0]].node
                  for a, b in zip(slots, slots[1:]))
    key = (tuple((s.device, s.tp) for s in slots), links, micro_batch, recompute)
    if key not in cache:
        part = partition_layers(stage_options(cost, slots, micro_batch, recompute), cost.model.num_layers)
        cache[key] = None if part is None else (part, timing_of_partition(cost, slots, part, micro_batch))
    hit = cache[key]
    if hit is None:
        return None
    return Template(pool_index, len(slots), slots[0].tp, micro_batch, nodes_per_pipeline, tuple(slots), *hit)


def pool_templates(cost: CostModel, pools: Sequence[Pool], index: int, *, max_tp: int, recompute: str,
                   max_micro_batch: int, cache: dict) -> list[Template]:
    """Every memory-feasible template of one pool: inside a node, or over a few nodes."""
    pool = pools[index]
    g, num_layers = pool.gpus_per_node, cost.model.num_layers
    mbs = [b for b in MICRO_BATCH_CANDIDATES if b <= max_micro_batch] or [1]
    tps = [t for t in divisors(g) if t <= max_tp]
    found: list[Template] = []
    for span in divisors(len(pool.nodes)):
        if found and span > MAX_EXTRA_SPAN:
            break
        devices = [(pool.device, r) for node in pool.nodes[:span] for r in node]
        for t in tps:
            for d in divisors(span * g // t):
                if d > num_layers or (span > 1 and d * t != span * g):
                    continue
                slots = slots_for(devices[: d * t], t)
                for b in mbs:
                    tpl = build_template(cost, index, slots, b, recompute, span, cache)
                    if tpl is not None:
                        found.append(tpl)
    return found
