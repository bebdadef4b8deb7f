import math

import pytest

from ethpipe.cluster import cluster_from_dict
from ethpipe.cost import comm
from ethpipe.cost.compute import model_train_flops
from ethpipe.cost.model import CostModel
from ethpipe.cost.profile import LayerTiming, MeasuredProfile
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Block, Stage

CLUSTER = cluster_from_dict({"nodes": [
    {"gpu": "a100_80gb_sxm", "num_nodes": 2, "gpus_per_node": 4, "nic_gbit_s": 200},
    {"gpu": "v100_32gb_sxm2", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 100}]})
L7 = load_model_spec("llama2-7b")


@pytest.fixture(scope="module")
def cost() -> CostModel:
    return CostModel(CLUSTER, L7, 4096)


def test_model_flops_close_to_6n_plus_attention() -> None:
    flops = model_train_flops(L7, 4096, 1)
    six_n = 6 * L7.num_params() * 4096
    assert six_n < flops < 1.6 * six_n  # attention term at s=4096 adds ~ s/(6h) * ... on top of 6N


def test_compute_scales_with_batch_tp_and_recompute(cost: CostModel) -> None:
    st = Stage((0,), "a100_80gb_sxm", (0, 8))
    f1, b1 = cost.stage_compute_s(st, 1, first=False, last=False)
    f2, b2 = cost.stage_compute_s(st, 2, first=False, last=False)
    # Backward: twice the GEMM FLOPs plus more elementwise traffic; per-layer overheads are tiny at 7B.
    # Fixed per-kernel costs (launches, weight reads) make two samples cost less than twice one.
    assert 2 * f1 <= b1 < 2.5 * f1 and 1.8 * f1 < f2 < 2 * f1
    _, brc = cost.stage_compute_s(Stage((0,), "a100_80gb_sxm", (0, 8), recompute=True), 1, first=False, last=False)
    # recomputation re-runs the forward but its last GEMM and residual (torch's checkpoint stops early)
    assert brc == pytest.approx(b1 + 8 * cost.recompute_s("a100_80gb_sxm", 1, 1)) and b1 + 0.7 * f1 < brc < b1 + f1
    ftp, _ = cost.stage_compute_s(Stage((0, 1), "a100_80gb_sxm", (0, 8), tp=2), 1, first=False, last=False)
    assert f1 / 2 < ftp < f1  # half the math plus Megatron all-reduces
    fv, _ = cost.stage_compute_s(Stage((8,), "v100_32gb_sxm2", (0, 8)), 1, first=False, last=False)
    # device_speed is the marginal whole-model rate; one 8-layer stage at b=1 tracks it closely.
    assert fv / f1 == pytest.approx(1 / cost.device_speed("v100_32gb_sxm2"), rel=0.15)
    assert cost.device_speed("a100_80gb_sxm") == 1.0


def test_p2p_and_allreduce(cost: CostModel) -> None:
    # A100-80 has a measured NCCL curve (cost/links.py): 33.5 MB sees 0.808 x^2 + 16.4 x + 33.0 GB/s,
    # x = log2(33.55) = 5.07: 137 GB/s, not the flat 300 (intended since the curves landed).
    act = 4096 * 4096 * 2
    x = math.log2(act / 1e6)
    p2p_gbps = 0.80818532 * x * x + 16.40103598 * x + 32.98046678
    assert 130 < p2p_gbps < 145
    assert cost.p2p_s(0, 1, 1) == pytest.approx(5e-6 + act / (p2p_gbps * 1e9))
    assert cost.p2p_s(0, 4, 1) == pytest.approx(10e-6 + act / 25e9)
    assert cost.allreduce_s([0], 10**9) == 0.0
    intra = cost.allreduce_s([0, 1, 2, 3], 10**9)
    assert intra == pytest.approx(comm.ring_allreduce_s(4, 10**9, 243.215, 5e-6))  # 4-GPU curve, capped at its max
    cross = cost.allreduce_s([0, 4], 10**9)
    slower = cost.allreduce_s([0, 8], 10**9)
    assert intra < cross < slower  # slowest link sets the bandwidth
    assert cost.allreduce_s([0, 4], 10**9, nic_share=2) > cross


def test_hierarchical_never_worse_than_flat() -> None:
    kw = dict(num_ranks=16, num_nodes=2, max_ranks_per_node=8, intra_gbps=300, inter_gbps=25,
              intra_latency_s=5e-6, inter_latency_s=1e-5)
    flat = 2 * 15 * 1e-5 + 2 * 15 / 16 * 1e9 / 25e9
    assert comm.allreduce_shape_s(1e9, **kw) < flat


def test_memory_and_blocks(cost: CostModel) -> None:
    st = Stage((0,), "a100_80gb_sxm", (0, 8))
    base = cost.stage_memory_bytes(st, 1, 4, first=True, last=False)
    states = 16 * (8 * L7.params_per_layer() + L7.embedding_params())
    assert base > states and cost.stage_memory_bytes(st, 1, 8, first=True, last=False) > base
    rc = cost.stage_memory_bytes(Stage((0,), "a100_80gb_sxm", (0, 8), recompute=True), 1, 4, first=True, last=False)
    assert states < rc < base
    whole = cost.block_grad_bytes(Block((0, 32), (0,)), first=True, last=True)
    assert whole == 4 * L7.num_params()  # fp32 gradients, also under bf16 (the runtime keeps fp32 weights)


def test_profile_takes_precedence() -> None:
    prof = MeasuredProfile("cpu", "cpu", "fp32", L7.to_dict(), 4096,
                           {"block": {1: LayerTiming(1.0, 2.0)}, "head": {1: LayerTiming(0.5, 1.0)},
                            "embedding": {1: LayerTiming(0.1, 0.1)}}, 1e-9)
    cost = CostModel(CLUSTER, L7, 2048, profiles={"v100_32gb_sxm2": prof})
    f, b = cost.layer_times_s("v100_32gb_sxm2", 1)
    assert 0.4 < f < 0.6 and b == pytest.approx(2 * f)  # scaled by the FLOPs ratio to s=2048
    assert cost.device_speed("v100_32gb_sxm2") < 0.02  # 0.5 s per block vs ~6 ms analytic A100
    with pytest.raises(ValueError, match="not in the cluster"):
        CostModel(CLUSTER, L7, 2048, profiles={"h100_sxm": prof})


def test_a_noisy_profile_extrapolates_to_what_a_size_costs() -> None:
    """A short profile run's cold first size can read slower than the next: the fitted line then falls with the
    micro-batch, and at larger sizes it reached 0 s. Unmeasured sizes stay at least the largest measured one's time
    above the range, at least their share of the smallest's below it, and between the neighbours' times inside."""
    def prof(points: dict[int, float]) -> MeasuredProfile:
        return MeasuredProfile("cpu", "cpu", "fp32", L7.to_dict(), 4096,
                               {"block": {b: LayerTiming(t, 2 * t) for b, t in points.items()}}, 1e-9)

    noisy = prof({1: 1.0, 2: 0.7})
    assert [noisy.layer_times_s("block", b)[0] for b in (4, 8)] == [0.7, 0.7]  # the line: 0.1 s and 0 s
    affine = prof({2: 1.0, 4: 1.5, 8: 2.5})  # 0.5 s + 0.25 s per sample: the line itself wherever it is sane
    assert [affine.layer_times_s("block", b)[0] for b in (1, 3, 16)] == pytest.approx([0.75, 1.25, 4.5])
    dipped = prof({2: 1.0, 4: 2.0, 8: 1.6})  # a slow middle point
    assert 1.0 <= dipped.layer_times_s("block", 3)[0] <= 2.0
    assert prof({2: 1.0, 4: 0.2}).layer_times_s("block", 1)[0] >= 0.5  # at least half of size 2's


def test_seq_len_checked() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        CostModel(CLUSTER, L7, 10**6)


def test_derived_pricings_share_the_achievable_rate_and_match_a_fresh_one() -> None:
    """The planner derives a pricing per holder count and idle candidate; each shares the per-type rate memo with
    its source (a slot-powered card's rate prices 64 micro-batch sizes) and reads what a fresh pricing computes."""
    t4 = cluster_from_dict({"nodes": [{"gpu": "t4", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 100},
                                      {"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 4,
                                       "nic_gbit_s": 200}]})
    base = CostModel(t4, L7, 4096)
    sharded = base.with_optimizer_holders(4)
    sub = base.on_cluster(t4.without_devices([0, 1, 2, 3]))
    assert sharded.shared_memo is base.shared_memo and sub.shared_memo is base.shared_memo
    fresh = CostModel(t4, L7, 4096)
    assert fresh.shared_memo is not base.shared_memo
    for on in (sharded, sub):
        for t in on.cluster.gpu_types:
            assert on.achievable_flops(t) == fresh.achievable_flops(t)
    # a pricing derived with other compute (``ethpipe simulate --catalog`` replaces the calibration) gets its own
    import dataclasses

    from ethpipe.cost.hardware import GpuFactor, shipped_calibration

    cal = shipped_calibration()
    slower = dataclasses.replace(cal, gpus={**cal.gpus, "a100_80gb_sxm": GpuFactor(0.5, 1)})
    other = dataclasses.replace(base, calibration=slower)
    assert other.shared_memo is not base.shared_memo
    assert other.device_speeds() == CostModel(t4, L7, 4096, calibration=slower).device_speeds() != base.device_speeds()
    assert dataclasses.replace(base, seq_len=2048).achievable_flops("t4") == CostModel(t4, L7, 2048).achievable_flops("t4")
    # the memo is keyed by the GPU's spec too: a type id re-specified inline is priced afresh
    slow = cluster_from_dict({"nodes": [{"gpu": {"id": "a100_80gb_sxm", "memory_gib": 80, "peak_tflops": 100.0},
                                         "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 200}]})
    assert (base.on_cluster(slow).achievable_flops("a100_80gb_sxm")
            == CostModel(slow, L7, 4096).achievable_flops("a100_80gb_sxm")
            != base.achievable_flops("a100_80gb_sxm"))



def test_the_optimizer_steps_memo_follows_the_holders() -> None:
    """``optimizer_s`` is memoised per pricing: a sharded pricing derived from an unsharded one that already
    priced the stage gets its own (smaller) step, the one a fresh sharded pricing computes."""
    base = CostModel(CLUSTER, L7, 4096)
    stage = Stage((0,), "a100_80gb_sxm", (0, 8))
    whole = base.optimizer_s(stage, first=True, last=False)
    sharded = base.with_optimizer_holders(4)
    assert sharded.optimizer_s(stage, first=True, last=False) == CostModel(
        CLUSTER, L7, 4096, optimizer_holders=4).optimizer_s(stage, first=True, last=False) < whole
    assert base.optimizer_s(stage, first=True, last=False) == whole
    assert base.optimizer_s(stage, first=False, last=False) < whole  # the embedding's update is not the block's
