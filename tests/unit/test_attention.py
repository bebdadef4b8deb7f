"""Attention kernels as a plan choice: priced, recorded, kept by re-plans and simulate, honoured by the runtime."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ethpipe.cli import commands  # noqa: F401  (registers the commands)
from ethpipe.cli.app import app
from ethpipe.cluster import cluster_from_dict
from ethpipe.cost.model import CostModel
from ethpipe.cost.profile import load_profile
from ethpipe.errors import UserError
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Plan

V100 = {"nodes": [{"gpu": "v100_16gb_sxm2", "num_nodes": 2, "gpus_per_node": 4, "nic_gbit_s": 100}]}


def _plan(tmp_path: Path, name: str, *extra: str) -> Plan:
    (tmp_path / "c.yaml").write_text(json.dumps(V100))
    out = tmp_path / name
    res = CliRunner().invoke(app, ["plan", "--cluster", str(tmp_path / "c.yaml"), "--model", "gpt3-350m",
                                   "--global-batch", "32", "--seq-len", "2048", "--max-tp", "1", "--dtype", "fp32",
                                   "--out", str(out), *extra])
    assert res.exit_code == 0, res.output
    return Plan.load(out)


def test_materialised_attention_is_recorded_slower_and_priced_again_by_simulate(tmp_path: Path) -> None:
    auto = _plan(tmp_path, "auto.json")
    forced = _plan(tmp_path, "forced.json", "--attention", "materialised")
    assert auto.extra["attention"] == "auto" and forced.extra["attention"] == "materialised"
    assert "efficient attention" in auto.extra["compute_model"]["devices"]["v100_16gb_sxm2"]
    assert "materialised attention" in forced.extra["compute_model"]["devices"]["v100_16gb_sxm2"]
    # fp32 on a V100: 4 + 7 passes over 16 heads' s x s scores against one fused kernel.
    assert forced.predicted["iteration_time_s"] > 1.2 * auto.predicted["iteration_time_s"]
    for plan, name in ((auto, "auto.json"), (forced, "forced.json")):
        res = CliRunner().invoke(app, ["simulate", str(tmp_path / name), "--json"])
        assert res.exit_code == 0, res.output
        assert json.loads(res.output)["iteration_time_s"] == pytest.approx(plan.predicted["iteration_time_s"], rel=0.05)


def test_replan_keeps_the_attention_choice(tmp_path: Path) -> None:
    from ethpipe.cli.replanning import replan

    forced = _plan(tmp_path, "forced.json", "--attention", "materialised")
    smaller = cluster_from_dict({"nodes": [{**V100["nodes"][0], "num_nodes": 1}]})
    assert replan(forced, smaller).extra["attention"] == "materialised"


def test_a_plan_with_an_unknown_attention_is_refused_in_one_line(tmp_path: Path) -> None:
    plan = _plan(tmp_path, "auto.json")
    data = json.loads((tmp_path / "auto.json").read_text())
    data["attention"] = "flash3"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match="plan field 'attention' must be one of auto, materialised"):
        Plan.load(tmp_path / "bad.json")
    assert plan.extra["attention"] == "auto"


def test_materialised_scores_are_budgeted_in_the_memory_a_plan_needs() -> None:
    """mistral-7b at 4096 tokens on 16 GB V100s without recomputation fits neither way; the one-line error
    says how much each needs, and the unfused path needs at least one more 32 x 4096^2 fp16 score matrix
    (1 GiB) per layer held."""
    import re

    from ethpipe.planner import make_plan

    cluster = cluster_from_dict({"nodes": [{"gpu": "v100_16gb_sxm2", "num_nodes": 4, "gpus_per_node": 8,
                                            "nic_gbit_s": 100}]})
    spec = load_model_spec("mistral-7b")
    needs = {}
    for attention in ("auto", "materialised"):
        with pytest.raises(UserError) as err:
            make_plan(cluster, spec, 4, 4096, max_tp=1, dtype="fp16", attention=attention, recompute="never")
        assert "v100_16gb_sxm2" in str(err.value) and "--recompute always" in str(err.value)
        needs[attention] = float(re.search(r"needs ([0-9.]+) GiB", str(err.value)).group(1))
    assert needs["materialised"] >= needs["auto"] + 32 * 4096**2 * 2 / 2**30


def test_profile_records_its_attention_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    from ethpipe.cost.profile import LayerTiming, MeasuredProfile

    prof = MeasuredProfile("x", "cuda", "fp32", load_model_spec("tiny").to_dict(), 64,
                           {"block": {1: LayerTiming(1e-3, 2e-3)}}, 0.0, attention="materialised")
    prof.save(tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").attention == "materialised"
    data = json.loads((tmp_path / "p.json").read_text())
    del data["attention"]  # profiles written before the field: ethpipe's own runtime (SDPA)
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert load_profile(tmp_path / "old.json").attention == "auto"
    data["attention"] = "sometimes"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match="profile field 'attention'"):
        load_profile(tmp_path / "bad.json")


def test_runtime_attention_backend_is_a_no_op_off_cuda() -> None:
    import torch

    from ethpipe.runtime.model.kernel_modes import apply_attention

    plan = Plan.__new__(Plan)
    object.__setattr__(plan, "extra", {"attention": "materialised"})
    assert apply_attention(plan, torch.device("cpu")) is None
    assert torch.backends.cuda.flash_sdp_enabled()  # untouched


def test_cost_model_refuses_an_unknown_attention_mode() -> None:
    cluster = cluster_from_dict(V100)
    with pytest.raises(UserError, match="attention must be one of"):
        CostModel(cluster, load_model_spec("tiny"), 64, attention_mode="fused")
