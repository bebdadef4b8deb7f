import pytest

from ethpipe.cluster import cluster_from_dict, load_cluster
from ethpipe.cost.model import CostModel, dtype_bytes
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Plan
from ethpipe.planner import PlannerOptions, estimate_iteration_s, make_plan
from ethpipe.planner.baselines.exhaustive import exhaustive_eth
from ethpipe.planner.devices.grouping import evaluate_groups, homogeneous_group
from ethpipe.planner.devices.templates import build_template, pools_of, shape_slots

HETERO = cluster_from_dict({"nodes": [
    {"gpu": "a100_80gb_sxm", "num_nodes": 2, "gpus_per_node": 4, "nic_gbit_s": 800},
    {"gpu": "v100_32gb_sxm2", "num_nodes": 2, "gpus_per_node": 4, "nic_gbit_s": 400}]})


@pytest.fixture(scope="module")
def eth_plan() -> Plan:
    return make_plan(HETERO, load_model_spec("llama2-7b"), 128, 2048, max_tp=1)


def test_plan_contract_fields(eth_plan: Plan) -> None:
    data = eth_plan.to_dict()
    assert data["method"] == "eth" and data["model"] == "llama2-7b" and data["cluster"] == HETERO.source
    assert set(data["device_speeds"]) == {"a100_80gb_sxm", "v100_32gb_sxm2"}
    assert data["device_speeds"]["a100_80gb_sxm"] == 1.0
    pred = data["predicted"]
    for key in ("iteration_time_s", "tokens_per_s", "balance_efficiency", "planning_time_s", "ideal_time_s", "mfu",
                "grad_sync_exposed_s"):
        assert pred[key] > 0 or key == "grad_sync_exposed_s"
    assert len(pred["devices"]) == HETERO.num_devices
    assert all(d["memory_bytes"] <= d["memory_capacity_bytes"] for d in pred["devices"])
    assert Plan.from_dict(data) == Plan.from_dict(Plan.from_dict(data).to_dict())  # validates and round-trips


def test_eth_pipelines_homogeneous_and_data_follows_speed() -> None:
    plan = make_plan(HETERO, load_model_spec("llama2-7b"), 128, 2048, max_tp=1,
                     options=PlannerOptions(allow_mixed=False))
    assert all(s.tp == 1 for p in plan.pipelines for s in p.stages)
    per_type: dict[str, list[float]] = {}
    for p in plan.pipelines:
        devices = {s.device for s in p.stages}
        assert len(devices) == 1
        per_type.setdefault(devices.pop(), []).append(p.num_samples / p.depth)
    assert min(per_type["a100_80gb_sxm"]) > 2 * max(per_type["v100_32gb_sxm2"])


def test_estimate_reproduces_prediction_and_efficiency_bounded(eth_plan: Plan) -> None:
    cost = CostModel.for_plan(eth_plan)
    assert estimate_iteration_s(eth_plan, cost) == pytest.approx(eth_plan.predicted["iteration_time_s"], rel=1e-12)
    assert 0 < eth_plan.predicted["balance_efficiency"] <= 1


@pytest.mark.parametrize("model, batch, seq", [("gpt3-1.3b", 64, 2048), ("llama2-7b", 96, 4096)])
def test_heuristic_close_to_exhaustive_over_own_space(model: str, batch: int, seq: int) -> None:
    spec = load_model_spec(model)
    plan = make_plan(HETERO, spec, batch, seq)
    dtype = str(plan.extra["dtype"])  # price the exhaustive search in the plan's precision (compute depends on it)
    best = exhaustive_eth(CostModel(HETERO, spec, seq, dtype_bytes=dtype_bytes(dtype), dtype=dtype), batch,
                          time_budget_s=120).plan
    assert best is not None
    assert plan.predicted["iteration_time_s"] <= best.predicted["iteration_time_s"] / 0.98


def test_every_method_balance_efficiency_at_most_one() -> None:
    spec = load_model_spec("gpt3-1.3b")
    for method in ("eth", "uniform", "layer-balanced"):
        plan = make_plan(HETERO, spec, 64, 2048, method)
        assert 0 < plan.predicted["balance_efficiency"] <= 1
        assert sorted(r for p in plan.pipelines for r in p.ranks) == list(range(plan.world_size))
        assert plan.world_size + len(plan.idle_devices) == HETERO.num_devices  # eth may idle the V100 nodes


def test_cpu_demo_cluster_plans_tiny() -> None:
    cluster = load_cluster("examples/clusters/cpu_demo.yaml")
    for batch, seq in ((24, 128), (48, 128)):  # the demo's batch and twice it, in fp32 as the demo plans it
        assert make_plan(cluster, load_model_spec("tiny"), batch, seq, max_tp=1, dtype="fp32").world_size == 6
        plan = make_plan(cluster, load_model_spec("tiny"), batch, seq, max_tp=1, dtype="fp32",
                         options=PlannerOptions(allow_mixed=False))
        assert plan.world_size == 6 and plan.extra["device_speeds"]["slow"] == pytest.approx(1 / 4)
        fast = [p.num_samples for p in plan.pipelines if p.stages[0].device == "fast"]
        slow = [p.num_samples for p in plan.pipelines if p.stages[0].device == "slow"]
        assert min(fast) > max(slow)


def test_errors() -> None:
    t4 = cluster_from_dict({"nodes": [{"gpu": "t4", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 100}]})
    with pytest.raises(ValueError, match=r"llama2-70b needs .* GiB per stage at depth 8 on t4") as err:
        make_plan(t4, load_model_spec("llama2-70b"), 64, 4096)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="smaller than the"):  # 8 layers: at least 6 pipelines on 48 GPUs
        make_plan(load_cluster("examples/clusters/a100_v100.yaml"), load_model_spec("tiny"), 1, 64, max_tp=1)
    with pytest.raises(ValueError, match="unknown method"):
        make_plan(t4, load_model_spec("tiny"), 8, 64, method="fast")


def test_evaluate_groups_skips_the_sync_only_when_the_flush_cannot_beat_the_cutoff() -> None:
    """The flush bound of the combination search: every stage's sync and optimizer step follow its last
    backward, so the priced time is at least the slowest flush; a cutoff below it changes nothing."""
    cost = CostModel(HETERO, load_model_spec("gpt3-350m"), 512)
    groups = []
    for i, pool in enumerate(pools_of(cost)):
        tpl = build_template(cost, i, shape_slots(pool, 2, 1, 1), 2, "auto", 1, {})
        assert tpl is not None
        groups.append(homogeneous_group(cost, tpl, pool))
    score, samples = evaluate_groups(cost, groups, 64)
    flush_s = max(float(g.template.timing.finish_s(max(row))[0]) for g, row in zip(groups, samples))
    assert flush_s < score  # the sync and optimizer are priced after the flush
    assert evaluate_groups(cost, groups, 64, cutoff_s=score)[0] == score  # above the flush: priced exactly
    assert evaluate_groups(cost, groups, 64, cutoff_s=flush_s * (1 + 1e-12))[0] == score
    assert evaluate_groups(cost, groups, 64, cutoff_s=flush_s)[0] == float("inf")
