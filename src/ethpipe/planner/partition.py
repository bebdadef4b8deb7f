"""Level 2: layers -> stages inside one pipeline (docs/design.md §2.1).

All decoder blocks are identical, so a stage's time and memory are linear in its number of
layers: ``fixed + k * per_layer`` (the fixed part holds the embedding on the first stage, the
norm + head on the last, and the p2p transfers). Minimising the bottleneck is then exact with
a binary search over the finitely many candidate bottleneck values and a greedy feasibility
check (take as many layers as fit under the threshold, leaving one per remaining stage): the
greedy prefix dominates every feasible partition's prefix, so it fails only if none exists.
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

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StageOption:
    """One way to run a stage: time ``fixed_s + k * per_layer_s`` for k layers, at most ``max_layers``."""

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


def partition_layers(stages: Sequence[Sequence[StageOption]], num_layers: int) -> Partition | None:
    """Contiguous split of ``num_layers`` blocks over the stages minimising the slowest stage.

    Every stage gets at least one layer. Returns None when no split fits memory.
    """
    depth = len(stages)
    if depth == 0 or depth > num_layers:
        return None
    ks = np.arange(1, num_layers + 1, dtype=np.float64)
    candidates = np.unique(np.concatenate([
        o.fixed_s + ks[: max(min(o.max_layers, num_layers), 0)] * o.per_layer_s for opts in stages for o in opts
    ]))
    arrays = _option_arrays(stages)
    if candidates.size == 0 or not _feasible(arrays, num_layers, float(candidates[-1])):
        return None
    lo, hi = 0, candidates.size - 1  # smallest feasible index
    while lo < hi:
        mid = (lo + hi) // 2
        if not _feasible(arrays, num_layers, float(candidates[mid])):
            lo = mid + 1
        else:
            hi = mid
    counts = _greedy(stages, num_layers, float(candidates[lo]))
    assert counts is not None
    chosen = [_choose(opts, k) for opts, k in zip(stages, counts)]
    greedy = Partition(tuple(counts), tuple(o.recompute for o in chosen),
                       max(o.time_s(k) for o, k in zip(chosen, counts)))
    if depth == 1:
        return greedy
    balanced = _balanced_counts(arrays, num_layers, float(candidates[lo]))
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


def _caps(arrays: tuple[np.ndarray, np.ndarray, np.ndarray], threshold_s: float) -> np.ndarray:
    """Each stage's ``max(o.layers_within(threshold))`` over its options, vectorised (same arithmetic)."""
    fixed, per, most = arrays
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
    """Layers per stage minimising the sum of squared stage times, every stage within the threshold."""
    depth, n = arrays[0].shape[0], num_layers
    j = np.arange(n + 1)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((depth, n + 1), dtype=np.int64)
    tables = _time_tables(arrays, n, threshold_s) ** 2
    for i in range(depth):
        sq = tables[i]
        held = np.flatnonzero(np.isfinite(sq))
        if held.size == 0:
            return None
        ks = np.arange(1, held[-1] + 1)  # only layer counts the stage can hold under the threshold
        back = j[:, None] - ks[None, :]  # back[j, k] = layers before a stage that ends at j and holds ks[k]
        total = np.where(back >= 0, best[np.maximum(back, 0)] + sq[ks][None, :], np.inf)
        arg = np.argmin(total, axis=1)
        choice[i] = ks[arg]
        best = total[j, arg]
    if not np.isfinite(best[n]):
        return None
    counts, end = [], n
    for i in range(depth - 1, -1, -1):
        k = int(choice[i, end])
        counts.append(k)
        end -= k
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
