"""The lines `ethpipe plan` (and `simulate`) print under a plan's table: idle devices, nodes, the optimizer state and
the gradient sync's precision."""

from __future__ import annotations

from typing import Any

from ethpipe.plan import Plan
from ethpipe.units import index_ranges


def idle_lines(plan: Any) -> list[str]:
    """Which nodes / devices the plan leaves idle (no rank, no process), and where to start ethpipe."""
    if not plan.idle_devices:
        return []
    from ethpipe.cluster import cluster_from_dict

    full = cluster_from_dict(plan.cluster)
    group_of: list[tuple[int, int]] = []  # global node -> (node group, node within it)
    for g, group in enumerate(full.source["nodes"]):
        group_of += [(g, k) for k in range(int(group["num_nodes"]))]
    by_node: dict[int, list[Any]] = {}
    for d in sorted(plan.idle_devices, key=lambda d: d.device_index):
        by_node.setdefault(full.devices[d.device_index].node, []).append(d)
    # One line per run of alike nodes (same cluster-file entry, same idle share, same reason), not one per node.
    runs: list[tuple[list[int], list[int], str, bool]] = []  # (nodes, device indices, reason, whole)
    for node, idle in sorted(by_node.items()):
        indices = [d.device_index for d in idle]
        whole = len(indices) == sum(1 for d in full.devices if d.node == node)
        last = runs[-1] if runs else None
        if (last is not None and last[0][-1] == node - 1 and group_of[last[0][-1]][0] == group_of[node][0]
                and last[2] == idle[0].reason and last[3] == whole and len(last[1]) % len(indices) == 0):
            last[0].append(node)
            last[1].extend(indices)
        else:
            runs.append(([node], indices, idle[0].reason, whole))
    lines = []
    for nodes, indices, reason, whole in runs:
        g, k = group_of[nodes[0]]
        per = len(indices) // len(nodes)
        what = ("whole node" if whole else f"{per} devices of node") + ("s" if len(nodes) > 1 else "")
        each = " each" if len(nodes) > 1 else ""
        lines.append(f"idle: {what} {index_ranges(nodes)} (cluster nodes[{g}] from node {k}: {per} x "
                     f"{full.devices[indices[0]].gpu.id}{each}, devices {index_ranges(indices)}): no rank, start no "
                     f"process there ({reason})")
    lines.append(f"start ethpipe on the other {plan.world_size} of {full.num_devices} devices only (world size "
                 f"{plan.world_size}; ranks number them in cluster order)")
    return lines


def nodes_line(plan: Plan) -> str:
    """Which ranks each node of the cluster file hosts (what `ethpipe launch` starts where)."""
    from ethpipe.cluster_launch import node_ranks

    runs: list[list[Any]] = []  # consecutive nodes alike (GPU, ranks per node) in one entry: 80 nodes, a few runs
    for n in node_ranks(plan):
        last = runs[-1][-1] if runs else None
        if last is not None and (last.gpu, last.num_ranks, last.cluster_node + 1, last.ranks.stop) == (
                n.gpu, n.num_ranks, n.cluster_node, n.ranks.start):
            runs[-1].append(n)
        else:
            runs.append([n])
    parts = []
    for run in runs:
        first, last = run[0], run[-1]
        nodes = f"node {first.cluster_node}" if len(run) == 1 else f"nodes {first.cluster_node}-{last.cluster_node}"
        each = " each" if len(run) > 1 else ""
        parts.append(f"{nodes} ({first.num_ranks} x {first.gpu}{each}): ranks {first.ranks.start}-{last.ranks.stop - 1}")
    return "nodes: " + "; ".join(parts)


def reduce_bound_line(plan: Plan) -> str:
    """How far a bf16 gradient sum may be from the exact one at this plan's pipeline count (docs/runtime.md,
    "16-bit gradient reduction"): (P + 1) 2^-8 of the terms' absolute sum, void past 256 terms."""
    holders = len(plan.pipelines)
    if holders > 256:
        return (f"bf16 gradient sums over {holders} pipelines: no error bound holds past 256 terms (a partial sum "
                "256 times a term loses it); use --grad-reduce fp32")
    line = (f"bf16 gradient sums over {holders} pipelines: each within {holders + 1} x 2^-8 = "
            f"{(holders + 1) / 256:.1%} of its terms' absolute sum")
    fp32_s = ((plan.extra.get("search") or {}).get("grad_reduce") or {}).get("fp32_iteration_s")
    if fp32_s:
        own = float(plan.predicted["iteration_time_s"])
        verdict = "faster" if own < fp32_s else "not faster"
        line += f"; with the sync in fp32 the plan takes {fp32_s:.4g} s, this one {own:.4g} s ({verdict})"
    return line


def sharding_line(plan: Plan) -> str:
    """Whether the plan shards the optimizer state, and what the planner compared."""
    record = (plan.extra.get("search") or {}).get("shard_optimizer") or {}
    if plan.shard_optimizer:
        head = f"optimizer state: AdamW moments sharded over the {len(plan.pipelines)} pipelines (ZeRO-1)"
        other = record.get("unsharded_iteration_s")
        return head + (f"; unsharded {other:.3f} s" if other else "; unsharded: does not fit")
    sharded = record.get("sharded_iteration_s")
    if not record:
        return "optimizer state: whole on every rank (--no-shard-optimizer)"
    return "optimizer state: whole on every rank" + (f" (sharded: {sharded:.3f} s, slower)" if sharded else "")


def sublayer_line(plan: Plan) -> str | None:
    """Whether stages end inside layers, and the plan's time in whole layers (None: not tried)."""
    record = (plan.extra.get("search") or {}).get("sublayer_cuts")
    if not record:
        return None
    if record["kept"]:
        split = ", the batch re-split for them" if record.get("batch_resplit") else ""
        return (f"stages cut inside layers (a = attention, m = MLP half){split}: {record['half_layers_s']:.4g} s, "
                f"{record['whole_layers_s']:.4g} s in whole layers")
    return f"stages hold whole layers: {record['why_not']}"
