"""Relative speeds, time scale, pacing arithmetic (paced and measured modes) and slowdowns of --emulate."""

from __future__ import annotations


import pytest

from ethpipe.model_spec import model_presets
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.plan import Plan as PlanType
from ethpipe.runtime.adapt.emulate import (
    CPU_SHARE, Emulator, Slowdown, auto_time_scale, check_emulation, emulation_time_scale, make_emulator,
    paced_targets, parse_slowdown, relative_speeds, with_emulation,
)


def _plan(devices: list[str], extra: dict | None = None) -> Plan:
    pipes = tuple(Pipeline((Stage((r,), d, (0, 8)),), (1,)) for r, d in enumerate(devices))
    return Plan("custom", "tiny", len(devices), 16, pipes, compute_blocks(pipes), model_presets()["tiny"],
                extra=extra or {})


def test_speeds_from_plan_field() -> None:
    plan = _plan(["fast", "slow", "slow"], {"device_speeds": {"fast": 4.0, "slow": 1.0}})
    assert relative_speeds(plan) == {"fast": 1.0, "slow": 0.25}
    assert make_emulator(plan, 2).speed == 0.25


def test_speeds_from_catalog_ids() -> None:
    from ethpipe.catalog import gpu_catalog

    ids = sorted(gpu_catalog())[:2]
    speeds = relative_speeds(_plan(ids))
    assert max(speeds.values()) == 1.0 and set(speeds) == set(ids)


def test_no_speeds_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="device_speeds"):
        relative_speeds(_plan(["cpu-a", "cpu-b"]))
    with pytest.raises(ValueError, match="no speed for device type 'b'"):
        relative_speeds(_plan(["a", "b"], {"device_speeds": {"a": 1.0}}))


def test_scaled_targets_pace_every_rank() -> None:
    # The fastest device sleeps too once time_scale > 1: 0.2 s of compute lasts 0.2 * 3 s.
    assert Emulator(1.0, time_scale=3.0).target_s("F", 1, 0.2, 0) == pytest.approx(0.6)
    assert Emulator(0.25).target_s("B", 1, 0.2, 0) == pytest.approx(0.8)  # 1/4 speed: 4x as long
    # The sleep tops the action's wall time up to its target; time spent descheduled counts as elapsed.
    em = Emulator(0.5, time_scale=2.0)
    assert em.sleep_s("F", 1, 0.1, 0.1, 0) == pytest.approx(0.3)
    assert em.sleep_s("F", 1, 0.1, 0.25, 0) == pytest.approx(0.15)
    assert em.sleep_s("F", 1, 0.1, 0.5, 0) == 0.0  # an overrun is never shortened
    assert Emulator(1.0).sleep_s("F", 1, 0.2, 0.2, 0) == 0.0  # scale 1: the fastest device runs as is


def test_paced_targets_ignore_measurement_and_apply_slowdowns() -> None:
    em = Emulator(0.25, time_scale=4.0, slowdowns=(Slowdown(0, 2.0, from_step=3),),
                  paced=((1, 0.010, 0.020, 0.0), (2, 0.016, 0.030, 0.0)))
    assert em.target_s("F", 1, 123.0, 0) == pytest.approx(0.010)
    assert em.target_s("B", 2, 0.0, 0) == pytest.approx(0.030)
    assert em.target_s("B", 2, 0.0, 3) == pytest.approx(0.060)
    assert em.sleep_s("F", 1, 0.001, 0.004, 0) == pytest.approx(0.006)
    assert em.target_s("F", 3, 0.01, 0) == pytest.approx(0.01 * 4.0 / 0.25)  # no target: scaled


def test_slowdowns_multiply() -> None:
    slow = Emulator(0.5, slowdowns=(Slowdown(0, 2.0, from_step=3), Slowdown(0, 1.5, from_step=5)))
    assert slow.target_s("F", 1, 1.0, 2) == pytest.approx(2.0)
    assert slow.target_s("F", 1, 1.0, 3) == pytest.approx(4.0)
    assert slow.target_s("F", 1, 1.0, 5) == pytest.approx(6.0)


def test_auto_time_scale_keeps_compute_within_the_cpu_share() -> None:
    # 2 fast + 4 slow at a quarter speed on 2 cores: sum of speeds 3 -> 3 / (share * 2).
    assert auto_time_scale([1, 1, 0.25, 0.25, 0.25, 0.25], 2) == pytest.approx(3.0 / (CPU_SHARE * 2))
    assert auto_time_scale([1.0], 64) == 1.0  # never faster than real
    with pytest.raises(ValueError):
        auto_time_scale([], 2)


def test_time_scale_from_plan_or_auto() -> None:
    plan = _plan(["fast", "slow", "slow"], {"device_speeds": {"fast": 4.0, "slow": 1.0}})
    assert emulation_time_scale(plan, num_cores=1) == pytest.approx(1.5 / CPU_SHARE)
    pinned = with_emulation(plan, 7.0)
    assert emulation_time_scale(pinned, num_cores=1) == 7.0
    assert make_emulator(pinned, 0).time_scale == 7.0
    with pytest.raises(ValueError, match="emulation.time_scale"):
        emulation_time_scale(PlanType(**{**plan.__dict__, "extra": {**plan.extra, "emulation": {"time_scale": 0.5}}}))


def test_paced_targets_round_trip_through_the_plan_file() -> None:
    plan = _plan(["fast", "slow"], {"device_speeds": {"fast": 2.0, "slow": 1.0}})
    paced = with_emulation(plan, 3.0, {0: {1: (0.01, 0.02)}, 1: {1: (0.02, 0.04)}})
    again = PlanType.from_dict(paced.to_dict())
    assert paced_targets(again, 1) == ((1, 0.02, 0.04, 0.0),)
    em = make_emulator(again, 1)
    assert (em.speed, em.time_scale, em.paced) == (0.5, 3.0, ((1, 0.02, 0.04, 0.0),))
    assert paced_targets(plan, 0) == ()  # no targets: scaled from measurement
    check_emulation(paced)
    with pytest.raises(ValueError, match="no targets for rank 1"):
        check_emulation(with_emulation(plan, 3.0, {0: {1: (0.01, 0.02)}}))
    with pytest.raises(ValueError, match="no target for micro-batch size 1"):
        paced_targets(with_emulation(plan, 3.0, {0: {2: (0.01, 0.02)}, 1: {2: (0.01, 0.02)}}), 0)


def test_a_split_backward_is_paced_as_its_input_and_weight_passes() -> None:
    pipe = Pipeline((Stage((0,), "fast", (0, 4)), Stage((1,), "slow", (4, 8))), (1, 1), "zb-h1")
    zb = Plan("custom", "tiny", 2, 16, (pipe,), compute_blocks([pipe]), model_presets()["tiny"],
              extra={"device_speeds": {"fast": 2.0, "slow": 1.0}})
    paced = PlanType.from_dict(with_emulation(zb, 3.0, {0: {1: (0.01, 0.02, 0.005)}, 1: {1: (0.02, 0.04, 0.01)}}).to_dict())
    em = make_emulator(paced, 1)
    assert [em.target_s(k, 1, 0.0, 0) for k in ("F", "B", "B-input", "W")] == pytest.approx([0.02, 0.04, 0.03, 0.01])
    targets = {0: {1: (0.01, 0.02)}, 1: {1: (0.02, 0.04)}}
    assert paced_targets(with_emulation(zb, 3.0, targets), 0) == ((1, 0.01, 0.02, 0.0),)  # stage 0 never splits
    with pytest.raises(ValueError, match="wgrad_s.*splits its backward"):
        paced_targets(with_emulation(zb, 3.0, targets), 1)
    with pytest.raises(ValueError, match="wgrad_s is part of bwd_s"):
        paced_targets(with_emulation(zb, 3.0, {0: {1: (0.01, 0.02, 0.03)}, 1: {1: (0.01, 0.02, 0.03)}}), 0)


def test_an_interleaved_stage_is_paced_chunk_by_chunk() -> None:
    """Targets per chunk: "size" for chunk 0, "size.c" for chunk c (``pacing_targets`` prices each chunk's
    own layers, with the embedding in stage 0's chunk 0 and the head in the last stage's last chunk)."""
    from ethpipe.runtime.adapt.emulate import pacing_targets

    stages = (Stage((0,), "fast", (0, 3), chunks=((0, 3), (4, 7))), Stage((1,), "slow", (3, 4), chunks=((3, 4), (7, 8))))
    pipe = Pipeline(stages, (1, 2), "interleaved")
    plan = Plan("custom", "tiny", 3, 16, (pipe,), compute_blocks([pipe]), model_presets()["tiny"],
                extra={"device_speeds": {"fast": 2.0, "slow": 1.0}})
    targets = {0: {1: (0.01, 0.02), 2: (0.02, 0.04), "1.1": (0.03, 0.05), "2.1": (0.06, 0.1)},
               1: {1: (0.01, 0.02), 2: (0.02, 0.04), "1.1": (0.01, 0.02), "2.1": (0.02, 0.04)}}
    paced = PlanType.from_dict(with_emulation(plan, 3.0, targets).to_dict())
    assert paced_targets(paced, 0) == ((1, 0.01, 0.02, 0.0), ("1.1", 0.03, 0.05, 0.0), (2, 0.02, 0.04, 0.0),
                                       ("2.1", 0.06, 0.1, 0.0))
    em = make_emulator(paced, 0)
    assert (em.target_s("F", 2, 0.0, 0, chunk=1), em.target_s("B", 2, 0.0, 0)) == (0.06, 0.04)
    del targets[1]["2.1"]
    with pytest.raises(ValueError, match=r"no target for chunk 1 at micro-batch size 2 \(key \"2.1\"\)"):
        paced_targets(with_emulation(plan, 3.0, targets), 1)

    class Cost:  # layers, +10 for the embedding, +20 for the head: what each chunk is priced with
        def stage_compute_s(self, stage: Stage, b: int, *, first: bool, last: bool) -> tuple[float, float]:
            return b * (stage.num_layers + 10 * first + 20 * last), 0.0

        def weight_grad_s(self, stage: Stage, b: int, *, first: bool, last: bool) -> float:
            return 0.0

    from_cost = pacing_targets(plan, Cost())
    assert {k: v[0] for k, v in from_cost[0].items()} == {1: 13, 2: 26, "1.1": 3, "2.1": 6}
    assert {k: v[0] for k, v in from_cost[1].items()} == {1: 1, 2: 2, "1.1": 21, "2.1": 42}


def test_parse_slowdown() -> None:
    assert parse_slowdown("3:2.5@10") == Slowdown(3, 2.5, 10)
    assert parse_slowdown("1:2") == Slowdown(1, 2.0, 0)
    with pytest.raises(ValueError, match="RANK:FACTOR@STEP"):
        parse_slowdown("fast")
    with pytest.raises(ValueError, match=">= 1"):
        parse_slowdown("1:0.5")
    plan = _plan(["a", "a"], {"device_speeds": {"a": 1.0}})
    assert make_emulator(plan, 0, (Slowdown(0, 2.0), Slowdown(1, 3.0))).slowdowns == (Slowdown(0, 2.0),)
    with pytest.raises(ValueError, match="slowdown rank 5 is not in the plan"):
        make_emulator(plan, 0, (Slowdown(5, 3.0),))


def test_measured_mode_scales_real_compute_and_ignores_paced_targets() -> None:
    plan = _plan(["fast", "slow"], {"device_speeds": {"fast": 4.0, "slow": 1.0}})
    paced = with_emulation(plan, 3.0, {0: {1: (0.01, 0.02)}, 1: {1: (0.02, 0.04)}})
    assert make_emulator(paced, 1).paced == ((1, 0.02, 0.04, 0.0),)  # default mode: the plan's targets
    em = make_emulator(paced, 1, mode="measured", slowdowns=(Slowdown(1, 2.0, from_step=2),))
    assert (em.speed, em.time_scale, em.paced) == (0.25, 3.0, ())
    # 5 ms of real compute on a quarter-speed device at scale 3 lasts 5 * 3 / 0.25 = 60 ms, twice that once slowed.
    assert em.target_s("F", 1, 0.005, 0) == pytest.approx(0.060)
    assert em.target_s("B", 1, 0.005, 2) == pytest.approx(0.120)
    assert em.sleep_s("F", 1, 0.005, 0.007, 0) == pytest.approx(0.053)  # wall time already spent counts
    fast = make_emulator(paced, 0, mode="measured")
    assert fast.target_s("F", 1, 0.005, 0) == pytest.approx(0.015)  # the fastest device is slowed by the scale only
    with pytest.raises(ValueError, match="--emulate-mode must be paced or measured"):
        make_emulator(paced, 0, mode="fast")  # type: ignore[arg-type]


def test_train_config_checks_the_emulate_mode() -> None:
    from ethpipe.runtime.train import TrainConfig

    assert TrainConfig(data="x.bin", steps=1).emulate_mode == "paced"
    assert TrainConfig(data="x.bin", steps=1, emulate=True, emulate_mode="measured").emulate_mode == "measured"
    with pytest.raises(ValueError, match="--emulate-mode"):
        TrainConfig(data="x.bin", steps=1, emulate_mode="scaled")  # type: ignore[arg-type]


def test_cli_emulate_mode_needs_emulate(tmp_path) -> None:
    from typer.testing import CliRunner

    import ethpipe.cli.commands  # noqa: F401  (registers the commands on the app)
    from ethpipe.cli.app import app

    args = ["train", "--plan", str(tmp_path / "p.json"), "--data", str(tmp_path / "t.bin"), "--steps", "1",
            "--emulate-mode", "measured"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "--emulate-mode needs --emulate" in result.output
