"""CostModel's communication pricing (a mixin: ``cost/model.py`` holds the state).

Every message the runtime sends is priced here: stage-boundary p2p (each NIC shared by the pipelines
crossing it, ``cost/p2p.py``), the block-wise gradient sync and, under ZeRO-1 across pipelines, its
reduce-scatter and all-gather phases (``cost/sync.py``). The planner's estimate and the simulator call the same
methods, so what a plan is priced at is what it is replayed at.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from ethpipe.cluster import Cluster
from ethpipe.cost import comm, links, memory
from ethpipe.cost.p2p import P2pFlows
from ethpipe.cost.sync import (STATS_BYTES_PER_RANK, SyncShape, block_sync_shapes, distinct_gpus, sync_shape_s,
                              tied_sync_shape, world_gather_shape)
from ethpipe.plan import Plan


def plan_ranks(plan: Plan) -> np.ndarray:
    """Every rank of ``plan``, as an index array into its cluster's devices."""
    return np.fromiter(itertools.chain.from_iterable(st.ranks for pipe in plan.pipelines for st in pipe.stages),
                       dtype=np.int64)


def sharded_phase_fraction(num_holders: int) -> float:
    """One phase of the sharded sync (``runtime/sync/zero.py``) as a fraction of the all-reduce of the same bytes.
    The runtime runs one reduce-scatter per bucket tensor (and one all-gather after the optimizer): a ring
    all-reduce is exactly those two, (k - 1) steps of S / k bytes each, so each phase is half its time, latency
    included, whatever the number of holders (the hierarchical all-reduce likewise splits into halves)."""
    return 0.5 if num_holders > 1 else 1.0


class CommPricing:
    """P2p and gradient-sync seconds of a ``CostModel`` (its cluster, p2p flows and memos)."""

    cluster: Cluster
    p2p_flows: P2pFlows | None
    optimizer_holders: int

    def p2p_link_gbps(self, src_rank: int, dst_rank: int, num_bytes: float) -> float:
        """Per-direction bandwidth of one message: intra-node the measured curve (2 GPUs) or the flat link;
        across nodes one GPU's rail, each end's NIC shared by the pipelines crossing it (``p2p_flows``)."""
        a, b = self.cluster.devices[src_rank], self.cluster.devices[dst_rank]
        if a.node == b.node:
            return min(links.intra_gbps(a.gpu, 2, num_bytes), links.intra_gbps(b.gpu, 2, num_bytes))
        fa, fb = (self.p2p_flows or {}).get((src_rank, dst_rank), (1, 1))
        return min(a.flow_gbps, a.nic_gbps / fa, b.flow_gbps, b.nic_gbps / fb)

    def boundary_bytes(self, micro_batch: int) -> float:
        """One micro-batch's activation (or its gradient) as it crosses a stage boundary: in the compute dtype."""
        return micro_batch * self._act_bytes  # type: ignore[attr-defined, no-any-return]

    def p2p_s(self, src_rank: int, dst_rank: int, micro_batch: int) -> float:
        """Send one micro-batch's activation (or its gradient) between two ranks (memoised: the planner asks
        for the same links for every template and micro-batch size)."""
        key = (src_rank, dst_rank, micro_batch)
        memo = self._p2p  # type: ignore[attr-defined]
        hit = memo.get(key)  # one hash per call: read for every slot of every template
        if hit is None:
            num_bytes = micro_batch * self._act_bytes  # type: ignore[attr-defined]
            hit = memo[key] = comm.p2p_s(num_bytes, self.p2p_link_gbps(src_rank, dst_rank, num_bytes),
                                         self.cluster.link_latency_s(src_rank, dst_rank))
        return hit  # type: ignore[no-any-return]

    def allreduce_s(self, ranks: Sequence[int], num_bytes: int, *, nic_share: float = 1.0) -> float:
        """All-reduce among ``ranks``; each node's NIC is shared ``nic_share`` ways (concurrent collectives)."""
        if len(ranks) <= 1:
            return 0.0
        per_node: dict[int, int] = {}
        for r in ranks:
            node = self.cluster.devices[r].node
            per_node[node] = per_node.get(node, 0) + 1
        devs = [self.cluster.devices[r] for r in ranks]
        count = max(per_node.values()) if len(per_node) > 1 else len(ranks)
        # One rail per participating GPU on a node, capped by the node's NIC and its share of it.
        inter = min(min(c * d.flow_gbps, d.nic_gbps / max(nic_share, 1.0))
                    for n, c in per_node.items() for d in devs if d.node == n)
        staged_gbps, curve = links.collective_intra(distinct_gpus(d.gpu for d in devs), count, num_bytes)
        return comm.allreduce_shape_s(
            num_bytes,
            num_ranks=len(ranks),
            num_nodes=len(per_node),
            max_ranks_per_node=max(per_node.values()),
            intra_gbps=staged_gbps if staged_gbps is not None else min(d.gpu.intra_node_gbps for d in devs),
            inter_gbps=inter,
            intra_latency_s=self.cluster.intra_node_latency_s,
            inter_latency_s=self.cluster.inter_node_latency_s,
            intra_curve=curve,
        )

    def sync_s(self, shape: SyncShape | None) -> float:
        """Seconds of one block's gradient sync of this shape (``cost/sync.py``): its all-reduce, or sharded
        (``optimizer_holders`` > 1) the reduce-scatter, which the all-gather after the optimizer repeats over the
        fp32 weights (``gather_s``)."""
        if shape is None:
            return 0.0
        return sync_shape_s(shape, self.cluster) * (sharded_phase_fraction(shape.num_ranks)
                                                    if self.optimizer_holders > 1 else 1.0)

    def gather_s(self, shape: SyncShape | None) -> float:
        """Seconds of the all-gather of the updated shards after the optimizer, for a block's sync ``shape`` (0.0
        unsharded): the reduce-scatter's phase over the weights, which move in fp32 whatever ``grad_reduce`` the
        gradients were summed in (so a bf16 reduce's gather moves twice its bytes)."""
        if shape is None or self.optimizer_holders <= 1:
            return 0.0
        ratio = memory.GRAD_BYTES_PER_PARAM / self.grad_bytes
        if ratio != 1.0:
            shape = replace(shape, num_bytes=shape.num_bytes * ratio)
        return self.sync_s(shape)

    def block_gather_s(self, plan: Plan) -> list[float]:
        """Seconds of each block's all-gather of the updated shards after the optimizer (0.0 unsharded)."""
        if self.optimizer_holders <= 1:
            return [0.0] * len(plan.blocks)
        shapes = block_sync_shapes(plan, self.cluster, lambda b, first, last: self.block_grad_bytes(
            b, first=first, last=last, sublayers=plan.sublayers))
        return [self.gather_s(shape) for shape in shapes]

    def tied_gather_s(self, plan: Plan) -> float:
        if self.optimizer_holders <= 1 or not self.tied_grad_bytes():
            return 0.0
        return self.gather_s(tied_sync_shape(plan, self.cluster, self.tied_grad_bytes()))

    def tied_sync_s(self, plan: Plan) -> float:
        """Seconds of the tied embedding matrix's all-reduce among its copies (0 for an untied model)."""
        return self.sync_s(tied_sync_shape(plan, self.cluster, self.tied_grad_bytes())) if self.tied_grad_bytes() else 0.0

    def stats_gather_s(self, plan: Plan) -> float:
        """Seconds of the step's stats all-gather (``runtime/step.py``, ``gather_step_stats``): after every rank's
        sync and before any optimizer step, one all-gather of ``STATS_BYTES_PER_RANK`` from every rank of the
        plan. Latency-bound: at 4096 ranks it is the inter-node ring's steps."""
        ranks = plan_ranks(plan)
        shape = world_gather_shape(self.cluster, ranks, STATS_BYTES_PER_RANK)
        return 0.0 if shape is None else sync_shape_s(shape, self.cluster) * sharded_phase_fraction(len(ranks))

    def block_sync_s(self, plan: Plan) -> list[float]:
        """Seconds of each block's all-reduce in ``plan`` (0.0 where one pipeline holds it).

        The one pricing of gradient sync: the planner's estimate and the simulator both call it.
        """
        shapes = block_sync_shapes(plan, self.cluster, lambda b, first, last: self.block_grad_bytes(
            b, first=first, last=last, sublayers=plan.sublayers))
        return [self.sync_s(shape) for shape in shapes]
