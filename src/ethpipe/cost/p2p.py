"""NIC contention of pipeline p2p across nodes: how many pipelines send through a node's NIC at once.

Identical pipelines run their 1F1B schedules in lockstep, so when several of them cross the same
node boundary (strided shapes, or pipelines packed on the same nodes), their activations and
gradients go through that node's NIC at the same time. A pipeline counts once per node: its own
sends on one node are ordered by its schedule. Each cross-node flow then gets, on each end,
``min(rail, nic / pipelines crossing there)`` (``CostModel.p2p_s``); the block gradient sync
shares the NIC the same way (``cost/sync.py``). An interleaved pipeline's ring also wraps from its last
stage to its first (``links``).
"""

from __future__ import annotations

from collections.abc import Mapping

from ethpipe.cluster import Cluster
from ethpipe.plan import Pipeline, Plan, Stage

P2pFlows = Mapping[tuple[int, int], tuple[int, int]]  # (src head, dst head) -> (pipelines at src node, at dst node)


def links(pipe: Pipeline) -> list[tuple[Stage, Stage]]:
    """A pipeline's stage boundaries: consecutive stages, and the ring's wrap-around when interleaved."""
    pairs = list(zip(pipe.stages, pipe.stages[1:]))
    return pairs + [(pipe.stages[-1], pipe.stages[0])] if pipe.num_chunks > 1 and pipe.depth > 2 else pairs


def pipelines_crossing_per_node(plan: Plan, cluster: Cluster) -> dict[int, int]:
    """Per node: the pipelines with a stage boundary that leaves or enters it."""
    devices = cluster.devices
    per_node: dict[int, int] = {}
    for pipe in plan.pipelines:
        touched = {n for a, b in links(pipe) if devices[a.ranks[0]].node != devices[b.ranks[0]].node
                   for n in (devices[a.ranks[0]].node, devices[b.ranks[0]].node)}
        for n in touched:
            per_node[n] = per_node.get(n, 0) + 1
    return per_node


def p2p_flows(plan: Plan, cluster: Cluster) -> dict[tuple[int, int], tuple[int, int]]:
    """Both directions of every cross-node stage boundary, with the pipelines sharing each end's NIC."""
    devices = cluster.devices
    per_node = pipelines_crossing_per_node(plan, cluster)
    out: dict[tuple[int, int], tuple[int, int]] = {}
    for pipe in plan.pipelines:
        for a, b in links(pipe):
            ra, rb = a.ranks[0], b.ranks[0]
            na, nb = devices[ra].node, devices[rb].node
            if na != nb:
                out[(ra, rb)] = (per_node[na], per_node[nb])
                out[(rb, ra)] = (per_node[nb], per_node[na])
    return out
