"""Level 2's schedule choice (planner/layers/schedules.py): each pipeline the fastest schedule that fits.

On the 128-GPU H100/A100-80/L4 cluster with llama2-7b at one sample per GPU (4096 tokens), 1F1B's bubble
costs eth a fifth of the cluster; with zb-h1 allowed the plan is faster and its bubble factor rises above
0.9; `--schedules 1f1b` gives the 1F1B-only plan, and the baselines keep 1F1B unless told. A schedule
whose in-flight micro-batches do not fit a device is never chosen, and the plan file carries the choice.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from ethpipe.cli import commands  # noqa: F401  (registers the commands)
from ethpipe.cli.app import app
from ethpipe.cluster import load_cluster
from ethpipe.cost.model import CostModel
from ethpipe.cost.plan_memory import memory_shortfalls
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Pipeline, Plan
from ethpipe.planner import make_plan
from ethpipe.planner.estimate import estimate_iteration_s, plan_layout
from ethpipe.planner.layers.interleave import interleaved_of
from ethpipe.planner.layers.schedules import BestOfTiming, choose_schedules, fits
from ethpipe.planner.layers.timing import PipelineTiming
from ethpipe.sim import simulate

CLUSTER = load_cluster("examples/clusters/eval_h100_a100_l4_128.yaml")
LLAMA = load_model_spec("llama2-7b")
LLAMA3 = load_model_spec("llama3-8b")  # at one sample per GPU its 2-stage pipelines cannot hold interleaved chunks


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {"all": make_plan(CLUSTER, LLAMA, 128, 4096),
            "1f1b": make_plan(CLUSTER, LLAMA, 128, 4096, schedules=("1f1b",)),
            # pipelines of A100s behind an H100 where zb-h1 fits (sharded, this batch's plan is 40 single-type
            # pipelines since every optimizer step waits for the world's stats all-gather: 0.15% slower than these)
            "1f1b-half": make_plan(CLUSTER, LLAMA, 64, 4096, schedules=("1f1b",), shard_optimizer=False),
            "layer-balanced": make_plan(CLUSTER, LLAMA, 128, 4096, "layer-balanced", time_budget_s=5.0)}


def test_zb_h1_lifts_the_bubble_of_the_128_gpu_case(plans: dict[str, Plan]) -> None:
    zb, one = plans["all"], plans["1f1b"]
    assert {p.schedule for p in one.pipelines} == {"1f1b"}
    assert "zb-h1" in {p.schedule for p in zb.pipelines}
    assert zb.predicted["iteration_time_s"] < one.predicted["iteration_time_s"]
    assert one.predicted["efficiency_factors"]["bubble"] < 0.85 < 0.90 <= zb.predicted["efficiency_factors"]["bubble"]
    for plan in (zb, one):  # the simulator replays the chosen schedules and agrees with the planner
        cost = CostModel.for_plan(plan)
        assert simulate(plan, cost).iteration_time_s == pytest.approx(plan.predicted["iteration_time_s"], rel=1e-9)
        assert memory_shortfalls(plan, cost) == []
    assert zb.extra["search"]["schedules"] == ["1f1b", "zb-h1", "interleaved"]
    assert one.extra["search"]["schedules"] == ["1f1b"]
    assert Plan.from_dict(json.loads(zb.to_json())) == Plan.from_dict(zb.to_dict())


def test_interleaving_is_tried_where_memory_allows(plans: dict[str, Plan]) -> None:
    """Without zb-h1, eth prices interleaving inside its search (every finalist layout) and on its final plan,
    where that is faster and fits (planner/layers/interleave.py), so allowing it never gives a slower plan. At 8
    samples per GPU the 128-GPU llama2-7b plan interleaves (its bubble factor rises and the simulator agrees with
    the estimate); at one sample per GPU llama3-8b's 2-stage pipelines would hold 2.5 micro-batches of
    activations on the first stage instead of 2, which does not fit, so the plan stays 1F1B there."""
    one = make_plan(CLUSTER, LLAMA3, 128, 4096, schedules=("1f1b",))
    same = make_plan(CLUSTER, LLAMA3, 128, 4096, schedules=("1f1b", "interleaved"))
    assert same.pipelines == one.pipelines and max(p.depth for p in one.pipelines) > 1
    cost = CostModel.for_plan(one)
    assert not any(fits(cost, p, "interleaved") for p in (interleaved_of(q) for q in one.pipelines) if p is not None)
    flat = make_plan(CLUSTER, LLAMA, 128 * 8, 4096, schedules=("1f1b",))
    both = make_plan(CLUSTER, LLAMA, 128 * 8, 4096, schedules=("1f1b", "interleaved"))
    assert {(p.schedule, p.num_chunks) for p in both.pipelines} == {("interleaved", 2)}
    for pipe in both.pipelines:  # a rank's layers in two near-equal chunks, the larger first
        assert all(0 <= s.chunk_layers[0] - s.chunk_layers[1] <= 1 for s in pipe.stages)
    assert both.predicted["efficiency_factors"]["bubble"] > flat.predicted["efficiency_factors"]["bubble"]
    assert both.predicted["iteration_time_s"] < flat.predicted["iteration_time_s"]
    cost = CostModel.for_plan(both)
    assert simulate(both, cost).iteration_time_s == pytest.approx(both.predicted["iteration_time_s"], rel=1e-9)
    assert memory_shortfalls(both, cost) == []
    assert Plan.from_dict(json.loads(both.to_json())) == both


def test_baselines_keep_1f1b_unless_told(plans: dict[str, Plan]) -> None:
    lb = plans["layer-balanced"]
    assert {p.schedule for p in lb.pipelines} == {"1f1b"} and lb.extra["search"]["schedules"] == ["1f1b"]
    told = make_plan(CLUSTER, LLAMA, 128, 4096, "uniform", schedules=("1f1b", "zb-h1"))
    plain = make_plan(CLUSTER, LLAMA, 128, 4096, "uniform")
    assert told.predicted["iteration_time_s"] <= plain.predicted["iteration_time_s"]


def test_a_schedule_that_does_not_fit_is_never_chosen(plans: dict[str, Plan]) -> None:
    one = plans["1f1b-half"]
    cost = CostModel.for_plan(one)
    # The plan's first pipeline with its two A100 stages as one, so that the last stage's device type appears once
    # in it and can be shrunk alone below.
    first, *_, last = one.pipelines[0].stages
    assert first.device != last.device
    pipe = dataclasses.replace(one.pipelines[0], stages=(first, dataclasses.replace(last, layers=(first.layers[1], 32))))
    one = dataclasses.replace(one, pipelines=(pipe,))
    assert fits(cost, pipe, "zb-h1") and fits(cost, pipe, "1f1b")
    # Shrink the first stage's device until zb-h1's depth-many in-flight micro-batches no longer fit there
    # while 1F1B's (the same on stage 0) do: only the later stages hold more under zb-h1.
    last = pipe.stages[-1]
    need = {s: cost.stage_memory_bytes(last, max(pipe.micro_batch_sizes), n, first=pipe.depth == 1, last=True)
            for s, n in (("1f1b", 1), ("zb-h1", pipe.depth))}
    assert need["zb-h1"] > need["1f1b"]
    usable = (need["zb-h1"] + need["1f1b"]) // 2

    class Tight(CostModel):
        def usable_memory_bytes(self, device: str) -> int:
            return usable if device == last.device else super().usable_memory_bytes(device)

    tight = Tight(**{f.name: getattr(cost, f.name) for f in dataclasses.fields(CostModel) if f.init})
    assert not fits(tight, pipe, "zb-h1") and fits(tight, pipe, "1f1b")
    kept, _ = choose_schedules(one, tight, ("1f1b", "zb-h1"))
    assert all(p.schedule == "1f1b" for p in kept.pipelines if p.stages[-1].device == last.device)


def test_a_re_split_priced_with_its_layouts_shared_terms_is_priced_as_alone(plans: dict[str, Plan]) -> None:
    """choose_schedules prices the plan and its re-split with one ``PlanLayout`` (the p2p sharing, holders, sync
    durations and pricing keys their stages share): the same seconds as pricing the re-split on its own; a
    layout of other stages is refused."""
    one = plans["1f1b-half"]
    cost = CostModel.for_plan(one)
    chosen, chosen_s = choose_schedules(one, cost, ("1f1b", "zb-h1"))
    assert chosen is not one and "zb-h1" in {p.schedule for p in chosen.pipelines}
    assert chosen_s == estimate_iteration_s(chosen, cost)
    other = dataclasses.replace(one, pipelines=one.pipelines[1:] + one.pipelines[:1])
    with pytest.raises(AssertionError, match="a layout of other stages"):
        estimate_iteration_s(one, cost, layout=plan_layout(other, cost))


def test_pipeline_timings_kept_across_layouts_and_holder_counts_price_the_same(plans: dict[str, Plan]) -> None:
    """``choose_schedules(timings=memo)`` (the planning run's T(n) memo, shared by the sharding rounds) gives the
    plan and seconds it gives without one, reuses the tables for a plan of the same layout at another holder
    count, and keys them by the layout's pricing keys (devices, layers, links with their NIC sharing): one
    table per distinct pipeline, not per pipeline."""
    one = plans["1f1b"]
    cost = CostModel.for_plan(one)
    memo: dict = {}
    want = choose_schedules(one, cost, ("1f1b", "zb-h1"))
    assert choose_schedules(one, cost, ("1f1b", "zb-h1"), timings=memo) == want
    kept = dict(memo)
    assert kept and all(k[-1] in ("1f1b", "zb-h1") for k in kept)
    sharded = cost.with_optimizer_holders(len(one.pipelines))
    assert choose_schedules(one, sharded, ("1f1b", "zb-h1"), timings=memo) == choose_schedules(
        one, sharded, ("1f1b", "zb-h1"))
    assert memo.keys() == kept.keys() and all(memo[k] is kept[k] for k in kept)  # reused, none added
    layout = plan_layout(one, cost)
    assert len(set(layout.keys)) < len(one.pipelines)  # pipelines share keys: one table each, not per pipeline
    assert {k[0] for k in memo} <= set(layout.keys)


def test_cli_schedules_option_and_its_errors(tmp_path) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    out = tmp_path / "p.json"
    args = ["plan", "--cluster", "examples/clusters/h100_a100_l4.yaml", "--model", "llama2-7b", "--global-batch", "64",
            "--seq-len", "4096"]
    res = runner.invoke(app, [*args, "--schedules", "1f1b", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert {p["schedule"] for p in json.loads(out.read_text())["pipelines"]} == {"1f1b"}
    res = runner.invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 0 and "schedule" in res.output and "zb-h1" in res.output
    for bad, needle in (("gpipe", "unknown schedule 'gpipe' in --schedules"), (",", "at least one")):
        res = runner.invoke(app, [*args, "--schedules", bad])
        assert res.exit_code == 2 and needle in res.output and "Traceback" not in res.output, res.output
    plan = json.loads(out.read_text())
    plan["pipelines"][0]["schedule"] = "gpipe"
    bad_plan = tmp_path / "bad.json"
    bad_plan.write_text(json.dumps(plan))
    with pytest.raises(ValueError, match=r"pipelines\[0\].schedule' must be one of 1f1b, zb-h1, interleaved"):
        Plan.load(bad_plan)


def test_interleaved_of_keeps_each_ranks_layers_and_fixes_the_count() -> None:
    from ethpipe.plan import Pipeline, Stage

    flat = Pipeline((Stage((0,), "a", (0, 5)), Stage((1, 2), "b", (5, 8), tp=2), Stage((3,), "a", (8, 12), recompute=True)),
                    (2,) * 6)
    pipe = interleaved_of(flat)
    assert pipe is not None and pipe.schedule == "interleaved" and pipe.micro_batch_sizes == (2,) * 6
    # virtual stages in order: chunk 0 of every stage, then chunk 1; 5 layers -> 3 + 2, 3 -> 2 + 1, 4 -> 2 + 2
    assert [s.chunks for s in pipe.stages] == [((0, 3), (7, 9)), ((3, 5), (9, 10)), ((5, 7), (10, 12))]
    assert [(s.ranks, s.tp, s.recompute) for s in pipe.stages] == [(s.ranks, s.tp, s.recompute) for s in flat.stages]
    ragged = interleaved_of(Pipeline(flat.stages, (2, 2, 2, 1)))  # 4 micro-batches over 3 stages: 6 of 7 samples
    assert ragged is not None and ragged.micro_batch_sizes == (2, 1, 1, 1, 1, 1)
    assert interleaved_of(Pipeline(flat.stages, (1, 1, 1, 1))) is None  # 6 micro-batches need 6 samples
    assert interleaved_of(Pipeline(flat.stages, (3, 2))) is not None  # at most depth: as it is
    assert interleaved_of(Pipeline((Stage((0,), "a", (0, 11)), Stage((1,), "a", (11, 12))), (1,))) is None
    assert interleaved_of(Pipeline((Stage((0,), "a", (0, 12)),), (1,))) is None


def test_more_schedules_never_give_a_slower_plan_and_incumbents_are_1f1b_comparable(plans: dict[str, Plan]) -> None:
    from ethpipe.planner.search.incumbent import incumbent_bar_s

    zb = make_plan(CLUSTER, LLAMA, 128, 4096, schedules=("1f1b", "zb-h1"))
    assert plans["all"].predicted["iteration_time_s"] <= zb.predicted["iteration_time_s"] \
        <= plans["1f1b"].predicted["iteration_time_s"]
    # a zb-h1 plan is passed to later searches as its 1F1B score (higher than its price); a 1F1B plan as its price
    score = zb.extra["search"]["estimated_iteration_s"]
    assert score > zb.predicted["iteration_time_s"]
    assert incumbent_bar_s(zb, zb.predicted["iteration_time_s"]) == score
    one = plans["1f1b"]  # a 1F1B plan as its price, or cut inside layers as its price in whole layers (higher)
    price_s, cuts = one.predicted["iteration_time_s"], one.extra["search"]["sublayer_cuts"]
    assert incumbent_bar_s(one, price_s) == (max(price_s, cuts["whole_layers_s"]) if cuts["kept"] else price_s)
    assert incumbent_bar_s(one, float("inf")) == float("inf")


def test_a_pipeline_that_keeps_1f1b_says_why() -> None:
    """`--schedules interleaved` on a plan whose pipelines stay 1F1B records why, per pipeline shape, and
    `ethpipe plan` prints it: one stage, too few layers per stage, not faster, or memory."""
    from ethpipe.planner.layers.interleave import why_not_interleaved
    from ethpipe.units import index_ranges

    one = make_plan(CLUSTER, LLAMA3, 128, 4096, schedules=("1f1b", "interleaved"))
    kept = one.extra["search"]["kept_schedule"]
    assert kept and all(k["schedule"] == "1f1b" and k["reason"] for k in kept)
    assert sorted(p for k in kept for p in k["pipelines"]) == [
        p for p, pipe in enumerate(one.pipelines) if pipe.schedule == "1f1b"]
    kinds = r"one stage|not faster|a stage holds|its stages would not fit memory|\d+ samples cannot fill"
    assert all(re.match(kinds, part) for k in kept for part in k["reason"].split("; "))
    deep = one.pipelines[0]
    shallow = Pipeline((deep.stages[0],), deep.micro_batch_sizes)
    assert why_not_interleaved(shallow) == "one stage: nothing to interleave"
    assert index_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_three_or_four_chunks_where_they_are_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interleaving tries 2, 3 and 4 chunks per stage and keeps the fastest that fits: at one sample per GPU on the
    16-GPU A100/V100 cluster (llama2-7b, fp16, 1F1B or interleaved) more chunks shrink the bubble further, and
    the simulator agrees with the plan's price; restricted to 2 chunks the same search returns a slower plan."""
    import ethpipe.planner.layers.interleave as interleave

    cluster = load_cluster("examples/clusters/eval_a100_v100_16.yaml")
    spec = load_model_spec("llama2-7b")
    plan = make_plan(cluster, spec, 16, 4096, schedules=("1f1b", "interleaved"), dtype="fp16")
    assert max(p.num_chunks for p in plan.pipelines) in (3, 4)
    cost = CostModel.for_plan(plan)
    assert simulate(plan, cost).iteration_time_s == pytest.approx(plan.predicted["iteration_time_s"], rel=1e-9)
    assert memory_shortfalls(plan, cost) == []
    monkeypatch.setattr(interleave, "CHUNK_COUNTS", (2,))
    two = make_plan(cluster, spec, 16, 4096, schedules=("1f1b", "interleaved"), dtype="fp16")
    assert max(p.num_chunks for p in two.pipelines) <= 2
    assert plan.predicted["iteration_time_s"] < 0.98 * two.predicted["iteration_time_s"]


def test_the_best_of_two_schedules_answers_alike_whatever_is_asked_first() -> None:
    """``BestOfTiming``'s inverse (what the data balancer asks) is the min of its schedules' tables even when it is
    asked before any T(n): 4 equal stages (F 1 s, B 2 s, of which W 1 s): 1F1B takes 1 sample within 12.5 s, zb-h1
    2 (the inherited table builder answered 1F1B's 1)."""
    def rows(x: int) -> tuple[np.ndarray, np.ndarray]:
        return np.full(4, 1.0 * x), np.full(4, 2.0 * x)

    def best_of() -> BestOfTiming:
        zb = PipelineTiming(1, rows, schedule="zb-h1", weight_times=lambda x: (np.full(4, 1.0 * x),),
                            unsplit=(False,) * 4)
        return BestOfTiming([PipelineTiming(1, rows), zb])
    assert PipelineTiming(1, rows).max_samples_within(12.5, 100) == 1
    asked_first = best_of().max_samples_within(12.5, 100)
    after = best_of()
    assert after.time_s(2) <= 12.5 < after.time_s(3)
    assert asked_first == after.max_samples_within(12.5, 100) == 2
