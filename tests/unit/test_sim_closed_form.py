"""The planner's closed-form estimate and the simulator agree on every plan the planner emits."""

from __future__ import annotations

import dataclasses
import random

import pytest

from ethpipe.cluster import cluster_from_dict
from ethpipe.model_load import load_model_spec
from ethpipe.planner import CostModel, estimate_iteration_s, make_plan
from ethpipe.sim import simulate

GPUS = ("a100_80gb_sxm", "h100_sxm", "v100_32gb_sxm2", "l4", "a100_40gb_sxm", "rtx_4090")
MODELS = ("tiny", "small", "gpt3-1.3b", "llama2-7b")
TOLERANCE = 0.05


def _random_case(seed: int) -> tuple[dict, str, int, int, str]:
    rng = random.Random(seed)
    groups = [
        {"gpu": g, "num_nodes": rng.randint(1, 3), "gpus_per_node": rng.choice([1, 2, 4, 8]),
         "nic_gbit_s": rng.choice([25, 100, 200, 400])}
        for g in rng.sample(GPUS, rng.randint(1, 3))
    ]
    return ({"nodes": groups}, rng.choice(MODELS), rng.choice([256, 1024, 2048]), rng.choice([8, 32, 64, 256]),
            rng.choice(["eth", "uniform", "layer-balanced"]))


@pytest.mark.parametrize("seed", range(36))
def test_planner_estimate_matches_simulation(seed: int) -> None:
    cluster_spec, model_name, seq_len, batch, method = _random_case(seed)
    model = load_model_spec(model_name)
    seq_len = min(seq_len, model.max_seq_len)
    try:
        plan = make_plan(cluster_from_dict(cluster_spec), model, batch, seq_len, method, time_budget_s=1.0)
    except ValueError as err:
        pytest.skip(f"no feasible plan: {err}")
    cost = CostModel.for_plan(plan)
    estimate = estimate_iteration_s(plan, cost)
    simulated = simulate(plan, cost).iteration_time_s
    assert simulated == pytest.approx(estimate, rel=TOLERANCE), (
        f"{method} {model_name} on {plan.world_size} ranks, {len(plan.pipelines)} pipelines: "
        f"estimate {estimate:.6f} s, simulated {simulated:.6f} s"
    )
    if len(plan.pipelines) > 1:  # the sharded optimizer's gather phase too (ZeRO-1: priced after the optimizer)
        zero = dataclasses.replace(plan, shard_optimizer=not plan.shard_optimizer)
        zero_cost = CostModel.for_plan(zero)
        assert simulate(zero, zero_cost).iteration_time_s == pytest.approx(estimate_iteration_s(zero, zero_cost),
                                                                          rel=TOLERANCE)
