"""Alpha-beta communication primitives (reference/formulas.md section 5).

Bandwidths are per-direction GB/s (1e9 bytes/s), latencies seconds. Collectives are priced
for the ring algorithm; when the participants span nodes the hierarchical variant (intra-node
reduce-scatter, inter-node ring on the node's share, intra-node all-gather) is priced too and
the cheaper one is taken, as NCCL's tuner does. The slowest link of the ring sets its bandwidth.
Where the intra-node link has a measured curve (``cost/links.py``), its bandwidth at the
collective's message size replaces the flat figure (``intra_curve``).
"""

from __future__ import annotations

from ethpipe.cost.links import LinkCurve


def p2p_s(num_bytes: float, gbps: float, latency_s: float) -> float:
    """One point-to-point message: alpha + bytes / bandwidth."""
    return latency_s + num_bytes / (gbps * 1e9)


def ring_allreduce_s(num_ranks: int, num_bytes: float, gbps: float, latency_s: float) -> float:
    """Ring all-reduce: 2(n-1) steps of S/n bytes."""
    if num_ranks <= 1 or num_bytes <= 0:
        return 0.0
    n = num_ranks
    return 2 * (n - 1) * latency_s + 2.0 * (n - 1) / n * num_bytes / (gbps * 1e9)


def allreduce_shape_s(
    num_bytes: float,
    *,
    num_ranks: int,
    num_nodes: int,
    max_ranks_per_node: int,
    intra_gbps: float,
    inter_gbps: float,
    intra_latency_s: float,
    inter_latency_s: float,
    intra_curve: LinkCurve | None = None,
) -> float:
    """All-reduce of ``num_bytes`` over ranks spread on ``num_nodes`` nodes.

    ``inter_gbps`` is the slowest participating node's NIC bandwidth available to this
    collective; with one node only the intra-node ring is priced. ``intra_curve`` (measured,
    for the node's GPU count) prices the intra-node link at ``num_bytes`` instead of ``intra_gbps``.
    """
    if num_ranks <= 1 or num_bytes <= 0:
        return 0.0
    if intra_curve is not None:
        intra_gbps = intra_curve.gbps(num_bytes)
    if num_nodes <= 1:
        return ring_allreduce_s(num_ranks, num_bytes, intra_gbps, intra_latency_s)
    flat = 2 * (num_ranks - 1) * inter_latency_s + 2.0 * (num_ranks - 1) / num_ranks * num_bytes / (
        min(intra_gbps, inter_gbps) * 1e9
    )
    g = max_ranks_per_node
    # Every node pushes its whole reduced share (S) through its NIC in the inter-node ring.
    intra_phase = (g - 1) / g * num_bytes / (intra_gbps * 1e9) + (g - 1) * intra_latency_s if g > 1 else 0.0
    inter_phase = ring_allreduce_s(num_nodes, num_bytes, inter_gbps, inter_latency_s)
    return min(flat, 2 * intra_phase + inter_phase)
