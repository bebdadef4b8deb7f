"""Level 1: devices -> pipelines. Instances of templates, and a group-level iteration time.

Candidates are compared with the group-level evaluator below (identical pipelines are priced
once), which mirrors ``estimate.py``'s block-wise sync on groups instead of ranks; the plan
finally chosen is re-priced rank by rank with ``estimate_plan``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ethpipe.cost import comm
from ethpipe.cost.model import CostModel
from ethpipe.plan import Block, Stage
from ethpipe.planner.balance import balance_samples
from ethpipe.planner.templates import Pool, Template, slots_for
from ethpipe.planner.timing import StageSlot


@dataclass(frozen=True)
class Group:
    """``instances`` pipelines that all follow ``template`` (same layer split and timing)."""

    template: Template
    instances: tuple[tuple[StageSlot, ...], ...]
    num_nodes: int  # nodes these pipelines occupy
    pipelines_per_node: int
    gpus_per_node: int

    @property
    def count(self) -> int:
        return len(self.instances)


def homogeneous_group(template: Template, pool: Pool) -> Group:
    """Cut a whole pool into pipelines of ``template``: inside each node, or over spans of nodes."""
    size = template.devices_per_pipeline
    if template.nodes_per_pipeline > 1:
        k = template.nodes_per_pipeline
        spans = [[r for node in pool.nodes[i:i + k] for r in node] for i in range(0, len(pool.nodes), k)]
    else:
        spans = [list(node[j:j + size]) for node in pool.nodes for j in range(0, len(node), size)]
    instances = tuple(slots_for([(pool.device, r) for r in ranks], template.tp) for ranks in spans)
    return Group(template, instances, len(pool.nodes), max(pool.gpus_per_node // size, 1), pool.gpus_per_node)


def _ready_and_opt(cost: CostModel, group: Group, num_samples: int) -> tuple[list[float], list[float]]:
    tpl = group.template
    timing = tpl.timing
    total = timing.time_s(num_samples)
    last = num_samples - (-(-num_samples // timing.micro_batch) - 1) * timing.micro_batch
    ready = [total - d for d in timing.drain_s(last)]
    opts = []
    for i, (lo, hi) in enumerate(tpl.partition.ranges()):
        stage = Stage(tpl.slots[i].ranks, tpl.slots[i].device, (lo, hi), tpl.slots[i].tp, tpl.partition.recompute[i])
        opts.append(cost.optimizer_s(stage, first=i == 0, last=i == tpl.depth - 1))
    return ready, opts


def group_iteration_s(cost: CostModel, groups: Sequence[Group], samples: Sequence[Sequence[int]]) -> float:
    """Iteration time of a candidate: slowest flush + exposed block-wise sync + optimizer."""
    ready, opts = {}, {}
    for g, (group, row) in enumerate(zip(groups, samples)):
        r, o = _ready_and_opt(cost, group, max(row))
        for s in range(group.template.depth):
            ready[(g, s)], opts[(g, s)] = r[s], o[s]
    num_pipes = sum(gr.count for gr in groups)
    if num_pipes > 1:
        _sync_blocks(cost, groups, ready)
    return max(ready[k] + opts[k] for k in ready)


def _sync_blocks(cost: CostModel, groups: Sequence[Group], free: dict[tuple[int, int], float]) -> None:
    num_layers = cost.model.num_layers
    cuts = sorted({0, num_layers, *(lo for gr in groups for lo, _ in gr.template.partition.ranges())})
    devs = [cost.cluster.devices[gr.instances[0][0].ranks[0]] for gr in groups]
    num_nodes = sum(gr.num_nodes for gr in groups)
    # One concurrent collective per syncing (stage, shard) of a node, pipelines_per_node ranks each.
    share = max(max(gr.gpus_per_node / gr.pipelines_per_node, 1.0) for gr in groups) if num_nodes > 1 else 1.0
    intra = min(d.gpu.intra_node_gbps for d in devs)
    inter = min(d.nic_gbps for d in devs) / share
    per_node = max(gr.pipelines_per_node for gr in groups)
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        holders = []
        tp = min(gr.template.tp for gr in groups)
        for g, gr in enumerate(groups):
            s = next(i for i, (a, b) in enumerate(gr.template.partition.ranges()) if a <= lo < b)
            holders.append((g, s))
        num_bytes = cost.block_grad_bytes(Block((lo, hi), ()), first=lo == 0, last=hi == num_layers) / tp
        duration = comm.allreduce_shape_s(
            num_bytes, num_ranks=sum(gr.count for gr in groups), num_nodes=num_nodes, max_ranks_per_node=per_node,
            intra_gbps=intra, inter_gbps=inter, intra_latency_s=cost.cluster.intra_node_latency_s,
            inter_latency_s=cost.cluster.inter_node_latency_s)
        start = max(free[h] for h in holders)
        for h in holders:
            free[h] = start + duration


def evaluate_groups(cost: CostModel, groups: Sequence[Group], global_batch: int) -> tuple[float, list[list[int]]]:
    """Balance the batch over the groups' pipelines (level 3) and price the iteration."""
    samples = balance_samples([gr.template.timing for gr in groups], [gr.count for gr in groups], global_batch)
    return group_iteration_s(cost, groups, samples), samples
