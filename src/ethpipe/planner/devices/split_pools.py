"""Split pools, the third family of ETH's widened level 1 (docs/design.md §2.1): a pool's nodes shared by its two
best shapes (half, a quarter or three quarters on the best), extra per-pool candidates of the combination search:
finer data granularity, and a mix of one shape's sync relief with the other's short pipelines."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ethpipe.cost.model import CostModel
from ethpipe.planner.devices.grouping import Group, homogeneous_group
from ethpipe.planner.devices.templates import Pool

SPLIT_FRACTIONS = (1 / 2, 1 / 4, 3 / 4)  # of a pool's nodes on its best shape, the rest on its second best


def split_candidates(cost: CostModel, pool: Pool, groups: Sequence[Group], every: bool = False,
                     cache: dict | None = None) -> list[list[Group]]:
    """The pool's nodes shared by two of its shapes: the best (``groups[0]``) on a fraction of them, the
    second best on the rest (``every``: every pair of ``groups`` at every node count that both tile)."""
    n = len(pool.nodes)
    pairs = itertools.combinations(groups, 2) if every else [tuple(groups[:2])] if len(groups) > 1 else []
    out = []
    for a, b in pairs:
        ta, tb = a.template, b.template
        points = range(1, n) if every else sorted({round(n * f) for f in SPLIT_FRACTIONS})
        for n_a in points:
            if 0 < n_a < n and n_a % ta.nodes_per_pipeline == 0 and (n - n_a) % tb.nodes_per_pipeline == 0:
                first = Pool(pool.device, pool.gpus_per_node, pool.nodes[:n_a])
                rest = Pool(pool.device, pool.gpus_per_node, pool.nodes[n_a:])
                out.append([homogeneous_group(cost, ta, first, cache), homogeneous_group(cost, tb, rest, cache)])
    return out
