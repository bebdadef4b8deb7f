"""The demo's pure pieces: shipped cluster, profile mapping, pacing targets = simulated compute, summaries."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from ethpipe.plan_text import pipeline_groups, plan_shape
from ethpipe import demo
from ethpipe.cost.profile import LayerTiming, MeasuredProfile
from ethpipe.model_spec import model_presets
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.runtime.adapt.emulate import auto_time_scale, make_emulator
from ethpipe.sim import simulate
from ethpipe.sim.trace import TraceEvent

SEQ = 32


def _profile() -> MeasuredProfile:
    spec = model_presets()["tiny"]
    layers = {kind: {b: LayerTiming(t * b, 2 * t * b) for b in (1, 2, 4)}
              for kind, t in (("embedding", 1e-4), ("block", 1e-3), ("head", 5e-4))}
    return MeasuredProfile("cpu: test", "cpu", "fp32", spec.to_dict(), SEQ, layers, optimizer_s_per_param=2e-9)


def test_shipped_cluster_is_the_example() -> None:
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "clusters" / "cpu_demo.yaml"
    assert yaml.safe_load(demo.demo_cluster_path().read_text()) == yaml.safe_load(example.read_text())
    cluster = demo.demo_cluster()
    assert cluster.num_devices == 6
    assert sorted(d.gpu.id for d in cluster.devices) == ["fast", "fast", "slow", "slow", "slow", "slow"]


def test_profile_mapping_follows_the_emulation() -> None:
    prof = _profile()
    slow = demo.emulated_profile(prof, speed=0.25, time_scale=6.0)
    assert slow.layers["block"][2].fwd_s == pytest.approx(prof.layers["block"][2].fwd_s * 24.0)
    assert slow.layers["head"][1].bwd_s == pytest.approx(prof.layers["head"][1].bwd_s * 24.0)
    assert slow.optimizer_s_per_param == prof.optimizer_s_per_param  # the optimizer is not paced
    cluster = demo.demo_cluster()
    speeds = demo.cluster_speeds(cluster, model_presets()["tiny"], SEQ)
    assert speeds == pytest.approx({"fast": 1.0, "slow": 0.25})
    assert demo.cluster_time_scale(cluster, speeds, num_cores=2) == auto_time_scale([1, 1] + [0.25] * 4, 2)


def _hand_plan() -> Plan:
    spec = model_presets()["tiny"]
    pipes = (Pipeline((Stage((0,), "fast", (0, 4)), Stage((1,), "fast", (4, 8))), (2, 2, 1)),
             Pipeline((Stage((2,), "slow", (0, 8)),), (1,)))
    cluster = yaml.safe_load(demo.demo_cluster_path().read_text())
    cluster["nodes"] = [cluster["nodes"][0], {**cluster["nodes"][1], "num_nodes": 1, "gpus_per_node": 1}]
    return Plan("custom", "tiny", 6, SEQ, pipes, compute_blocks(pipes), spec, cluster,
                extra={"device_speeds": {"fast": 1.0, "slow": 0.25}})


def test_pacing_targets_are_the_simulated_compute() -> None:
    from ethpipe.cluster import cluster_from_dict

    plan = _hand_plan()
    cluster = cluster_from_dict(plan.cluster)
    prof = _profile()
    profiles = demo.emulated_profiles(prof, {"fast": 1.0, "slow": 0.25}, time_scale=2.0)
    cost = demo.emulated_cost(cluster, plan.resolve_model(), SEQ, profiles)
    targets = demo.pacing_targets(plan, cost)
    assert sorted(targets) == [0, 1, 2] and sorted(targets[0]) == [1, 2] and sorted(targets[2]) == [1]
    # Stage 0 of pipeline 0 (embedding + 4 blocks) at micro-batch 2, as the profile says x 2 / 1.0.
    fwd, bwd, wgrad = targets[0][2]
    assert 0 < wgrad < bwd  # the weight-gradient part of the backward (what a split W lasts)
    assert fwd == pytest.approx(2.0 * (2e-4 + 4 * 2e-3))
    assert bwd == pytest.approx(2.0 * (4e-4 + 4 * 4e-3))
    # The slow single-stage pipeline: everything x 2 / 0.25.
    assert targets[2][1][0] == pytest.approx(8.0 * (1e-4 + 8 * 1e-3 + 5e-4))
    paced = demo.with_emulation(plan, 2.0, targets)
    em = make_emulator(Plan.from_dict(paced.to_dict()), 1)
    assert em.target_s("B", 2, 0.0, 0) == pytest.approx(targets[1][2][1])
    # What the simulator charges for each compute event is exactly the paced target.
    report = simulate(paced, cost)
    for e in report.events:
        if e.kind == "compute":
            size = paced.pipelines[e.pipeline].micro_batch_sizes[e.microbatch]
            assert e.dur_s == pytest.approx(targets[e.ranks[0]][size][0 if e.name.startswith("F") else 1])


def test_make_plans_pins_the_emulation() -> None:
    cluster = demo.demo_cluster()
    profiles = demo.emulated_profiles(_profile(), {"fast": 1.0, "slow": 0.25}, 3.0)
    plans = demo.make_plans(cluster, model_presets()["tiny"], 24, SEQ, profiles, 3.0)
    assert list(plans) == list(demo.METHODS)
    for plan in plans.values():
        assert plan.extra["emulation"]["time_scale"] == 3.0
        assert sorted(int(r) for r in plan.extra["emulation"]["compute_s"]) == list(range(6))
        assert make_emulator(plan, 5).paced  # every rank is paced
        assert plan_shape(plan).count(";") == len(pipeline_groups(plan.pipelines)) - 1  # identical ones share
    unpaced = demo.make_plans(cluster, model_presets()["tiny"], 24, SEQ, profiles, 3.0, ("uniform",), paced=False)
    assert "compute_s" not in unpaced["uniform"].extra["emulation"]


def test_measured_step_leaves_out_warmup() -> None:
    records = [{"iteration_time_s": t} for t in (9.0, 1.0, 3.0, 2.0)]
    assert demo.measured_step_s(records) == 2.0
    assert demo.measured_step_s(records[:1]) == 9.0
    with pytest.raises(ValueError):
        demo.measured_step_s([])


def test_last_step_events_cut_at_the_second_to_last_optimizer() -> None:
    def ev(name: str, start: float, end: float) -> TraceEvent:
        return TraceEvent(name, "", 0, 0, start, end - start)

    events = [ev("F0", 0, 1), ev("optimizer", 1, 2), ev("F0", 2, 3), ev("B0", 3, 4), ev("optimizer", 4, 5)]
    assert [e.name for e in demo.last_step_events({0: events})[0]] == ["F0", "B0", "optimizer"]
    assert len(demo.last_step_events({0: events[:2]})[0]) == 2  # one step: everything


def test_demo_cli_rejects_too_few_steps_before_doing_anything(tmp_path: object) -> None:
    from ethpipe.cli import commands  # noqa: F401
    from ethpipe.cli.app import app

    result = CliRunner().invoke(app, ["demo", "--steps", "1"])
    assert result.exit_code == 2
    assert "--steps" in result.output and "Traceback" not in result.output
