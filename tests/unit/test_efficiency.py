"""Balance efficiency decomposed into factors (planner/efficiency.py, docs/cost-model.md)."""

import math

import pytest

from ethpipe.cluster import cluster_from_dict, load_cluster
from ethpipe.model_load import load_model_spec
from ethpipe.planner import PlannerOptions, make_plan
from ethpipe.planner.efficiency import FACTORS

DEMO = "examples/clusters/cpu_demo.yaml"


def _a100_v100():
    return cluster_from_dict({"nodes": [
        {"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 1600},
        {"gpu": "v100_32gb_sxm2", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 800}]})


CASES = [
    (DEMO, "tiny", 32, 64, "eth", None),
    (DEMO, "tiny", 32, 64, "uniform", None),
    (DEMO, "tiny", 24, 64, "eth", PlannerOptions(block_sync=False, fine_grained=False)),
    ("a100_v100", "gpt3-1.3b", 64, 2048, "eth", None),
    ("a100_v100", "gpt3-1.3b", 64, 2048, "uniform", None),
    ("a100_v100", "gpt3-1.3b", 16, 2048, "layer-balanced", None),
]


@pytest.mark.parametrize("cluster, model, batch, seq, method, options", CASES)
def test_factors_multiply_to_balance_efficiency(cluster, model, batch, seq, method, options) -> None:
    clu = _a100_v100() if cluster == "a100_v100" else load_cluster(cluster)
    plan = make_plan(clu, load_model_spec(model), batch, seq, method, max_tp=1, options=options)
    factors = plan.predicted["efficiency_factors"]
    assert tuple(factors) == FACTORS
    assert math.prod(factors.values()) == pytest.approx(plan.predicted["balance_efficiency"], rel=1e-9)
    for name, value in factors.items():
        assert 0.0 < value <= 1.0 + 1e-12, (name, value)


def test_single_stage_pipeline_has_no_granularity_bubble_or_p2p_loss() -> None:
    """One device, one stage: nothing to balance, no bubble beyond the one micro-batch in flight, no receives."""
    clu = cluster_from_dict({"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 1, "nic_gbit_s": 200}]})
    plan = make_plan(clu, load_model_spec("gpt3-125m"), 8, 512, max_tp=1)
    factors = plan.predicted["efficiency_factors"]
    assert len(plan.pipelines) == 1 and plan.pipelines[0].depth == 1
    assert factors["layer_granularity"] == pytest.approx(1.0)
    assert factors["bubble"] == pytest.approx(1.0)
    assert factors["p2p"] == pytest.approx(1.0)
    assert factors["data_balance"] == pytest.approx(1.0)
    assert factors["grad_sync"] == pytest.approx(1.0)


def test_equal_data_over_unequal_pipelines_shows_as_data_balance() -> None:
    """uniform gives equal data to pipelines of different types (rank order): that loss is data balance."""
    clu = cluster_from_dict({"nodes": [
        {"gpu": g, "num_nodes": 2, "gpus_per_node": 8, "nic_gbit_s": nic}
        for g, nic in (("a100_40gb_sxm", 1600), ("v100_16gb", 800), ("t4", 200))]})
    spec = load_model_spec("gpt3-1.3b")
    uniform = make_plan(clu, spec, 96, 2048, "uniform", max_tp=1)
    eth = make_plan(clu, spec, 96, 2048, "eth", max_tp=1)
    assert len({p.stages[0].device for p in uniform.pipelines}) > 1
    assert uniform.predicted["efficiency_factors"]["data_balance"] < 0.5
    assert eth.predicted["efficiency_factors"]["data_balance"] > 0.9


def test_idle_devices_show_as_the_idle_factor() -> None:
    """A plan that leaves a type idle is measured against the whole cluster: the idle type's capacity is
    the `idle` factor, and the factors still multiply to the balance efficiency."""
    from ethpipe.cost.model import CostModel
    from ethpipe.planner.estimate import ideal_time_s

    clu = cluster_from_dict({"nodes": [
        {"gpu": {"id": "slow", "memory_gib": 16, "peak_tflops": 2, "intra_node_gbps": 1.0}, "num_nodes": 2,
         "gpus_per_node": 2, "nic_gbit_s": 10},
        {"gpu": {"id": "fast", "memory_gib": 16, "peak_tflops": 100, "intra_node_gbps": 100.0}, "num_nodes": 1,
         "gpus_per_node": 4, "nic_gbit_s": 100}]})
    spec = load_model_spec("tiny")
    plan = make_plan(clu, spec, 8, 128, max_tp=1)
    assert plan.idle_devices, "precondition: eth leaves the slow type idle here"
    factors = plan.predicted["efficiency_factors"]
    full = CostModel(clu, spec, 128, dtype_bytes=2, dtype=plan.extra["dtype"])
    active = CostModel.for_plan(plan)
    assert factors["idle"] == pytest.approx(ideal_time_s(full, 8) / ideal_time_s(active, 8), rel=1e-9)
    assert factors["idle"] < 1.0
    assert plan.predicted["ideal_time_s"] == pytest.approx(ideal_time_s(full, 8), rel=1e-9)
    assert math.prod(factors.values()) == pytest.approx(plan.predicted["balance_efficiency"], rel=1e-9)
    every = make_plan(clu, spec, 8, 128, max_tp=1, options=PlannerOptions(allow_idle=False))
    assert every.predicted["efficiency_factors"]["idle"] == 1.0


def test_a_profiled_plan_never_beats_its_own_ideal(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """With a profile the ideal rate was the profile's micro-batch-1 rate: plans at larger micro-batches priced
    above it (balance efficiency 1.49, compute 1.56 on a CPU profile). It is now the whole model's fastest
    per-sample time over the micro-batch sizes a plan may use."""
    from ethpipe.cluster import load_cluster
    from ethpipe.cost.profile import LayerTiming, MeasuredProfile
    from ethpipe.model_load import load_model_spec
    from ethpipe.planner import make_plan

    spec = load_model_spec("tiny")
    # per micro-batch b: 2 ms fixed + 0.5 ms per sample (forward), twice that backward: b = 1 is the slowest rate
    layers = {kind: {b: LayerTiming(fwd_s=2e-3 + 5e-4 * b, bwd_s=4e-3 + 1e-3 * b) for b in (1, 2, 4, 8)}
              for kind in ("embedding", "block", "head")}
    profile = MeasuredProfile("cpu: test", "cpu", "fp32", spec.to_dict(), 128, layers, 1e-9)
    plan = make_plan(load_cluster("examples/clusters/cpu_tp.yaml"), spec, 16, 128, dtype="fp32",
                     profiles={"cpu": profile})
    assert plan.predicted["balance_efficiency"] <= 1.0 + 1e-9
    assert plan.predicted["efficiency_factors"]["compute"] <= 1.0 + 1e-9
