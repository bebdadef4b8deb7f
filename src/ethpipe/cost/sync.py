"""Block-wise gradient all-reduce pricing (docs/design.md §2.2): the ONE place it is defined.

The planner's estimate, its search (group level) and the simulator all price a block's
all-reduce from a ``SyncShape``. One group per TP shard (the holder stages' shard ranks, one
per pipeline), all shards in parallel, each syncing bytes / tp. Across nodes the collective is
hierarchical (or a flat ring, whichever is cheaper, ``comm.allreduce_shape_s``) and shares each
node's NIC: a stage syncs its blocks one after another, so a node runs one collective at a time
per syncing (stage, shard) whose group crosses nodes, and the group's ranks on one node are
reduced inside it first. On each node the collective gets ``nic / share`` with ``share`` = (the
node's ranks in cross-node block groups / this group's ranks on that node); the ring runs at
the slowest node's share.
This is conservative (stages that finish at different times do not really contend), and it is
why many small in-node pipelines are not free: every node then pushes a whole model replica's
gradients through its NIC, while a pipeline spanning ``k`` nodes pushes ``1/k`` of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from ethpipe.catalog import GpuSpec
from ethpipe.cluster import Cluster
from ethpipe.cost import comm, links
from ethpipe.plan import Block, Plan, layer_owners


@dataclass(frozen=True)
class SyncShape:
    """One block's all-reduce (per TP shard) as the links see it."""

    num_bytes: float
    num_ranks: int
    num_nodes: int
    max_ranks_per_node: int
    intra_gbps: float
    nic_gbps: float  # min over its nodes of NIC / (collectives sharing that NIC)
    gpus: tuple[GpuSpec, ...] = ()  # the holders' GPU types: their measured intra-node curves, if any


def nic_share_gbps(nic_gbps: float, flow_gbps: float, ranks_here: int, ranks_sharing: int) -> float:
    """A collective's inter-node bandwidth on one node: its ranks' rails, capped by its share of the NIC.

    ``ranks_here`` of its ranks sit on the node, ``ranks_sharing`` (>= ranks_here) of the node's ranks
    are in cross-node collectives at once; one rail per GPU (``flow_gbps``, = nic without rails).
    """
    return min(ranks_here * flow_gbps, nic_gbps * min(1.0, ranks_here / max(ranks_sharing, 1)))


def distinct_gpus(gpus: Iterable[GpuSpec]) -> tuple[GpuSpec, ...]:
    """Distinct types, first seen first. Devices share their type's spec object, so identity goes first: hashing
    a spec (all its fields) per device was a tenth of planning time at 4096 GPUs."""
    return tuple(dict.fromkeys({id(g): g for g in gpus}.values()))


def sync_shape_s(shape: SyncShape, cluster: Cluster) -> float:
    if shape.num_ranks <= 1 or shape.num_bytes <= 0:
        return 0.0
    curve, intra_gbps = None, shape.intra_gbps
    if shape.gpus:
        count = shape.max_ranks_per_node if shape.num_nodes > 1 else shape.num_ranks
        staged_gbps, curve = links.collective_intra(shape.gpus, count, shape.num_bytes)
        intra_gbps = staged_gbps if staged_gbps is not None else intra_gbps
    return comm.allreduce_shape_s(
        shape.num_bytes, num_ranks=shape.num_ranks, num_nodes=shape.num_nodes,
        max_ranks_per_node=shape.max_ranks_per_node, intra_gbps=intra_gbps,
        inter_gbps=shape.nic_gbps, intra_latency_s=cluster.intra_node_latency_s,
        inter_latency_s=cluster.inter_node_latency_s, intra_curve=curve)


# The step's stats (runtime/observe/metrics.py, ``gather_stats``): one fp64 vector per rank, 9 values (loss, square
# norm and non-finite parts; forward, backward, idle and exposed-sync seconds; two memory figures).
STATS_BYTES_PER_RANK = 9 * 8


def world_gather_shape(cluster: Cluster, ranks: np.ndarray, bytes_per_rank: int) -> SyncShape | None:
    """The all-gather of ``bytes_per_rank`` from each of ``ranks`` (a plan's every rank) as the shape of the
    all-reduce of the gathered bytes (a ring all-gather is that all-reduce's second half,
    ``model_comm.sharded_phase_fraction``). Every rank of a node is in it, so they share its NIC
    (``nic_share_gbps`` with all of them sharing). None for a single rank."""
    if len(ranks) < 2:
        return None
    cols = cluster.columns
    nodes, per_node = np.unique(cols.node[ranks], return_inverse=True)
    here = np.bincount(per_node)
    count = here[per_node]
    share = np.minimum(count * cols.flow_gbps[ranks], cols.nic_gbps[ranks])
    kinds, first = np.unique(cols.gpu[ranks], return_index=True)
    return SyncShape(float(len(ranks) * bytes_per_rank), len(ranks), len(nodes), int(here.max()),
                     float(cols.intra_gbps[ranks].min()), float(share.min()),
                     tuple(cols.gpus[int(k)] for k in kinds[np.argsort(first)]))


def block_sync_order(num_blocks: int) -> list[int]:
    """The order the runtime issues block all-reduces in (``runtime/grad_buckets.sync_order``): blocks
    descending, the order their gradients become final in the backward; the tied matrix after them."""
    return list(range(num_blocks - 1, -1, -1))


def tied_holder_stages(plan: Plan) -> list[tuple[int, int]]:
    """(pipeline, stage) of every copy of a tied embedding: each pipeline's first stage, and its last if deeper."""
    return [(p, s) for p, pipe in enumerate(plan.pipelines) for s in dict.fromkeys((0, pipe.depth - 1))]


def tied_sync_shape(plan: Plan, cluster: Cluster, num_bytes: float) -> SyncShape | None:
    """The tied matrix's one all-reduce among all its copies (after the blocks: it shares no NIC with them);
    None where a single stage holds the only copy."""
    stages = [plan.pipelines[p].stages[s] for p, s in tied_holder_stages(plan)]
    if len(stages) < 2:
        return None
    heads = [cluster.devices[st.ranks[0]] for st in stages]
    here: dict[int, int] = {}
    nic: dict[int, tuple[float, float]] = {}
    for d in heads:
        here[d.node] = here.get(d.node, 0) + 1
        nic[d.node] = (d.nic_gbps, d.flow_gbps)
    return SyncShape(num_bytes=num_bytes / min(st.tp for st in stages), num_ranks=len(heads), num_nodes=len(here),
                     max_ranks_per_node=max(here.values()), intra_gbps=min(d.gpu.intra_node_gbps for d in heads),
                     nic_gbps=min(nic_share_gbps(*nic[n], c, c) for n, c in here.items()),
                     gpus=distinct_gpus(d.gpu for d in heads))


def holder_stages(plan: Plan) -> list[list[tuple[int, int]]]:
    """Per block: the (pipeline, stage) holding it in every pipeline, in plan order."""
    per_pipe = layer_owners(plan.pipelines, plan.num_layers)
    return [[(p, owner[block.layers[0]]) for p, owner in enumerate(per_pipe)] for block in plan.blocks]


def block_sync_shapes(plan: Plan, cluster: Cluster, grad_bytes: Callable[[Block, bool, bool], float]
                      ) -> list[SyncShape | None]:
    """Per block its all-reduce shape, or None where one pipeline alone holds it."""
    devices = cluster.devices
    holders_of = holder_stages(plan)
    syncing: dict[int, int] = {}  # node -> its ranks in cross-node block groups
    crossing: list[bool] = []
    counted: set[tuple[int, int]] = set()
    for holders in holders_of:
        stages = [plan.pipelines[p].stages[s] for p, s in holders]
        cross = len(holders) > 1 and len({devices[st.ranks[0]].node for st in stages}) > 1
        crossing.append(cross)
        for key, st in zip(holders, stages):
            if cross and key not in counted:
                counted.add(key)
                for r in st.ranks:
                    syncing[devices[r].node] = syncing.get(devices[r].node, 0) + 1
    out: list[SyncShape | None] = []
    last = len(plan.blocks) - 1
    for k, (block, holders, cross) in enumerate(zip(plan.blocks, holders_of, crossing)):
        if len(holders) < 2:
            out.append(None)
            continue
        stages = [plan.pipelines[p].stages[s] for p, s in holders]
        heads = [devices[st.ranks[0]] for st in stages]
        here: dict[int, int] = {}
        nic: dict[int, tuple[float, float]] = {}
        for d in heads:
            here[d.node] = here.get(d.node, 0) + 1
            nic[d.node] = (d.nic_gbps, d.flow_gbps)
        out.append(SyncShape(
            num_bytes=grad_bytes(block, k == 0, k == last) / min(st.tp for st in stages), num_ranks=len(heads),
            num_nodes=len(here), max_ranks_per_node=max(here.values()),
            intra_gbps=min(d.gpu.intra_node_gbps for d in heads),
            nic_gbps=min(nic_share_gbps(*nic[n], c, syncing[n] if cross else c) for n, c in here.items()),
            gpus=distinct_gpus(d.gpu for d in heads)))
    return out
