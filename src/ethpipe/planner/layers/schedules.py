"""Level 2's schedule choice: every pipeline runs the fastest schedule its memory allows.

The search chooses devices, depths and layer cuts under 1F1B (its closed forms and bounds are what
keeps it fast at thousands of GPUs). Then each pipeline of the search's best few layouts is priced under every
allowed schedule (``ethpipe.schedule.SCHEDULES``) that fits its devices' memory with that schedule's
in-flight micro-batches (zb-h1 holds ``depth`` on every stage, 1F1B ``depth - s``), and level 3 re-splits
the batch over the pipelines' best-of-schedules times: ``min_s T_s(n)`` is non-decreasing in n like each
``T_s``, so the water-filling stays exact. A pipeline then runs the schedule that is fastest at the
samples it got (1F1B on ties). The result is kept only if its predicted iteration (gradient sync
included) is faster, and the fastest of the layouts so re-priced wins (``devices/eth.py``). What this does not do: search for shapes that only win under another schedule
(a deeper pipeline whose 1F1B bubble ruled it out); docs/design.md, "Schedules".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from ethpipe.cost.model import CostModel
from ethpipe.plan import Pipeline, Plan
from ethpipe.planner.estimate import PlanLayout, estimate_iteration_s, plan_layout
from ethpipe.planner.predicted import predicted_metrics
from ethpipe.planner.layers.interleave import try_interleaving
from ethpipe.planner.layers.timing import (
    PipelineTiming, StageSlot, action_times_s, layer_count, split_sizes, timing_of_layers, weight_times_s,
)
from ethpipe.planner.samples.balance import balance_samples
from ethpipe.planner.search.options import options_record
from ethpipe.cost.plan_memory import fits
from ethpipe.schedule import DEFAULT_SCHEDULE, SCHEDULES, SPLIT_SCHEDULES


class BestOfTiming(PipelineTiming):
    """``min`` over several schedules' T(n) of one pipeline shape (each non-decreasing, so is the min)."""

    def __init__(self, timings: Sequence[PipelineTiming]) -> None:
        first = timings[0]
        super().__init__(first.micro_batch, first._action_times, first.granularity)
        self.timings = list(timings)

    def _extend(self, upper: int) -> np.ndarray:
        """Kept until a longer one is asked for: each table only grows at its end (``PipelineTiming._extend``),
        so the min of their prefixes stays what it was."""
        if self._table is None or self._table.size < upper:
            tables = [t._extend(upper) for t in self.timings]
            size = min(t.size for t in tables)
            self._table = np.minimum.reduce([t[:size] for t in tables])
        return self._table

    def _build(self) -> np.ndarray:
        """The min of the tables each schedule builds on its own (``_reaching`` asks before anything is extended;
        the inherited ``_build`` would tabulate the first schedule alone)."""
        if self._table is None:
            self._extend(min(t._build().size for t in self.timings))
        assert self._table is not None
        return self._table

    def finish_s(self, num_samples: int) -> np.ndarray:
        return self.fastest(num_samples).finish_s(num_samples)

    def fastest(self, num_samples: int) -> PipelineTiming:
        return min(self.timings, key=lambda t: (t.time_s(num_samples), t.schedule != DEFAULT_SCHEDULE))


def pipeline_timings(cost: CostModel, pipe: Pipeline, schedules: Sequence[str], granularity: int,
                     memo: dict | None = None, key: tuple | None = None) -> list[PipelineTiming]:
    """The pipeline's T(n) under each schedule that fits its memory. ``memo`` keeps them by ``key`` (what the
    times depend on: ``estimate.PlanLayout.keys``, its links' NIC sharing included) across layouts and
    optimizer-holder counts: a split schedule's table is an exact replay, the dearest part of a re-split."""
    slots = [StageSlot(s.device, s.tp, s.ranks) for s in pipe.stages]
    layers, rc = [layer_count(s) for s in pipe.stages], [s.recompute for s in pipe.stages]
    b = max(pipe.micro_batch_sizes)
    store = memo if memo is not None and key is not None else {}
    fitting = [sch for sch in schedules if fits(cost, pipe, sch)]  # memory: this holder count's own
    for sch in fitting:
        if (key, b, granularity, sch) not in store:
            store[(key, b, granularity, sch)] = timing_of_layers(cost, slots, layers, rc, b, granularity, sch)
    return [store[(key, b, granularity, sch)] for sch in fitting]


def flush_past_under_any(cost: CostModel, shapes: Sequence[tuple[Sequence[StageSlot], Sequence[int], Sequence[bool],
                                                                int, int, float]],
                         global_batch: int, schedules: Sequence[str]) -> bool:
    """True if every split of the batch over these pipeline shapes ((slots, layers, recompute, micro-batch size,
    how many, a time), links as priced by ``cost``) has a pipeline whose flush passes its shape's time under
    each of ``schedules`` (1F1B and the split ones): a lower bound on what ``choose_schedules`` can price them at,
    given each pipeline's micro-batch size as it prices them (the largest of the split it starts from).

    A split schedule runs 1F1B's order of forwards and input-gradient backwards with the W passes added, and
    taking those out of a stage's list only lets the rest start earlier: each pipeline's T(n) is at least 1F1B's
    with every backward shortened by its W (``PipelineTiming``'s closed form, itself below the flush it bounds,
    ``cost/pipeline.py``), and so is 1F1B's own. NIC sharing only slows the plan's links down. Every pipeline
    takes at least one sample, and at most what keeps its flush within its time."""
    if any(s != DEFAULT_SCHEDULE and s not in SPLIT_SCHEDULES for s in schedules):
        return False  # interleaving shortens the bubble otherwise: no claim
    room = 0
    for slots, layers, recompute, micro_batch, count, flush_s in shapes:
        def times(x: int, slots: Sequence[StageSlot] = slots, layers: Sequence[int] = layers,
                  recompute: Sequence[bool] = recompute) -> tuple[np.ndarray, np.ndarray]:
            """Action times of an x-sample micro-batch with each backward's W taken out."""
            fwd, bwd = action_times_s(cost, slots, layers, recompute, x)
            (moved,) = weight_times_s(cost, slots, layers, recompute, x)
            return fwd, bwd - moved
        floor = PipelineTiming(micro_batch, times)
        if floor.time_s(1) > flush_s:
            return True
        room += count * floor.max_samples_within(flush_s, global_batch)
    return room < global_batch


def choose_schedules(plan: Plan, cost: CostModel, schedules: Sequence[str], *,
                     flat_sync: bool = False, timings: dict | None = None) -> tuple[Plan, float]:
    """``plan`` (priced or not) with each pipeline's fastest allowed schedule and the batch re-split for them,
    if that is predicted faster, else ``plan``; and the kept plan's predicted iteration seconds. Interleaving
    (where allowed) is tried last, on the pipelines so chosen (``layers/interleave.py``); eth's search asks for it
    only where zb-h1 is not allowed, and interleaves its final plan (``planner.make_plan``). ``timings``:
    ``pipeline_timings``'s memo."""
    assert schedules and all(s in SCHEDULES for s in schedules)
    layout = plan_layout(plan, cost)  # shared by the re-split's estimate: same stages
    own_s = estimate_iteration_s(plan, cost, flat_sync=flat_sync, layout=layout)
    flat = [s for s in schedules if s != "interleaved"]
    resplit = flat not in ([], [DEFAULT_SCHEDULE]) and all(p.num_chunks == 1 for p in plan.pipelines)
    chosen, chosen_s = _resplit(plan, cost, flat, own_s, flat_sync, layout, timings) if resplit else (plan, own_s)
    if "interleaved" in schedules:
        chosen, chosen_s = try_interleaving(chosen, cost, chosen_s, flat_sync=flat_sync)
    return chosen, chosen_s


def _resplit(plan: Plan, cost: CostModel, schedules: Sequence[str], own_s: float,
             flat_sync: bool, layout: PlanLayout, memo: dict | None = None) -> tuple[Plan, float]:
    """The best-of-schedules re-split of the batch (module docstring), if predicted faster than ``own_s``. A plan
    made to hold equal data per pipeline (``PlannerOptions.balance`` "layers": the ablation of level 3) keeps each
    pipeline's samples and takes only the fastest schedule for them."""
    recorded = options_record(plan)
    whole, equal_data = recorded.get("fine_grained", True) is False, recorded.get("balance") == "layers"
    pcost = layout.cost
    groups: dict[tuple, list[int]] = {}
    timings: list[BestOfTiming] = []
    for p, pipe in enumerate(plan.pipelines):
        key = (layout.keys[p], max(pipe.micro_batch_sizes))  # devices, layers and links: identical timings
        if key not in groups:
            groups[key] = []
            options = pipeline_timings(pcost, pipe, schedules, max(pipe.micro_batch_sizes) if whole else 1,
                                       memo, layout.keys[p])
            if not options:
                return plan, own_s  # the plan's own schedules are the only ones that fit
            timings.append(BestOfTiming(options))
        groups[key].append(p)
    members = list(groups.values())
    samples = ([[plan.pipelines[p].num_samples for p in idx] for idx in members] if equal_data else
               balance_samples(timings, [len(m) for m in members], plan.global_batch_size))
    assert samples is not None, "nothing to give up at"
    pipelines: list[Pipeline] = list(plan.pipelines)
    for timing, idx, row in zip(timings, members, samples):
        for p, n in zip(idx, row):
            pipe = plan.pipelines[p]
            pipelines[p] = Pipeline(pipe.stages, split_sizes(n, max(pipe.micro_batch_sizes)), timing.fastest(n).schedule)
    candidate = dataclasses.replace(plan, pipelines=tuple(pipelines), predicted=None)
    candidate_s = estimate_iteration_s(candidate, cost, flat_sync=flat_sync, layout=layout)
    return (candidate, candidate_s) if candidate_s < own_s else (plan, own_s)


def with_schedules(plan: Plan, cost: CostModel, schedules: Sequence[str], *, flat_sync: bool = False) -> Plan:
    """A priced plan after ``choose_schedules``, re-priced where it changed (a baseline told to use them)."""
    chosen, _ = choose_schedules(plan, cost, schedules, flat_sync=flat_sync)
    if chosen is plan:
        return plan
    old = plan.predicted or {}
    predicted = predicted_metrics(chosen, cost, float(old.get("planning_time_s", 0.0)), flat_sync=flat_sync)
    return dataclasses.replace(chosen, predicted={**old, **predicted})
