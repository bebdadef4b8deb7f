"""ZeRO-1 across pipelines, the parts without ranks: shard cuts, the plan fields, the cost model's terms and
the planner's choice (the runtime itself: tests/dist/test_zero.py)."""

from __future__ import annotations

import copy

import pytest

from ethpipe.cluster import cluster_from_dict
from ethpipe.cost import memory
from ethpipe.cost.model import CostModel
from ethpipe.cost.model_comm import sharded_phase_fraction
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Plan
from ethpipe.planner import PlannerOptions, estimate_iteration_s, make_plan
from ethpipe.planner.devices import eth
from ethpipe.runtime.sync.zero import shard_bounds
from ethpipe.sim import simulate

from test_plan_format import BASE


@pytest.mark.parametrize("numel, weights", [(10, [1, 1]), (7, [1, 1, 1]), (100, [3, 1, 2]), (3, [1, 1, 1, 1, 1]),
                                            (0, [1, 2]), (1000, [0.1, 5.0])])
def test_shards_tile_the_tensor_in_proportion(numel: int, weights: list[float]) -> None:
    bounds = shard_bounds(numel, weights)
    assert len(bounds) == len(weights) and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, no gap, no overlap
    for (lo, hi), w in zip(bounds, weights):
        assert abs((hi - lo) - numel * w / sum(weights)) <= 1.0  # rounded cuts: within one element


def _with(**fields: object) -> dict:
    data = copy.deepcopy(BASE)
    data.update(fields)
    return data


def test_plan_fields_round_trip_and_bad_ones_get_one_line_errors() -> None:
    plan = Plan.from_dict(_with(shard_optimizer=True, shard_weights=[1, 2, 1, 3]))
    assert plan.shard_optimizer and plan.shard_weights == (1.0, 2.0, 1.0, 3.0)
    assert Plan.from_dict(plan.to_dict()) == plan
    assert "shard_optimizer" not in Plan.from_dict(copy.deepcopy(BASE)).to_dict()  # old plans read and write alike
    for fields, needle in [({"shard_optimizer": "yes"}, "true or false"),
                           ({"shard_optimizer": True, "shard_weights": [1, 2]}, "one per rank"),
                           ({"shard_optimizer": True, "shard_weights": [1, 0, 1, 1]}, "positive"),
                           ({"shard_weights": [1, 1, 1, 1]}, "needs 'shard_optimizer'")]:
        with pytest.raises(ValueError, match=needle) as err:
            Plan.from_dict(_with(**fields))
        assert "\n" not in str(err.value)


def test_state_bytes_and_sync_phases() -> None:
    assert memory.state_bytes_per_param(2) == 16 and memory.state_bytes_per_param(2, 16) == 8.5  # the figure
    assert memory.state_bytes_per_param(8, 4) == 16 + 16 / 4  # the fp64 exactness mode
    # one reduce-scatter and one all-gather per bucket tensor: each half a ring all-reduce, for any number of holders
    assert sharded_phase_fraction(2) == sharded_phase_fraction(32) == 0.5 and sharded_phase_fraction(1) == 1.0


V100S = cluster_from_dict({"nodes": [{"gpu": "v100_32gb_sxm2", "num_nodes": 4, "gpus_per_node": 8,
                                      "nic_gbit_s": 100}]})


def test_the_planner_spends_the_freed_memory_and_says_so() -> None:
    """llama2-13b on 32 V100-32: whole AdamW state forces two 16-stage pipelines, most stages recomputing; sharded,
    the freed memory buys shallower pipelines (more of them) or fewer recomputing stages, whichever is faster
    (today: four 8-stage pipelines), and the plan is faster, priced at its own number of holders."""
    spec = load_model_spec("llama2-13b")
    plain = make_plan(V100S, spec, 64, 4096, max_tp=1, shard_optimizer=False)
    plan = make_plan(V100S, spec, 64, 4096, max_tp=1)
    assert not plain.shard_optimizer and plan.shard_optimizer
    record = plan.extra["search"]["shard_optimizer"]
    # as compared: finished (interleaved, cut inside layers) unless too slow for that to make it win (``_finished``)
    unfinished_s = plain.extra["search"]["sublayer_cuts"]["whole_layers_s"]
    assert record["chosen"] and record["unsharded_iteration_s"] in (
        pytest.approx(plain.predicted["iteration_time_s"]), pytest.approx(unfinished_s))
    assert plan.predicted["iteration_time_s"] < plain.predicted["iteration_time_s"]

    def recomputing(p: Plan) -> int:
        return sum(s.recompute for pipe in p.pipelines for s in pipe.stages)

    def deepest(p: Plan) -> int:
        return max(pipe.depth for pipe in p.pipelines)

    assert deepest(plan) < deepest(plain) or recomputing(plan) < recomputing(plain)
    loaded = Plan.from_dict(plan.to_dict())
    cost = CostModel.for_plan(loaded)
    assert cost.optimizer_holders == len(plan.pipelines) > 1
    assert estimate_iteration_s(loaded, cost) == pytest.approx(plan.predicted["iteration_time_s"], rel=1e-9)
    report = simulate(loaded, cost)
    assert report.iteration_time_s == pytest.approx(plan.predicted["iteration_time_s"], rel=0.05)
    assert any(e.kind == "allgather" for e in report.events)  # the gather phase after the optimizer


A100_L4 = cluster_from_dict({"nodes": [
    {"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 100},
    {"gpu": "l4", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 100}]})


def test_sharding_can_put_devices_the_unsharded_plan_left_idle_back_to_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """llama2-7b, 20 samples, on 8 A100-80 + 8 L4 on 50 Gbit/s NICs, without the rank-order replicas: unsharded,
    the L4s are idle (their stages cannot hold enough of the model to pay); the memory sharding frees makes them pay.
    The sharding rounds search every device as well as the unsharded plan's (``sharding._Rounds``): the plan runs all
    16 devices, sharded, faster than the best sharded plan on the A100s alone, which is what searching the unsharded
    plan's devices only gives. (At 16 samples on 100 Gbit/s NICs, the case this was first shown on, every optimizer
    step now waits for the world's stats all-gather after the last sync, and the L4s stay idle sharded too.)"""
    monkeypatch.setattr(eth, "_rank_order_found", lambda *args, **kwargs: ([], 0))
    spec = load_model_spec("llama2-7b")
    slow_nics = cluster_from_dict({"nodes": [{**n, "nic_gbit_s": 50} for n in A100_L4.source["nodes"]]})
    unsharded = make_plan(slow_nics, spec, 20, 4096, shard_optimizer=False)
    assert {d.device for d in unsharded.idle_devices} == {"l4"}
    plan = make_plan(slow_nics, spec, 20, 4096)
    a100s = cluster_from_dict({"nodes": [slow_nics.source["nodes"][0]]})
    alone = make_plan(a100s, spec, 20, 4096)
    assert plan.shard_optimizer and not plan.idle_devices
    assert "sharded_uses_every_device" in plan.extra["search"]["idle"]
    assert plan.predicted["iteration_time_s"] < alone.predicted["iteration_time_s"] < unsharded.predicted[
        "iteration_time_s"]
    loaded = Plan.from_dict(plan.to_dict())
    assert estimate_iteration_s(loaded, CostModel.for_plan(loaded)) == pytest.approx(
        plan.predicted["iteration_time_s"], rel=1e-9)


A100_V100 = cluster_from_dict({"nodes": [
    {"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 1600},
    {"gpu": "v100_32gb_sxm2", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 800}]})


@pytest.mark.parametrize("cluster, model, batch, rounds", [(A100_V100, "llama3-8b", 24, [2, 4]),  # 2k taken
                                                           (V100S, "llama2-13b", 64, [2])])  # 2k not needed
def test_the_next_sharding_round_searched_ahead_gives_the_same_plan(monkeypatch: pytest.MonkeyPatch, cluster,
                                                                    model: str, batch: int, rounds: list[int]) -> None:
    """The round at 2k searched in a forked process while this one searches k: the plan is the one the rounds
    give one after the other, whether 2k is needed or not. (Forced on at 16 and 32 GPUs, and where another
    test may have left a thread alive, which switches it off in real use.)"""
    from ethpipe.planner.devices import sharding
    from ethpipe.planner.search.ahead import Ahead

    started: list[Ahead] = []

    class Counted(Ahead):
        def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
            super().__init__(fn)
            started.append(self)

    monkeypatch.setattr(sharding, "can_run_ahead", lambda: True)
    monkeypatch.setattr(sharding, "Ahead", Counted)
    spec = load_model_spec(model)
    monkeypatch.setattr(sharding, "AHEAD_MIN_DEVICES", 10 ** 9)
    here = make_plan(cluster, spec, batch, 4096)
    assert not started
    monkeypatch.setattr(sharding, "AHEAD_MIN_DEVICES", 1)
    ahead = make_plan(cluster, spec, batch, 4096)
    assert len(started) == 1
    for plan in (here, ahead):
        assert plan.extra["search"]["shard_optimizer"]["holders_tried"] == rounds
    assert ahead.pipelines == here.pipelines and ahead.shard_optimizer == here.shard_optimizer
    timeless = [{k: v for k, v in p.predicted.items() if k != "planning_time_s"} for p in (ahead, here)]
    assert timeless[0] == timeless[1]


def test_a_shape_whose_split_did_not_move_keeps_its_timing_across_holder_counts() -> None:
    """``build_template`` keeps a shape's T(n) for the planning run (``("template_timings",)``): a sharding
    round that splits the shape as the unsharded search did gets the same table object, one whose split moved
    gets its own, and both price as a template built without the memo."""
    from ethpipe.planner.devices.templates import build_template, pools_of, shape_slots

    cost = CostModel(cluster_from_dict({"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 2, "gpus_per_node": 8,
                                                   "nic_gbit_s": 100}]}), load_model_spec("llama2-13b"), 4096)
    shared: dict = {}
    pool = pools_of(cost)[0]
    same = moved = 0
    for depth in (2, 4, 8, 16):
        slots = shape_slots(pool, depth, 1, 1 if depth <= 8 else 2)
        alone = build_template(cost, 0, slots, 1, "auto", 1, {})
        plain = build_template(cost, 0, slots, 1, "auto", 1, {("template_timings",): shared})
        sharded = build_template(cost.with_optimizer_holders(64), 0, slots, 1, "auto", 1, {("template_timings",): shared})
        if alone is None or sharded is None:
            continue
        assert plain is not None and plain.partition == alone.partition
        assert plain.timing.time_s(40) == alone.timing.time_s(40)
        if sharded.partition == plain.partition:
            same += 1
            assert sharded.timing is plain.timing
        else:
            moved += 1
            assert sharded.timing is not plain.timing
    assert same and moved  # memory moves some splits of a 13B model on 80 GB A100s, not all


def test_memory_terms_after_another_holder_count_equal_a_fresh_models() -> None:
    """The holder-independent parts of a stage's memory terms are kept in the compute memo that
    ``with_optimizer_holders`` shares: a sharding round that reads them after the unsharded search must get the
    very floats a cost model built at its holder count computes, for every position, recompute choice, end and
    type (a profile-less V100, an A100 with materialised attention)."""
    cluster = cluster_from_dict({"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 100},
                                           {"gpu": "v100_32gb_sxm2", "num_nodes": 1, "gpus_per_node": 8,
                                            "nic_gbit_s": 100}]})
    for attention in ("auto", "materialised"):
        unsharded = CostModel(cluster, load_model_spec("llama2-7b"), 4096, attention_mode=attention)
        cases = [(tp, b, k, rc, first, last, device) for tp in (1, 2) for b in (1, 3) for k in (1, 5)
                 for rc in (False, True) for first in (False, True) for last in (False, True)
                 for device in ("a100_80gb_sxm", "v100_32gb_sxm2")]
        for tp, b, k, rc, first, last, device in cases:  # fills the shared memo at one holder
            unsharded.memory_terms(tp, b, k, rc, first=first, last=last, device=device)
        for holders in (1, 8, 64):
            reused = unsharded.with_optimizer_holders(holders)
            for tp, b, k, rc, first, last, device in cases:  # each against a model that computed nothing before
                fresh = CostModel(cluster, load_model_spec("llama2-7b"), 4096, attention_mode=attention,
                                  optimizer_holders=holders)
                got = reused.memory_terms(tp, b, k, rc, first=first, last=last, device=device)
                assert got == fresh.memory_terms(tp, b, k, rc, first=first, last=last, device=device)
        sharded_fixed, sharded_per_layer = unsharded.with_optimizer_holders(64).memory_terms(
            1, 1, 1, False, first=True, last=False, device="a100_80gb_sxm")
        fixed, per_layer = unsharded.memory_terms(1, 1, 1, False, first=True, last=False, device="a100_80gb_sxm")
        assert sharded_fixed < fixed and sharded_per_layer < per_layer  # the moments' share did move


H100_A100_L4 = cluster_from_dict({"nodes": [
    {"gpu": "h100_sxm", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 3200},
    {"gpu": "a100_80gb_sxm", "num_nodes": 2, "gpus_per_node": 8, "nic_gbit_s": 1600},
    {"gpu": "l4", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 100}]})


def test_sharding_can_leave_idle_the_devices_the_unsharded_plan_used() -> None:
    """The mirror of test_sharding_can_put_devices_the_unsharded_plan_left_idle_back_to_work. llama2-13b, 128
    samples, on 8 H100 + 16 A100-80 + 8 L4 (the L4s on a 100 Gbit/s NIC): unsharded, every device runs, and the plan without the L4s came within 1% of it; sharded, the
    plan without the L4s is the faster one (the memory sharding frees lets the H100s and A100s hold the model in
    fewer, faster stages). The sharding rounds search that idle candidate's devices too (``sharding._Rounds``):
    the plan leaves the L4s idle, as fast as planning the 24 others alone, faster than the best sharded plan on
    every device (by 0.3% with the shipped prices), which is what searching the unsharded plan's devices only
    gave. In whole layers: cut inside layers, the unsharded plan without the L4s is the faster one already."""
    spec = load_model_spec("llama2-13b")
    whole = PlannerOptions(sublayer_cuts=False)
    unsharded = make_plan(H100_A100_L4, spec, 128, 4096, shard_optimizer=False, options=whole)
    assert not unsharded.idle_devices
    near_s = unsharded.extra["search"]["idle"]["candidates"][0]["near_s"]
    assert near_s <= 1.01 * unsharded.predicted["iteration_time_s"]
    plan = make_plan(H100_A100_L4, spec, 128, 4096, options=whole)
    every = make_plan(H100_A100_L4, spec, 128, 4096, options=PlannerOptions(allow_idle=False, sublayer_cuts=False))
    alone = make_plan(cluster_from_dict({"nodes": H100_A100_L4.source["nodes"][:2]}), spec, 128, 4096, options=whole)
    assert plan.shard_optimizer and every.shard_optimizer
    assert {d.device for d in plan.idle_devices} == {"l4"}
    assert all(d.reason.startswith("idle: sharded") for d in plan.idle_devices)
    assert "sharded_idles" in plan.extra["search"]["idle"]
    assert plan.predicted["iteration_time_s"] == pytest.approx(alone.predicted["iteration_time_s"], rel=1e-9)
    assert plan.predicted["iteration_time_s"] < every.predicted["iteration_time_s"]
    loaded = Plan.from_dict(plan.to_dict())
    assert estimate_iteration_s(loaded, CostModel.for_plan(loaded)) == pytest.approx(
        plan.predicted["iteration_time_s"], rel=1e-9)


def test_the_slower_plan_is_interleaved_where_closing_its_bubble_could_win() -> None:
    """llama2-13b, 16 samples, on 8 H100 + 8 RTX 3090: unsharded, the search's plan is one 4-stage 1F1B pipeline
    (1.93 s) and the sharded one two 2-stage pipelines (1.88 s with its cuts). The sharded plan is finished first;
    the unsharded one, cut alone, still loses, but with its bubble closed it could win, so it is interleaved too
    (4 chunks: 1.78 s) and wins. Finished only where its cuts won, the plan was 1.88 s, slower than
    ``--no-shard-optimizer``'s."""
    cluster = cluster_from_dict({"nodes": [
        {"gpu": "h100_sxm", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 100},
        {"gpu": "rtx_3090", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 100}]})
    spec = load_model_spec("llama2-13b")
    unsharded = make_plan(cluster, spec, 16, 4096, shard_optimizer=False)
    plan = make_plan(cluster, spec, 16, 4096)
    record = plan.extra["search"]["shard_optimizer"]
    assert record["sharded_iteration_s"] > plan.predicted["iteration_time_s"]
    assert plan.predicted["iteration_time_s"] <= unsharded.predicted["iteration_time_s"]
    assert {p.schedule for p in plan.pipelines} == {"interleaved"} and not plan.shard_optimizer
