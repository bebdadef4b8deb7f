"""Relative speeds, stretch arithmetic and injected slowdowns of --emulate."""

from __future__ import annotations

import pytest

from ethpipe.model_spec import model_presets
from ethpipe.plan import Pipeline, Plan, Stage, compute_blocks
from ethpipe.runtime.emulate import Emulator, Slowdown, make_emulator, parse_slowdown, relative_speeds


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


def test_stretch_arithmetic_and_slowdowns() -> None:
    assert Emulator(1.0).extra_s(0.2, 0) == 0.0
    assert Emulator(0.25).extra_s(0.2, 0) == pytest.approx(0.6)  # 0.2 s at 1/4 speed lasts 0.8 s
    slow = Emulator(0.5, (Slowdown(0, 2.0, from_step=3),))
    assert slow.extra_s(1.0, 2) == pytest.approx(1.0)
    assert slow.extra_s(1.0, 3) == pytest.approx(3.0)


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
