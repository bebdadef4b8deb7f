"""Level 2: layers -> stages inside one pipeline (docs/design.md §2.1).

All decoder blocks are identical, so a stage's time and memory are linear in its number of
layers: ``fixed + k * per_layer`` (the fixed part holds the embedding on the first stage, the
norm + head on the last, and the p2p transfers). Minimising the bottleneck is then exact with
a binary search over the finitely many candidate bottleneck values and a greedy feasibility
check (take as many layers as fit under the threshold, leaving one per remaining stage): the
greedy prefix dominates every feasible partition's prefix, so it fails only if none exists.
Each stage may have several options (with / without activation recomputation); it takes the
cheapest option that holds its layers.
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
    if candidates.size == 0 or _greedy(stages, num_layers, float(candidates[-1])) is None:
        return None
    lo, hi = 0, candidates.size - 1  # smallest feasible index
    while lo < hi:
        mid = (lo + hi) // 2
        if _greedy(stages, num_layers, float(candidates[mid])) is None:
            lo = mid + 1
        else:
            hi = mid
    counts = _greedy(stages, num_layers, float(candidates[lo]))
    assert counts is not None
    chosen = [_choose(opts, k) for opts, k in zip(stages, counts)]
    return Partition(tuple(counts), tuple(o.recompute for o in chosen),
                     max(o.time_s(k) for o, k in zip(chosen, counts)))


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
