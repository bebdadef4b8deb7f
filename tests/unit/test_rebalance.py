"""Level-3 re-solve inside the runtime (runtime/adapt/rebalance.py): pure functions, no processes."""

from __future__ import annotations

import itertools

import pytest

from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.runtime.adapt.rebalance import (
    PipelineModel, RebalanceConfig, Rebalancer, decide, fit_models, makespan_s, micro_batch_sizes, parse_rebalance,
    split_of, water_fill, with_split,
)

SPEC = ModelSpec(name="t", num_layers=4, hidden_size=16, num_heads=2, num_kv_heads=2, ffn_hidden_size=32,
                 vocab_size=64, max_seq_len=16)


def _plan() -> Plan:
    pipes = (Pipeline((Stage((0,), "a", (0, 2)), Stage((1,), "a", (2, 4))), (2, 2, 2, 2)),
             Pipeline((Stage((2,), "b", (0, 4)),), (3, 1)))
    return Plan("eth", SPEC.name, 12, 8, pipes, compute_blocks(pipes), SPEC)


def test_parse_rebalance() -> None:
    assert parse_rebalance("every=5") == RebalanceConfig(5, 0.05, 0)
    assert parse_rebalance("every=3, threshold=0.1,window=6") == RebalanceConfig(3, 0.1, 6)
    assert parse_rebalance("every=3").window_steps == 3
    for bad in ("", "5", "every=x", "every=0", "every=2,every=3", "every=2,foo=1", "threshold=0.1",
                "every=2,threshold=1.5", "every=2,threshold=nan", "every=2,window=-1"):
        with pytest.raises(ValueError, match="--rebalance"):
            parse_rebalance(bad)


@pytest.mark.parametrize("seed", range(6))
def test_water_fill_matches_brute_force(seed: int) -> None:
    import random

    rng = random.Random(seed)
    models = [PipelineModel(rng.uniform(0.1, 2.0), rng.uniform(0.0, 3.0)) for _ in range(3)]
    total = rng.randint(3, 14)
    got = water_fill(models, total)
    assert sum(got) == total and min(got) >= 1
    best = min(makespan_s(models, c) for c in itertools.product(range(1, total + 1), repeat=3) if sum(c) == total)
    assert makespan_s(models, got) == pytest.approx(best)


def test_water_fill_proportional_to_speed_and_rejects_tiny_batches() -> None:
    assert water_fill([PipelineModel(1.0, 0.0), PipelineModel(2.0, 0.0), PipelineModel(2.0, 0.0)], 40) == (20, 10, 10)
    with pytest.raises(ValueError, match="cannot give"):
        water_fill([PipelineModel(1.0, 0.0)] * 3, 2)


def test_split_keeps_micro_batch_size_stages_and_blocks() -> None:
    plan = _plan()
    assert micro_batch_sizes(7, 2) == (2, 2, 2, 1) and micro_batch_sizes(2, 3) == (2,)
    new = with_split(plan, (5, 7))
    assert split_of(new) == (5, 7) and new.pipelines[0].micro_batch_sizes == (2, 2, 1)
    assert new.pipelines[1].micro_batch_sizes == (3, 3, 1)
    assert new.blocks == plan.blocks and [p.stages for p in new.pipelines] == [p.stages for p in plan.pipelines]
    assert new.global_batch_size == plan.global_batch_size


def test_fit_models_is_1f1b() -> None:
    m = fit_models(_plan(), [(1.0, 3.0), (2.0,)])
    assert m[0] == PipelineModel(3.0, 2 * 1.0) and m[1] == PipelineModel(2.0, 0.0)


def test_decide_applies_only_above_threshold() -> None:
    plan = _plan()
    even = decide(plan, plan, [(1.0, 1.0), (2.0,)], 0.05)  # balanced for the current 8/4 split
    assert not even.applied
    slowed = decide(plan, plan, [(1.0, 4.0), (2.0,)], 0.05)  # pipeline 0's second stage 4x slower
    assert slowed.applied and slowed.new_split[0] < 8 and sum(slowed.new_split) == 12
    assert slowed.predicted_new_s < slowed.predicted_old_s and slowed.gain > 0.05
    record = slowed.to_record()
    assert record["old_split"] == [8, 4] and record["per_sample_s"] == [[1.0, 4.0], [2.0]]
    assert not decide(plan, plan, [(1.0, 4.0), (2.0,)], 0.99).applied


def test_rebalancer_checks_every_k_steps_and_switches_the_split() -> None:
    plan = _plan()
    reb = Rebalancer(plan, RebalanceConfig(every=2, threshold=0.05))
    busy = [8 * 1.0, 8 * 4.0, 4 * 2.0]  # seconds per step of ranks 0..2 under the 8/4 split
    assert reb.observe(0, busy) is None
    decision = reb.observe(1, busy)
    assert decision is not None and decision.applied and split_of(reb.plan) == decision.new_split
    assert reb.observe(2, busy) is None  # window restarted after the switch
