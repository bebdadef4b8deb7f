"""The baselines a Megatron or torchtitan user would run on a mixed cluster: uniform (or layer-balanced) on the
best homogeneous subset, the one GPU type that is fastest alone, the other devices left idle.

``uniform`` on the whole cluster must use every device, slow nodes on slow NICs included, which nobody running a
homogeneous-cluster framework would do; HexiScale and Zorse report their gains against the best homogeneous
configuration, and so does ``ethpipe compare`` (``docs/cost-model.md``). Each GPU type is planned alone (its
nodes' devices, the rest idle) with the baseline method; the fastest predicted iteration is the baseline. Nodes of
one type with different NICs count as one subset (the planner prices their links as they are).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from ethpipe.cluster import Cluster
from ethpipe.errors import UserError
from ethpipe.plan import Plan


def homogeneous_subsets(cluster: Cluster) -> dict[str, Cluster]:
    """Per GPU type of ``cluster``, the cluster with only that type's devices (the others idle)."""
    out = {}
    for gpu in dict.fromkeys(d.gpu.id for d in cluster.devices):
        others = [d.rank for d in cluster.devices if d.gpu.id != gpu]
        out[gpu] = cluster.without_devices(others) if others else cluster
    return out


def best_homogeneous(cluster: Cluster, plan_on: Callable[[Cluster], Plan], method: str) -> Plan | None:
    """The fastest plan of ``plan_on`` (a baseline method) over the homogeneous subsets that fit; None if none
    does. Its idle devices say why they are idle."""
    best: tuple[float, str, Plan] | None = None
    for gpu, sub in homogeneous_subsets(cluster).items():
        try:
            plan = plan_on(sub)
        except UserError:  # the model does not fit that type alone (memory), or too few devices for the batch
            continue
        time_s = plan.predicted["iteration_time_s"]
        if best is None or time_s < best[0]:
            best = (time_s, gpu, plan)
    if best is None:
        return None
    _, gpu, plan = best
    reason = f"{method} on the best homogeneous subset: {gpu} alone"
    return dataclasses.replace(plan, idle_devices=tuple(dataclasses.replace(d, reason=reason) for d in plan.idle_devices))
