"""``grad_reduce: bf16`` is priced as the runtime runs it: half the sync's bytes, one bf16 copy per synced parameter in
memory, unsharded; the plan records it and every consumer reads it back (tests/dist/test_grad_reduce.py: the
runtime's sums and their bound)."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ethpipe.cli import commands  # noqa: F401
from ethpipe.cli.app import app
from ethpipe.cluster import cluster_from_dict
from ethpipe.cost import memory
from ethpipe.errors import UserError
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Plan
from ethpipe.planner import CostModel, estimate_iteration_s, make_plan
from ethpipe.sim import simulate

SPEC = load_model_spec("gpt3-125m")
# Two nodes on a slow NIC: the block sync is a large part of the step.
SLOW_NIC = {"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 2, "gpus_per_node": 2, "nic_gbit_s": 25}]}
BATCH = 32  # two 2-stage pipelines: each block synced across the NIC


def test_bf16_reduce_halves_the_sync_bytes_and_adds_its_copy_to_memory() -> None:
    clu = cluster_from_dict(SLOW_NIC)
    fp32, bf16 = CostModel(clu, SPEC, 512), CostModel(clu, SPEC, 512, grad_reduce="bf16")
    assert bf16.grad_sync_bytes(4, first=True, last=False) * 2 == fp32.grad_sync_bytes(4, first=True, last=False)
    assert memory.state_bytes_per_param(2, 1, "bf16") == memory.state_bytes_per_param(2, 1) + 2 == 18
    assert memory.state_bytes_per_param(8, 1, "bf16") == 32 + 2  # fp64 exactness mode: the same 2-byte copy
    per_layer = [c.memory_terms(1, 1, 2, False, first=True, last=False, device="a100_80gb_sxm")[1] for c in (fp32, bf16)]
    assert per_layer[1] - per_layer[0] == pytest.approx(2 * SPEC.params_per_layer())  # +2 B per parameter
    with pytest.raises(UserError, match="--grad-reduce must be one of fp32, bf16"):
        CostModel(clu, SPEC, 512, grad_reduce="fp16")


def test_a_bf16_plan_is_recorded_and_priced_faster_where_the_sync_is_exposed() -> None:
    clu = cluster_from_dict(SLOW_NIC)
    fp32 = make_plan(clu, SPEC, BATCH, 512, max_tp=1, shard_optimizer=False)
    bf16 = make_plan(clu, SPEC, BATCH, 512, max_tp=1, grad_reduce="bf16", shard_optimizer=False)
    assert bf16.extra["grad_reduce"] == "bf16" and fp32.extra["grad_reduce"] == "fp32"
    cost = CostModel.for_plan(bf16)
    assert cost.grad_reduce == "bf16"
    assert simulate(bf16, cost).iteration_time_s == pytest.approx(estimate_iteration_s(bf16, cost), rel=0.05)
    assert fp32.predicted["grad_sync_exposed_s"] > 0
    assert bf16.predicted["iteration_time_s"] < fp32.predicted["iteration_time_s"]
    # the fp32 plan's layout priced with a bf16 reduce: its sync alone is cheaper (what the planner compares)
    same = dataclasses.replace(fp32, extra={**fp32.extra, "grad_reduce": "bf16"})
    assert sum(CostModel.for_plan(same).block_sync_s(same)) < sum(CostModel.for_plan(fp32).block_sync_s(fp32))


def test_the_plan_file_checks_grad_reduce() -> None:
    clu = cluster_from_dict(SLOW_NIC)
    data = make_plan(clu, SPEC, BATCH, 512, max_tp=1, grad_reduce="bf16").to_dict()
    assert Plan.from_dict(copy.deepcopy(data)).extra["grad_reduce"] == "bf16"
    with pytest.raises(UserError, match="plan field 'grad_reduce' must be one of fp32, bf16"):
        Plan.from_dict({**copy.deepcopy(data), "grad_reduce": "int8"})
    assert Plan.from_dict({**copy.deepcopy(data), "shard_optimizer": True}).shard_optimizer


def test_sharded_a_bf16_reduce_halves_the_reduce_scatter_not_the_fp32_all_gather() -> None:
    """ZeRO-1 with a bf16 sum: the reduce-scatter moves bf16, the gather after the optimizer fp32 weights; the
    estimate and the simulator price the same, and an fp32 plan's gather still equals its reduce."""
    clu = cluster_from_dict(SLOW_NIC)
    plan = make_plan(clu, SPEC, BATCH, 512, max_tp=1, shard_optimizer=False)
    for reduce in ("fp32", "bf16"):
        sharded = dataclasses.replace(plan, shard_optimizer=True, extra={**plan.extra, "grad_reduce": reduce})
        cost = CostModel.for_plan(sharded)
        syncs, gathers = cost.block_sync_s(sharded), cost.block_gather_s(sharded)
        assert any(s > 0 for s in syncs)
        full = CostModel.for_plan(dataclasses.replace(sharded, extra={**sharded.extra, "grad_reduce": "fp32"}))
        assert gathers == pytest.approx(full.block_sync_s(sharded))  # the fp32 weights' bytes either way
        if reduce == "bf16":
            assert all(s < g for s, g in zip(syncs, gathers) if g > 0)
        assert simulate(sharded, cost).iteration_time_s == pytest.approx(estimate_iteration_s(sharded, cost), rel=0.05)


def test_plan_cli_takes_grad_reduce_and_refuses_a_bad_one(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("nodes:\n  - {gpu: a100_80gb_sxm, num_nodes: 2, gpus_per_node: 2, nic_gbit_s: 25}\n")
    args = ["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", "gpt3-125m", "--global-batch", str(BATCH),
            "--seq-len", "512", "--max-tp", "1"]
    res = CliRunner().invoke(app, [*args, "--grad-reduce", "bf16", "--out", str(tmp_path / "p.json")])
    assert res.exit_code == 0, res.output
    assert "bf16 gradient sums over 2 pipelines: each within 3 x 2^-8" in res.output
    saved = Plan.load(tmp_path / "p.json")
    assert saved.extra["grad_reduce"] == "bf16"
    # the opt-in lever says whether it pays: the same plan request with an fp32 sync, priced beside it
    fp32_s = saved.extra["search"]["grad_reduce"]["fp32_iteration_s"]
    assert fp32_s > saved.predicted["iteration_time_s"]  # a slow NIC: the halved sync pays
    assert f"with the sync in fp32 the plan takes {fp32_s:.4g} s" in res.output and "(faster)" in res.output
    bad = CliRunner().invoke(app, [*args, "--grad-reduce", "fp8"])
    assert bad.exit_code != 0 and "--grad-reduce must be one of fp32, bf16" in bad.output
    assert "Traceback" not in bad.output


def test_a_replan_keeps_the_plans_grad_reduce() -> None:
    from ethpipe.cli.replanning import replan

    old = make_plan(cluster_from_dict(SLOW_NIC), SPEC, BATCH, 512, max_tp=1, grad_reduce="bf16")
    one_node = cluster_from_dict({"nodes": [{**SLOW_NIC["nodes"][0], "num_nodes": 1}]})
    assert replan(old, one_node).extra["grad_reduce"] == "bf16"
