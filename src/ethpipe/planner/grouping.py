"""Level 1: devices -> pipelines. Groups of identical pipelines, and a group-level iteration time.

Candidates are compared with ``group_iteration_s``, which computes exactly what
``estimate_plan`` computes for the assembled plan (same stage finish formula, same
``SyncShape`` pricing from ``cost/sync.py``) but prices identical pipelines once: a group's
node statistics are gathered when it is made, so a candidate costs O(blocks x groups).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ethpipe.catalog import GpuSpec
from ethpipe.cost.model import CostModel
from ethpipe.cost.sync import SyncShape, distinct_gpus, nic_share_gbps
from ethpipe.errors import Infeasible
from ethpipe.plan import Block, Stage
from ethpipe.planner.balance import balance_samples
from ethpipe.planner.templates import Pool, Template, slots_for, span_instances
from ethpipe.planner.timing import StageSlot


@dataclass(frozen=True)
class StageNodes:
    """Where one stage position of a group's pipelines sits: heads per node and the slowest links."""

    heads: tuple[tuple[int, int, float], ...]  # (node, pipelines whose stage head is on it, node NIC GB/s)
    intra_gbps: float
    flow_gbps: tuple[tuple[int, float], ...] = ()  # (node, one GPU's NIC rail GB/s)
    gpus: tuple[GpuSpec, ...] = ()  # the heads' GPU types (measured intra-node curves)


@dataclass(frozen=True)
class Group:
    """``instances`` pipelines that all follow ``template`` (same layer split and timing)."""

    template: Template
    instances: tuple[tuple[StageSlot, ...], ...]
    stages: tuple[StageNodes, ...]
    ranks_per_node: tuple[tuple[int, int], ...]  # (node, ranks of this group on it)

    @property
    def count(self) -> int:
        return len(self.instances)

    @property
    def num_nodes(self) -> int:
        return len(self.ranks_per_node)


def make_group(cost: CostModel, template: Template, instances: Sequence[tuple[StageSlot, ...]]) -> Group:
    devices = cost.cluster.devices
    stages = []
    for s in range(template.depth):
        heads: dict[int, int] = {}
        nic: dict[int, float] = {}
        flow: dict[int, float] = {}
        intra = float("inf")
        for slots in instances:
            d = devices[slots[s].ranks[0]]
            heads[d.node] = heads.get(d.node, 0) + 1
            nic[d.node] = d.nic_gbps
            flow[d.node] = d.flow_gbps
            intra = min(intra, d.gpu.intra_node_gbps)
        gpus = distinct_gpus(devices[slots[s].ranks[0]].gpu for slots in instances)
        stages.append(StageNodes(tuple((n, c, nic[n]) for n, c in heads.items()), intra, tuple(flow.items()), gpus))
    ranks: dict[int, int] = {}
    for slots in instances:
        for slot in slots:
            for r in slot.ranks:
                ranks[devices[r].node] = ranks.get(devices[r].node, 0) + 1
    return Group(template, tuple(instances), tuple(stages), tuple(ranks.items()))


def homogeneous_group(cost: CostModel, template: Template, pool: Pool) -> Group:
    """Cut a whole pool into pipelines of ``template`` (``span_instances``)."""
    spans = span_instances(pool, template.depth, template.tp, template.nodes_per_pipeline)
    return make_group(cost, template, [slots_for([(pool.device, r) for r in ranks], template.tp) for ranks in spans])


def _holders(groups: Sequence[Group], lo: int) -> list[int]:
    return [next(i for i, (a, b) in enumerate(gr.template.partition.ranges()) if a <= lo < b) for gr in groups]


def sync_shapes(cost: CostModel, groups: Sequence[Group]) -> list[tuple[list[int], SyncShape | None]]:
    """Per block (common refinement of the groups' splits): holder stage per group, and its shape."""
    num_layers = cost.model.num_layers
    cuts = sorted({0, num_layers, *(lo for gr in groups for lo, _ in gr.template.partition.ranges())})
    blocks = []
    for lo in cuts[:-1]:
        holders = _holders(groups, lo)
        here: dict[int, int] = {}
        nic: dict[int, tuple[float, float]] = {}
        for gr, s in zip(groups, holders):
            flow = dict(gr.stages[s].flow_gbps)
            for node, c, bw in gr.stages[s].heads:
                here[node] = here.get(node, 0) + c
                nic[node] = (bw, flow.get(node, bw))
        blocks.append((holders, here, nic))
    syncing: dict[int, int] = {}
    counted: set[tuple[int, int]] = set()
    for holders, here, _ in blocks:
        if len(here) > 1:
            for g, s in enumerate(holders):
                if (g, s) not in counted:
                    counted.add((g, s))
                    tp = groups[g].template.slots[s].tp
                    for node, c, _ in groups[g].stages[s].heads:
                        syncing[node] = syncing.get(node, 0) + c * tp
    num_pipes = sum(gr.count for gr in groups)
    out = []
    for (lo, hi), (holders, here, nic) in zip(zip(cuts[:-1], cuts[1:]), blocks):
        if num_pipes < 2:
            out.append((holders, None))
            continue
        st = [gr.stages[s] for gr, s in zip(groups, holders)]
        tp = min(gr.template.slots[s].tp for gr, s in zip(groups, holders))
        num_bytes = cost.block_grad_bytes(Block((lo, hi), ()), first=lo == 0, last=hi == num_layers) / tp
        cross = len(here) > 1
        bw = min(nic_share_gbps(*nic[n], c, syncing[n] if cross else c) for n, c in here.items())
        out.append((holders, SyncShape(num_bytes, num_pipes, len(here), max(here.values()),
                                       min(x.intra_gbps for x in st), bw, distinct_gpus(g for x in st for g in x.gpus))))
    return out


def group_iteration_s(cost: CostModel, groups: Sequence[Group], samples: Sequence[Sequence[int]], *,
                      flat_sync: bool = False, shapes: list | None = None) -> float:
    """Iteration time of a candidate: stage finishes, block-wise (or flat) sync, optimizer."""
    finish, free, opts = {}, {}, {}
    for g, (group, row) in enumerate(zip(groups, samples)):
        f = group.template.timing.finish_s(max(row))
        tpl = group.template
        for s, (lo, hi) in enumerate(tpl.partition.ranges()):
            finish[(g, s)] = float(f[s])
            stage = Stage(tpl.slots[s].ranks, tpl.slots[s].device, (lo, hi), tpl.slots[s].tp, tpl.partition.recompute[s])
            opts[(g, s)] = cost.optimizer_s(stage, first=s == 0, last=s == tpl.depth - 1)
    makespan = max(finish.values())
    free = {k: (makespan if flat_sync else v) for k, v in finish.items()}
    for holders, shape in (shapes if shapes is not None else sync_shapes(cost, groups)):
        duration = cost.sync_s(shape)
        if duration > 0.0:
            keys = [(g, s) for g, s in enumerate(holders)]
            start = max(free[k] for k in keys)
            for k in keys:
                free[k] = start + duration
    return max(max(free[k], finish[k]) + opts[k] for k in finish)


def evaluate_groups(cost: CostModel, groups: Sequence[Group], global_batch: int, *, equal_data: bool = False,
                    flat_sync: bool = False) -> tuple[float, list[list[int]]]:
    """Balance the batch over the groups' pipelines (level 3; or split it equally) and price the iteration."""
    if equal_data:
        samples = equal_samples(groups, global_batch)
    else:
        samples = balance_samples([gr.template.timing for gr in groups], [gr.count for gr in groups], global_batch)
    return group_iteration_s(cost, groups, samples, flat_sync=flat_sync), samples


def equal_split(total: int, parts: int) -> list[int]:
    """``total`` as ``parts`` near-equal integers, larger ones first (data or layers)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def equal_samples(groups: Sequence[Group], global_batch: int) -> list[list[int]]:
    num_pipes = sum(g.count for g in groups)
    if global_batch < num_pipes:
        raise Infeasible(f"global batch {global_batch} is smaller than the {num_pipes} pipelines of this plan need "
                         f"(one sample each): use --global-batch >= {num_pipes} or fewer, deeper pipelines")
    shares = iter(equal_split(global_batch, num_pipes))
    return [[next(shares) for _ in range(g.count)] for g in groups]
