"""Level 3: samples -> pipelines (water-filling, docs/design.md §2.1).

Given each pipeline's non-decreasing iteration time ``T_p(n)``, choose integers ``n_p >= 1``
with ``sum n_p = B`` minimising ``max_p T_p(n_p)``. For a makespan bound T each pipeline can
take ``cap_p(T) = max{n : T_p(n) <= T}`` samples; T is feasible iff ``sum cap_p(T) >= B``, so
a bisection on T finds the optimum and the surplus is trimmed from the slowest pipelines.
Identical pipelines share one timing (``counts``), so the cost does not grow with the number
of pipelines. Every pipeline keeps at least one sample: a plan uses every device it lists.
With whole micro-batches only (a timing's ``granularity`` = its micro-batch size) caps and
trimming move in whole micro-batches and every pipeline keeps at least one.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from ethpipe.errors import Infeasible
from ethpipe.planner.layers.timing import PipelineTiming

_BISECTION_STEPS = 100
_RELATIVE_TOLERANCE = 1e-7


def balance_samples(timings: Sequence[PipelineTiming], counts: Sequence[int], total: int,
                    give_up_at_s: float = math.inf) -> list[list[int]] | None:
    """Samples per pipeline, grouped like ``timings`` (group g has ``counts[g]`` identical pipelines).

    None if every split has a pipeline with ``T(n) > give_up_at_s`` (the pipelines cannot take the batch within
    it): a caller that only wants splits under a time is spared the bisection."""
    num_pipes = sum(counts)
    units = [t.granularity for t in timings]
    if total < sum(c * u for c, u in zip(counts, units)):
        raise Infeasible(
            f"global batch {total} is smaller than the {num_pipes} pipelines of this plan need (one sample each): "
            f"use --global-batch >= {num_pipes} or fewer, deeper pipelines"
        )
    if total % math.gcd(*units):  # else the caps below stop short of the batch and too few samples get priced
        raise Infeasible(f"global batch {total} is not a whole number of micro-batches of {math.gcd(*units)} samples: "
                         "use a multiple of the micro-batch size, or sample-level balance")
    lo = max(t.time_s(u) for t, u in zip(timings, units))  # every split's slowest pipeline takes at least this
    if lo > give_up_at_s:
        return None
    hi = max(t.time_s(total - num_pipes + 1) for t in timings)

    def caps(limit: float) -> list[int]:
        return [max(t.max_samples_within(limit, total), u) for t, u in zip(timings, units)]

    if sum(c * n for c, n in zip(counts, caps(lo))) < total:
        if math.isfinite(give_up_at_s) and sum(c * n for c, n in zip(counts, caps(give_up_at_s))) < total:
            return None  # (past it, the bisection below runs as it would without the question)
        for _ in range(_BISECTION_STEPS):
            mid = (lo + hi) / 2
            if sum(c * n for c, n in zip(counts, caps(mid))) >= total:
                hi = mid
            else:
                lo = mid
            if hi - lo <= _RELATIVE_TOLERANCE * hi:
                break
    else:
        hi = lo
    per_group = caps(hi)
    samples = [[per_group[g]] * counts[g] for g in range(len(timings))]
    _trim(timings, samples, sum(c * n for c, n in zip(counts, per_group)) - total)
    assert sum(map(sum, samples)) == total, f"balanced {samples} samples, not the batch of {total}"
    return samples


def _trim(timings: Sequence[PipelineTiming], samples: list[list[int]], excess: int) -> None:
    """Remove ``excess`` samples, a unit at a time, from the currently slowest pipeline (keeping one unit)."""
    units = [t.granularity for t in timings]
    if len(set(units)) == 1 and all(len(set(row)) == 1 for row in samples):
        _trim_blocks(timings, samples, excess, units[0])
        return
    heap = [(-timings[g].time_s(n), g, i) for g, row in enumerate(samples) for i, n in enumerate(row)
            if n > units[g] and units[g] <= excess]
    heapq.heapify(heap)
    while excess > 0:
        assert heap, "whole micro-batches of different sizes cannot add up to the batch"
        _, g, i = heapq.heappop(heap)
        samples[g][i] -= units[g]
        excess -= units[g]
        if samples[g][i] > units[g] and units[g] <= excess:
            heapq.heappush(heap, (-timings[g].time_s(samples[g][i]), g, i))


def _trim_blocks(timings: Sequence[PipelineTiming], samples: list[list[int]], excess: int, unit: int) -> None:
    """``_trim``'s result in one step per run of identical pipelines instead of one per unit (one unit
    size; each group's pipelines start equal). The unit-wise heap trims the slowest pipeline (ties: lowest
    group, then index) until its time drops below its level, then the next: so a group's pipelines at one
    level drop, in index order, to the next lower level, all but the one where the excess runs out."""
    heap = [(-timings[g].time_s(row[0]), g, 0, len(row), row[0]) for g, row in enumerate(samples)
            if row[0] > unit and unit <= excess]
    heapq.heapify(heap)
    while excess > 0:
        assert heap, "whole micro-batches of different sizes cannot add up to the batch"
        neg_t, g, start, count, n = heapq.heappop(heap)  # one run per group: its pipelines are all at n
        below = timings[g].samples_below(-neg_t, n)  # the most samples priced strictly under this level
        m = max(unit, n - -(-(n - below) // unit) * unit)
        full = min(count, excess // (n - m))
        for i in range(start, start + full):
            samples[g][i] = m
        excess -= full * (n - m)
        if full < count:  # the excess runs out inside this pipeline: it stays at its level
            samples[g][start + full] = n - excess
            excess = 0
        elif m > unit and unit <= excess:
            heapq.heappush(heap, (-timings[g].time_s(m), g, start, count, m))


def makespan_s(timings: Sequence[PipelineTiming], samples: Sequence[Sequence[int]]) -> float:
    return max(t.time_s(n) for t, row in zip(timings, samples) for n in row)
