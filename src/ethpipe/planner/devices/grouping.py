"""Level 1: devices -> pipelines. Groups of identical pipelines, and a group-level iteration time.

Candidates are compared with ``group_iteration_s``, which computes exactly what
``estimate_plan`` computes for the assembled plan (same stage finish formula, same
``SyncShape`` pricing from ``cost/sync.py``; all but the step's stats all-gather, a few milliseconds the
final pricing adds) but prices identical pipelines once: a group's
node statistics are gathered when it is made, so a candidate costs O(blocks x groups).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ethpipe.catalog import GpuSpec
from ethpipe.cost.model import CostModel
from ethpipe.cost.sync import SyncShape, block_sync_order, distinct_gpus, nic_share_gbps
from ethpipe.errors import Infeasible
from ethpipe.plan import Block, Stage
from ethpipe.planner.samples.balance import balance_samples
from ethpipe.planner.search.memo import cluster_memo
from ethpipe.planner.devices.instances import RankRows
from ethpipe.planner.devices.templates import Pool, Template, span_instances
from ethpipe.planner.layers.timing import StageSlot, link_key


@dataclass(frozen=True)
class StageNodes:
    """Where one stage position of a group's pipelines sits: heads per node and the slowest links."""

    heads: tuple[tuple[int, int, float], ...]  # (node, pipelines whose stage head is on it, node NIC GB/s)
    intra_gbps: float
    flow_gbps: tuple[tuple[int, float], ...] = ()  # (node, one GPU's NIC rail GB/s)
    gpus: tuple[GpuSpec, ...] = ()  # the heads' GPU types (measured intra-node curves)

    @functools.cached_property
    def head_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``heads`` as arrays (node, pipelines, node NIC GB/s, one GPU's rail GB/s): ``sync_shapes`` reads them
        for every candidate that holds this stage position."""
        rails = dict(self.flow_gbps)
        node = np.array([n for n, _, _ in self.heads], dtype=np.int64)
        count = np.array([c for _, c, _ in self.heads], dtype=np.float64)
        nic = np.array([bw for _, _, bw in self.heads], dtype=np.float64)
        flow = np.array([rails.get(n, bw) for n, _, bw in self.heads], dtype=np.float64)
        return node, count, nic, flow


@dataclass(frozen=True)
class Group:
    """``instances`` pipelines that all follow ``template`` (same layer split and timing)."""

    template: Template
    instances: Sequence[tuple[StageSlot, ...]]  # a tuple, or ``RankRows`` (built when a plan is assembled)
    stages: tuple[StageNodes, ...]
    ranks_per_node: tuple[tuple[int, int], ...]  # (node, ranks of this group on it)

    @property
    def count(self) -> int:
        return len(self.instances)

    @property
    def num_nodes(self) -> int:
        return len(self.ranks_per_node)


def make_group(cost: CostModel, template: Template, instances: Sequence[tuple[StageSlot, ...]],
               heads: np.ndarray | None = None, ranks: np.ndarray | None = None) -> Group:
    """``instances`` as one group, with its node statistics. ``heads`` (pipeline x stage: each stage's first
    rank) and ``ranks`` (every rank, pipeline by pipeline, stage by stage): the instances' own, where the
    caller has them as arrays (``RankRows``); else read from the instances."""
    if heads is None or ranks is None:
        heads = np.array([[slots[s].ranks[0] for s in range(template.depth)] for slots in instances],
                         dtype=np.int64).reshape(len(instances), template.depth)
        ranks = np.fromiter((r for slots in instances for slot in slots for r in slot.ranks), dtype=np.int64)
    cols = cost.cluster.columns
    depth = template.depth
    node, count, last, at = _first_seen(cols.node[heads])
    last_heads = heads.reshape(-1, order="F")[last]  # the last head on each node gives its NIC figures
    nic, flow = cols.nic_gbps[last_heads].tolist(), cols.flow_gbps[last_heads].tolist()
    gpu, _, _, gpu_at = _first_seen(cols.gpu[heads])
    intra = cols.intra_gbps[heads].min(axis=0).tolist() if len(heads) else [float("inf")] * depth
    stages = []
    for s in range(depth):
        lo, hi = at[s], at[s + 1]
        nodes = node[lo:hi]
        stages.append(StageNodes(tuple(zip(nodes, count[lo:hi], nic[lo:hi])), intra[s], tuple(zip(nodes, flow[lo:hi])),
                                 distinct_gpus(cols.gpus[i] for i in gpu[gpu_at[s]:gpu_at[s + 1]])))
    node, first, count = np.unique(cols.node[ranks], return_index=True, return_counts=True)
    order = np.argsort(first, kind="stable")
    return Group(template, instances if isinstance(instances, RankRows) else tuple(instances), tuple(stages),
                 tuple(zip(node[order].tolist(), count[order].tolist())))


def _first_seen(values: np.ndarray) -> tuple[list[int], list[int], np.ndarray, list[int]]:
    """Each column's distinct values of ``values`` (pipeline x stage), column by column, each column's first seen
    first; how often each occurs; where it last occurs (an index into the column-by-column flattening); and
    where each column's values start (one more at the end): what a per-pipeline loop filling a dict per
    column would see, for every column at once."""
    cols = values.shape[1]
    span = int(values.max()) + 1 if values.size else 1
    keys = (values + np.arange(cols, dtype=np.int64) * span).reshape(-1, order="F")
    uniq, first, counts = np.unique(keys, return_index=True, return_counts=True)
    _, from_end = np.unique(keys[::-1], return_index=True)
    order = np.argsort(first, kind="stable")  # column by column (the flattening's order), first seen first
    uniq = uniq[order]
    at = np.searchsorted(uniq // span, np.arange(cols + 1)).tolist()
    return (uniq % span).tolist(), counts[order].tolist(), (len(keys) - 1 - from_end)[order], at

Structures = list[tuple[tuple[StageSlot, ...], Group]]


def link_structures(cost: CostModel, instances: Sequence[tuple[StageSlot, ...]]) -> Structures:
    """Pipelines grouped by what their template depends on besides the micro-batch size (devices, TP, links:
    ``build_template``'s key), each group's node statistics computed once: depend on the cluster alone, so
    memoised in ``cluster_memo`` by the callers; ``with_templates`` fills in one micro-batch size's templates."""
    members: dict[tuple, list[tuple[StageSlot, ...]]] = {}
    for slots in instances:
        members.setdefault((tuple((s.device, s.tp) for s in slots), link_key(cost, slots)), []).append(slots)
    return [(inst[0], make_group(cost, _placeholder(inst[0]), inst)) for inst in members.values()]


def rank_structures(cost: CostModel, ranks: np.ndarray, tp: int) -> Structures:
    """``link_structures`` of the pipelines whose ranks are ``ranks``' rows (stage by stage, ``tp`` ranks each),
    grouped with arrays: the same groups, in the same order, their instances built only when used."""
    cols = cost.cluster.columns
    heads = ranks[:, ::tp]
    link = cols.link[heads]
    cross = cols.node[heads[:, 1:]] != cols.node[heads[:, :-1]]
    codes = np.where(cross, 1 + link[:, :-1] * (int(cols.link.max()) + 1) + link[:, 1:], 0)  # 0: inside a node
    types = cols.gpu_type[heads]
    _, first, inverse = np.unique(np.concatenate([types, codes], axis=1), axis=0, return_index=True,
                                  return_inverse=True)
    inverse = inverse.reshape(-1)
    by_structure = np.argsort(inverse, kind="stable")  # each structure's rows together, in row order
    ends = np.cumsum(np.bincount(inverse)).tolist()
    out: Structures = []
    for g in np.argsort(first, kind="stable").tolist():  # structures first seen first
        rows = by_structure[(ends[g - 1] if g else 0):ends[g]]
        inst = RankRows([cols.gpu_types[t] for t in types[rows[0]].tolist()], tp, ranks[rows])
        out.append((inst[0], make_group(cost, _placeholder(inst[0]), inst, heads[rows], ranks[rows].reshape(-1))))
    return out


def _placeholder(slots: tuple[StageSlot, ...]) -> Template:
    """make_group only reads the depth; the real template replaces this one per micro-batch size."""
    return Template(-1, len(slots), slots[0].tp, 1, 1, slots, None, None)  # type: ignore[arg-type]


def with_templates(structures: Structures, make: Callable[[tuple[StageSlot, ...]], Template | None]
                   ) -> list[Group] | None:
    """Each structure's group with its template (``make``: one per structure); None if one does not fit."""
    groups = []
    for slots, group in structures:
        template = make(slots)
        if template is None:
            return None
        groups.append(dataclasses.replace(group, template=template))
    return groups


def homogeneous_group(cost: CostModel, template: Template, pool: Pool, cache: dict | None = None) -> Group:
    """Cut a whole pool into pipelines of ``template`` (``span_instances``); the node statistics, which depend on
    the shape alone, memoised in ``cache``'s ``cluster_memo``."""
    key = ("pool_group", pool.device, pool.nodes, template.depth, template.tp, template.nodes_per_pipeline)
    memo = cluster_memo(cache, cost.cluster) if cache is not None else {}
    if key not in memo:
        ranks = np.array(span_instances(pool, template.depth, template.tp, template.nodes_per_pipeline), dtype=np.int64)
        memo[key] = make_group(cost, template, RankRows((pool.device,) * template.depth, template.tp, ranks),
                               ranks[:, ::template.tp], ranks.reshape(-1))
    return dataclasses.replace(memo[key], template=template)


def sync_shapes(cost: CostModel, groups: Sequence[Group]) -> list[tuple[list[int], SyncShape | None]]:
    """Per block (common refinement of the groups' splits): holder stage per group, and its shape.

    Vectorised over (block, node): each group's heads per (stage, node) once, gathered by the blocks'
    holder stages; per node the arithmetic of ``cost/sync.py``'s ``nic_share_gbps``, so the shapes equal
    those of a per-block loop."""
    num_layers = cost.model.num_layers
    ranges = [gr.template.partition.ranges() for gr in groups]
    cuts = sorted({0, num_layers, *(lo for r in ranges for lo, _ in r)})
    at = np.stack([np.searchsorted([lo for lo, _ in r], cuts[:-1], side="right") - 1 for r in ranges], axis=1)
    holders = at.tolist()  # (block, group): the stage holding the block's first layer
    if sum(gr.count for gr in groups) < 2:
        return [(h, None) for h in holders]
    per_group = [_head_arrays(gr) for gr in groups]
    every = np.concatenate([a[1] for a in per_group])
    columns, last = _last_seen(every)  # a node's NIC figures: its last head's, as a loop over the heads would set
    nic = np.concatenate([a[3] for a in per_group])[last]  # the node's NIC and one GPU's rail
    flow = np.concatenate([a[4] for a in per_group])[last]
    heads = []
    for gr, (stage, node, count, _, _) in zip(groups, per_group):
        counts = np.zeros((gr.template.depth, len(columns)))
        counts[stage, np.searchsorted(columns, node)] = count
        heads.append(counts)
    here = sum(counts[at[:, g]] for g, counts in enumerate(heads))  # (block, node) heads
    present = here > 0
    cross = present.sum(axis=1) > 1
    syncing = np.zeros(len(columns))  # ranks of each node in cross-node groups (each holder stage once)
    for g, counts in enumerate(heads):
        stages = np.unique(at[cross, g])
        tps = np.array([groups[g].template.slots[s].tp for s in stages], dtype=np.float64)
        syncing += (counts[stages] * tps[:, None]).sum(axis=0)
    sharing = np.where(cross[:, None], syncing[None, :], here)
    share = np.minimum(here * flow, nic * np.minimum(1.0, here / np.maximum(sharing, 1)))
    bw = np.where(present, share, np.inf).min(axis=1)
    num_nodes, most = present.sum(axis=1), here.max(axis=1)
    num_pipes = sum(gr.count for gr in groups)
    out: list[tuple[list[int], SyncShape | None]] = []
    for b, ((lo, hi), holder) in enumerate(zip(zip(cuts[:-1], cuts[1:]), holders)):
        st = [gr.stages[s] for gr, s in zip(groups, holder)]
        tp = min(gr.template.slots[s].tp for gr, s in zip(groups, holder))
        num_bytes = cost.block_grad_bytes(Block((lo, hi), ()), first=lo == 0, last=hi == num_layers) / tp
        out.append((holder, SyncShape(num_bytes, num_pipes, int(num_nodes[b]), int(most[b]),
                                      min(x.intra_gbps for x in st), float(bw[b]),
                                      distinct_gpus(g for x in st for g in x.gpus))))
    return out


def _head_arrays(group: Group) -> tuple[np.ndarray, ...]:
    """A group's heads, stage after stage, as arrays: (stage, node, pipelines, node NIC GB/s, one GPU's rail)."""
    parts = [st.head_arrays for st in group.stages]
    stage = np.repeat(np.arange(len(parts)), [len(p[0]) for p in parts])
    return (stage, *(np.concatenate([p[i] for p in parts]) for i in range(4)))


def _last_seen(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values, sorted, and where each last occurs."""
    uniq, from_end = np.unique(values[::-1], return_index=True)
    return uniq, len(values) - 1 - from_end


def tied_shape(cost: CostModel, groups: Sequence[Group]) -> SyncShape | None:
    """The tied matrix's all-reduce among every pipeline's first and last stage (``cost/sync.tied_sync_shape``'s
    arithmetic on the groups' heads); None for an untied model or a single copy."""
    if not cost.tied_grad_bytes():
        return None
    ends = [gr.stages[s] for gr in groups for s in dict.fromkeys((0, gr.template.depth - 1))]
    here: dict[int, int] = {}
    nic: dict[int, tuple[float, float]] = {}
    for st in ends:
        rails = dict(st.flow_gbps)
        for node, c, bw in st.heads:
            here[node] = here.get(node, 0) + c
            nic[node] = (bw, rails.get(node, bw))
    if sum(here.values()) < 2:
        return None
    tp = min(gr.template.slots[s].tp for gr in groups for s in (0, gr.template.depth - 1))
    return SyncShape(cost.tied_grad_bytes() / tp, sum(here.values()), len(here), max(here.values()),
                     min(st.intra_gbps for st in ends), min(nic_share_gbps(*nic[n], c, c) for n, c in here.items()),
                     distinct_gpus(g for st in ends for g in st.gpus))


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
    blocks = shapes if shapes is not None else sync_shapes(cost, groups)
    syncs = [([(g, s) for g, s in enumerate(blocks[k][0])], blocks[k][1]) for k in block_sync_order(len(blocks))]
    syncs.append(([(g, s) for g, gr in enumerate(groups) for s in dict.fromkeys((0, gr.template.depth - 1))],
                  tied_shape(cost, groups)))  # the runtime's order: blocks descending, the tied matrix last
    for keys, shape in syncs:
        duration = cost.sync_s(shape)
        if duration > 0.0:
            start = max(free[k] for k in keys)
            for k in keys:
                free[k] = start + duration
    # Every optimizer step waits for the step's stats all-gather after the last rank's sync (``estimate_plan``). Its
    # few milliseconds are left to the final pricing: a score stays at most its plan's price (the search's bars).
    stats_end_s = max(free.values())  # a stage is free no earlier than its finish
    end = {k: stats_end_s + opts[k] for k in finish}
    if cost.optimizer_holders > 1:  # sharded: the gathers after the optimizer, in the sync's reversed order
        for keys, shape in reversed(syncs):
            duration = cost.gather_s(shape)
            if duration > 0.0:
                start = max(end[k] for k in keys)
                for k in keys:
                    end[k] = start + duration
    return max(end.values())


ROUNDING = 1e-9  # relative; far above the difference of two float evaluations of one path (~1e-14)


def evaluate_groups(cost: CostModel, groups: Sequence[Group], global_batch: int, *, equal_data: bool = False,
                    flat_sync: bool = False, shapes: list | None = None, cutoff_s: float = math.inf
                    ) -> tuple[float, list[list[int]]]:
    """Balance the batch over the groups' pipelines (level 3; or split it equally) and price the iteration
    (``shapes``: the groups' ``sync_shapes``, when already known). If the slowest pipeline's flush alone
    (a lower bound: every stage's sync and optimizer step come after its last backward) is at least
    ``cutoff_s``, the sync is not priced and the score is inf (and the balance not finished where it shows
    that already: no samples then)."""
    if equal_data:
        samples = equal_samples(groups, global_batch)
    else:
        # Each T(n) is at most the flush it bounds (``equal_sizes_makespans``: some of ``stage_finish_s``'s paths,
        # with free sends: the senders' waits only make the flush later),
        # up to rounding, so a balance whose every split has some T(n) past the cutoff (by more than any
        # rounding) ends in the check below: stop it there.
        found = balance_samples([gr.template.timing for gr in groups], [gr.count for gr in groups], global_batch,
                                give_up_at_s=cutoff_s * (1 + ROUNDING))
        if found is None:
            return math.inf, []
        samples = found
    if math.isfinite(cutoff_s) and max(float(gr.template.timing.finish_s(max(row))[0])
                                       for gr, row in zip(groups, samples)) >= cutoff_s:
        return math.inf, samples
    return group_iteration_s(cost, groups, samples, flat_sync=flat_sync, shapes=shapes), samples


def capacity_per_s(groups: Sequence[Group]) -> float:
    """Samples per second the groups' pipelines take at most (``PipelineTiming.per_sample_floor_s``): any
    split of a batch B over them prices at least B / capacity, a bound that prunes combinations."""
    return sum(g.count / g.template.timing.per_sample_floor_s() for g in groups)


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
