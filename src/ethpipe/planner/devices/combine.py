"""Level 1's combination search: one candidate shape per pool (or per mixed set), combined into a layout.

Every combination when few (``MAX_COMBINATIONS``), else coordinate descent from each pool's best candidate; the
split pools' candidates last. Each combination is balanced (level 3) and priced like the final plan, and skipped
where its capacity bound or slowest flush cannot beat the best so far (``devices/eth.py``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from ethpipe.cost.model import CostModel
from ethpipe.errors import Infeasible
from ethpipe.planner.assemble import Found
from ethpipe.planner.devices.grouping import Group, capacity_per_s, evaluate_groups
from ethpipe.planner.search.options import PlannerOptions

MAX_COMBINATIONS = 27


def search_combinations(cost: CostModel, per_pool: list[list[list[Group]]], global_batch: int,
                        options: PlannerOptions, extra: Sequence[list[list[Group]]] = (),
                        incumbent_s: float = math.inf, passes: int = 2) -> Found | None:
    """Every combination when few, else coordinate descent from each pool's best candidate; then each pool's
    ``extra`` candidates (split pools), one pool at a time from that best, so they never make it worse.
    A combination whose capacity bound or slowest flush cannot beat the best so far (``incumbent_s`` or this
    search's) is not priced; None if none was."""
    best: Found | None = None
    last_error: Infeasible | None = None
    seen: set[tuple[int, ...]] = set()
    lists = [c + (list(extra[i]) if i < len(extra) else []) for i, c in enumerate(per_pool)]

    def consider(choice: Sequence[int]) -> None:
        nonlocal best, last_error
        if tuple(choice) in seen:
            return
        seen.add(tuple(choice))
        groups = [g for pool, c in zip(lists, choice) for g in pool[c]]
        bar_s = min(incumbent_s, best[0] if best else math.inf)
        if global_batch / capacity_per_s(groups) >= bar_s:
            return
        try:
            score, samples = evaluate_groups(cost, groups, global_batch, equal_data=not options.balance_data,
                                             flat_sync=not options.block_sync, cutoff_s=bar_s)
        except Infeasible as err:
            last_error = err
            return
        if math.isfinite(score) and (best is None or score < best[0]):
            best = (score, groups, samples)
            best_choice[:] = list(choice)

    def descend(sizes: Sequence[int], passes: int = 2, first: Sequence[int] = ()) -> None:
        consider(best_choice)
        for _ in range(passes):
            for i, s in enumerate(sizes):
                base = list(best_choice)
                for c in range(first[i] if first else 0, s):
                    consider(base[:i] + [c] + base[i + 1:])

    best_choice: list[int] = [0] * len(per_pool)
    sizes = [len(c) for c in per_pool]
    total = 1
    for s in sizes:
        total *= s
    if total <= MAX_COMBINATIONS:
        for choice in itertools.product(*(range(s) for s in sizes)):
            consider(choice)
    else:
        descend(sizes, passes)
    if any(len(a) > len(b) for a, b in zip(lists, per_pool)):  # one pass over the splits, from the best
        descend([len(c) for c in lists], 1, sizes)
    if best is None and last_error is not None:
        raise last_error
    return best
