"""Closed-form iteration time of ANY valid plan, with block-wise gradient sync (DESIGN 2.2).

Per pipeline: the 1F1B critical path of ``timing.py``. Each stage's last backward ends
``drain`` seconds before its pipeline's flush; then every stage all-reduces its blocks in
ascending block order (the global order that keeps overlapping groups deadlock-free). A
block's all-reduce starts when all its holders are free, holders stay busy until it ends,
and each stage runs its optimizer step after its last block. Collectives that cross nodes at
the same time share the NIC: a stage syncs its blocks one after another, so a node runs at
most one collective per syncing rank at a time (one per stage and TP shard; pipelines on the
same node are reduced inside it first). A collective therefore gets the NIC divided by
(the node's ranks in cross-node block groups / this group's ranks on the node), for its
busiest node. With TP each shard syncs bytes / tp.
"""

from __future__ import annotations

from dataclasses import dataclass

from ethpipe.cost.compute import model_train_flops
from ethpipe.cost.model import CostModel
from ethpipe.plan import Plan
from ethpipe.planner.timing import StageSlot, stage_times_s


@dataclass(frozen=True)
class Estimate:
    iteration_time_s: float
    makespan_s: float  # slowest pipeline's flush
    pipeline_times_s: tuple[float, ...]
    grad_sync_exposed_s: float  # block all-reduce time after the makespan
    optimizer_s: float  # slowest optimizer step
    busy_s: dict[int, float]  # per rank: compute seconds in the iteration
    memory_bytes: dict[int, int]  # per rank: peak bytes


def _pipeline_parts(plan: Plan, cost: CostModel, p: int, cache: dict) -> tuple[float, list[float], list[float]]:
    """(T_p, ready time of each stage's gradients, compute-busy seconds of each stage)."""
    pipe = plan.pipelines[p]
    slots = [StageSlot(s.device, s.tp, s.ranks) for s in pipe.stages]
    layers = [s.num_layers for s in pipe.stages]
    rc = [s.recompute for s in pipe.stages]
    links = tuple((cost.cluster.link_gbps(a.ranks[0], b.ranks[0]), cost.cluster.link_latency_s(a.ranks[0], b.ranks[0]))
                  for a, b in zip(slots, slots[1:]))
    key = (tuple((s.device, s.tp, s.num_layers, s.recompute) for s in pipe.stages), links)
    per_size: dict[int, tuple[list[float], list[float]]] = {}
    for x in set(pipe.micro_batch_sizes):
        if (key, x) not in cache:
            cache[(key, x)] = stage_times_s(cost, slots, layers, rc, x)
        per_size[x] = cache[(key, x)]
    sums = {x: sum(t) for x, (t, _) in per_size.items()}
    maxes = {x: max(t) for x, (t, _) in per_size.items()}
    total = sum(maxes[x] for x in pipe.micro_batch_sizes) + max(sums[x] - maxes[x] for x in per_size)
    last_drains = per_size[pipe.micro_batch_sizes[-1]][1]
    ready, acc = [], 0.0
    for d in last_drains:
        ready.append(total - acc)
        acc += d
    busy = []
    for i, stage in enumerate(pipe.stages):
        first, last = i == 0, i == pipe.depth - 1
        busy.append(sum(sum(cost.stage_compute_s(stage, x, first=first, last=last)) for x in pipe.micro_batch_sizes))
    return total, ready, busy


def estimate_plan(plan: Plan, cost: CostModel) -> Estimate:
    cache: dict = {}
    parts = [_pipeline_parts(plan, cost, p, cache) for p in range(len(plan.pipelines))]
    times = tuple(t for t, _, _ in parts)
    makespan = max(times)
    free = {(p, s): parts[p][1][s] for p, pipe in enumerate(plan.pipelines) for s in range(pipe.depth)}
    holders_of = []
    for block in plan.blocks:
        holders = []
        for p, pipe in enumerate(plan.pipelines):
            s = next(i for i, st in enumerate(pipe.stages) if st.layers[0] <= block.layers[0] < st.layers[1])
            holders.append((p, s))
        holders_of.append(holders)
    num_layers = plan.num_layers
    groups = []
    syncing: dict[int, set[int]] = {}  # node -> its ranks that take part in a cross-node block group
    for block, holders in zip(plan.blocks, holders_of):
        stages = [plan.pipelines[p].stages[s] for p, s in holders]
        ranks = [st.ranks[0] for st in stages]
        num_bytes = cost.block_grad_bytes(block, first=block.layers[0] == 0, last=block.layers[1] == num_layers)
        if len({cost.cluster.devices[r].node for r in ranks}) > 1:
            for st in stages:
                for r in st.ranks:
                    syncing.setdefault(cost.cluster.devices[r].node, set()).add(r)
        groups.append((ranks, num_bytes / min(st.tp for st in stages)))
    sync_end = makespan
    for holders, (ranks, shard_bytes) in zip(holders_of, groups):
        if len(ranks) > 1:
            here: dict[int, int] = {}
            for r in ranks:
                node = cost.cluster.devices[r].node
                here[node] = here.get(node, 0) + 1
            share = max(len(syncing.get(n, ())) / count for n, count in here.items()) if len(here) > 1 else 1.0
            duration = cost.allreduce_s(ranks, int(shard_bytes), nic_share=max(share, 1.0))
            start = max(free[h] for h in holders)
            for h in holders:
                free[h] = start + duration
            sync_end = max(sync_end, start + duration)
    iteration, opt_max = 0.0, 0.0
    busy: dict[int, float] = {}
    memory: dict[int, int] = {}
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            first, last = s == 0, s == pipe.depth - 1
            opt = cost.optimizer_s(stage, first=first, last=last)
            opt_max = max(opt_max, opt)
            iteration = max(iteration, free[(p, s)] + opt)
            in_flight = min(pipe.depth - s, pipe.num_microbatches)
            mem = cost.stage_memory_bytes(stage, max(pipe.micro_batch_sizes), in_flight, first=first, last=last)
            for r in stage.ranks:
                busy[r] = parts[p][2][s]
                memory[r] = mem
    return Estimate(iteration, makespan, times, max(sync_end - makespan, 0.0), opt_max, busy, memory)


def estimate_iteration_s(plan: Plan, cost: CostModel) -> float:
    """The planner's closed-form iteration time of any valid plan (the simulator is checked against it)."""
    return estimate_plan(plan, cost).iteration_time_s


def ideal_time_s(cost: CostModel, global_batch: int) -> float:
    """DESIGN section 4: model FLOPs of the iteration over the cluster's summed achievable FLOP/s."""
    total = sum(cost.achievable_flops(d.gpu.id) for d in cost.cluster.devices)
    return model_train_flops(cost.model, cost.seq_len, global_batch) / total


def predicted_metrics(plan: Plan, cost: CostModel, planning_time_s: float) -> dict:
    """What `ethpipe plan` writes under ``predicted``: times, throughput, efficiency, per device."""
    est = estimate_plan(plan, cost)
    it = est.iteration_time_s
    ideal = ideal_time_s(cost, plan.global_batch_size)
    flops = model_train_flops(cost.model, cost.seq_len, plan.global_batch_size)
    peak = sum(d.gpu.peak_tflops * 1e12 for d in cost.cluster.devices)
    devices = [
        {"rank": r, "device": cost.cluster.devices[r].gpu.id, "memory_bytes": est.memory_bytes[r],
         "memory_capacity_bytes": cost.gpu(cost.cluster.devices[r].gpu.id).memory_bytes,
         "busy_fraction": round(est.busy_s[r] / it, 6)}
        for r in sorted(est.memory_bytes)
    ]
    return {
        "iteration_time_s": it,
        "tokens_per_s": plan.global_batch_size * plan.seq_len / it,
        "samples_per_s": plan.global_batch_size / it,
        "balance_efficiency": ideal / it,
        "ideal_time_s": ideal,
        "mfu": flops / (it * peak),
        "makespan_s": est.makespan_s,
        "pipeline_times_s": list(est.pipeline_times_s),
        "grad_sync_exposed_s": est.grad_sync_exposed_s,
        "optimizer_s": est.optimizer_s,
        "planning_time_s": planning_time_s,
        "devices": devices,
    }
