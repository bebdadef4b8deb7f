"""ETH's widened level 1 (planner/devices/hybrid.py): hybrid layouts, per-type TP and split pools win where they
should, their plans load and simulate, and ETH stays within 2% of an exhaustive search of the same space."""

from __future__ import annotations

import pytest

from ethpipe.cluster import cluster_from_dict
from ethpipe.cost.model import CostModel, dtype_bytes
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Plan
from ethpipe.planner import PlannerOptions, estimate_iteration_s, make_plan
from ethpipe.planner.baselines.exhaustive import exhaustive_widened
from ethpipe.sim import simulate

NIC = {"h100_sxm": 3200, "a100_80gb_sxm": 1600, "a100_40gb_sxm": 1600, "v100_32gb_sxm2": 800, "v100_16gb": 800,
       "l4": 400, "t4": 200}
ALL_DEVICES = PlannerOptions(allow_idle=False)  # the exhaustive searches plan on every device too


def _cluster(*parts: tuple[str, int, int]):
    return cluster_from_dict({"nodes": [{"gpu": g, "num_nodes": n, "gpus_per_node": k, "nic_gbit_s": NIC[g]}
                                        for g, n, k in parts]})


def _loads_and_simulates(plan: Plan) -> None:
    loaded = Plan.from_dict(plan.to_dict())
    assert loaded == Plan.from_dict(loaded.to_dict())
    cost = CostModel.for_plan(loaded)
    simulated = simulate(loaded, cost).iteration_time_s
    assert simulated == pytest.approx(estimate_iteration_s(loaded, cost), rel=0.05)


def _wins_and_round_trips(cluster, spec, batch: int, flag: str) -> tuple[Plan, Plan]:  # type: ignore[no-untyped-def]
    """The plan with every family and the plan with ``flag`` off: the family must win, and its plan load and
    simulate; both are returned for the family's own checks. Under 1F1B, the schedule the search prices: with
    zb-h1 (a smaller bubble) a layout without the family may overtake it (here for hybrid at batch 48)."""
    plan = make_plan(cluster, spec, batch, 2048, options=ALL_DEVICES, shard_optimizer=False,  # the family alone
                     schedules=("1f1b",))
    without = make_plan(cluster, spec, batch, 2048, options=PlannerOptions(allow_idle=False, **{flag: False}),
                        shard_optimizer=False, schedules=("1f1b",))
    assert plan.predicted["iteration_time_s"] < without.predicted["iteration_time_s"]
    _loads_and_simulates(plan)
    return plan, without


def test_hybrid_layout_wins_and_round_trips() -> None:
    # Every type holds a replica alone; the best plan still interleaves two of them.
    cluster = _cluster(("a100_80gb_sxm", 2, 2), ("l4", 2, 2), ("h100_sxm", 2, 2))
    spec = load_model_spec("gpt3-350m")
    plan, _ = _wins_and_round_trips(cluster, spec, 48, "hybrid")
    mixed = [p for p in plan.pipelines if len({s.device for s in p.stages}) > 1]
    alone = [p for p in plan.pipelines if len({s.device for s in p.stages}) == 1]
    mixed_types = {s.device for p in mixed for s in p.stages}
    assert mixed and alone and len(mixed_types) == 2
    assert not mixed_types & {s.device for p in alone for s in p.stages}


def test_per_type_tp_inside_one_pipeline_wins_and_round_trips() -> None:
    # The 16 GB V100s hold their share of llama2-13b's layers only with a higher TP degree than the H100s'.
    cluster = _cluster(("h100_sxm", 2, 4), ("v100_16gb", 2, 4))
    spec = load_model_spec("llama2-13b")
    plan, without = _wins_and_round_trips(cluster, spec, 128, "per_type_tp")
    assert any(len({s.tp for s in p.stages}) > 1 and len({s.device for s in p.stages}) > 1 for p in plan.pipelines)
    assert all(len({s.tp for s in p.stages}) == 1 for p in without.pipelines if len({s.device for s in p.stages}) > 1)


def test_split_pool_wins_and_round_trips() -> None:
    # The A100 pool's nodes are shared by two shapes (depth 1 and 2): a finer split of the batch. The gain is
    # small (0.36% here; 0.24-0.33% at batches 20 and 40) and the family is the rarest winner of the search.
    cluster = _cluster(("a100_80gb_sxm", 3, 2), ("v100_32gb_sxm2", 2, 2))
    spec = load_model_spec("gpt3-350m")
    plan, _ = _wins_and_round_trips(cluster, spec, 12, "split_pools")
    a100 = {(p.depth, p.stages[0].tp) for p in plan.pipelines if p.stages[0].device == "a100_80gb_sxm"}
    assert len(a100) == 2 and all(len({s.device for s in p.stages}) == 1 for p in plan.pipelines)


SMALL = [
    ((("a100_80gb_sxm", 1, 4), ("v100_32gb_sxm2", 1, 4)), "llama2-7b", 64),
    ((("a100_80gb_sxm", 2, 2), ("v100_32gb_sxm2", 2, 2)), "gpt3-1.3b", 64),
    ((("h100_sxm", 1, 4), ("a100_40gb_sxm", 1, 4), ("t4", 1, 4)), "llama2-7b", 96),
    ((("a100_80gb_sxm", 2, 4), ("v100_16gb", 2, 4)), "llama2-7b", 128),
    ((("h100_sxm", 2, 2), ("a100_80gb_sxm", 1, 2), ("v100_32gb_sxm2", 1, 2)), "gpt3-1.3b", 8),
    ((("a100_40gb_sxm", 1, 4), ("l4", 1, 4), ("t4", 1, 4)), "llama2-7b", 96),
]


def _within_two_percent_of_exhaustive(cluster, spec, batch: int, **kwargs) -> Plan:  # type: ignore[no-untyped-def]
    """eth's plan (``kwargs`` to ``make_plan``), asserted within 2% of the exhaustive widened search's."""
    plan = make_plan(cluster, spec, batch, 2048, options=ALL_DEVICES, **kwargs)
    dtype = str(plan.extra["dtype"])
    best = exhaustive_widened(CostModel(cluster, spec, 2048, dtype_bytes=dtype_bytes(dtype), dtype=dtype), batch,
                              time_budget_s=120)
    assert best.plan is not None and not best.timed_out
    assert plan.predicted["iteration_time_s"] <= best.plan.predicted["iteration_time_s"] / 0.98
    return plan


@pytest.mark.parametrize("parts, model, batch", SMALL)
def test_eth_within_two_percent_of_exhaustive_widened(parts: tuple, model: str, batch: int) -> None:
    _within_two_percent_of_exhaustive(_cluster(*parts), load_model_spec(model), batch)


def test_a_hybrid_pair_tries_the_micro_batch_of_its_balanced_share() -> None:
    # The A100/V100 pair's pipelines get a share of the 64 samples by peak speed and another from level 3's
    # balance; the micro-batch that flushes soonest differs between the two. Choosing it at the peak-speed share
    # alone was 3.9% slower than the exhaustive search (1F1B, the space it enumerates) under the prices of the
    # time (V100-first at micro-batch 1 won); under today's (the runtime's gradient accumulation priced, per-GPU
    # factors) the pair runs A100-first at micro-batch 2, still within 2% of the exhaustive search.
    cluster = _cluster(("h100_sxm", 2, 2), ("a100_80gb_sxm", 1, 2), ("v100_32gb_sxm2", 1, 2))
    plan = _within_two_percent_of_exhaustive(cluster, load_model_spec("gpt3-1.3b"), 64, schedules=("1f1b",))
    assert [p for p in plan.pipelines if len({s.device for s in p.stages}) > 1]
