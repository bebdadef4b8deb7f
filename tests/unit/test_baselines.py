from ethpipe.cluster import cluster_from_dict
from ethpipe.model_load import load_model_spec
from ethpipe.planner import make_plan
from ethpipe.planner.baselines.baselines import equal_split
from ethpipe.planner.devices.templates import equal_layers

CLUSTER = cluster_from_dict({"nodes": [
    {"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 800},
    {"gpu": "v100_32gb_sxm2", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 400}]})


def test_splits() -> None:
    assert equal_split(10, 3) == [4, 3, 3]
    assert equal_layers(10, 4) == [3, 3, 2, 2] and sum(equal_layers(32, 3)) == 32


def test_uniform_equal_layers_and_data() -> None:
    plan = make_plan(CLUSTER, load_model_spec("gpt3-1.3b"), 64, 2048, "uniform")
    sizes = {p.num_samples for p in plan.pipelines}
    assert max(sizes) - min(sizes) <= 1
    for p in plan.pipelines:
        counts = [s.num_layers for s in p.stages]
        assert max(counts) - min(counts) <= 1
    assert len({tuple(s.num_layers for s in p.stages) for p in plan.pipelines}) == 1


def test_layer_balanced_replicates_one_mixed_shape() -> None:
    plan = make_plan(CLUSTER, load_model_spec("gpt3-1.3b"), 64, 2048, "layer-balanced")
    shapes = {tuple((s.device, s.num_layers, s.tp) for s in p.stages) for p in plan.pipelines}
    assert len(shapes) == 1
    (shape,) = shapes
    assert {d for d, _, _ in shape} == {"a100_80gb_sxm", "v100_32gb_sxm2"}
    assert max(p.num_samples for p in plan.pipelines) - min(p.num_samples for p in plan.pipelines) <= 1
    assert plan.extra["search"]["timed_out"] is False


def test_layer_balanced_is_at_least_as_good_as_uniform_when_uniform_is_in_its_space() -> None:
    # One DP replica per GPU-type pair: uniform's in-rank-order shape (a100 x4 then v100 x4) is a
    # layer-balanced candidate with a non-optimal split, so exhaustive layer-balanced cannot lose.
    # llama2-7b fits these 8 GPUs only as one 8-deep pipeline, so uniform picks exactly that shape.
    spec = load_model_spec("llama2-7b")
    lb = make_plan(CLUSTER, spec, 64, 2048, "layer-balanced", max_tp=1)
    uni = make_plan(CLUSTER, spec, 64, 2048, "uniform", max_tp=1)
    assert [[s.device for s in p.stages] for p in uni.pipelines] == [["a100_80gb_sxm"] * 4 + ["v100_32gb_sxm2"] * 4]
    assert lb.predicted["iteration_time_s"] <= uni.predicted["iteration_time_s"] * (1 + 1e-9)


def test_layer_balanced_time_budget_is_reported() -> None:
    plan = make_plan(CLUSTER, load_model_spec("gpt3-1.3b"), 64, 2048, "layer-balanced", time_budget_s=0.0)
    assert plan.extra["search"]["timed_out"] is True and plan.extra["search"]["candidates_evaluated"] >= 1
