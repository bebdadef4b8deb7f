"""Pure logic of the evaluation suite (benchmarks/eval): headline statistics, case classes, plan
signatures and the replay of the runtime's online rebalancing."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from eval import headline as hl  # noqa: E402
from eval import replay as rp  # noqa: E402
from eval import scenarios as sc  # noqa: E402
from eval.common import layout_signature  # noqa: E402

from ethpipe.model_load import load_model_spec  # noqa: E402
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks  # noqa: E402
from ethpipe.planner import CostModel, make_plan  # noqa: E402
from ethpipe.sim import simulate  # noqa: E402

PAIR = "eth / layer-balanced"


def _sig(plan: dict[str, int], layout: dict[str, int] | None = None, kinds: int = 1, unequal: bool = False,
         used: int = 16) -> dict[str, Any]:
    return {"plan": plan, "layout": layout or {k.split(" b")[0]: v for k, v in plan.items()}, "kinds": kinds,
            "unequal_data": unequal, "devices_used": used, "uneven_layers": False}


def _method(sig: dict[str, Any], static: float, rebalanced: float) -> dict[str, Any]:
    rep = {"static": {"tokens_per_s": static}, "rebalanced": {"tokens_per_s": rebalanced}}
    return {"feasible": True, "signature": sig, "replay": {"nominal": rep, "slow": rep}}


def _row(spg: int, value: float, eth: dict[str, Any], base: dict[str, Any], rebalanced: float | None = None) -> dict:
    table = {"nominal": {PAIR: value}, "slow": {PAIR: value}}
    return {"cluster": "c", "model": f"m{spg}-{value}", "samples_per_gpu": spg,
            "methods": {"eth": eth, "layer-balanced": base},
            "speedup": {"static": table, "rebalanced": {"nominal": {PAIR: value},
                                                        "slow": {PAIR: rebalanced if rebalanced else value}}}}


def test_geomean_and_outcome_thresholds() -> None:
    assert hl.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert hl.outcome(1.02) == "win" and hl.outcome(1.005) == "tie" and hl.outcome(0.995) == "tie"
    assert hl.outcome(0.98) == "loss"
    assert hl.mechanism(1.0, 1.2) == "widened" and hl.mechanism(1.2, 1.0) == "narrowed"
    assert hl.mechanism(1.1, 1.105) == "unchanged"


def test_structure_compares_plans_not_ranks() -> None:
    a = _sig({"A:12 | V:12 b1 -- n16": 4})
    assert hl.structure(a, a) == "same plan"
    assert hl.structure(_sig({"A:12 | V:12 b2 -- n16": 4}), a) == "same layout"
    assert hl.structure(_sig({"A:24 b1 - n8": 8}, used=8), a) == "idle devices"
    mixed = _sig({"A:24 b1 - n20": 8, "V:12 | V:12 b1 -- n8": 4}, kinds=2, unequal=True)
    assert hl.structure(mixed, a) == "data-balanced kinds"
    assert hl.structure(_sig({"A:8 | V:16 b1 -- n16": 4}), a) == "other layout"


def test_stats_and_grid_over_samples_per_gpu() -> None:
    same = _sig({"x b1 - n1": 1})
    rows = [_row(1, 1.0, _method(same, 1, 1), _method(same, 1, 1)),
            _row(16, 1.5, _method(same, 1, 1), _method(same, 1, 1)),
            _row(16, 0.9, _method(same, 1, 1), _method(same, 1, 1))]
    rows.append({**_row(4, 1.0, _method(same, 1, 1), _method(same, 1, 1)),
                 "speedup": {m: {c: {PAIR: None} for c in ("nominal", "slow")} for m in ("static", "rebalanced")}})
    st = hl.stats(rows, PAIR, "nominal", "static")
    assert st["num_cases"] == 3 and st["geomean"] == pytest.approx((1.0 * 1.5 * 0.9) ** (1 / 3))
    assert st["max"]["value"] == 1.5 and st["max"]["samples_per_gpu"] == 16 and st["min"]["value"] == 0.9
    assert st["num_slower"] == 1 and st["num_slower_beyond_tolerance"] == 1 and st["num_faster_beyond_tolerance"] == 1
    cells = hl.grid(rows, [PAIR], ["nominal"], ["static"], [1, 4, 16])
    by = {c["samples_per_gpu"]: c for c in cells}
    assert by[1]["num_cases"] == 1 and by[4]["num_cases"] == 0 and by[16]["num_cases"] == 2 and by[0]["num_cases"] == 3
    assert by[16]["geomean"] == pytest.approx(math.sqrt(1.5 * 0.9))
    losses = hl.nominal_losses(rows, "eth", ["layer-balanced"])
    assert [(x["samples_per_gpu"], x["value"]) for x in losses] == [(16, 0.9)]


def test_classes_group_by_outcome_structure_and_mechanism() -> None:
    same = _sig({"x b1 - n1": 1})
    mixed = _sig({"y b1 - n3": 1, "z b1 - n1": 1}, kinds=2, unequal=True)
    rows = [_row(1, 1.0, _method(same, 10, 10), _method(same, 10, 10)),
            _row(16, 1.2, _method(mixed, 10, 13), _method(same, 10, 10), rebalanced=1.56),
            _row(16, 1.1, _method(mixed, 10, 12), _method(same, 10, 10), rebalanced=1.32)]
    nominal = hl.classes(rows, "eth", "layer-balanced", "nominal", "static", [1, 16])
    assert [(c["outcome"], c["structure"], c["count"]) for c in nominal] == [("win", "data-balanced kinds", 2),
                                                                            ("tie", "same plan", 1)]
    assert nominal[0]["by_samples_per_gpu"] == {"1": 0, "16": 2} and nominal[0]["mechanism"] is None
    slow = hl.classes(rows, "eth", "layer-balanced", "slow", "rebalanced", [1, 16])
    win = slow[0]
    assert (win["outcome"], win["mechanism"], win["count"]) == ("win", "widened", 2)
    assert win["median_a_gain"] == pytest.approx(1.25) and win["median_b_gain"] == 1.0
    assert win["b_could_rebalance"] == 0 and win["example"]["value"] == pytest.approx(1.56)


def test_moved_samples_and_condition_types() -> None:
    assert rp.moved_samples((10, 10, 4), (14, 8, 2)) == 4
    assert rp.moved_samples((5, 5), (5, 5)) == 0

    class Speeds:
        def device_speeds(self) -> dict[str, float]:
            return {"fast": 1.0, "mid": 0.6, "slow": 0.3}

    assert rp.device_type_for(Speeds(), rp.condition("slowest_slow")) == "slow"  # type: ignore[arg-type]
    assert rp.device_type_for(Speeds(), rp.condition("fastest_slow")) == "fast"  # type: ignore[arg-type]
    assert rp.device_type_for(Speeds(), rp.condition("nominal")) is None  # type: ignore[arg-type]


def _two_type_plan() -> Plan:
    """Two depth-2 pipelines, one per GPU type of the 16-GPU cluster, with equal data (32 samples each)."""
    cluster = sc.load(sc.cluster_scenario("a100_v100_16"))
    spec = load_model_spec("gpt3-1.3b")
    base = make_plan(cluster, spec, 64, 2048, "uniform")
    by_type: dict[str, list[int]] = {}
    for i, d in enumerate(cluster.devices):
        by_type.setdefault(d.gpu.id, []).append(i)
    half = spec.num_layers // 2
    pipes = tuple(Pipeline((Stage((r[0],), t, (0, half)), Stage((r[1],), t, (half, spec.num_layers))), (1,) * 32)
                  for t, r in by_type.items())
    return dataclasses.replace(base, pipelines=pipes, blocks=compute_blocks(pipes), idle_devices=())


def test_rebalance_moves_samples_off_the_slower_pipeline() -> None:
    plan = _two_type_plan()
    sig = layout_signature(plan)
    assert sig["kinds"] == 2 and not sig["unequal_data"] and sig["devices_used"] == 4 and len(sig["plan"]) == 2
    cost = CostModel.for_plan(plan)
    report = simulate(plan, cost)
    rates = rp.stage_rates_s(plan, report)
    assert [len(r) for r in rates] == [2, 2] and all(x > 0 for r in rates for x in r)
    out = rp.replay(plan, cost, report)
    assert out["static"]["tokens_per_s"] == pytest.approx(report.tokens_per_s)
    rb = out["rebalanced"]
    assert rb["applied"] >= 1 and rb["moved_samples"] > 0 and rb["first_predicted_gain"] > rp.THRESHOLD
    assert rb["tokens_per_s"] > out["static"]["tokens_per_s"]
    slowed = rp.device_type_for(cost, rp.condition("slowest_slow"))
    slow_cost = rp.cost_under(cost, rp.condition("slowest_slow"), slowed)
    assert simulate(plan, slow_cost).iteration_time_s > report.iteration_time_s


def test_single_pipeline_has_nothing_to_resplit() -> None:
    plan = _two_type_plan()
    one = dataclasses.replace(plan, pipelines=plan.pipelines[:1], global_batch_size=32,
                              blocks=compute_blocks(plan.pipelines[:1]))
    out = rp.replay(one, CostModel.for_plan(one))
    assert out["rebalanced"]["stop"] == "single pipeline" and out["rebalanced"]["applied"] == 0
    assert out["rebalanced"]["tokens_per_s"] == out["static"]["tokens_per_s"]
