"""What a planning run keeps across its searches that depends on a cluster's devices alone."""

from __future__ import annotations

from ethpipe.cluster import Cluster


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
