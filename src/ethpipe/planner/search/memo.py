"""What a planning run keeps across its searches: what depends on a cluster's devices alone, and the lower
bounds' memos."""

from __future__ import annotations

from ethpipe.cluster import Cluster
from ethpipe.cost.model import CostModel
from ethpipe.planner.search.bounds import LowerBounds


def cluster_memo(cache: dict, cluster: Cluster) -> dict:
    """The part of a planning cache that depends on ``cluster``'s devices alone (layouts and their replicas,
    node statistics, the first stages' sync bounds), shared by the caches of every optimizer-holder count
    (``planner.make_plan`` puts one dict under ``("cluster_memo",)`` in each): the sharded rounds search the
    unsharded plan's devices again."""
    shared = cache.setdefault(("cluster_memo",), {})
    entry = shared.get(id(cluster))
    if entry is None or entry[0] is not cluster:  # the entry keeps its cluster alive: its id is not reused
        entry = shared[id(cluster)] = (cluster, {})
    return entry[1]


def shared_bounds(cost: CostModel, cache: dict) -> LowerBounds:
    """One memoised ``LowerBounds`` per planning run, kept in its template cache (the families share it);
    a new cluster in the same cache (``plan_eth`` drops the old bounds) keeps the per-device memos."""
    if ("lower_bounds",) not in cache:
        sync = cluster_memo(cache, cost.cluster).setdefault(("first_stage_sync", cost.optimizer_holders > 1), {})
        bounds = cache[("lower_bounds",)] = LowerBounds(cost, cache.get(("device_bounds",)),
                                                         cache.get(("compute_bounds",)), sync)
        cache[("device_bounds",)] = bounds.device_memo
        cache.setdefault(("compute_bounds",), bounds.compute_memo)
    return cache[("lower_bounds",)]
