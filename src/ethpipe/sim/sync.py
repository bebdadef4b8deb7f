"""How long each block's gradient all-reduce takes (DESIGN 2.2), priced like the planner's estimate.

One group per TP shard (each holder stage's shard ranks, one per pipeline), all shards in
parallel, each syncing bytes / tp. Cross-node collectives share each node's NIC: after the
intra-node reduction a node's NIC carries every cross-node block it holds once, so a
collective gets the fraction of the NIC that its bytes are of all those bytes. This mirrors
``ethpipe.planner.estimate`` so the closed form and the simulator price sync identically;
timing models without a cluster (test fakes) get no NIC sharing.
"""

from __future__ import annotations

from ethpipe.plan import Plan
from ethpipe.sim.timing import TimingModel


def holder_stages(plan: Plan) -> list[list[tuple[int, int]]]:
    """Per block: the (pipeline, stage) holding it in every pipeline, in plan order."""
    out = []
    for block in plan.blocks:
        lo = block.layers[0]
        out.append([(p, next(i for i, st in enumerate(pipe.stages) if st.layers[0] <= lo < st.layers[1]))
                    for p, pipe in enumerate(plan.pipelines)])
    return out


def block_sync_durations_s(plan: Plan, cost: TimingModel) -> list[float]:
    """Seconds of each block's all-reduce (0.0 where a single pipeline holds it)."""
    cluster = getattr(cost, "cluster", None)
    groups = []
    node_bytes: dict[int, float] = {}
    last = len(plan.blocks) - 1
    for k, (block, holders) in enumerate(zip(plan.blocks, holder_stages(plan))):
        stages = [plan.pipelines[p].stages[s] for p, s in holders]
        ranks = [st.ranks[0] for st in stages]
        num_bytes = cost.block_grad_bytes(block, first=k == 0, last=k == last)
        nodes = {cluster.devices[r].node for r in ranks} if cluster is not None else set()
        if len(nodes) > 1:
            for node in nodes:
                node_bytes[node] = node_bytes.get(node, 0.0) + num_bytes
        groups.append((ranks, num_bytes / min(st.tp for st in stages), nodes))
    out = []
    for ranks, shard_bytes, nodes in groups:
        if len(ranks) < 2 or shard_bytes <= 0:
            out.append(0.0)
            continue
        share = max(node_bytes[n] for n in nodes) / shard_bytes if len(nodes) > 1 else 1.0
        out.append(cost.allreduce_s(ranks, int(shard_bytes), nic_share=max(share, 1.0)))
    return out
