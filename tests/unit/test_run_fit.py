"""Learning the devices from a run: stage-level observations -> per-type scales -> a re-plan that uses them.

Synthetic metrics lines made from the cost model itself with a known truth (the "fast" type 2x slower than
believed, a little noise, a slow first step): the fit must recover the truth, the re-planner must find and
price a faster plan, and the CLI must write a catalog that `plan` / `replan` price with.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

import ethpipe.cli.commands  # noqa: F401  (registers the commands on the app)
from ethpipe.cli.app import app
from ethpipe.cli.learn import RunReplanner, fit_run, priced_with
from ethpipe.cli.replanning import recorded_calibration
from ethpipe.cluster import load_cluster
from ethpipe.cost.hardware import (
    Calibration,
    DeviceScale,
    calibration_from_dict,
    load_calibration,
    shipped_calibration,
)
from ethpipe.cost.model import CostModel
from ethpipe.cost.run_fit import fit_device_scales, stage_observations
from ethpipe.errors import UserError
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Plan
from ethpipe.planner import make_plan

DEMO = "examples/clusters/cpu_demo.yaml"
TRUTH = {"fast": 2.0, "slow": 1.0}  # measured / believed compute per type


def _plan() -> Plan:
    return make_plan(load_cluster(DEMO), load_model_spec("tiny"), 24, 128, "eth", max_tp=1, dtype="fp32")


def _records(plan: Plan, steps: int = 8, noise: float = 0.02, seed: int = 0,
             truth: dict[str, float] | None = None, warm_s: float = 5.0) -> list[dict]:
    """What `train --metrics` writes, with every rank's compute = the model's x truth[type] (TRUTH) x noise, the
    first step ``warm_s`` x slower (allocation and warm-up)."""
    truth = TRUTH if truth is None else truth
    cost = CostModel.for_plan(plan)
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        fwd, bwd = [], []
        for rank in range(plan.world_size):
            pos = plan.position_of(rank)
            pipe = plan.pipelines[pos.pipeline]
            stage = pipe.stages[pos.stage]
            f = b = 0.0
            for size in pipe.micro_batch_sizes:
                sf, sb = cost.stage_compute_s(stage, size, first=pos.stage == 0, last=pos.stage == pipe.depth - 1)
                f, b = f + sf, b + sb
            k = truth[stage.device] * (warm_s if step == 0 else 1.0)
            fwd.append(f * k * (1 + noise * rng.standard_normal()))
            bwd.append(b * k * (1 + noise * rng.standard_normal()))
        out.append({"step": step, "loss": 5.0, "iteration_time_s": 1.0, "rank_fwd_s": fwd, "rank_bwd_s": bwd,
                    "micro_batch_sizes": [list(p.micro_batch_sizes) for p in plan.pipelines]})
    return out


def test_the_fit_recovers_each_types_measured_speed_from_stage_observations() -> None:
    plan = _plan()
    obs = stage_observations(plan, _records(plan), CostModel.for_plan(plan))
    assert len(obs) == 7 * plan.world_size  # the first step is left out
    assert len({o.num_layers for o in obs}) > 1  # stages of different depths inform the same constants
    scales = fit_device_scales(obs)
    for t, truth in TRUTH.items():
        assert scales[t].fwd_scale == pytest.approx(truth, rel=0.03)
        assert scales[t].bwd_scale == pytest.approx(truth, rel=0.03)
    fit = fit_run(plan, _records(plan))
    assert all(abs(row["error"]) < 0.03 for row in fit.after)  # predicted vs measured per stage, after the fit
    assert any(abs(row["error"]) > 0.4 for row in fit.before)  # the fast stages were priced 2x too fast


def test_the_replanner_switches_to_a_faster_plan_and_keeps_one_it_cannot_beat() -> None:
    plan = _plan()
    new, decision = RunReplanner(5)(plan, _records(plan))
    assert decision["switched"] and new is not None and decision["gain"] > 0.05
    assert decision["relative_speeds"]["slow"] == pytest.approx(0.25 * 2, rel=0.05)  # fast was 4x, is 2x
    assert new.world_size == plan.world_size and not new.idle_devices  # the same devices (the job's world)
    fit = fit_run(plan, _records(plan))
    assert decision["new_predicted_s"] == pytest.approx(priced_with(new, fit.calibration), rel=1e-9)
    assert decision["old_predicted_s"] == pytest.approx(priced_with(plan, fit.calibration), rel=1e-9)
    as_priced = _records(new, 6, noise=0.0, truth={t: 1.0 for t in TRUTH}, warm_s=1.0)  # the new plan's model is right
    kept, again = RunReplanner(5)(new, as_priced)
    assert kept is None and not again["switched"] and "keeping the plan" in again["line"]


def test_device_scales_round_trip_and_price_the_type() -> None:
    cal = Calibration({}, "x", None, {"fast": DeviceScale(2.0, 3.0, "run", 12)})
    back = calibration_from_dict(cal.to_dict())
    assert back.devices == cal.devices
    cluster, spec = load_cluster(DEMO), load_model_spec("tiny")
    plain = CostModel(cluster, spec, 128, dtype_bytes=4)
    scaled = CostModel(cluster, spec, 128, dtype_bytes=4, calibration=cal)
    stage = dataclasses.replace(_plan().pipelines[0].stages[-1], recompute=False)  # recompute: a forward again
    pf, pb = plain.stage_compute_s(stage, 2, first=False, last=True)
    sf, sb = scaled.stage_compute_s(stage, 2, first=False, last=True)
    assert (sf, sb) == pytest.approx((2 * pf, 3 * pb))
    assert scaled.achievable_flops("fast") == pytest.approx(plain.achievable_flops("fast") / (8 / 3))


def test_calibrate_from_run_writes_a_catalog_that_plan_and_replan_use(tmp_path: Path) -> None:
    plan = _plan()
    plan.save(tmp_path / "plan.json")
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(plan)))
    runner = CliRunner()
    res = runner.invoke(app, ["calibrate", "--from-run", str(tmp_path / "m.jsonl"), "--plan", str(tmp_path / "plan.json"),
                              "--out", str(tmp_path / "fitted.yaml")], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "predicted vs measured per stage" in res.output and "fast" in res.output
    from ethpipe.plan_text import layers_text

    first = plan.pipelines[0].stages[0]
    assert layers_text(first.layer_ranges, first.sublayers) in res.output  # the stage's layers as `plan` names them
    devices = yaml.safe_load((tmp_path / "fitted.yaml").read_text())["devices"]
    assert devices["fast"]["fwd_scale"] == pytest.approx(2.0, rel=0.03)
    planned = runner.invoke(app, ["plan", "--cluster", DEMO, "--model", "tiny", "--global-batch", "24", "--seq-len",
                                  "128", "--max-tp", "1", "--dtype", "fp32", "--catalog", str(tmp_path / "fitted.yaml")],
                            env={"COLUMNS": "250"})
    assert planned.exit_code == 0 and "as a run measured" in planned.output, planned.output
    replanned = runner.invoke(app, ["replan", "--plan", str(tmp_path / "plan.json"), "--catalog",
                                    str(tmp_path / "fitted.yaml"), "--out", str(tmp_path / "new.json")])
    assert replanned.exit_code == 0, replanned.output
    new = Plan.load(tmp_path / "new.json")
    assert new.world_size == plan.world_size
    from ethpipe.plan_text import plan_shape

    assert f"new: {plan_shape(new)}" in replanned.output  # the plan's [stages] printed as text, not eaten as markup
    # the headline pairs prices from the same constants (the old plan's own, uncalibrated, is only mentioned)
    headline = next(line for line in replanned.output.splitlines() if line.startswith("predicted iteration"))
    repriced = priced_with(plan, (recorded_calibration(plan) or shipped_calibration()).merged(
        load_calibration(tmp_path / "fitted.yaml")))
    assert headline.startswith(f"predicted iteration {repriced:.4f} s -> {new.predicted['iteration_time_s']:.4f} s "
                               "(both with the new constants; the old plan's own price was"), headline
    (tmp_path / "old.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    old = runner.invoke(app, ["calibrate", "--from-run", str(tmp_path / "old.jsonl"), "--plan",
                              str(tmp_path / "plan.json"), "--out", str(tmp_path / "x.yaml")])
    assert old.exit_code == 2 and "rank_fwd_s" in old.output and not (tmp_path / "x.yaml").exists()


def test_a_tensor_parallel_stages_all_reduces_are_taken_out_of_the_fit() -> None:
    """measured = truth x compute + the TP all-reduces (priced on the link): the fit recovers the truth exactly, as
    CostModel applies the scale to compute only."""
    plan = make_plan(load_cluster("examples/clusters/cpu_tp.yaml"), load_model_spec("tiny"), 2, 64, "eth", dtype="fp32")
    assert max(s.tp for p in plan.pipelines for s in p.stages) > 1
    cost = CostModel.for_plan(plan)
    records = []
    for step in range(4):
        fwd, bwd = [], []
        for rank in range(plan.world_size):
            pos = plan.position_of(rank)
            pipe = plan.pipelines[pos.pipeline]
            stage = pipe.stages[pos.stage]
            ends = {"first": pos.stage == 0, "last": pos.stage == pipe.depth - 1}
            f = b = 0.0
            for size in pipe.micro_batch_sizes:
                (pf, pb), (cf, cb) = cost.stage_compute_s(stage, size, **ends), cost.stage_tp_comm_s(stage, size, **ends)
                assert cf > 0 or stage.tp == 1
                f, b = f + 3.0 * (pf - cf) + cf, b + 3.0 * (pb - cb) + cb
            fwd.append(f)
            bwd.append(b)
        records.append({"step": step, "rank_fwd_s": fwd, "rank_bwd_s": bwd,
                        "micro_batch_sizes": [list(p.micro_batch_sizes) for p in plan.pipelines]})
    scale = fit_device_scales(stage_observations(plan, records, cost))["cpu"]
    assert (scale.fwd_scale, scale.bwd_scale) == pytest.approx((3.0, 3.0), rel=1e-9)


def test_a_fit_takes_only_the_steps_of_the_plan_it_is_given() -> None:
    """A run that switched plans (--replan-after) has steps of two layouts in one metrics file: each step records
    its layout, and a fit against one plan takes its own steps only (before: the old plan's steps were fitted
    against the new plan's layout, silently)."""
    from ethpipe.plan import layout_key

    plan = _plan()
    other = dataclasses.replace(plan, pipelines=tuple(reversed(plan.pipelines)))
    assert layout_key(other) != layout_key(plan)
    mine = [{**r, "layout": layout_key(plan)} for r in _records(plan)]
    theirs = [{**r, "layout": layout_key(other), "rank_fwd_s": [9.0 * t for t in r["rank_fwd_s"]]}
              for r in _records(plan, seed=1)]
    clean = fit_run(plan, mine)
    mixed = fit_run(plan, theirs + mine)  # the other layout's 9x slower steps are left out
    assert {k: (s.fwd_scale, s.bwd_scale) for k, s in mixed.scales.items()} == {
        k: (s.fwd_scale, s.bwd_scale) for k, s in clean.scales.items()}
    with pytest.raises(UserError, match="no step of these metrics ran under this --plan's layout"):
        fit_run(plan, theirs)
