"""Level 2's sub-layer cuts: a stage may end between a layer's attention and its MLP (``ethpipe.sublayers``).

Whole layers are coarse where a stage holds few of them: at one sample per GPU a pipeline of 16 two-layer stages
balances its stages' compute to within a whole layer of 2 (the last stage's head counting as a layer or two),
so its slowest stage runs up to a quarter longer than the mean. Applied to eth's final plan (devices, shapes,
micro-batches, schedules, sharding, idle devices and interleaving decided: ``planner.make_plan``). Applied
inside the search instead (each layout's final price, before the sharding and idle comparisons), it changed
which plan reached the interleaving pass: llama2-13b on 32 V100-32 at 64 samples kept an unsharded plan cut in
half layers at 16.30 s where the sharded one, interleaved, prices 15.08 s.

The plan's cut points (the union of every pipeline's stage boundaries: its gradient blocks' edges) move together,
each by at most ``WINDOW`` half layers: a cut that pipelines share stays shared, so the blocks keep their number
and their holders. Moving one pipeline's cut alone would split a block whose holders then sync it in pieces, each
piece waiting for holders still busy with another (measured: planner_random plans re-cut pipeline by pipeline
priced up to 2.6x slower, their sync exposed 0.8 -> 4.6 s). The cuts minimise the largest ratio of a stage's
compute (fwd + bwd of one micro-batch, its embedding or head included: ``CostModel.half_layer_times_s``) to its
pipeline's slowest stage in whole layers; the plan so re-cut is kept if every stage still fits its memory and the
whole plan (sync included) is predicted faster, with the batch re-split for the new stage times where that is
faster still (level 3, each pipeline's micro-batch size and schedule kept). Interleaved pipelines keep their cuts,
which also pins the cuts they share.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

from ethpipe.cost.model import CostModel
from ethpipe.cost.plan_memory import held_at_most
from ethpipe.plan import Pipeline, Plan, compute_blocks
from ethpipe.plan_parts import in_half_layers
from ethpipe.planner.estimate import Estimate, PlanLayout, estimate_iteration_s, estimate_plan, plan_layout
from ethpipe.planner.predicted import predicted_metrics
from ethpipe.planner.robust import resplit
from ethpipe.planner.search.options import options_record
from ethpipe.sublayers import attention_units

# A re-cut plan must be predicted faster than this fraction of the whole-layer plan's time (a gain within rounding
# is not worth a plan in a finer unit).
MIN_GAIN = 1e-6
WINDOW = 2  # half layers a cut may move each way: one layer
BISECTION_STEPS = 40  # the limit to about 1e-12 of its range
MIN_BOTTLENECK_GAIN = 0.01  # half layers must shorten some pipeline's slowest stage by this much to be priced


def _unit_costs(cost: CostModel, pipe: Pipeline) -> list[tuple[float, float, float, float]]:
    """Per stage (ends, attention half, MLP half, less for an attention half that ends the stage) seconds of one
    micro-batch's forward and backward."""
    b, depth = max(pipe.micro_batch_sizes), pipe.depth
    out = []
    for s, st in enumerate(pipe.stages):
        (af, ab), (mf, mb) = cost.half_layer_times_s(st.device, b, st.tp, st.recompute)
        ef, eb = cost.end_times_s(st.device, b, st.tp, first=s == 0, last=s == depth - 1)
        out.append((ef + eb, af + ab, mf + mb, cost.lone_attention_saving_s(st.device, b, st.tp, st.recompute)))
    return out


def _stage_s(costs: tuple[float, float, float, float], lo: int, hi: int) -> float:
    ends, attn, mlp, lone_saving = costs
    num_attn = attention_units(lo, hi, 2)
    return ends + num_attn * attn + (hi - lo - num_attn) * mlp - (hi % 2) * lone_saving


@dataclasses.dataclass(frozen=True)
class _Ending:
    """A stage that ends at a cut: its costs, its pipeline's whole-layer bottleneck, the cut it starts at, and
    whether it fits its device's memory holding a unit range (memoised)."""

    costs: tuple[float, float, float, float]
    scale_s: float
    start: int  # index of its first cut, -1 for unit 0
    fits: Callable[[int, int], bool]

    def within(self, placed: Sequence[int], end: int, limit: float) -> bool:
        lo = placed[self.start] if self.start >= 0 else 0
        return _stage_s(self.costs, lo, end) <= limit * self.scale_s and self.fits(lo, end)


@dataclasses.dataclass(frozen=True)
class _Cuts:
    """The plan's cut points (ascending units), the stages ending at each (``tail``: at the last unit), and the
    cuts that stay (an interleaved pipeline's)."""

    cuts: Sequence[int]
    endings: Sequence[Sequence[_Ending]]
    tail: Sequence[_Ending]
    fixed: Sequence[bool]
    num_units: int

    def window(self, j: int, placed: Sequence[int]) -> range:
        """Where cut j may go: within ``WINDOW`` of it, after the cut before it as placed and before the next cut
        as it is (so the cuts as they are stay reachable: no cut crowds a later one out of its window)."""
        cut = self.cuts[j]
        after = placed[-1] + 1 if placed else 1
        if self.fixed[j]:
            return range(cut, cut + 1) if after <= cut else range(0)
        before = self.cuts[j + 1] - 1 if j + 1 < len(self.cuts) else self.num_units - 1
        return range(max(cut - WINDOW, after), min(cut + WINDOW, before) + 1)

    def completion(self, placed: list[int], limit: float) -> list[int] | None:
        """``placed`` (the first cuts' positions) completed with every stage within ``limit`` x its pipeline's
        scale and its memory, each later cut as far right as its ending stages allow (a stage starting later is
        never slower); None where there is none."""
        placed = list(placed)
        for j in range(len(placed), len(self.cuts)):
            pos = next((p for p in reversed(self.window(j, placed))
                        if all(e.within(placed, p, limit) for e in self.endings[j])), None)
            if pos is None:
                return None
            placed.append(pos)
        return placed if all(e.within(placed, self.num_units, limit) for e in self.tail) else None

    def nearest(self, limit: float) -> list[int] | None:
        """A placement within ``limit`` that moves each cut as little as the cuts before it allow (so the
        whole-layer split's own balance, which level 2 chose, stays wherever half layers do not improve it)."""
        placed: list[int] = []
        for j, cut in enumerate(self.cuts):
            for pos in sorted(self.window(j, placed), key=lambda p: (abs(p - cut), p)):
                if (all(e.within(placed, pos, limit) for e in self.endings[j])
                        and self.completion(placed + [pos], limit) is not None):
                    placed.append(pos)
                    break
            else:
                return None
        return placed


def _memory_check(cost: CostModel, pipe: Pipeline, s: int) -> Callable[[int, int], bool]:
    """Whether stage ``s`` of ``pipe`` fits its device's memory holding units [lo, hi) (memoised), at any split of
    the batch (``plan_memory.held_at_most``: what level 2 checks, so a ``--rebalance`` cannot run it out)."""
    b, held, usable = max(pipe.micro_batch_sizes), held_at_most(pipe, s), cost.usable_memory_bytes(pipe.stages[s].device)

    @functools.lru_cache(maxsize=None)
    def fits(lo: int, hi: int) -> bool:
        stage = dataclasses.replace(pipe.stages[s], layers=(lo, hi))
        return cost.stage_memory_bytes(stage, b, held.in_flight, first=s == 0, last=s == pipe.depth - 1,
                                       pending_weights=held.pending_weights, stashed_inputs=held.stashed_inputs,
                                       live_heads=held.live_heads) <= usable
    return fits


def shared_cuts(cost: CostModel, pipes: Sequence[Pipeline], num_units: int) -> dict[int, int]:
    """Where each of the pipelines' cut points (units) moves: the least limit (bisected) with a placement, then
    the placement within it nearest the cuts as they are (``_Cuts.nearest``)."""
    cuts = sorted({hi for p in pipes for st in p.stages for _, hi in st.layer_ranges if hi < num_units})
    index = {c: j for j, c in enumerate(cuts)}
    endings: list[list[_Ending]] = [[] for _ in cuts]
    tail: list[_Ending] = []
    fixed = [False] * len(cuts)
    for pipe in pipes:
        if pipe.num_chunks > 1:
            for st in pipe.stages:
                for c in (c for rng in st.layer_ranges for c in rng if c in index):
                    fixed[index[c]] = True
            continue
        per_stage = _unit_costs(cost, pipe)
        scale_s = max(_stage_s(c, *st.layers) for c, st in zip(per_stage, pipe.stages))
        for s, (c, st) in enumerate(zip(per_stage, pipe.stages)):
            lo, hi = st.layers
            ending = _Ending(c, scale_s, index[lo] if lo > 0 else -1, _memory_check(cost, pipe, s))
            (tail if hi == num_units else endings[index[hi]]).append(ending)
    problem = _Cuts(cuts, endings, tail, fixed, num_units)
    low, high = 0.0, 1.0  # at 1 every pipeline's slowest stage is its scale
    if problem.completion([], high) is None:
        return {}  # the cuts as they are may not fit memory at every batch split as a half-layer stage counts it
    for _ in range(BISECTION_STEPS):
        mid = (low + high) / 2
        if problem.completion([], mid) is None:
            low = mid
        else:
            high = mid
    if high > 1 - MIN_BOTTLENECK_GAIN:
        return {}
    placed = problem.nearest(high)
    assert placed is not None, "the bisection keeps a limit with a placement"
    return dict(zip(cuts, placed))


def _moved(pipe: Pipeline, moves: dict[int, int]) -> Pipeline:
    if pipe.num_chunks > 1:
        return pipe
    stages = tuple(dataclasses.replace(st, layers=(moves.get(st.layers[0], st.layers[0]),
                                                   moves.get(st.layers[1], st.layers[1])))
                   for st in pipe.stages)
    return Pipeline(stages, pipe.micro_batch_sizes, pipe.schedule)


def _resplit_if_faster(plan: Plan, cost: CostModel, flat_sync: bool, layout: PlanLayout) -> Plan:
    """The re-cut plan with its batch re-split by level 3 for its new stage times (``robust.resplit``: each
    pipeline keeps its micro-batch size and schedule), where that is predicted faster: a pipeline whose slowest stage
    shortened then takes more samples instead of waiting for the others. Memory holds at any split (the cuts were
    checked with ``held_at_most``). Not for a plan made to hold equal data per pipeline (``PlannerOptions.balance``
    "layers"). ``layout``: ``plan``'s (the re-split keeps its stages)."""
    if len(plan.pipelines) < 2 or options_record(plan).get("balance") == "layers":
        return plan
    split = resplit(plan, cost)
    if all(a.micro_batch_sizes == b.micro_batch_sizes for a, b in zip(split.pipelines, plan.pipelines)):
        return plan
    own_s = estimate_iteration_s(plan, cost, flat_sync=flat_sync, layout=layout)
    return split if estimate_iteration_s(split, cost, flat_sync=flat_sync, layout=layout) < own_s else plan


def try_sublayer_cuts(plan: Plan, cost: CostModel, plan_s: float, *, flat_sync: bool = False
                      ) -> tuple[Plan, Estimate | None, str]:
    """``plan`` re-cut in half layers where that is predicted faster (module docstring) with its detailed estimate,
    or ``plan`` (predicted ``plan_s``), None and why it stays as it is."""
    if plan.sublayers != 1:
        return plan, None, "already in half layers"
    halves = in_half_layers(plan.pipelines)
    shapes: dict[tuple, Pipeline] = {}
    for pipe in halves:  # identical pipelines but for their ranks: priced once
        shapes.setdefault((tuple((s.device, s.tp, s.recompute, s.layer_ranges) for s in pipe.stages),
                           pipe.micro_batch_sizes, pipe.schedule), pipe)
    moves = shared_cuts(cost, list(shapes.values()), plan.num_layers * 2)
    if all(old == new for old, new in moves.items()):
        return plan, None, "whole layers balance best (within memory)"
    pipelines = tuple(_moved(p, moves) for p in halves)
    cut = dataclasses.replace(plan, pipelines=pipelines, blocks=compute_blocks(pipelines), predicted=None)
    layout = plan_layout(cut, cost)  # what pricing takes from the stages alone: shared by every estimate here
    trial = _resplit_if_faster(cut, cost, flat_sync, layout)
    est = estimate_plan(trial, cost, flat_sync=flat_sync, layout=layout)
    if est.iteration_time_s < plan_s * (1 - MIN_GAIN):
        return trial, est, ""
    return plan, None, f"not faster: {est.iteration_time_s:.4g} s in half layers, {plan_s:.4g} s in whole ones"


def with_sublayer_cuts(plan: Plan, cost: CostModel, *, flat_sync: bool = False) -> Plan:
    """A priced plan after ``try_sublayer_cuts``, re-priced where it changed (its planning time included); the plan
    records what was tried (``search.sublayer_cuts``: kept or not, why not, the predicted seconds in whole and in
    half layers)."""
    started = time.perf_counter()
    whole_s = float(plan.predicted["iteration_time_s"])
    chosen, est, why = try_sublayer_cuts(plan, cost, whole_s, flat_sync=flat_sync)
    record: dict = {"kept": est is not None, "whole_layers_s": whole_s}
    record.update({"half_layers_s": est.iteration_time_s,
                   "batch_resplit": any(a.num_samples != b.num_samples for a, b in zip(chosen.pipelines, plan.pipelines))}
                  if est is not None else {"why_not": why})
    old = plan.predicted or {}
    planning_s = float(old.get("planning_time_s", 0.0)) + time.perf_counter() - started
    predicted = ({**old, **predicted_metrics(chosen, cost, planning_s, flat_sync=flat_sync, est=est)}
                 if est is not None else {**old, "planning_time_s": planning_s})
    search = {**(chosen.extra.get("search") or {}), "sublayer_cuts": record}
    return dataclasses.replace(chosen, predicted=predicted, extra={**chosen.extra, "search": search})
