"""Level 1's groups built from rank matrices (``rank_structures``, ``make_group``, ``RankRows``) are exactly the
groups a per-pipeline, per-device loop builds: same structures in the same order, same node statistics."""

from collections import Counter

import numpy as np
import pytest

from ethpipe.cluster import cluster_from_dict
from ethpipe.cost.model import CostModel
from ethpipe.cost.sync import distinct_gpus
from ethpipe.model_load import load_model_spec
from ethpipe.planner.devices.grouping import StageNodes, homogeneous_group, make_group, rank_structures
from ethpipe.planner.devices.instances import RankRows
from ethpipe.planner.devices.replicated import layer_balanced_layouts, uniform_layouts
from ethpipe.planner.devices.templates import Template, pool_shapes, pools_of, slots_for
from ethpipe.planner.layers.timing import link_key

# Two pools of one type with different NICs (and a rail), a type spread over node sizes: links and NIC
# figures differ between replicas, so structures split and node statistics are not uniform.
CLUSTER = {"nodes": [
    {"gpu": "a100_80gb_sxm", "num_nodes": 2, "gpus_per_node": 4, "nic_gbit_s": 800, "nic_rail_gbit_s": 100},
    {"gpu": "v100_32gb_sxm2", "num_nodes": 2, "gpus_per_node": 4, "nic_gbit_s": 400},
    {"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 200},
    {"gpu": "l4", "num_nodes": 2, "gpus_per_node": 2, "nic_gbit_s": 100},
]}


def _reference_structures(cost: CostModel, instances: list[tuple]) -> list[tuple]:
    """The per-device loops: group by devices, TP and links, then each stage's heads per node (first seen
    first, a node's NIC figures from its last head), the slowest intra-node link, the heads' GPU types, and
    every rank's node."""
    devices = cost.cluster.devices
    members: dict[tuple, list[tuple]] = {}
    for slots in instances:
        members.setdefault((tuple((s.device, s.tp) for s in slots), link_key(cost, slots)), []).append(slots)
    out = []
    for inst in members.values():
        stages = []
        for s in range(len(inst[0])):
            at = [devices[slots[s].ranks[0]] for slots in inst]
            heads: dict[int, int] = {}
            nic: dict[int, float] = {}
            flow: dict[int, float] = {}
            for d in at:
                heads[d.node] = heads.get(d.node, 0) + 1
                nic[d.node], flow[d.node] = d.nic_gbps, d.flow_gbps
            stages.append(StageNodes(tuple((n, c, nic[n]) for n, c in heads.items()),
                                     min(d.gpu.intra_node_gbps for d in at), tuple(flow.items()),
                                     distinct_gpus(d.gpu for d in at)))
        nodes = Counter(devices[r].node for slots in inst for slot in slots for r in slot.ranks)
        out.append((inst[0], tuple(inst), tuple(stages), tuple(nodes.items())))
    return out


@pytest.mark.parametrize("space", ["layer_balanced", "uniform"])
def test_rank_structures_are_the_per_device_loops(space: str) -> None:
    cost = CostModel(cluster_from_dict(CLUSTER), load_model_spec("gpt3-350m"), 512)
    layouts = (layer_balanced_layouts if space == "layer_balanced" else uniform_layouts)(cost, 64, 2)
    devices = cost.cluster.devices
    checked = 0
    for _, tp, _, _, _, build, _ in layouts:
        ranks = build()
        instances = [slots_for([(devices[r].gpu.id, r) for r in row], tp) for row in ranks.tolist()]
        got = rank_structures(cost, ranks, tp)
        want = _reference_structures(cost, instances)
        assert [(slots, tuple(g.instances), g.stages, g.ranks_per_node) for slots, g in got] == want
        assert all(isinstance(g.instances, RankRows) and g.count == len(g.instances) for _, g in got)
        checked += len(got)
    assert checked > 10  # the cluster splits layouts into several structures


def test_homogeneous_groups_are_the_per_device_loops() -> None:
    cost = CostModel(cluster_from_dict(CLUSTER), load_model_spec("gpt3-350m"), 512)
    pool = pools_of(cost)[0]  # the three 4-GPU A100 nodes, two NICs
    assert len(pool.nodes) == 3
    for depth, tp, span in pool_shapes(cost, pool, 2):
        slots = slots_for([(pool.device, r) for r in pool.nodes[0][:depth * tp]], tp)
        template = Template(0, depth, tp, 1, span, slots, None, None)  # type: ignore[arg-type]
        group = homogeneous_group(cost, template, pool)
        (_, inst, stages, nodes), = _reference_structures(cost, list(group.instances))
        assert (stages, nodes) == (group.stages, group.ranks_per_node)
        backwards = list(reversed(group.instances))  # nodes first seen in descending order: not sorted
        (_, _, stages, nodes), = _reference_structures(cost, backwards)
        again = make_group(cost, template, backwards)
        assert (stages, nodes) == (again.stages, again.ranks_per_node) and again.instances == tuple(backwards)


def test_rank_rows_read_like_the_tuple_they_stand_for() -> None:
    ranks = np.arange(12, dtype=np.int64).reshape(3, 4)
    rows = RankRows(("a", "b"), 2, ranks)
    want = tuple(slots_for([("a", r[0]), ("a", r[1]), ("b", r[2]), ("b", r[3])], 2) for r in ranks.tolist())
    assert rows[0] == want[0] and rows[-1] == want[-1]  # before materialising
    assert len(rows) == 3 and tuple(rows) == want and rows[1:] == want[1:] and rows == want and rows == list(want)
    assert rows != want[:2] and hash(rows) == hash(want)
    assert all(type(r) is int for slot in rows[2] for r in slot.ranks)  # plain ints, as the plan writes them
