"""Plans that leave devices idle: no rank, listed in ``idle_devices`` (docs/plan-format.md, "Idle devices")."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ethpipe.cli import commands  # noqa: F401  (registers the commands)
from ethpipe.cli.app import app
from ethpipe.cli.replanning import replan
from ethpipe.cluster import cluster_from_dict, load_cluster
from ethpipe.cost.model import CostModel
from ethpipe.errors import Infeasible, UserError
from ethpipe.model_load import load_model_spec
from ethpipe.plan import IdleDevice, Plan
from ethpipe.planner import PlannerOptions, estimate_iteration_s, make_plan
from ethpipe.planner.devices import eth, idle
from ethpipe.planner.search.incumbent import incumbent_bar_s
from ethpipe.planner.search.ahead import MISSING, Ahead
from ethpipe.planner.devices.eth import plan_eth
from ethpipe.planner.devices.idle import plan_with_idle
from ethpipe.sim import simulate

TINY = load_model_spec("tiny")
SEQ = 128
# The slow type is listed first, so idling it shifts every rank: rank r is cluster device r + 4. Its slow
# intra-node link makes pricing a rank on the wrong device visible.
SLOW_FIRST = {"nodes": [
    {"gpu": {"id": "slow", "memory_gib": 16, "peak_tflops": 2, "intra_node_gbps": 1.0}, "num_nodes": 2,
     "gpus_per_node": 2, "nic_gbit_s": 10},
    {"gpu": {"id": "fast", "memory_gib": 16, "peak_tflops": 100, "intra_node_gbps": 100.0}, "num_nodes": 1,
     "gpus_per_node": 4, "nic_gbit_s": 100},
]}
IDLE = [{"device_index": i, "device": "slow", "reason": "idle: hand-written"} for i in range(4)]
PLAN = {
    "version": 1, "method": "eth", "model": "tiny", "global_batch_size": 6, "seq_len": SEQ,
    "pipelines": [
        {"stages": [{"ranks": [0], "device": "fast", "layers": [0, 4]},
                    {"ranks": [1], "device": "fast", "layers": [4, 8]}], "micro_batch_sizes": [2, 1]},
        {"stages": [{"ranks": [2], "device": "fast", "layers": [0, 3]},
                    {"ranks": [3], "device": "fast", "layers": [3, 8]}], "micro_batch_sizes": [3]},
    ],
    "blocks": [{"layers": [0, 3], "ranks": [0, 2]}, {"layers": [3, 4], "ranks": [0, 3]},
               {"layers": [4, 8], "ranks": [1, 3]}],
    "cluster": SLOW_FIRST, "idle_devices": IDLE,
}


def _plan_dict(**changes: object) -> dict:
    data = copy.deepcopy(PLAN)
    data.update(copy.deepcopy(changes))
    return data


# -- Cluster.without_devices ---------------------------------------------------------------

def test_without_devices_renumbers_and_keeps_nodes() -> None:
    full = cluster_from_dict(SLOW_FIRST)
    sub = full.without_devices(range(4))
    assert [d.rank for d in sub.devices] == [0, 1, 2, 3] and {d.gpu.id for d in sub.devices} == {"fast"}
    assert [(d.node, d.local_rank) for d in sub.devices] == [(2, 0), (2, 1), (2, 2), (2, 3)]
    assert all(d.nic_gbps == full.devices[4].nic_gbps for d in sub.devices)
    assert sub.source == full.source and sub.device_indices == (4, 5, 6, 7)
    assert [d.rank for d in sub.idle_devices] == [0, 1, 2, 3]
    assert sub.link_gbps(0, 3) == 100.0  # still one node: the fast node's intra-node link

    part = full.without_devices([1, 5])  # one device of node 0, one of node 2
    assert part.device_indices == (0, 2, 3, 4, 6, 7)
    assert [(d.node, d.local_rank) for d in part.devices] == [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1), (2, 2)]
    assert part.link_gbps(1, 2) == 1.0 and part.link_gbps(3, 5) == 100.0
    assert part.link_gbps(0, 1) == full.link_gbps(0, 2)  # across nodes: the NIC figures are kept
    again = part.without_devices([0])  # indices are this cluster's ranks; the idle list is in full indices
    assert again.device_indices == (2, 3, 4, 6, 7) and [d.rank for d in again.idle_devices] == [0, 1, 5]


@pytest.mark.parametrize("indices, message", [([8], "not a device"), ([-1], "not a device"),
                                              (range(8), "leave no device")])
def test_without_devices_refuses_bad_indices(indices, message) -> None:
    with pytest.raises(ValueError, match=message):
        cluster_from_dict(SLOW_FIRST).without_devices(indices)


# -- the plan field -----------------------------------------------------------------------

def test_plan_round_trip_with_idle_devices(tmp_path: Path) -> None:
    plan = Plan.from_dict(_plan_dict())
    assert plan.idle_devices == tuple(IdleDevice(i, "slow", "idle: hand-written") for i in range(4))
    assert plan.world_size == 4 and plan.idle_device_indices == (0, 1, 2, 3)
    assert plan.to_dict()["idle_devices"] == IDLE and "idle_devices" not in plan.extra
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan
    assert plan.active_cluster().device_indices == (4, 5, 6, 7)
    old = {k: v for k, v in _plan_dict().items() if k != "idle_devices"}  # a plan without the field
    old["cluster"] = {"nodes": [SLOW_FIRST["nodes"][1]]}
    loaded = Plan.from_dict(old)
    assert loaded.idle_devices == () and "idle_devices" not in loaded.to_dict()


def _idle(**entry: object) -> list:
    return [{**IDLE[0], **entry}] + copy.deepcopy(IDLE[1:])


@pytest.mark.parametrize("changes, needle", [
    ({"idle_devices": {"device_index": 0}}, "'idle_devices' must be a list"),
    ({"idle_devices": ["slow"]}, "'idle_devices[0]' must be an object"),
    ({"idle_devices": _idle(device_index="0")}, "'idle_devices[0].device_index' must be an integer"),
    ({"idle_devices": _idle(device_index=True)}, "'idle_devices[0].device_index' must be an integer"),
    ({"idle_devices": _idle(device_index=8)}, "'idle_devices[0].device_index' is 8 but the cluster has 8 devices: "
                                              "use an index in 0..7"),
    ({"idle_devices": _idle(device_index=1)}, "'idle_devices[1].device_index' 1 is listed twice"),
    ({"idle_devices": _idle(device="fast")}, "'idle_devices[0].device' is 'fast' but cluster device 0 is a 'slow'"),
    ({"idle_devices": _idle(reason="  ")}, "'idle_devices[0].reason' must be a non-empty string"),
    ({"idle_devices": [{"device_index": 0, "device": "slow"}]}, "'idle_devices[0].reason' is missing"),
    ({"idle_devices": IDLE[:3]}, "'idle_devices' leaves 5 of the cluster's 8 devices active but the pipelines use 4"),
    ({"cluster": None}, "'idle_devices' needs the plan's 'cluster'"),
    ({"cluster": {"nodes": []}}, "plan field 'cluster' is invalid"),
    ({"idle_devices": [{**e, "device_index": e["device_index"] + 4, "device": "fast"} for e in IDLE]},
     "'pipelines[0].stages[0].device' is 'fast' but rank 0 is cluster device 0, a 'slow'"),
])
def test_idle_devices_validation_errors(changes, needle) -> None:
    data = _plan_dict(**changes)
    if data["cluster"] is None:
        del data["cluster"]
    with pytest.raises(UserError) as err:
        Plan.from_dict(data)
    message = str(err.value)
    assert needle in message and "\n" not in message, message


# -- pricing and the planner ----------------------------------------------------------------

@pytest.fixture(scope="module")
def idle_plan() -> Plan:
    return make_plan(cluster_from_dict(SLOW_FIRST), TINY, 8, SEQ, max_tp=1, shard_optimizer=False)  # one pricing


def test_eth_leaves_the_slow_nodes_idle_when_faster(idle_plan: Plan) -> None:
    every = make_plan(cluster_from_dict(SLOW_FIRST), TINY, 8, SEQ, max_tp=1, options=PlannerOptions(allow_idle=False),
                      shard_optimizer=False)
    assert every.world_size == 8 and every.idle_devices == ()
    assert idle_plan.world_size == 4 and idle_plan.idle_device_indices == (0, 1, 2, 3)
    fast_s, every_s = idle_plan.predicted["iteration_time_s"], every.predicted["iteration_time_s"]
    assert fast_s <= every_s
    # The idle search compares plans in whole layers (sub-layer cuts come after it: ``planner.make_plan``)
    cuts = every.extra["search"]["sublayer_cuts"]
    every_s = cuts["whole_layers_s"]
    reason = f"idle: plan without slow predicted {fast_s:.4g} s vs {every_s:.4g} s with it"
    assert {d.reason for d in idle_plan.idle_devices} == {reason}
    tried = idle_plan.extra["search"]["idle"]
    assert tried["full_cluster_iteration_time_s"] == every_s
    assert tried["candidates"][0]["idle_types"] == ["slow"] and tried["candidates"][0]["iteration_time_s"] == fast_s
    assert idle_plan.extra["device_speeds"] == {"fast": 1.0}
    assert Plan.from_dict(json.loads(idle_plan.to_json())) == idle_plan  # valid, and it round-trips


def test_for_plan_prices_ranks_as_the_active_devices(idle_plan: Plan) -> None:
    cost = CostModel.for_plan(idle_plan)
    assert cost.cluster.device_indices == (4, 5, 6, 7) and {d.gpu.id for d in cost.cluster.devices} == {"fast"}
    assert estimate_iteration_s(idle_plan, cost) == pytest.approx(idle_plan.predicted["iteration_time_s"], rel=1e-12)
    wrong = CostModel(cluster_from_dict(SLOW_FIRST), TINY, SEQ)  # ranks as devices 0..3: the slow node's links
    assert estimate_iteration_s(idle_plan, wrong) > 1.01 * estimate_iteration_s(idle_plan, cost)
    assert simulate(idle_plan, cost).iteration_time_s == pytest.approx(idle_plan.predicted["iteration_time_s"],
                                                                        rel=0.05)


def test_cli_plan_and_simulate_with_idle_devices(tmp_path: Path) -> None:
    cluster, out = tmp_path / "c.yaml", tmp_path / "p.json"
    cluster.write_text(yaml.safe_dump(SLOW_FIRST))
    runner = CliRunner()
    res = runner.invoke(app, ["plan", "--cluster", str(cluster), "--model", "tiny", "--global-batch", "8",
                              "--seq-len", str(SEQ), "--max-tp", "1", "--out", str(out)], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    # the two idle nodes of one cluster-file entry: one line, not one per node
    assert ("idle: whole nodes 0-1 (cluster nodes[0] from node 0: 2 x slow each, devices 0-3): no rank, start no"
            in res.output)
    assert res.output.count("idle: whole node") == 1
    assert "start ethpipe on the other 4 of 8 devices only (world size 4" in res.output
    res = runner.invoke(app, ["simulate", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert [r["device"] for r in json.loads(res.stdout)["ranks"]] == ["fast"] * 4
    res = runner.invoke(app, ["simulate", str(out)], env={"COLUMNS": "250"})
    assert res.exit_code == 0 and "4 cluster devices idle (no rank, not simulated)" in res.output


def test_no_idle_when_every_device_helps() -> None:
    demo = load_cluster("examples/clusters/cpu_demo.yaml")
    # 64 samples: at 32 the 2 fast devices alone win by 0.5% (12.52 vs 12.58 ms), one node's stats all-gather
    # instead of three's 200 us hops before every optimizer step
    plan = make_plan(demo, TINY, 64, 64, max_tp=1)
    assert plan.idle_devices == () and plan.world_size == demo.num_devices
    (candidate,) = plan.extra["search"]["idle"]["candidates"]
    # the sub-cluster's search prunes against the full plan's time and finds nothing under it
    full_s = plan.extra["search"]["idle"]["full_cluster_iteration_time_s"]  # the unsharded search's plan
    assert candidate["skipped"] == f"no plan predicted under {full_s:.4g} s"
    assert plan.predicted["iteration_time_s"] <= full_s  # sharding the optimizer state kept it or did better
    one_type = cluster_from_dict({"nodes": [SLOW_FIRST["nodes"][1]]})
    assert "idle" not in make_plan(one_type, TINY, 8, SEQ, max_tp=1).extra["search"]


def test_plan_with_idle_skips_infeasible_and_bounded_candidates() -> None:
    cost = CostModel(cluster_from_dict(SLOW_FIRST), TINY, SEQ)

    def only_full(on: CostModel, incumbent_s: float) -> Plan:
        if on.cluster.num_devices < 8:
            raise Infeasible("does not fit")
        return make_plan(on.cluster, TINY, 8, SEQ, max_tp=1, options=PlannerOptions(allow_idle=False))

    plan, chosen = plan_with_idle(cost, 8, only_full)
    assert plan.idle_devices == () and chosen is cost
    assert plan.extra["search"]["idle"]["candidates"][0]["skipped"] == "infeasible: does not fit"

    def never(on: CostModel, incumbent_s: float = math.inf) -> Plan:
        raise Infeasible(f"nothing fits on {on.cluster.num_devices}")

    with pytest.raises(Infeasible, match="nothing fits on 8"):  # the full cluster's error
        plan_with_idle(cost, 8, never)
    full = make_plan(cost.cluster, TINY, 8, SEQ, max_tp=1, options=PlannerOptions(allow_idle=False))
    hopeless = dataclasses.replace(full, predicted={**full.predicted, "iteration_time_s": 1e-9})
    plan, _ = plan_with_idle(cost, 8, lambda on, _: hopeless if on is cost else never(on))
    assert plan.extra["search"]["idle"]["candidates"][0]["skipped"].startswith("lower bound")
    seen: list[float] = []

    def nothing_faster(on: CostModel, incumbent_s: float) -> Plan | None:
        seen.append(incumbent_s)
        return full if on is cost else None

    plan, chosen = plan_with_idle(cost, 8, nothing_faster)
    assert plan.idle_devices == () and chosen is cost
    assert seen == [math.inf, math.inf]  # the first candidate has nothing to beat (it may run ahead, in parallel)
    (candidate,) = plan.extra["search"]["idle"]["candidates"]  # and the search stops there
    assert candidate["skipped"].startswith("no plan predicted under")


THREE_TYPES = {"nodes": [
    {"gpu": {"id": "slow", "memory_gib": 16, "peak_tflops": 2}, "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 10},
    {"gpu": {"id": "mid", "memory_gib": 16, "peak_tflops": 20}, "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 10},
    {"gpu": {"id": "fast", "memory_gib": 16, "peak_tflops": 100}, "num_nodes": 1, "gpus_per_node": 2,
     "nic_gbit_s": 10},
]}


def test_later_idle_candidates_are_told_the_time_to_beat() -> None:
    cost = CostModel(cluster_from_dict(THREE_TYPES), TINY, SEQ)
    full = make_plan(cost.cluster, TINY, 8, SEQ, max_tp=1, options=PlannerOptions(allow_idle=False))
    times = {6: 3.0, 4: 2.0, 2: 1.5}  # devices left -> predicted seconds: each idle type helps
    seen: list[tuple[int, float]] = []

    def timed(on: CostModel, incumbent_s: float) -> Plan:
        seen.append((on.cluster.num_devices, incumbent_s))
        return dataclasses.replace(full, predicted={**full.predicted, "iteration_time_s": times[on.cluster.num_devices]})

    plan, chosen = plan_with_idle(cost, 8, timed, ahead=False)
    assert seen == [(6, math.inf), (4, math.inf), (2, 2.0)] and chosen.cluster.num_devices == 2
    assert [c["iteration_time_s"] for c in plan.extra["search"]["idle"]["candidates"]] == [2.0, 1.5]


@pytest.mark.parametrize("first_s", [3.5, 3.2])  # slower than the full plan (3.2: within NEAR)
@pytest.mark.parametrize("fast_nic_gbit_s", [10, 100])
def test_a_candidate_that_does_not_pay_stops_the_idle_search_unless_near_or_the_next_frees_slow_nics(
        first_s: float, fast_nic_gbit_s: int) -> None:
    """Idling the slowest type may not pay where idling the two slowest does (the planner_random cases in
    idle.py's docstring). After a candidate that does not pay, the search goes on only if that candidate came
    within ``NEAR`` of the best, or to a candidate that raises the slowest per-GPU NIC share of the devices it
    keeps."""
    nodes = copy.deepcopy(THREE_TYPES)
    nodes["nodes"][2]["nic_gbit_s"] = fast_nic_gbit_s  # the slow and mid nodes: 10 Gbit/s
    cost = CostModel(cluster_from_dict(nodes), TINY, SEQ)
    full = make_plan(cost.cluster, TINY, 8, SEQ, max_tp=1, options=PlannerOptions(allow_idle=False))
    times = {6: 3.0, 4: first_s, 2: 1.5}
    seen: list[tuple[int, float]] = []

    def timed(on: CostModel, incumbent_s: float) -> Plan | None:
        seen.append((on.cluster.num_devices, incumbent_s))
        time_s = times[on.cluster.num_devices]
        if time_s >= incumbent_s:
            return None
        return dataclasses.replace(full, predicted={**full.predicted, "iteration_time_s": time_s})

    plan, chosen = plan_with_idle(cost, 8, timed, ahead=False)
    tried = plan.extra["search"]["idle"]["candidates"]
    assert tried[0]["skipped"] == "no plan predicted under 3 s" and tried[0].get("near_s") == (
        first_s if first_s == 3.2 else None)
    assert 3.2 < idle.NEAR * 3.0 < 3.5
    if fast_nic_gbit_s == 10 and first_s != 3.2:  # not near, and idling the mid type too frees no slower NIC
        assert seen == [(6, math.inf), (4, math.inf)] and chosen is cost and len(tried) == 1
        return
    assert seen == [(6, math.inf), (4, math.inf), (2, 3.0)]  # the best so far is still the full cluster's
    assert chosen.cluster.num_devices == 2 and plan.predicted["iteration_time_s"] == 1.5
    assert tried[1]["iteration_time_s"] == 1.5
    shares = idle.nic_share_by_type(cost)
    assert idle.slowest_nic_share_gbps(shares, ("slow",)) == 10 / 8 / 2
    assert (idle.slowest_nic_share_gbps(shares, ("slow", "mid")) > 10 / 8 / 2) == (fast_nic_gbit_s > 10)


def test_the_first_idle_candidate_planned_ahead_gives_the_same_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a second (forked) process or in this one: the same plan either way. (Forced on: another test may
    have left a thread alive, which switches it off in real use.)"""
    started: list[Ahead] = []

    class Counted(Ahead):
        def __init__(self, fn) -> None:  # type: ignore[no-untyped-def]
            super().__init__(fn)
            started.append(self)

    monkeypatch.setattr(idle, "can_run_ahead", lambda: True)
    monkeypatch.setattr(idle, "Ahead", Counted)
    cost = CostModel(cluster_from_dict(SLOW_FIRST), TINY, SEQ)

    def plan_on(on: CostModel, incumbent_s: float) -> Plan | None:
        return plan_eth(on, 8, max_tp=1, incumbent_s=incumbent_s)

    here, _ = plan_with_idle(cost, 8, plan_on, ahead=False)
    assert not started
    ahead, chosen = plan_with_idle(cost, 8, plan_on, ahead=True)
    assert len(started) == 1
    assert chosen.cluster.num_devices == 4 and ahead.idle_device_indices == here.idle_device_indices == (0, 1, 2, 3)
    assert ahead.pipelines == here.pipelines and ahead.extra["search"]["idle"] == here.extra["search"]["idle"]
    timeless = [{k: v for k, v in p.predicted.items() if k != "planning_time_s"} for p in (ahead, here)]
    assert timeless[0] == timeless[1] and ahead.blocks == here.blocks


def test_a_child_that_cannot_answer_leaves_the_call_to_this_process() -> None:
    seen: list[int] = []
    job = Ahead(lambda: (lambda: None))  # a lambda does not pickle: the child sends nothing
    assert job.result() is MISSING
    job = Ahead(lambda: seen.append(1) or 7)  # the child's side effects stay in the child
    assert job.result() == 7 and seen == []
    job = Ahead(lambda: (_ for _ in ()).throw(Infeasible("does not fit")))
    with pytest.raises(Infeasible, match="does not fit"):
        job.result()


def test_plan_eth_with_an_incumbent_is_the_same_plan_or_none() -> None:
    """Pruning against another cluster's time is sound: a looser incumbent gives the unpruned plan, a
    tighter one than the best plan gives None. Looser than the plan's bar (``incumbent_bar_s``: its time in whole
    layers where it is cut inside layers, which is what the search's whole-layer scores are compared with)."""
    cost = CostModel(cluster_from_dict(SLOW_FIRST), TINY, SEQ)
    free = plan_eth(cost, 8, max_tp=1)
    best_s = free.predicted["iteration_time_s"]
    loose = plan_eth(cost, 8, max_tp=1, incumbent_s=incumbent_bar_s(free, best_s) * 1.01)
    assert loose is not None and loose.pipelines == free.pipelines
    assert plan_eth(cost, 8, max_tp=1, incumbent_s=best_s) is None


def test_replan_for_a_running_world_uses_every_device(idle_plan: Plan) -> None:
    cluster = cluster_from_dict(SLOW_FIRST)
    assert replan(idle_plan, cluster).world_size == 4
    assert replan(idle_plan, cluster, allow_idle=False).world_size == 8


def test_robust_idling_is_judged_by_the_worst_case() -> None:
    """With --robust the idle decision compares worst cases, and the reason says so."""
    plan = make_plan(cluster_from_dict(SLOW_FIRST), TINY, 8, SEQ, max_tp=1, robust=True)
    tried = plan.extra["search"]["idle"]["candidates"]
    assert all("worst_case_time_s" in c for c in tried if "iteration_time_s" in c)
    assert plan.idle_devices and "worst case" in plan.idle_devices[0].reason
    assert plan.predicted["worst_case_time_s"] <= plan.extra["search"]["idle"]["full_cluster_iteration_time_s"]


def test_no_idle_uses_every_device(tmp_path: Path) -> None:
    """`plan --no-idle`: the whole cluster has ranks even where the planner would leave the slow nodes idle."""
    cluster, out = tmp_path / "c.yaml", tmp_path / "p.json"
    cluster.write_text(yaml.safe_dump(SLOW_FIRST))
    args = ["plan", "--cluster", str(cluster), "--model", "tiny", "--global-batch", "8", "--seq-len", str(SEQ),
            "--max-tp", "1", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0 and Plan.load(out).idle_devices, res.output  # the planner idles the slow nodes
    res = CliRunner().invoke(app, [*args, "--no-idle"])
    assert res.exit_code == 0, res.output
    plan = Plan.load(out)
    assert not plan.idle_devices and plan.world_size == 8


def test_a_sub_cluster_searches_its_rank_order_replicas_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """qwen2.5-14b, one sample per GPU, bf16 sync, on 312 H100 (1600 Gbit/s) + 96 A800-PCIe-40 + 104 A800-PCIe
    (100 and 50 Gbit/s): the plan leaves both A800 types idle and runs 12 rank-order replicas of depth 13 at TP 2
    over the H100s (spanning nodes: no pool shape of 8-GPU nodes is 26 GPUs deep). It is as fast as planning the
    H100s alone, whose search has the uniform baseline's rank-order space; the idle search's sub-cluster searches
    that space apart from its other families (``eth._rank_order_found``), and without it the plan is 8% slower."""
    nodes = [{"gpu": "h100_sxm", "num_nodes": 39, "gpus_per_node": 8, "nic_gbit_s": 1600},
             {"gpu": "a800_pcie_40gb", "num_nodes": 12, "gpus_per_node": 8, "nic_gbit_s": 100},
             {"gpu": "a800_pcie", "num_nodes": 26, "gpus_per_node": 4, "nic_gbit_s": 50}]
    spec = load_model_spec("qwen2.5-14b")
    plan = make_plan(cluster_from_dict({"nodes": nodes}), spec, 512, 4096, grad_reduce="bf16")
    assert {d.device for d in plan.idle_devices} == {"a800_pcie_40gb", "a800_pcie"}
    assert {(p.depth, p.stages[0].tp) for p in plan.pipelines} == {(13, 2)}
    alone = make_plan(cluster_from_dict({"nodes": nodes[:1]}), spec, 512, 4096, grad_reduce="bf16")
    assert plan.predicted["iteration_time_s"] == pytest.approx(alone.predicted["iteration_time_s"], rel=1e-9)
    monkeypatch.setattr(eth, "_rank_order_found", lambda *args, **kwargs: ([], 0))
    without = make_plan(cluster_from_dict({"nodes": nodes}), spec, 512, 4096, grad_reduce="bf16")
    assert plan.predicted["iteration_time_s"] < 0.95 * without.predicted["iteration_time_s"]
