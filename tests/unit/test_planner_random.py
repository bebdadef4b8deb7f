"""benchmarks/planner_random.py: the random clusters are what its report says, and its summary is computed from the
cases (the benchmark itself runs for minutes; here one small cluster is planned end to end)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import planner_random as pr  # noqa: E402


def test_random_clusters_have_the_sizes_types_and_nics_the_report_states() -> None:
    rng, pool = random.Random(0), pr.gpu_pool()
    clusters = [pr.random_cluster(rng, pool) for _ in range(20)]
    for name, cluster, nodes in clusters:
        assert cluster.num_devices in pr.SIZES, name
        assert 3 <= len({n["gpu"] for n in nodes}) == len(nodes) <= 5
        assert all(n["gpus_per_node"] in (4, 8) and n["nic_gbit_s"] in pr.NICS_GBIT for n in nodes)
        assert sum(n["num_nodes"] * n["gpus_per_node"] for n in nodes) == cluster.num_devices
    again = [pr.random_cluster(r, pool)[0] for r in [random.Random(0)] for _ in range(20)]
    assert again == [c[0] for c in clusters]  # seeded: the same clusters every run


def test_summary_is_the_worst_and_median_of_the_cases() -> None:
    factors = {k: 1.0 for k in pr.FACTORS}
    rows = [{"batch": "1/GPU", "planning_s": t, "balance_efficiency": e, "factors": {**factors, "compute": e},
             "model": "m", "cluster": f"c{i}"} for i, (t, e) in enumerate([(0.2, 0.5), (0.9, 0.3), (0.4, 0.7)])]
    rows.append({"batch": "4/GPU", "planning_s": 1.5, "error": "no plan fits"})
    s = pr.summary({"rows": rows})
    assert s["num_cases"] == 4 and s["num_planned"] == 3
    assert s["planning_s"] == {"median": pytest.approx(0.65), "worst": 1.5}
    one = s["by_batch"]["1/GPU"]
    assert one["median_efficiency"] == 0.5 and one["worst_efficiency"] == 0.3 and one["worst_case"] == "m on c1"
    assert one["median_factors"]["compute"] == 0.5 and one["worst_factors"]["compute"] == 0.3
    assert "4/GPU" not in s["by_batch"]


def test_one_case_is_planned_and_its_factors_multiply_to_its_efficiency() -> None:
    cluster = pr.cluster_from_dict({"nodes": [
        {"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 400},
        {"gpu": "v100_32gb_sxm2", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 100},
        {"gpu": "t4", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 50}]})
    row = pr.plan_case(cluster, "gpt3-1.3b", 2048, cluster.num_devices)
    assert "error" not in row and row["planning_s"] > 0
    product = 1.0
    for k in pr.FACTORS:
        product *= row["factors"][k]
    assert product == pytest.approx(row["balance_efficiency"], rel=1e-6)
