"""Level 2's interleaving: a pipeline whose stages hold v model chunks each, where that is predicted faster.

Applied to eth's final plan (``with_interleaving``: devices, idle and sharding decided, so allowing it never
gives a slower plan; docs/design.md, "Schedules") and, through ``layers/schedules.choose_schedules``, to a
baseline told to use it and to each robust candidate. This pass re-cuts a chosen pipeline into ``depth * v`` virtual stages that keep it: stage s's ``n_s`` layers
become v chunks of ``n_s // v`` or one more (the larger first), placed Megatron's way (chunk c of stage s
is virtual stage ``c * depth + s``). So every rank computes what it did, fill and drain shrink to about
``1/v`` of 1F1B's, and each chunk boundary is one more message. Its micro-batch count must be at most the
depth or a multiple of it (``schedule.interleaved_fits``): where the pipeline's is not, its samples are
re-split into the next multiple of the depth (smaller micro-batches, as even as they go). Each distinct
pipeline shape is switched only if the whole plan's predicted iteration (sync included) gets faster and
every stage still fits its memory with the interleaved schedule's in-flight chunks; what this does not do
is re-balance the batch for interleaved times (docs/design.md, "Schedules").
"""

from __future__ import annotations

import dataclasses
import time

from ethpipe.cost.model import CostModel
from ethpipe.cost.plan_memory import fits
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.planner.estimate import estimate_iteration_s
from ethpipe.planner.predicted import predicted_metrics
from ethpipe.schedule import interleaved_fits

NUM_CHUNKS = 2  # Megatron's usual choice: most of the bubble gain, half the extra messages of 3 or 4


def interleaved_of(pipe: Pipeline, num_chunks: int = NUM_CHUNKS) -> Pipeline | None:
    """``pipe`` re-cut into ``num_chunks`` chunks per stage with the same layers per rank, or None where a
    stage has fewer layers than chunks, the pipeline has one stage, or its samples cannot fill a count the
    schedule runs."""
    depth = pipe.depth
    if depth < 2 or pipe.num_chunks > 1 or any(s.num_layers < num_chunks for s in pipe.stages):
        return None
    sizes = pipe.micro_batch_sizes
    if not interleaved_fits(depth, len(sizes)):
        count = -(-len(sizes) // depth) * depth
        if count > pipe.num_samples:
            return None
        base, extra = divmod(pipe.num_samples, count)
        sizes = tuple(base + (1 if j < extra else 0) for j in range(count))
    per_chunk = [[s.num_layers // num_chunks + (1 if c < s.num_layers % num_chunks else 0) for c in range(num_chunks)]
                 for s in pipe.stages]
    start, ranges = 0, [[(0, 0)] * num_chunks for _ in pipe.stages]
    for c in range(num_chunks):
        for s in range(depth):
            ranges[s][c] = (start, start + per_chunk[s][c])
            start += per_chunk[s][c]
    stages = tuple(Stage(st.ranks, st.device, ranges[s][0], st.tp, st.recompute, tuple(ranges[s]))
                   for s, st in enumerate(pipe.stages))
    return Pipeline(stages, sizes, "interleaved")


def try_interleaving(plan: Plan, cost: CostModel, plan_s: float, *, flat_sync: bool = False) -> tuple[Plan, float]:
    """``plan`` with each distinct pipeline shape interleaved where that is predicted faster and fits memory
    (module docstring), and its predicted iteration seconds (``plan_s``: ``plan``'s)."""
    shapes: dict[tuple, list[int]] = {}
    for p, pipe in enumerate(plan.pipelines):
        shapes.setdefault((tuple((s.device, s.tp, s.num_layers, s.recompute) for s in pipe.stages),
                           pipe.micro_batch_sizes, pipe.schedule), []).append(p)
    for members in shapes.values():
        switched = list(plan.pipelines)
        for p in members:  # they differ in ranks only, which memory does not depend on: one memory check
            candidate = interleaved_of(plan.pipelines[p])
            if candidate is None or (p == members[0] and not fits(cost, candidate, "interleaved")):
                break
            switched[p] = candidate
        else:
            pipes = tuple(switched)
            trial = dataclasses.replace(plan, pipelines=pipes, blocks=compute_blocks(pipes), predicted=None)
            trial_s = estimate_iteration_s(trial, cost, flat_sync=flat_sync)
            if trial_s < plan_s:
                plan, plan_s = trial, trial_s
    return plan, plan_s


def with_interleaving(plan: Plan, cost: CostModel, *, flat_sync: bool = False) -> Plan:
    """A priced plan after ``try_interleaving``, re-priced where it changed (its planning time included)."""
    started = time.perf_counter()
    chosen, _ = try_interleaving(plan, cost, float(plan.predicted["iteration_time_s"]), flat_sync=flat_sync)
    if chosen is plan:
        return plan
    old = plan.predicted or {}
    planning_s = float(old.get("planning_time_s", 0.0)) + time.perf_counter() - started
    return dataclasses.replace(chosen, predicted={**old, **predicted_metrics(chosen, cost, planning_s, flat_sync=flat_sync)})
