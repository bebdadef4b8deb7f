"""Level 2's interleaving: a pipeline whose stages hold v model chunks each, where that is predicted faster.

Applied to eth's final plan (``with_interleaving``: devices, idle and sharding decided, so allowing it never
gives a slower plan; docs/design.md, "Schedules") and, through ``layers/schedules.choose_schedules``, to each
finalist layout of eth's search where zb-h1 is not allowed (``planner.make_plan``), to a baseline told to use it
and to each robust candidate. This pass re-cuts a chosen pipeline into ``depth * v`` virtual stages that keep it: stage s's ``n_s`` layers
become v chunks of ``n_s // v`` or one more (the larger first), placed Megatron's way (chunk c of stage s
is virtual stage ``c * depth + s``). So every rank computes what it did, fill and drain shrink to about
``1/v`` of 1F1B's, and each chunk boundary is one more message. Its micro-batch count must be at most the
depth or a multiple of it (``schedule.interleaved_fits``): where the pipeline's is not, its samples are
re-split into the next multiple of the depth (smaller micro-batches, as even as they go). Each distinct
pipeline shape is switched to the v of ``CHUNK_COUNTS`` (2, 3 or 4) that makes the whole plan's predicted
iteration (sync included) fastest, if any makes it faster and every stage still fits its memory with the
interleaved schedule's in-flight chunks; what this does not do
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

NUM_CHUNKS = 2  # the default of ``interleaved_of`` / ``why_not_interleaved`` (Megatron's usual choice)
CHUNK_COUNTS = (2, 3, 4)  # tried in turn: more chunks shrink the bubble further for more messages and memory


def why_not_interleaved(pipe: Pipeline, num_chunks: int = NUM_CHUNKS) -> str | None:
    """Why ``pipe`` cannot be re-cut into ``num_chunks`` chunks per stage (None: it can)."""
    depth = pipe.depth
    if depth < 2:
        return "one stage: nothing to interleave"
    if pipe.num_chunks > 1:
        return "already interleaved"
    few = min(s.num_layers for s in pipe.stages)
    if few < num_chunks:
        return f"a stage holds {few} layer, fewer than {num_chunks} chunks"
    count = -(-pipe.num_microbatches // depth) * depth
    if not interleaved_fits(depth, pipe.num_microbatches) and count > pipe.num_samples:
        return (f"{pipe.num_samples} samples cannot fill {count} micro-batches (the schedule runs at most "
                f"{depth} or a multiple of {depth})")
    return None


def interleaved_of(pipe: Pipeline, num_chunks: int = NUM_CHUNKS) -> Pipeline | None:
    """``pipe`` re-cut into ``num_chunks`` chunks per stage with the same layers per rank, or None where it cannot
    be (``why_not_interleaved``: one stage, a stage with fewer layers than chunks, or samples that cannot fill a
    count the schedule runs)."""
    if why_not_interleaved(pipe, num_chunks) is not None:
        return None
    depth = pipe.depth
    sizes = pipe.micro_batch_sizes
    if not interleaved_fits(depth, len(sizes)):
        count = -(-len(sizes) // depth) * depth
        base, extra = divmod(pipe.num_samples, count)
        sizes = tuple(base + (1 if j < extra else 0) for j in range(count))
    per_chunk = [[s.num_layers // num_chunks + (1 if c < s.num_layers % num_chunks else 0) for c in range(num_chunks)]
                 for s in pipe.stages]
    start, ranges = 0, [[(0, 0)] * num_chunks for _ in pipe.stages]
    for c in range(num_chunks):
        for s in range(depth):
            ranges[s][c] = (start, start + per_chunk[s][c])
            start += per_chunk[s][c]
    stages = tuple(Stage(st.ranks, st.device, ranges[s][0], st.tp, st.recompute, tuple(ranges[s]), st.sublayers)
                   for s, st in enumerate(pipe.stages))
    return Pipeline(stages, sizes, "interleaved")


def try_interleaving(plan: Plan, cost: CostModel, plan_s: float, *, flat_sync: bool = False,
                     reasons: dict[int, str] | None = None) -> tuple[Plan, float]:
    """``plan`` with each distinct pipeline shape interleaved where that is predicted faster and fits memory
    (module docstring), and its predicted iteration seconds (``plan_s``: ``plan``'s). ``reasons``, if given,
    gets why each pipeline that stays as it was stays (by pipeline index)."""
    if plan.sublayers != 1:  # chunks of whole layers only: a layer split between two chunks of a stage cannot run
        if reasons is not None:
            reasons.update(dict.fromkeys(range(len(plan.pipelines)), "its stages end inside layers"))
        return plan, plan_s
    shapes: dict[tuple, list[int]] = {}
    for p, pipe in enumerate(plan.pipelines):
        shapes.setdefault((tuple((s.device, s.tp, s.num_layers, s.recompute) for s in pipe.stages),
                           pipe.micro_batch_sizes, pipe.schedule), []).append(p)
    for members in shapes.values():
        if plan.pipelines[members[0]].num_chunks > 1:  # interleaved by the search already
            continue
        base, memory, slower, other = plan, [], [], []
        fewest = min(s.num_layers for s in plan.pipelines[members[0]].stages)
        for num_chunks in CHUNK_COUNTS:  # the fastest that fits wins; each count is priced against the best so far
            switched = _switched(base, cost, members, num_chunks)
            if switched is None:
                memory.append(num_chunks)
                continue
            if isinstance(switched, str):
                other.append(switched)
                if fewest < num_chunks:  # too few layers for this count, and so for every larger one
                    break
                continue
            trial = dataclasses.replace(base, pipelines=switched, blocks=compute_blocks(switched), predicted=None)
            trial_s = estimate_iteration_s(trial, cost, flat_sync=flat_sync)
            if trial_s < plan_s:
                plan, plan_s = trial, trial_s
            else:
                slower.append((num_chunks, trial_s))
        if plan.pipelines[members[0]].num_chunks == 1 and reasons is not None:
            reasons.update(dict.fromkeys(members, _why_kept(memory, slower, other, plan_s)))
    return plan, plan_s


def _why_kept(memory: list[int], slower: list[tuple[int, float]], other: list[str], plan_s: float) -> str:
    """Why a pipeline shape kept its schedule, over the chunk counts tried: each kind of reason once."""
    parts = list(dict.fromkeys(other))
    if slower:
        counts = " / ".join(str(v) for v, _ in slower)
        times = " / ".join(f"{t:.4g}" for _, t in slower)
        parts.insert(0, f"not faster: with {counts} chunks the plan would take {times} s, not {plan_s:.4g} s")
    if memory:
        counts = ", ".join(str(v) for v in memory)
        parts.append(f"its stages would not fit memory with {counts} interleaved chunks in flight")
    return "; ".join(parts)


def _switched(plan: Plan, cost: CostModel, members: list[int], num_chunks: int) -> tuple[Pipeline, ...] | str | None:
    """The plan's pipelines with ``members`` (one shape, differing in ranks only) re-cut into ``num_chunks``
    chunks, why they cannot be, or None where they would not fit memory (one check: memory does not depend on
    ranks)."""
    switched = list(plan.pipelines)
    for p in members:
        candidate = interleaved_of(plan.pipelines[p], num_chunks)
        if candidate is None:
            why = why_not_interleaved(plan.pipelines[p], num_chunks)
            assert why is not None
            return why
        if p == members[0] and not fits(cost, candidate, "interleaved"):
            return None
        switched[p] = candidate
    return tuple(switched)


def with_interleaving(plan: Plan, cost: CostModel, *, flat_sync: bool = False) -> Plan:
    """A priced plan after ``try_interleaving``, re-priced where it changed (its planning time included)."""
    started = time.perf_counter()
    reasons: dict[int, str] = {}
    chosen, _ = try_interleaving(plan, cost, float(plan.predicted["iteration_time_s"]), flat_sync=flat_sync,
                                 reasons=reasons)
    chosen = _with_reasons(chosen, reasons)
    if chosen.pipelines == plan.pipelines:
        return chosen
    old = plan.predicted or {}
    planning_s = float(old.get("planning_time_s", 0.0)) + time.perf_counter() - started
    return dataclasses.replace(chosen, predicted={**old, **predicted_metrics(chosen, cost, planning_s, flat_sync=flat_sync)})


def _with_reasons(plan: Plan, reasons: dict[int, str]) -> Plan:
    """The plan with why each pipeline kept its schedule in ``search.kept_schedule`` (``ethpipe plan`` prints it)."""
    if not reasons:
        return plan
    by_reason: dict[str, list[int]] = {}
    for p, why in sorted(reasons.items()):
        by_reason.setdefault(why, []).append(p)
    kept = [{"pipelines": ps, "schedule": plan.pipelines[ps[0]].schedule, "reason": why} for why, ps in by_reason.items()]
    search = {**(plan.extra.get("search") or {}), "kept_schedule": kept}
    return dataclasses.replace(plan, extra={**plan.extra, "search": search})
