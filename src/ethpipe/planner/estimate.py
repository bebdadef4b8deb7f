"""Closed-form iteration time of ANY valid plan, with block-wise gradient sync (docs/design.md §2.2).

Per pipeline: each stage's flush under its schedule, the senders' waits for their sends priced
(``cost/schedule_time.stage_finish_of``: 1F1B's closed form ``cost/pipeline.stage_finish_s``, another
schedule's exact replay; any micro-batch sizes). Then every stage all-reduces its blocks in the runtime's one global order
(blocks descending, then the tied matrix: ``cost/sync.block_sync_order``), which keeps overlapping
groups deadlock-free: a block's all-reduce starts when all
its holders are free, holders stay busy until it ends. Then every rank waits for the step's stats, one
world-wide all-gather after the last rank's sync (``runtime/step.py``: the gradient norm the clipped optimizer
needs), and runs its optimizer step. All-reduce durations come from ``CostModel.block_sync_s`` (the one
pricing, shared with the simulator). ``flat_sync``: every all-reduce waits for the slowest
pipeline's flush (DDP-style), as the simulator's ``flat_sync``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from ethpipe.cost.compute import model_train_flops
from ethpipe.cost.memory import GRAD_BYTES_PER_PARAM
from ethpipe.cost.model import CostModel
from ethpipe.cost.schedule_time import stage_finish_of
from ethpipe.cost.sync import block_sync_order
from ethpipe.plan import Pipeline, Plan, Stage, layer_owners
from ethpipe.planner.layers.timing import action_times_s, recv_times_s, virtual_stages, weight_times_s
from ethpipe.cost.plan_memory import held_of, stage_bytes
from ethpipe.schedule import SPLIT_SCHEDULES


@dataclass(frozen=True)
class Estimate:
    iteration_time_s: float
    makespan_s: float  # slowest pipeline's flush
    pipeline_times_s: tuple[float, ...]
    grad_sync_exposed_s: float  # block all-reduce time after the makespan
    optimizer_s: float  # slowest optimizer step
    busy_s: dict[int, float]  # per rank: compute seconds in the iteration
    memory_bytes: dict[int, int]  # per rank: peak bytes
    no_sync_iteration_s: float = 0.0  # the iteration if gradient sync were free (efficiency factors)


@dataclass(frozen=True)
class PlanLayout:
    """What pricing a plan takes from its stages and blocks alone, not from its micro-batches or schedules:
    computed once for the estimates of one layout's re-splits (``layers/schedules.py``), which at thousands of
    pipelines is most of an estimate. Pipelines with one key (same stages' devices, layers and links) hold the
    same blocks at the same stages: the sync is replayed per key class, not per pipeline."""

    stages: tuple[tuple[Stage, ...], ...]  # per pipeline: the stages this was computed for
    cost: CostModel  # with the layout's p2p NIC sharing (``CostModel.with_plan_p2p``)
    keys: tuple[tuple, ...]  # per pipeline: what its stage times depend on (devices, layers, links)
    key_class: tuple[int, ...]  # per pipeline: its key's index among the distinct keys, first seen first
    holders: list[list[tuple[int, int]]]  # per block: its holder stages as (key class, stage) (``holder_stages``)
    sync_s: list[float]  # per block: its all-reduce (sharded: reduce phase)
    tied_holders: list[tuple[int, int]]  # (key class, stage)
    tied_sync_s: float
    stats_s: float = 0.0  # the step's stats all-gather over every rank (``CostModel.stats_gather_s``)


def plan_layout(plan: Plan, cost: CostModel) -> PlanLayout:
    pcost = cost.with_plan_p2p(plan)  # pipelines crossing the same NIC share it (cost/p2p.py)
    links: dict = {}
    keys = tuple(_pipeline_key(pipe, pcost, links) for pipe in plan.pipelines)
    index: dict[tuple, int] = {}
    key_class = tuple(index.setdefault(k, len(index)) for k in keys)
    firsts: dict[int, int] = {}
    for p, c in enumerate(key_class):
        firsts.setdefault(c, p)  # classes are numbered first seen first: in class order
    one_each = [plan.pipelines[p] for p in firsts.values()]
    owners = layer_owners(one_each, plan.num_layers)
    holders = [[(c, owner[block.layers[0]]) for c, owner in enumerate(owners)] for block in plan.blocks]
    tied = [(c, s) for c, pipe in enumerate(one_each) for s in dict.fromkeys((0, pipe.depth - 1))]
    return PlanLayout(tuple(p.stages for p in plan.pipelines), pcost, keys, key_class, holders,
                      pcost.block_sync_s(plan), tied, pcost.tied_sync_s(plan), pcost.stats_gather_s(plan))


def _pipeline_key(pipe: Pipeline, cost: CostModel, links: dict) -> tuple:
    """Its stages' devices and layers, and each receive's link (an interleaved ring's wrap-around too)."""
    stages = pipe.stages
    heads = [st.ranks[0] for st in stages]
    depth = len(stages)
    ring = heads * pipe.num_chunks if pipe.num_chunks > 1 else heads  # the rows' order (``virtual_stages``)
    return (tuple((s.device, s.tp, s.layers, s.chunks, s.recompute, s.sublayers) for s in stages),
            tuple(_link(cost, a, b, links) for a, b in zip(ring[:depth], ring[1:depth + 1])))


def _link(cost: CostModel, a: int, b: int, memo: dict) -> tuple:
    """What a receive from rank a's stage to rank b's depends on, both directions (the backward's gradient):
    inside a node the two GPU types (their link curves), across nodes each end's rail and NIC and the
    pipelines sharing them (``CostModel.p2p_link_gbps``); latency follows from which."""
    key = memo.get((a, b))
    if key is None:
        x, y = cost.cluster.devices[a], cost.cluster.devices[b]
        key = memo[(a, b)] = ((x.gpu.id, y.gpu.id) if x.node == y.node else
                              (x.flow_gbps, x.nic_gbps, y.flow_gbps, y.nic_gbps, (cost.p2p_flows or {}).get((a, b))))
    return key


def _pipeline_finish(pipe: Pipeline, cost: CostModel, key: tuple, cache: dict) -> np.ndarray:
    """Each stage's flush, its senders' waits priced (identical pipelines, same ``key``, are priced once). An
    interleaved pipeline is priced per virtual stage (``virtual_stages``): its rows, its receives over the
    wrap-around too."""
    split = pipe.schedule in SPLIT_SCHEDULES
    if (key, pipe.micro_batch_sizes, pipe.schedule) not in cache:
        slots, layers, rc = virtual_stages(pipe)
        per_size = {}
        for x in set(pipe.micro_batch_sizes):
            if (key, x, split) not in cache:
                cache[(key, x, split)] = action_times_s(cost, slots, layers, rc, x) + (
                    weight_times_s(cost, slots, layers, rc, x) if split else ()) + recv_times_s(cost, slots, x)
            per_size[x] = cache[(key, x, split)]
        arrays = [np.stack([per_size[x][k] for x in pipe.micro_batch_sizes], axis=1)
                  for k in range(len(per_size[pipe.micro_batch_sizes[0]]))]
        cache[(key, pipe.micro_batch_sizes, pipe.schedule)] = stage_finish_of(
            pipe.schedule, *arrays[:-2], unsplit=tuple(s.recompute for s in pipe.stages), num_chunks=pipe.num_chunks,
            recv=(arrays[-2], arrays[-1]))
    return cache[(key, pipe.micro_batch_sizes, pipe.schedule)]


def estimate_plan(plan: Plan, cost: CostModel, *, flat_sync: bool = False, detail: bool = True,
                  layout: PlanLayout | None = None) -> Estimate:
    """``detail=False`` leaves ``busy_s`` / ``memory_bytes`` empty (robust pricing needs only the times).
    ``layout``: ``plan_layout`` of a plan with the same stages and blocks (else computed here)."""
    if layout is None:
        layout = plan_layout(plan, cost)
    assert layout.stages == tuple(p.stages for p in plan.pipelines), "a layout of other stages"
    cost = layout.cost
    cache: dict = {}
    arrays = [_pipeline_finish(pipe, cost, key, cache) for pipe, key in zip(plan.pipelines, layout.keys)]
    # Identical pipelines (one key, micro-batches and schedule) share one array: one class, priced once. A key
    # class's pipelines hold the same blocks at the same stages, so every member of a class is free at the
    # same times and the sync below runs per class (``free[(class, stage)]``) with the same result.
    of_array: dict[int, int] = {}
    rows: list[list[float]] = []  # per class: its stages' finishes
    first_of: list[int] = []  # per class: its first pipeline
    of_key: list[list[int]] = [[] for _ in range(max(layout.key_class, default=-1) + 1)]
    cls = []
    for p, f in enumerate(arrays):
        c = of_array.get(id(f))
        if c is None:
            c = of_array[id(f)] = len(rows)
            rows.append(f.tolist())
            first_of.append(p)
            of_key[layout.key_class[p]].append(c)
        cls.append(c)
    class_times = [max(row) for row in rows]
    times = tuple(class_times[c] for c in cls)
    makespan = max(class_times)
    depths = [plan.pipelines[p].depth for p in first_of]
    free = {(c, s): (makespan if flat_sync else row[s]) for c, row in enumerate(rows) for s in range(depths[c])}
    sync_end = makespan

    def members(holders: list[tuple[int, int]]) -> list[tuple[int, int]]:
        return [(c, s) for k, s in holders for c in of_key[k]]

    blocks = [members(h) for h in layout.holders]
    tied_holders, tied_s, durations = members(layout.tied_holders), layout.tied_sync_s, layout.sync_s
    syncs = [(blocks[k], durations[k]) for k in block_sync_order(len(plan.blocks))]
    syncs.append((tied_holders, tied_s))  # the runtime's order: the tied matrix last
    for holders, duration in syncs:
        if duration > 0.0:
            start = max(free[h] for h in holders)
            for h in holders:
                free[h] = start + duration
            sync_end = max(sync_end, start + duration)
    # No rank steps its optimizer before the stats all-gather, which waits for every rank's sync (module docstring).
    stats_end_s = max(free.values()) + layout.stats_s  # a stage is free no earlier than its flush
    opt_max = 0.0
    for c in range(len(rows)):
        pipe = plan.pipelines[first_of[c]]
        for s, stage in enumerate(pipe.stages):
            opt = cost.optimizer_s(stage, first=s == 0, last=s == pipe.depth - 1)  # memoised by the pricing
            opt_max = max(opt_max, opt)
            free[(c, s)] = stats_end_s + opt
    no_sync = makespan + layout.stats_s + opt_max  # with free syncs the barrier is the slowest flush
    busy: dict[int, float] = {}
    memory: dict[int, int] = {}
    for pipe in plan.pipelines if detail else ():
        for s, stage in enumerate(pipe.stages):
            first, last = s == 0, s == pipe.depth - 1
            held = held_of(pipe, s)
            detail_key = ("detail", stage.device, stage.tp, stage.layer_ranges if stage.sublayers != 1 else
                          stage.chunk_layers, stage.recompute, first, last, pipe.micro_batch_sizes, held)  # once
            if detail_key not in cache:
                cache[detail_key] = (
                    stage_bytes(cost, pipe, s, max(pipe.micro_batch_sizes), held),
                    sum(n * sum(cost.stage_compute_s(stage, x, first=first, last=last))  # chunks: the same total
                        for x, n in Counter(pipe.micro_batch_sizes).items()))
            mem, work = cache[detail_key]
            for r in stage.ranks:
                busy[r] = work
                memory[r] = mem
    # Sharded: the all-gathers of the updated shards repeat the reduce phases over the fp32 weights
    # (``CostModel.block_gather_s``: the reduce's own durations unless the gradients were summed in bf16).
    sharded, same = cost.optimizer_holders > 1, cost.grad_bytes == GRAD_BYTES_PER_PARAM
    gathers = (durations if same else cost.block_gather_s(plan)) if sharded else [0.0] * len(durations)
    tied_gather = (tied_s if same else cost.tied_gather_s(plan)) if sharded else 0.0
    iteration = _after_gathers(plan, free, blocks, gathers, tied_holders, tied_gather)
    return Estimate(iteration, makespan, times, max(sync_end - makespan, 0.0), opt_max, busy, memory, no_sync)


def _after_gathers(plan: Plan, free: dict[tuple[int, int], float], holders_of: list[list[tuple[int, int]]],
                   gather_s: list[float], tied_holders: list[tuple[int, int]], tied_gather_s: float) -> float:
    """The iteration's end: each stage's optimizer end, or, sharded, the all-gathers of the updated shards
    after it, in the runtime's order (the sync's reversed: the tied matrix, then blocks ascending)."""
    gathers = [(tied_holders, tied_gather_s)]
    gathers += [(holders_of[k], gather_s[k]) for k in reversed(block_sync_order(len(plan.blocks)))]
    for holders, duration in gathers:
        if duration > 0.0:
            start = max(free[h] for h in holders)
            for h in holders:
                free[h] = start + duration
    return max(free.values())


def estimate_iteration_s(plan: Plan, cost: CostModel, *, flat_sync: bool = False,
                         layout: PlanLayout | None = None) -> float:
    """The planner's closed-form iteration time of any valid plan (the simulator is checked against it)."""
    return estimate_plan(plan, cost, flat_sync=flat_sync, detail=False, layout=layout).iteration_time_s


def ideal_time_s(cost: CostModel, global_batch: int) -> float:
    """docs/design.md §4: model FLOPs of the iteration over the cluster's summed achievable FLOP/s."""
    flops = {t: cost.achievable_flops(t) for t in cost.cluster.gpu_types}  # per type once; summed in rank order
    total = sum(flops[d.gpu.id] for d in cost.cluster.devices)
    return model_train_flops(cost.model, cost.seq_len, global_batch) / total


def full_ideal_time_s(cost: CostModel, global_batch: int) -> float:
    """``ideal_time_s`` over every device of the cluster, the idle ones included (``Cluster.idle_devices``):
    what balance efficiency is measured against, so leaving a device idle shows as a loss."""
    if not cost.cluster.idle_devices:
        return ideal_time_s(cost, global_batch)
    from ethpipe.cluster import cluster_from_dict

    return ideal_time_s(cost.on_cluster(cluster_from_dict(cost.cluster.source)), global_batch)
