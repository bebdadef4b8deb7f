"""Robust pricing under per-type speed perturbations with online data re-split (planner/robust.py)."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ethpipe.cli import commands  # noqa: F401  (registers the commands)
from ethpipe.cli.app import app
from ethpipe.cluster import cluster_from_dict, load_cluster
from ethpipe.cost.model import CostModel
from ethpipe.errors import UserError
from ethpipe.model_load import load_model_spec
from ethpipe.planner import PlannerOptions, make_plan
from ethpipe.planner.estimate import estimate_iteration_s
from ethpipe.planner.robust import Scenario, perturbed, price_under, resplit, robust_record, scenarios

DEMO = "examples/clusters/cpu_demo.yaml"
A100, V100 = "a100_80gb_sxm", "v100_32gb_sxm2"


def _cluster(*parts: tuple[str, int, int]):
    return cluster_from_dict({"nodes": [{"gpu": g, "num_nodes": n, "gpus_per_node": 8, "nic_gbit_s": nic}
                                        for g, n, nic in parts]})


def _a100_v100():
    return _cluster((A100, 1, 1600), (V100, 1, 800))


def test_scenario_set() -> None:
    """Each type -30% and +30% alone; all but the fastest -30% together only with >= 3 types."""
    two = CostModel(_a100_v100(), load_model_spec("gpt3-1.3b"), 2048, dtype="fp16")
    assert [s.name for s in scenarios(two)] == [f"{A100} -30%", f"{A100} +30%", f"{V100} -30%", f"{V100} +30%"]
    three = CostModel(_cluster((A100, 1, 1600), (V100, 1, 800), ("t4", 1, 200)), load_model_spec("gpt3-1.3b"),
                      2048, dtype="fp16")
    names = [s.name for s in scenarios(three)]
    assert len(names) == 7 and names[-1] == "all but the fastest -30%"
    assert dict(scenarios(three)[-1].speeds) == {V100: 0.7, "t4": 0.7}


def test_resplit_keeps_layers_and_batch_and_moves_data_off_the_slowed_type() -> None:
    clu, spec = _a100_v100(), load_model_spec("llama2-7b")
    # 1F1B pipelines: an interleaved pipeline keeps its samples (its micro-batch count is constrained)
    # Whole layers: cut inside layers, one mixed layer-balanced replica wins here, and no pipeline is the V100s' own.
    plan = make_plan(clu, spec, 64, 4096, options=PlannerOptions(allow_mixed=False, sublayer_cuts=False),
                     schedules=("1f1b",))
    cost = CostModel.for_plan(plan)
    slow = resplit(plan, perturbed(cost, Scenario("v100 slow", ((V100, 0.7),))))
    assert [[s.layers for s in p.stages] for p in slow.pipelines] == [[s.layers for s in p.stages] for p in plan.pipelines]
    assert sum(p.num_samples for p in slow.pipelines) == 64
    v100_before = sum(p.num_samples for p in plan.pipelines if p.stages[0].device == V100)
    v100_after = sum(p.num_samples for p in slow.pipelines if p.stages[0].device == V100)
    assert v100_after < v100_before


def test_layer_balanced_replicas_lose_to_per_type_pipelines_when_a_type_is_slower() -> None:
    """Issue 13's case, qualitatively (llama2-7b, 8 A100 + 8 V100): every layer-balanced replica holds
    V100 stages, so a slower V100 slows every replica and re-splitting data cannot help; per-type
    pipelines move samples to the A100 pipelines and absorb part of it. At nominal speeds the per-type plan
    is ~12% slower here (the shipped constants), so the V100s run at half speed: a slowdown that matters."""
    clu, spec = _a100_v100(), load_model_spec("llama2-7b")
    balanced = make_plan(clu, spec, 64, 4096, "layer-balanced", max_tp=1)
    per_type = make_plan(clu, spec, 64, 4096, max_tp=1, options=PlannerOptions(allow_mixed=False))
    assert all(len({s.device for s in p.stages}) == 2 for p in balanced.pipelines)
    assert all(len({s.device for s in p.stages}) == 1 for p in per_type.pipelines)
    slow = Scenario(f"{V100} -50%", ((V100, 0.5),))
    cost = CostModel.for_plan(balanced)
    t_balanced, t_per_type = price_under(balanced, cost, slow), price_under(per_type, cost, slow)
    assert t_per_type < t_balanced
    # the per-type plan's slowdown is smaller because the re-split absorbs part of it
    assert (t_per_type / per_type.predicted["iteration_time_s"]
            < t_balanced / balanced.predicted["iteration_time_s"])
    pc = perturbed(cost, slow)
    assert estimate_iteration_s(resplit(per_type, pc), pc) < estimate_iteration_s(per_type, pc)


CASES = [
    (DEMO, "tiny", 32, 64),
    ("a100_v100", "llama2-7b", 64, 4096),
    ("a100_v100", "gpt3-1.3b", 128, 2048),
    ("three", "gpt3-1.3b", 96, 2048),
]


@pytest.mark.parametrize("cluster, model, batch, seq", CASES)
def test_robust_never_worsens_the_worst_case(cluster, model, batch, seq) -> None:
    clu = {"a100_v100": _a100_v100, "three": lambda: _cluster((A100, 1, 1600), (V100, 1, 800), ("t4", 1, 200))
           }.get(cluster, lambda: load_cluster(cluster))()
    spec = load_model_spec(model)
    nominal = make_plan(clu, spec, batch, seq, max_tp=1)
    robust = make_plan(clu, spec, batch, seq, max_tp=1, robust=True)
    nominal_worst = robust_record(nominal, CostModel.for_plan(nominal))["worst_case_time_s"]
    assert robust.predicted["worst_case_time_s"] <= nominal_worst * (1 + 1e-9)
    if robust.predicted["iteration_time_s"] < nominal.predicted["iteration_time_s"] * (1 - 1e-9):
        # Nominally faster only through a sharding round the nominal fixpoint converged before (it stops where a
        # round's plan has k pipelines): "three" takes the round at 16 holders, 0.1% faster than the nominal plan.
        tried = [set(p.extra["search"]["shard_optimizer"]["holders_tried"]) for p in (nominal, robust)]
        assert tried[1] - tried[0], "the robust plan beats the nominal one on a round both searched"
    assert robust.predicted["worst_case_time_s"] >= robust.predicted["iteration_time_s"]
    assert robust.extra["search"]["robust"] is True
    assert robust_record(robust, CostModel.for_plan(robust))["worst_case_time_s"] == pytest.approx(
        robust.predicted["worst_case_time_s"])


def test_robust_is_for_eth_only() -> None:
    with pytest.raises(UserError, match="--robust"):
        make_plan(load_cluster(DEMO), load_model_spec("tiny"), 32, 64, "uniform", robust=True)


def test_cli_plan_robust_and_compare_print_worst_case(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["--cluster", DEMO, "--model", "tiny", "--global-batch", "32", "--seq-len", "64", "--max-tp", "1"]
    res = runner.invoke(app, ["plan", *args, "--robust"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "worst case" in res.output and "balance efficiency = product of" in res.output
    out = tmp_path / "r.json"
    res = runner.invoke(app, ["compare", *args, "--out", str(out)], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "worst case s" in res.output
    rows = json.loads(out.read_text())["methods"]
    assert set(rows) == {"eth", "eth (no ZeRO)", "eth 1F1B only", "uniform", "layer-balanced", "uniform (best type)",
                         "layer-balanced (best type)"}
    assert all(row["worst_case_time_s"] > 0 and row["worst_scenario"] for row in rows.values())
