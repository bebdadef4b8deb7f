"""bf16 only where the catalog says the device has it: plan, compare, replan and train refuse it elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import ethpipe.cli.commands  # noqa: F401  (registers the commands on the app)
from ethpipe.cli.app import app
from ethpipe.cli.replanning import replan
from ethpipe.cluster import cluster_from_dict, load_cluster
from ethpipe.errors import UserError
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Plan
from ethpipe.planner import PlannerOptions, make_plan
from ethpipe.precision import check_train_dtype
from ethpipe.runtime.start import launch

DEMO = "examples/clusters/cpu_demo.yaml"
MIXED = "examples/clusters/a100_v100.yaml"
TINY = ["--model", "tiny", "--global-batch", "16", "--seq-len", "64", "--max-tp", "1"]
A100 = cluster_from_dict({"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 100}]})


def _cli(*args: str) -> tuple[int, list[str]]:
    res = CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})
    return res.exit_code, [line for line in res.output.strip().splitlines() if line.strip()]


@pytest.mark.parametrize("command", ["plan", "compare"])
def test_plan_and_compare_refuse_bf16_on_v100(command: str) -> None:
    code, lines = _cli(command, "--cluster", MIXED, *TINY, "--dtype", "bf16")
    assert code == 2 and len(lines) == 1, lines
    assert "device type 'v100_32gb_sxm2'" in lines[0] and "has no bf16" in lines[0] and "--dtype fp32" in lines[0]


def test_auto_dtype_is_bf16_where_every_device_has_it_else_fp16(tmp_path: Path) -> None:
    code, lines = _cli("plan", "--cluster", MIXED, *TINY, "--out", str(tmp_path / "p.json"))
    assert code == 0, lines
    assert Plan.load(tmp_path / "p.json").extra["dtype"] == "fp16"
    tiny = load_model_spec("tiny")
    assert make_plan(A100, tiny, 16, 64, max_tp=1).extra["dtype"] == "bf16"
    assert make_plan(load_cluster(MIXED), tiny, 16, 64, max_tp=1, dtype="fp32").extra["dtype"] == "fp32"
    with pytest.raises(UserError, match="device type 't4' .*has no bf16: use --dtype fp16 or --dtype fp32"):
        t4 = cluster_from_dict({"nodes": [{"gpu": "t4", "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 100}]})
        make_plan(t4, tiny, 16, 64, max_tp=1, dtype="bf16")


def test_auto_dtype_is_bf16_when_the_plan_idles_every_device_without_it() -> None:
    """auto is judged on the devices the plan runs on: a plan that leaves the T4s idle trains in bf16, priced
    exactly as the fp16 plan of the same layout (same 16-bit peak, same 2-byte elements)."""
    import dataclasses

    from ethpipe.cost.model import CostModel
    from ethpipe.planner import estimate_iteration_s

    cluster = cluster_from_dict({"nodes": [{"gpu": "a100_40gb_sxm", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 400},
                                           {"gpu": "t4", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 400}]})
    spec = load_model_spec("gpt3-1.3b")
    plan = make_plan(cluster, spec, 8, 2048)
    assert {s.device for p in plan.pipelines for s in p.stages} == {"a100_40gb_sxm"} and plan.idle_devices
    assert plan.extra["dtype"] == "bf16"
    check_train_dtype(plan, "bf16")
    as_fp16 = dataclasses.replace(plan, extra={**plan.extra, "dtype": "fp16"})
    assert estimate_iteration_s(plan, CostModel.for_plan(plan)) == pytest.approx(
        estimate_iteration_s(as_fp16, CostModel.for_plan(as_fp16)), rel=1e-12) == pytest.approx(
        plan.predicted["iteration_time_s"], rel=1e-9)
    # Explicit choices stand, and a plan that runs on a T4 stays fp16.
    assert make_plan(cluster, spec, 8, 2048, dtype="fp16").extra["dtype"] == "fp16"
    every = make_plan(cluster, spec, 8, 2048, options=PlannerOptions(allow_idle=False))
    assert "t4" in {s.device for p in every.pipelines for s in p.stages} and every.extra["dtype"] == "fp16"
    # A re-plan judges auto again on its own devices: bf16 while the T4s stay idle, fp16 (said) once one runs.
    from ethpipe.cli.replanning import describe_changes

    assert replan(plan, cluster).extra["dtype"] == "bf16"
    forced = replan(plan, cluster, allow_idle=False)
    assert forced.extra["dtype"] == "fp16"
    assert any(line.startswith("dtype bf16 -> fp16") for line in describe_changes(plan, forced))
    explicit = make_plan(A100, spec, 8, 2048, dtype="bf16")  # asked for: kept, and refused where it cannot run
    with pytest.raises(UserError, match="the plan's dtype bf16 on the new cluster: device type 't4'"):
        replan(explicit, cluster)


def test_inline_devices_have_bf16_unless_their_spec_says_not() -> None:
    tiny = load_model_spec("tiny")
    demo = make_plan(load_cluster(DEMO), tiny, 24, 64, max_tp=1, dtype="bf16")  # the CPU runtime autocasts to bf16
    check_train_dtype(demo, "bf16")
    old = cluster_from_dict({"nodes": [{"gpu": {"id": "old", "memory_gib": 1, "peak_tflops": 1,
                                                "bf16_supported": False},
                                        "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 16}]})
    with pytest.raises(UserError, match="device type 'old' has no bf16"):
        make_plan(old, tiny, 8, 64, max_tp=1, dtype="bf16")


def test_replan_keeps_bf16_only_where_the_new_cluster_has_it() -> None:
    old = make_plan(A100, load_model_spec("tiny"), 16, 64, max_tp=1)
    assert old.extra["dtype"] == "bf16"
    with pytest.raises(UserError, match="the plan's dtype bf16 on the new cluster: device type 'v100_32gb_sxm2'"):
        replan(old, load_cluster(MIXED))
    unrecorded = Plan(**{**old.__dict__, "extra": {k: v for k, v in old.extra.items() if k != "dtype"}})
    assert replan(unrecorded, load_cluster(MIXED)).extra["dtype"] == "fp16"


@pytest.fixture
def v100_plan(tmp_path: Path) -> Path:
    cluster = cluster_from_dict({"nodes": [
        {"gpu": "a100_80gb_sxm", "num_nodes": 1, "gpus_per_node": 1, "nic_gbit_s": 100},
        {"gpu": "v100_32gb_sxm2", "num_nodes": 1, "gpus_per_node": 1, "nic_gbit_s": 100}]})
    path = tmp_path / "plan.json"
    # The V100 must run a stage (left to itself, eth idles it here: plan without v100 predicted faster).
    make_plan(cluster, load_model_spec("tiny"), 8, 64, max_tp=1, options=PlannerOptions(allow_idle=False)).save(path)
    return path


def _refuse_spawn(*_: object, **__: object) -> None:
    raise AssertionError("a process was started for bad input")


def test_train_refuses_bf16_on_the_plans_v100_before_any_process(v100_plan: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch.mp, "start_processes", _refuse_spawn)
    args = ["train", "--plan", str(v100_plan), "--data", str(tmp_path / "t.bin"), "--steps", "1", "--no-progress"]
    code, lines = _cli(*args, "--dtype", "bf16")
    assert code == 2 and len(lines) == 1 and "v100_32gb_sxm2" in lines[0] and "--dtype fp32" in lines[0], lines
    data = json.loads(v100_plan.read_text())
    data["dtype"] = "bf16"  # a hand-edited (or pre-check) plan priced for bf16
    v100_plan.write_text(json.dumps(data))
    code, lines = _cli(*args)  # the run would default to the plan's bf16
    assert code == 2 and len(lines) == 1 and "plan field 'dtype' is bf16" in lines[0], lines
    code, lines = _cli(*args, "--dtype", "fp32")  # a precision the V100 has overrides it: on to the next check
    assert code == 2 and len(lines) == 1 and "data file" in lines[0], lines


def test_train_without_the_plans_cluster_judges_catalog_ids(v100_plan: Path) -> None:
    plan = Plan.load(v100_plan)
    bare = Plan(**{**plan.__dict__, "cluster": None})
    with pytest.raises(UserError, match="v100_32gb_sxm2"):
        check_train_dtype(bare, "bf16")
    check_train_dtype(bare, "fp32")
