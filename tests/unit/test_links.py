"""Communication priced on measured curves, NIC rails and NIC contention (cost/links.py, cost/p2p.py)."""

import math

import pytest

from ethpipe.catalog import get_gpu
from ethpipe.cluster import cluster_from_dict
from ethpipe.cost import comm, links
from ethpipe.cost.model import CostModel
from ethpipe.cost.sync import nic_share_gbps
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Block, Pipeline, Plan, Stage

TINY = load_model_spec("tiny")
A100 = get_gpu("a100_40gb_sxm")


def test_small_messages_run_far_below_the_links_peak() -> None:
    curve = links.shipped_link_curves().curve("a100_40gb_sxm", 2)
    # Shipped fit: 0.808 x^2 + 16.4 x + 33.0 GB/s at x = log2(MB); capped at the measured 248.9.
    assert curve.gbps(1e6) == pytest.approx(32.98046678)
    x = math.log2(8)
    assert curve.gbps(8e6) == pytest.approx(0.80818532 * x * x + 16.40103598 * x + 32.98046678)  # 89.5
    assert curve.gbps(1e10) == pytest.approx(248.876)
    assert curve.gbps(1e6) < 0.15 * curve.max_gbps
    # Below 1 MB the fit is not trusted (it turns negative): the 1 MB bandwidth holds, latency comes on top.
    assert curve.gbps(64e3) == pytest.approx(32.98046678)
    assert curve.transfer_s(64e3) == pytest.approx(64e3 / 32.98046678e9)


def test_concave_curve_holds_its_vertex_past_the_measured_range() -> None:
    c = links.LinkCurve(-1.0, 10.0, 20.0, 1000.0)  # vertex at x = 5: 45 GB/s
    assert c.gbps(2**5 * 1e6) == pytest.approx(45.0)
    assert c.gbps(2**30 * 1e6) == pytest.approx(45.0)


def test_gpu_count_picks_the_measured_curve() -> None:
    curves = links.shipped_link_curves()
    assert curves.curve("rtx_3090", 8).max_gbps < curves.curve("rtx_3090", 2).max_gbps / 5  # PCIe through the host
    assert curves.curve("gh200_96gb", 8) == curves.curve("gh200_96gb", 4)  # largest measured count
    assert curves.curve("rtx_3090", 3) == curves.curve("rtx_3090", 4)  # nearest larger count
    assert curves.curve("h100_sxm", 2) is None


def test_tp_allreduce_on_the_curve_and_flat_without_one() -> None:
    clu = cluster_from_dict({"nodes": [{"gpu": "a100_40gb_sxm", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 100},
                                       {"gpu": "h100_sxm", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 100}]})
    cost = CostModel(clu, TINY, 128)
    act = 128 * TINY.hidden_size * 2
    want = comm.ring_allreduce_s(4, act, links.shipped_link_curves().curve("a100_40gb_sxm", 4).gbps(act), 5e-6)
    assert cost.tp_allreduce_s("a100_40gb_sxm", 4, 1) == pytest.approx(want)
    h100 = get_gpu("h100_sxm").intra_node_gbps
    assert cost.tp_allreduce_s("h100_sxm", 4, 1) == pytest.approx(comm.ring_allreduce_s(4, act, h100, 5e-6))
    notes = cost.compute_model_notes()
    assert "measured NCCL curve" in notes["a100_40gb_sxm"]
    assert "flat" in notes["h100_sxm"] and "no measured curve" in notes["h100_sxm"]


def test_cluster_override_of_the_intra_node_link_wins_over_the_curve() -> None:
    clu = cluster_from_dict({"nodes": [{"gpu": "a100_40gb_sxm", "num_nodes": 1, "gpus_per_node": 2,
                                        "nic_gbit_s": 100, "intra_node_gbps": 10.0}]})
    cost = CostModel(clu, TINY, 128)
    act = 128 * TINY.hidden_size * 2
    assert cost.p2p_s(0, 1, 1) == pytest.approx(5e-6 + act / 10e9)
    assert "flat 10 GB/s" in cost.compute_model_notes()["a100_40gb_sxm"]


def test_one_nic_rail_per_gpu_capped_by_the_node_nic() -> None:
    spec = {"nodes": [{"gpu": "a100_40gb_sxm", "num_nodes": 2, "gpus_per_node": 8, "nic_gbit_s": 800,
                       "nic_rail_gbit_s": 200}]}
    clu = cluster_from_dict(spec)
    assert clu.link_gbps(0, 8) == 25.0  # one GPU: its own 200 Gbit/s rail, not the node's 800
    assert nic_share_gbps(100.0, 25.0, 1, 1) == 25.0
    assert nic_share_gbps(100.0, 25.0, 8, 8) == 100.0  # 8 rails, capped by the node's NIC
    assert nic_share_gbps(100.0, 25.0, 2, 8) == 25.0  # a quarter of the NIC, 2 rails would allow 50
    cost = CostModel(clu, TINY, 128)
    one = cost.allreduce_s([0, 8], 10**9)
    assert one == pytest.approx(comm.allreduce_shape_s(
        10**9, num_ranks=2, num_nodes=2, max_ranks_per_node=1, intra_gbps=300, inter_gbps=25.0,
        intra_latency_s=5e-6, inter_latency_s=10e-6))
    # Without rails (existing cluster files) one GPU may use the whole NIC, as before.
    del spec["nodes"][0]["nic_rail_gbit_s"]
    old = cluster_from_dict(spec)
    assert old.link_gbps(0, 8) == 100.0 and old.devices[0].flow_gbps == old.devices[0].nic_gbps


def _two_pipelines(ranks: list[tuple[int, int]]) -> Plan:
    pipes = tuple(Pipeline((Stage((a,), "a100_40gb_sxm", (0, 1)), Stage((b,), "a100_40gb_sxm", (1, 2))), (1,))
                  for a, b in ranks)
    return Plan("eth", "tiny", len(ranks), 128, pipes,
                (Block((0, 1), tuple(a for a, _ in ranks)), Block((1, 2), tuple(b for _, b in ranks))))


def test_two_pipelines_crossing_the_same_nic_halve_its_bandwidth() -> None:
    clu = cluster_from_dict({"nodes": [{"gpu": "a100_40gb_sxm", "num_nodes": 2, "gpus_per_node": 2, "nic_gbit_s": 100}]})
    cost = CostModel(clu, TINY, 128)
    alone = cost.with_plan_p2p(_two_pipelines([(0, 2)]))
    shared = cost.with_plan_p2p(_two_pipelines([(0, 2), (1, 3)]))
    assert alone.p2p_link_gbps(0, 2, 1e6) == 12.5
    assert shared.p2p_link_gbps(0, 2, 1e6) == 6.25 and shared.p2p_link_gbps(3, 1, 1e6) == 6.25
    act = 128 * TINY.hidden_size * 2
    assert shared.p2p_s(0, 2, 1) == pytest.approx(10e-6 + act / 6.25e9)
    # Pipelines that stay inside their node do not share the NIC.
    inside = cost.with_plan_p2p(_two_pipelines([(0, 1), (2, 3)]))
    assert inside.p2p_link_gbps(0, 1, 1e6) == pytest.approx(links.intra_gbps(clu.devices[0].gpu, 2, 1e6))
    # With one 100 Gbit/s rail per GPU on a 200 Gbit/s node the two flows do not contend.
    railed = cluster_from_dict({"nodes": [{"gpu": "a100_40gb_sxm", "num_nodes": 2, "gpus_per_node": 2,
                                           "nic_gbit_s": 200, "nic_rail_gbit_s": 100}]})
    both = CostModel(railed, TINY, 128).with_plan_p2p(_two_pipelines([(0, 2), (1, 3)]))
    assert both.p2p_link_gbps(0, 2, 1e6) == 12.5


def test_simulator_and_estimate_price_the_contention() -> None:
    from ethpipe.planner import estimate_plan
    from ethpipe.sim import simulate

    clu = cluster_from_dict({"nodes": [{"gpu": "a100_40gb_sxm", "num_nodes": 2, "gpus_per_node": 2,
                                        "nic_gbit_s": 1}]})  # a slow NIC so the p2p dominates
    plan = _two_pipelines([(0, 2), (1, 3)])
    plan = Plan(**{**plan.__dict__, "cluster": clu.source, "model_spec": TINY})
    cost = CostModel(clu, TINY, 128)
    sim = simulate(plan, cost).iteration_time_s
    est = estimate_plan(plan, cost).iteration_time_s
    assert sim == pytest.approx(est, rel=1e-6)
    # The same plan with one 1 Gbit/s rail per GPU (2 Gbit/s node): no contention, faster.
    railed = cluster_from_dict({"nodes": [{"gpu": "a100_40gb_sxm", "num_nodes": 2, "gpus_per_node": 2,
                                           "nic_gbit_s": 2, "nic_rail_gbit_s": 1}]})
    free = simulate(Plan(**{**plan.__dict__, "cluster": railed.source}), CostModel(railed, TINY, 128)).iteration_time_s
    assert free < sim


def test_a_ring_without_pcie_peer_to_peer_runs_at_half_the_slowest_measured_rate() -> None:
    """GeForce cards stage every ring step through host memory (no PCIe P2P): half the slowest NCCL rate the node
    measured for any group size up to the ring's; GPUs with P2P keep the group size's own curve."""
    from ethpipe.catalog import get_gpu
    from ethpipe.cost.links import HOST_STAGED_CROSSINGS, allreduce_gbps, intra_gbps

    geforce, a100 = get_gpu("rtx_2080_ti"), get_gpu("a100_40gb_sxm")
    assert not geforce.pcie_p2p and a100.pcie_p2p
    assert {g for g in ("rtx_2080_ti", "titan_rtx", "rtx_3090", "rtx_4090") if not get_gpu(g).pcie_p2p} == \
        {"rtx_2080_ti", "titan_rtx", "rtx_3090", "rtx_4090"}
    n = 8e6
    for tp in (2, 4, 8):
        slowest = min(intra_gbps(geforce, k, n) for k in range(2, tp + 1))
        assert allreduce_gbps(geforce, tp, n) == slowest / HOST_STAGED_CROSSINGS
        assert allreduce_gbps(a100, tp, n) == intra_gbps(a100, tp, n)
    assert allreduce_gbps(geforce, 8, n) < intra_gbps(geforce, 8, n) / 2  # the 8-GPU curve reads higher than 2's


def test_a_geforce_nodes_gradient_sync_is_host_staged_like_its_tp_all_reduces() -> None:
    """Without PCIe peer-to-peer the data-parallel ring inside a node crosses host memory as the TP ring does
    (``links.allreduce_gbps``): 4 RTX 3090 pipelines' block sync on one node is priced at the staged rate, slower
    than the same GPUs priced on their peer-to-peer curve; an A100 node keeps its measured curve."""
    def sync_s(gpu: str) -> tuple[float, CostModel, Plan]:
        clu = cluster_from_dict({"nodes": [{"gpu": gpu, "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 100}]})
        pipes = tuple(Pipeline((Stage((r,), gpu, (0, 2)),), (1,)) for r in range(4))
        plan = Plan("eth", "tiny", 4, 128, pipes, (Block((0, 2), (0, 1, 2, 3)),))
        cost = CostModel(clu, TINY, 128)
        return cost.block_sync_s(plan)[0], cost, plan

    staged, cost, plan = sync_s("rtx_3090")
    nbytes = cost.block_grad_bytes(plan.blocks[0], first=True, last=True)
    rate = links.allreduce_gbps(get_gpu("rtx_3090"), 4, nbytes)
    assert rate < links.intra_gbps(get_gpu("rtx_3090"), 4, nbytes)
    assert staged == pytest.approx(comm.ring_allreduce_s(4, nbytes, rate, cost.cluster.intra_node_latency_s))
    assert cost.allreduce_s([0, 1, 2, 3], nbytes) == pytest.approx(staged)
    a100, cost_a, _ = sync_s("a100_40gb_sxm")  # same model and dtype: the same bytes
    curve = links.shipped_link_curves().curve("a100_40gb_sxm", 4)
    assert a100 == pytest.approx(comm.ring_allreduce_s(4, nbytes, curve.gbps(nbytes), cost_a.cluster.intra_node_latency_s))
