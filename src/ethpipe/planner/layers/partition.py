"""Level 2: layers -> stages inside one pipeline (docs/design.md §2.1).

All decoder blocks are identical, so a stage's time and memory are linear in its number of
layers: ``fixed + k * per_layer`` (the fixed part holds the embedding on the first stage, the
norm + head on the last, and the p2p transfers). Minimising the bottleneck is then exact: the
least threshold under which a greedy feasibility check (take as many layers as fit under it,
leaving one per remaining stage) finds a split, found directly from the stages' k-layer times
(``_least_feasible_threshold_s``); the greedy prefix dominates every feasible partition's prefix,
so it fails only if none exists. ``flush_lower_bound_s`` bounds the 1F1B flush of the split
returned here without computing it (the planner's searches prune with it).
Each stage may have several options (with / without activation recomputation); it takes the
cheapest option that holds its layers.

Tie-break. The greedy alone fills early stages up to the bottleneck and leaves one layer on
the rest: every loaded stage is then critical (any slowdown of it is a slowdown of the whole
pipeline) and the early stages, which keep the most micro-batches in flight, carry the most
layers. Among the splits with the optimal bottleneck we therefore return one minimising the
sum of squared stage times, found exactly by a DP over (stage, layers so far) restricted to
stage times within the bottleneck. Why that criterion: it is additive over stages (so the DP
is exact and a few numpy passes of ``depth x layers^2``), strictly Schur-convex (of two splits
with the same total it prefers the more even one, so slack is spread over all non-bottleneck
stages instead of piled on one), and it also penalises recomputation, which makes a stage
slower. The bottleneck is never worse than the greedy's (checked; the greedy split is kept
otherwise). On homogeneous pipelines the sum of stage times, hence the 1F1B fill and drain,
is unchanged; on mixed ones it may move a layer to a slower stage, which the level-1 pricing
of the resulting timing sees.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class StageOption(NamedTuple):
    """One way to run a stage: time ``fixed_s + k * per_layer_s`` for k layers, at most ``max_layers``.
    A named tuple rather than a frozen dataclass: the planner keys memos on whole pipelines of options, and a
    tuple hashes and compares in C (a dataclass's ``__hash__`` runs in Python for every option)."""

    fixed_s: float
    per_layer_s: float
    max_layers: int  # memory-feasible layer count; < 1 means the option holds nothing
    recompute: bool = False

    def time_s(self, num_layers: int) -> float:
        return self.fixed_s + num_layers * self.per_layer_s

    def layers_within(self, threshold_s: float) -> int:
        if self.per_layer_s <= 0:
            return self.max_layers if self.fixed_s <= threshold_s else 0
        k = math.floor((threshold_s - self.fixed_s) / self.per_layer_s * (1 + 1e-12) + 1e-12)
        return min(k, self.max_layers)


@dataclass(frozen=True)
class Partition:
    num_layers: tuple[int, ...]  # per stage
    recompute: tuple[bool, ...]
    bottleneck_s: float

    def ranges(self) -> tuple[tuple[int, int], ...]:
        out, lo = [], 0
        for k in self.num_layers:
            out.append((lo, lo + k))
            lo += k
        return tuple(out)


def _choose(options: Sequence[StageOption], k: int) -> StageOption:
    fitting = [o for o in options if o.max_layers >= k]
    return min(fitting, key=lambda o: (o.time_s(k), o.recompute))


def _greedy(stages: Sequence[Sequence[StageOption]], total: int, threshold_s: float) -> list[int] | None:
    depth, remaining, counts = len(stages), total, []
    for i, options in enumerate(stages):
        cap = max(o.layers_within(threshold_s) for o in options)
        if i == depth - 1:
            if remaining > cap:
                return None
            counts.append(remaining)
            return counts
        k = min(cap, remaining - (depth - 1 - i))
        if k < 1:
            return None
        counts.append(k)
        remaining -= k
    return None


class Prepared(NamedTuple):
    """What ``partition_layers`` and ``flush_lower_bound_s`` both derive from one pipeline's options first (the
    searches bound a shape's flush, then often partition it): the options as arrays, each stage's cheapest
    time for k = 1..L layers, and the least threshold a split fits under (None: none fits)."""

    arrays: tuple[np.ndarray, np.ndarray, np.ndarray]
    times: np.ndarray
    threshold_s: float | None


def prepare(stages: Sequence[Sequence[StageOption]], num_layers: int) -> Prepared:
    """``Prepared`` of a pipeline of at least one and at most ``num_layers`` stages."""
    arrays = _option_arrays(stages)
    table = _k_layer_times(arrays, num_layers)
    return Prepared(arrays, table[1], _least_feasible_threshold_s(arrays, num_layers, table))


def partition_layers(stages: Sequence[Sequence[StageOption]], num_layers: int,
                     prepared: Prepared | None = None) -> Partition | None:
    """Contiguous split of ``num_layers`` blocks over the stages minimising the slowest stage.

    Every stage gets at least one layer. Returns None when no split fits memory. ``prepared``: ``prepare``'s
    result for these stages, where the caller keeps it.
    """
    depth = len(stages)
    if depth == 0 or depth > num_layers:
        return None
    arrays, _, threshold_s = prepared or prepare(stages, num_layers)
    if threshold_s is None:
        return None
    counts = _greedy(stages, num_layers, threshold_s)
    assert counts is not None
    chosen = [_choose(opts, k) for opts, k in zip(stages, counts)]
    greedy = Partition(tuple(counts), tuple(o.recompute for o in chosen),
                       max(o.time_s(k) for o, k in zip(chosen, counts)))
    if depth == 1:
        return greedy
    balanced = _balanced_counts(arrays, num_layers, threshold_s)
    if balanced is None:
        return greedy
    chosen = [_choose(opts, k) for opts, k in zip(stages, balanced)]
    bottleneck = max(o.time_s(k) for o, k in zip(chosen, balanced))
    if bottleneck > greedy.bottleneck_s:
        return greedy
    return Partition(tuple(balanced), tuple(o.recompute for o in chosen), bottleneck)


def _option_arrays(stages: Sequence[Sequence[StageOption]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(fixed, per-layer, max layers) of every stage's options as (depth, options) arrays; a stage with fewer
    options is padded with one that holds nothing."""
    width = max(len(opts) for opts in stages)
    pad = [(np.inf, 1.0, -1)]
    rows = [[(o.fixed_s, o.per_layer_s, o.max_layers) for o in opts] + pad * (width - len(opts)) for opts in stages]
    table = np.array(rows, dtype=np.float64)
    return table[..., 0], table[..., 1], table[..., 2]


def _k_layer_times(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], num_layers: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(every option's time for 1..L layers where it holds them, (depth, L): each stage's cheapest time for k
    layers, inf where no option holds k); the same arithmetic as ``StageOption.time_s``. Unlike
    ``_time_tables`` (the tie-break DP's), not capped by a threshold."""
    fixed, per, most = arrays
    ks = np.arange(1, num_layers + 1, dtype=np.float64)
    values = fixed[..., None] + ks * per[..., None]
    held = ks <= most[..., None]
    return values[held], np.where(held, values, np.inf).min(axis=1)


def _least_feasible_threshold_s(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], num_layers: int,
                                table: tuple[np.ndarray, np.ndarray]) -> float | None:
    """The least stage time (some option's ``fixed + k * per_layer``) under which ``_greedy`` finds a split;
    None if none. A stage holds k layers under X iff its k-th time (cheapest option holding k) is <= X, and
    these times grow with k, so the stages hold ``#{(stage, k): t_k <= X}`` layers together: the least X is
    the larger of every stage's first time and the L-th smallest time of all (one ``np.partition``). Checked
    against ``_feasible`` (its float tolerance): where the two disagree, a bisection over every value decides.
    ``table``: ``_k_layer_times``."""
    candidates, times = table
    threshold_s = float(max(times[:, 0].max(), np.partition(times.ravel(), num_layers - 1)[num_layers - 1]))
    if math.isinf(threshold_s):
        return None
    below = candidates[candidates < threshold_s]
    if _feasible(arrays, num_layers, threshold_s) and not (
            below.size and _feasible(arrays, num_layers, float(below.max()))):
        return threshold_s
    candidates = np.unique(candidates)  # the tolerance moved the boundary: search every value
    if not _feasible(arrays, num_layers, float(candidates[-1])):
        return None
    lo, hi = 0, candidates.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if not _feasible(arrays, num_layers, float(candidates[mid])) else (lo, mid)
    return float(candidates[lo])


def flush_lower_bound_s(stages: Sequence[Sequence[StageOption]], num_layers: int, num_micro_batches: int,
                        fill: bool = True, prepared: Prepared | None = None) -> float:
    """A lower bound on the 1F1B flush (``cost.pipeline.stage_finish_s``, stage 0's last backward; the senders'
    waits for their sends only make it later, ``cost/rendezvous.py``) of the split
    ``partition_layers`` returns, with ``num_micro_batches`` micro-batches whose stage times the options give:
    stage a's actions all run between micro-batch 0 crossing the stages before it and the last one's gradient
    crossing them back, so T >= S_a + m t_a (S_a: the time of the stages before a; ``fill=False`` drops it,
    for a smaller last micro-batch). Without the split itself (no tie-break DP, no timing): it holds every
    stage within its layers under X, the threshold ``partition_layers`` uses, so the stages before a hold at
    least what the later ones cannot; and one stage takes at least X (fewer than L of the stages' times are
    below X, or a stage's first layer takes X). S_a is bounded by each stage's first layer plus its cheapest
    increment per extra layer. 0.0 (no claim) for negative per-layer times; inf if no split fits memory.
    ``prepared``: as for ``partition_layers``."""
    depth = len(stages)
    if depth == 0 or depth > num_layers:
        return math.inf
    arrays, times, threshold_s = prepared or prepare(stages, num_layers)
    if (arrays[1] < 0).any():
        return 0.0
    if threshold_s is None:
        return math.inf
    caps = np.minimum(_caps(arrays, threshold_s), num_layers).astype(np.int64)
    index = np.arange(depth)
    fewest = np.maximum(1, num_layers - (caps.sum() - caps))  # what the other stages cannot hold
    own_s = (num_micro_batches * times[index, fewest - 1]).tolist()
    critical = (times[index, caps - 1] >= threshold_s).tolist()  # may take the threshold within its layers
    with np.errstate(invalid="ignore"):
        steps = np.diff(times, axis=1)
    increment_s = np.where(np.isfinite(steps), steps, np.inf).min(axis=1).tolist() if num_layers > 1 else []
    first_layer_s, caps_list = times[:, 0].tolist(), caps.tolist()
    later = int(caps.sum())  # what stages a.. hold at most
    general_s, bottleneck_s, firsts_s = 0.0, math.inf, 0.0
    cheapest: list[tuple[float, int]] = []  # (increment, room) of the stages before a, cheapest first
    for a in range(depth):
        before_s = 0.0
        if fill and a:
            bisect.insort(cheapest, (increment_s[a - 1], caps_list[a - 1] - 1))
            firsts_s += first_layer_s[a - 1]
            extra, before_s = num_layers - later - a, firsts_s  # layers the stages before a hold beyond one each
            for inc_s, room in cheapest:
                if extra <= 0:
                    break
                take = extra if extra < room else room
                before_s += inc_s * take
                extra -= take
            assert extra <= 0, "feasible under the threshold: the stages before a have room for what a.. cannot hold"
        general_s = max(general_s, before_s + own_s[a])
        if critical[a]:
            bottleneck_s = min(bottleneck_s, before_s + num_micro_batches * threshold_s)
        later -= caps_list[a]
    return max(general_s, bottleneck_s if math.isfinite(bottleneck_s) else 0.0)


def _caps(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], threshold_s: float) -> np.ndarray:
    """Each stage's ``max(o.layers_within(threshold))`` over its options, vectorised (same arithmetic)."""
    fixed, per, most = arrays
    if per.min() > 0:  # every option slows with its layers (all but degenerate inputs): the same arithmetic
        return np.minimum(np.floor((threshold_s - fixed) / per * (1 + 1e-12) + 1e-12), most).max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.floor((threshold_s - fixed) / per * (1 + 1e-12) + 1e-12)
    k = np.where(per <= 0, np.where(fixed <= threshold_s, most, 0.0), np.minimum(k, most))
    return k.max(axis=1)


def _feasible(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], num_layers: int, threshold_s: float) -> bool:
    """Whether ``_greedy`` finds a split under the threshold: iff every stage holds a layer within it and
    together they hold all (the greedy leaves one layer per later stage and the last takes the rest)."""
    caps = _caps(arrays, threshold_s)
    return bool(caps.min() >= 1 and caps.sum() >= num_layers)


def _time_tables(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], num_layers: int, threshold_s: float
                 ) -> np.ndarray:
    """(depth, num_layers + 1): time of each stage holding k layers (its cheapest fitting option); inf where
    k = 0, no option holds k layers, or k exceeds what fits under the threshold (the greedy's caps)."""
    fixed, per, most = arrays
    ks = np.arange(num_layers + 1, dtype=np.float64)
    cap = _caps(arrays, threshold_s)[:, None, None]
    fits = (ks >= 1) & (ks <= np.minimum(most[..., None], cap))
    return np.where(fits, fixed[..., None] + ks * per[..., None], np.inf).min(axis=1)


def _balanced_counts(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], num_layers: int, threshold_s: float
                     ) -> list[int] | None:
    """Layers per stage minimising the sum of squared stage times, every stage within the threshold.

    A DP over the stages' last layers, each stage only over the ends it can have on a complete split (at least
    one layer per stage, at most what each holds): with memory binding these windows are a few layers wide, so
    plain floats beat array operations (2-3x at every depth); ties go to the fewest layers, as an argmin would."""
    depth, n = arrays[0].shape[0], num_layers
    tables = _time_tables(arrays, n, threshold_s) ** 2
    most = np.where(np.isfinite(tables), np.arange(n + 1), 0).max(axis=1).tolist()  # the most each stage holds
    if min(most) == 0:
        return None
    room = [0] * (depth + 1)  # room[i]: what stages i.. hold at most
    for i in range(depth - 1, -1, -1):
        room[i] = room[i + 1] + most[i]
    best: dict[int, float] = {0: 0.0}  # end of the stages so far -> least sum of squares
    chosen: list[dict[int, int]] = []  # per stage, end -> its layers on the best way there
    reach = 0
    for i in range(depth):
        squares = tables[i, 1:most[i] + 1].tolist()
        lo, hi = max(i + 1, n - room[i + 1]), min(reach + most[i], n - (depth - 1 - i))
        if lo > hi:
            return None
        ends: dict[int, float] = {}
        layers: dict[int, int] = {}
        for end in range(lo, hi + 1):
            least, k_least = math.inf, 0
            for k, square in enumerate(squares, start=1):
                value = best.get(end - k, math.inf) + square
                if value < least:
                    least, k_least = value, k
            ends[end], layers[end] = least, k_least
        best, reach = ends, hi
        chosen.append(layers)
    if not best.get(n, math.inf) < math.inf:
        return None
    counts, end = [], n
    for i in range(depth - 1, -1, -1):
        counts.append(chosen[i][end])
        end -= counts[-1]
    return counts[::-1]


def bottleneck_of(stages: Sequence[Sequence[StageOption]], counts: Sequence[int]) -> float | None:
    """Bottleneck of a given split (None if some stage cannot hold its layers): for tests and baselines."""
    if any(k < 1 for k in counts) or not any(True for _ in counts):
        return None
    times = []
    for opts, k in zip(stages, counts):
        fitting = [o for o in opts if o.max_layers >= k]
        if not fitting:
            return None
        times.append(min(o.time_s(k) for o in fitting))
    return max(times)
