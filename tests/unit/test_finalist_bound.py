"""The bound that spares eth's search pricing a hopeless finalist under every schedule (``devices/eth._beaten``).

A split schedule (zb-h1) adds W passes to 1F1B's order of forwards and input-gradient backwards, so no pipeline
runs faster than 1F1B with every backward shortened by its W (``layers/schedules.flush_past_under_any``); the
blocks a first stage holds are synced after its flush. Checked on the real cost model: the floor is under the
replayed zb-h1 and the closed-form 1F1B times, and every finalist the search skipped prices no better than the
time it had to beat.
"""

from __future__ import annotations

import random
from unittest import mock

import pytest

from ethpipe.cluster import cluster_from_dict
from ethpipe.cost.model import CostModel
from ethpipe.model_load import load_model_spec
from ethpipe.planner import make_plan
from ethpipe.planner.devices import eth
from ethpipe.planner.layers.timing import StageSlot, action_times_s, timing_of_layers, weight_times_s
from ethpipe.planner.layers.timing import PipelineTiming

CLUSTER = {"nodes": [{"gpu": "h100_sxm", "num_nodes": 2, "gpus_per_node": 4, "nic_gbit_s": 400},
                     {"gpu": "a100_40gb_sxm", "num_nodes": 2, "gpus_per_node": 4, "nic_gbit_s": 200},
                     {"gpu": "l4", "num_nodes": 2, "gpus_per_node": 4, "nic_gbit_s": 100}]}


def _floor(cost: CostModel, slots: tuple, layers: list[int], recompute: list[bool], b: int) -> PipelineTiming:
    def times(x: int):  # type: ignore[no-untyped-def]
        fwd, bwd = action_times_s(cost, slots, layers, recompute, x)
        (moved,) = weight_times_s(cost, slots, layers, recompute, x)
        return fwd, bwd - moved
    return PipelineTiming(b, times)


@pytest.mark.parametrize("seed", range(12))
def test_no_schedule_runs_a_pipeline_faster_than_the_floor(seed: int) -> None:
    rng = random.Random(seed)
    cost = CostModel(cluster_from_dict(CLUSTER), load_model_spec(rng.choice(["gpt3-350m", "small"])), 512)
    ranks = rng.sample(range(cost.cluster.num_devices), rng.randint(2, 8))
    slots = tuple(StageSlot(cost.cluster.devices[r].gpu.id, 1, (r,)) for r in ranks)
    cuts = sorted(rng.sample(range(1, cost.model.num_layers), len(slots) - 1))
    layers = [b - a for a, b in zip([0, *cuts], [*cuts, cost.model.num_layers])]
    recompute = [rng.random() < 0.3 for _ in slots]
    b = rng.choice([1, 2, 4])
    floor = _floor(cost, slots, layers, recompute, b)
    timings = {s: timing_of_layers(cost, slots, layers, recompute, b, 1, s) for s in ("1f1b", "zb-h1")}
    for n in list(range(1, 3 * len(slots) + 4)) + [rng.randint(20, 200)]:
        for name, timing in timings.items():
            assert floor.time_s(n) <= timing.time_s(n) * (1 + 1e-12), (name, n)
            assert floor.time_s(n) <= float(timing.finish_s(n).max()) * (1 + 1e-12), (name, n)


@pytest.mark.parametrize("model, seq_len, global_batch, sharded", [
    ("llama2-7b", 2048, 48, True), ("gpt3-1.3b", 2048, 96, False), ("llama2-13b", 2048, 24, True),
    ("gpt3-350m", 1024, 24, False)])
def test_a_finalist_skipped_by_the_bound_prices_no_better(model: str, seq_len: int, global_batch: int,
                                                          sharded: bool) -> None:
    """``sharded``: some finalist of a sharded round is skipped too (its syncs priced as a reduce, the optimizer
    step and a gather)."""
    seen: list[tuple] = []
    beaten = eth._beaten

    def recording(cost, batch, found, time_s, schedules):  # type: ignore[no-untyped-def]
        out = beaten(cost, batch, found, time_s, schedules)
        seen.append((cost, batch, found, time_s, schedules, out))
        return out
    with mock.patch.object(eth, "_beaten", recording):
        make_plan(cluster_from_dict(CLUSTER), load_model_spec(model), global_batch, seq_len)
    skipped = [s for s in seen if s[-1]]
    for cost, batch, found, time_s, schedules, _ in skipped:
        _, price_s = eth._pipelines(cost, batch, found, {}, eth.PlannerOptions(), schedules, None)
        assert price_s >= time_s, (price_s, time_s)
    assert skipped, "the bound never skipped a finalist here: the test proves nothing"
    assert not sharded or any(cost.optimizer_holders > 1 for cost, *_ in skipped)


@pytest.mark.parametrize("model, seq_len, global_batch", [("llama2-7b", 2048, 48), ("llama2-13b", 2048, 24)])
def test_what_follows_a_first_stage_flush_is_in_the_price(model: str, seq_len: int, global_batch: int) -> None:
    """``_after_flush_s``: every candidate the search priced (sharded rounds included) costs at least each group's
    flush plus it, and for some group that is the whole price (the bound is tight where the first stage ends
    last)."""
    from ethpipe.planner.devices.grouping import group_iteration_s

    seen: list[tuple] = []
    beaten = eth._beaten

    def recording(cost, batch, found, time_s, schedules):  # type: ignore[no-untyped-def]
        seen.append((cost, found))
        return beaten(cost, batch, found, time_s, schedules)
    with mock.patch.object(eth, "_beaten", recording):
        make_plan(cluster_from_dict(CLUSTER), load_model_spec(model), global_batch, seq_len)
    assert any(cost.optimizer_holders > 1 for cost, _ in seen)
    tight = 0
    for cost, (_, groups, samples) in seen:
        price_s = group_iteration_s(cost, groups, samples)
        ends = [float(g.template.timing.finish_s(max(row))[0]) + after
                for g, row, after in zip(groups, samples, eth._after_flush_s(cost, groups))]
        assert max(ends) <= price_s * (1 + 1e-12), (max(ends), price_s)
        tight += max(ends) >= price_s * (1 - 1e-9)
    assert tight, "the bound was never tight: it would not tell an over-count from a right one"


def test_a_pipeline_with_fewer_samples_than_its_micro_batch_is_bounded_at_its_own_size() -> None:
    """A re-split keeps each pipeline's micro-batch size as the split it starts from left it: one that got fewer
    samples than its template's micro-batch runs smaller ones, which can flush sooner than the template's size
    allows at the same sample count (found by review: a floor at the template's size skipped finalists priced
    under the time). So ``_beaten`` bounds such a pipeline at its own size, and at that size the floor is under
    every schedule's flush for any sample count."""
    from ethpipe.planner.layers import schedules as sched

    found_seen: list[tuple] = []
    beaten = eth._beaten

    def recording(cost, batch, found, time_s, schedules):  # type: ignore[no-untyped-def]
        found_seen.append((cost, batch, found, schedules))
        return beaten(cost, batch, found, time_s, schedules)
    with mock.patch.object(eth, "_beaten", recording):
        make_plan(cluster_from_dict(CLUSTER), load_model_spec("gpt3-1.3b"), 96, 2048)
    checked = 0
    for cost, batch, (score, groups, samples), schedules in found_seen:
        for g, row in enumerate(samples):
            tpl = groups[g].template
            if len(row) < 2 or tpl.micro_batch < 2 or row[0] < 2:
                continue
            cut = [list(r) for r in samples]
            cut[g][1] += cut[g][0] - 1  # the first pipeline keeps one sample, its neighbour takes the rest
            cut[g][0] = 1
            asked: list[list] = []
            with mock.patch.object(eth, "flush_past_under_any", lambda c, shapes, b, s: asked.append(shapes) or False):
                eth._beaten(cost, batch, (score, groups, cut), 1.0, schedules)
            sizes = sorted(size for slots, _, _, size, count, _ in asked[0] if slots == tpl.slots for _ in range(count))
            assert sizes[0] == 1 and sizes.count(1) == 1, sizes
            for n in (1, 2, 3, 7):  # and at size 1 the floor is under the priced flush of any sample count
                for name in ("1f1b", "zb-h1"):
                    flush_s = float(timing_of_layers(cost, tpl.slots, tpl.partition.num_layers,
                                                     tpl.partition.recompute, 1, 1, name).finish_s(n).max())
                    shape = (tpl.slots, tpl.partition.num_layers, tpl.partition.recompute, 1, 1, flush_s * (1 + 1e-9))
                    assert not sched.flush_past_under_any(cost, [shape], n, ("1f1b", "zb-h1")), (name, n)
            checked += 1
            break
    assert checked, "no finalist had a group to cut: the test proves nothing"
