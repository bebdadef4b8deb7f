"""Slot-powered cards (T4, L4) under a sustained load: fitted, shipped and priced (cost/sustained.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ethpipe.catalog import GpuSpec, get_gpu, gpu_catalog
from ethpipe.cluster import cluster_from_dict
from ethpipe.cost import calibrate, ops
from ethpipe.cost.hardware import (
    CONSTANT_NAMES,
    ArchConstants,
    Calibration,
    DeviceCompute,
    GpuFactor,
    calibration_from_dict,
    shipped_calibration,
)
from ethpipe.cost.model import CostModel
from ethpipe.cost.sustained import LOAD_REF_S, slot_powered, sustained_s
from ethpipe.errors import UserError
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Stage

T4, TITAN = get_gpu("t4"), get_gpu("titan_rtx")
TRUTH = ArchConstants(0.7, 0.7, 0.9, 0.6, 0.0, 0.0, "truth", CONSTANT_NAMES)


def test_only_cards_the_slot_powers_slow_down_and_only_past_the_reference() -> None:
    slot = {g for g, spec in gpu_catalog().items() if slot_powered(spec)}
    assert {"t4", "l4"} <= slot and all(0 < gpu_catalog()[g].tdp_w <= 75 for g in slot) and "a10" not in slot
    t = np.array([0.2e-3, 1e-3, 10e-3, 100e-3])
    slowed = sustained_s(t, 0.07)
    assert np.array_equal(slowed[:2], t[:2])  # under the reference: full clocks
    assert slowed[2] == pytest.approx(10e-3 * 10 ** 0.07) and slowed[3] == pytest.approx(100e-3 * 100 ** 0.07)
    assert sustained_s(0.5, 0.0) == 0.5


def _observations(gpu: GpuSpec, scale: float, exponent: float) -> list[calibrate.Observation]:
    """GEMM timings of 0.3-300 ms on ``gpu`` as a card of that compute factor and load exponent runs them."""
    dev = DeviceCompute.build(gpu, Calibration({}), "fp16", True)
    out = []
    for n in (1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384):
        terms = tuple(dev.kernel_terms([ops.gemm("g", n, n, n, 2)]))
        work = sum(max(c / (TRUTH.tensor_eff * scale), m / TRUTH.mem_eff) for _, c, m in terms)
        out.append(calibrate.Observation(gpu.arch, gpu.id, "m", "op", False, 1, 1, float(sustained_s(work, exponent)),
                                         terms, 0.0, layer_passes=0.0, launch_floor=False))
    return out


def test_the_fit_recovers_a_slot_powered_cards_exponent_and_gives_none_to_the_others() -> None:
    """Timings made with a T4 exponent of 0.07 (compute factor 0.6) beside a Titan RTX of the same family: the fit
    finds the exponent and prices them within 3% (the priors pull a little); the Titan RTX (280 W) gets none, even where its own timings
    carry one (it is not a cause it can have); and ignoring the exponent misprices the T4's longest GEMM."""
    obs = _observations(T4, 0.6, 0.07) + _observations(TITAN, 1.0, 0.0)
    fit = calibrate.fit(obs)
    assert fit.gpus["t4"].load_exponent == pytest.approx(0.07, abs=0.01)
    assert fit.gpus["titan_rtx"].load_exponent == 0.0
    errors = [abs(e) for e in calibrate.relative_errors(obs, fit)]
    assert max(errors) < 0.03
    flat = dataclasses.replace(fit, gpus={**fit.gpus, "t4": dataclasses.replace(fit.gpus["t4"], load_exponent=0.0)})
    longest = max(obs[:8], key=lambda o: o.measured_s)
    assert abs(longest.predict_with(flat) / longest.measured_s - 1) > 0.1
    titan_with_one = calibrate.fit(_observations(TITAN, 1.0, 0.07))
    assert titan_with_one.gpus["titan_rtx"].load_exponent == 0.0


def test_the_price_of_a_layer_on_a_t4_is_its_full_clock_price_slowed() -> None:
    """The cost model prices each T4 layer pass through ``sustained_s`` with the calibration's exponent (the
    forward and the backward apart, so a recomputing or split backward takes the same slowdown in proportion)."""
    spec = load_model_spec("llama2-7b")
    clu = cluster_from_dict({"nodes": [{"gpu": "t4", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 100}]})
    shipped = shipped_calibration()
    flat_t4 = dataclasses.replace(shipped.gpus["t4"], load_exponent=0.0)
    flat = dataclasses.replace(shipped, gpus={**shipped.gpus, "t4": flat_t4})
    exponent = shipped.gpus["t4"].load_exponent
    assert exponent > 0
    slowed = CostModel(clu, spec, 4096, dtype_bytes=2, dtype="fp16", calibration=shipped)
    at_full = CostModel(clu, spec, 4096, dtype_bytes=2, dtype="fp16", calibration=flat)
    for b in (1, 4):
        slow, full = slowed.layer_times_s("t4", b), at_full.layer_times_s("t4", b)
        for s, f in zip(slow, full):
            assert f > LOAD_REF_S and s == pytest.approx(f * (f / LOAD_REF_S) ** exponent, rel=1e-9)
        assert slowed.recompute_s("t4", b, 1) / at_full.recompute_s("t4", b, 1) == pytest.approx(slow[0] / full[0])


def test_a_slot_powered_cards_rate_is_a_floor_of_every_micro_batch_and_tp_degree() -> None:
    """The achievable rate (the physical limit's, and the planner's device shares) counts the slowdown, so a T4
    is not credited the speed of its full clocks; it stays a floor: no micro-batch at any TP degree runs a sample
    faster (balance efficiency <= 1)."""
    from ethpipe.cost.compute import model_train_flops

    spec = load_model_spec("llama2-7b")
    clu = cluster_from_dict({"nodes": [{"gpu": "t4", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 100}]})
    shipped = shipped_calibration()
    flat = dataclasses.replace(shipped, gpus={**shipped.gpus, "t4": dataclasses.replace(shipped.gpus["t4"],
                                                                                         load_exponent=0.0)})
    cost = CostModel(clu, spec, 4096, dtype_bytes=2, dtype="fp16", calibration=shipped)
    rate = cost.achievable_flops("t4")
    assert rate < 0.9 * CostModel(clu, spec, 4096, dtype_bytes=2, dtype="fp16", calibration=flat).achievable_flops("t4")
    flops = model_train_flops(spec, 4096, 1)
    for tp in (1, 2, 4, 8):
        for b in (1, 2, 3, 4, 8, 16, 64, 128):
            whole = Stage(tuple(range(tp)), "t4", (0, spec.num_layers), tp)  # its TP all-reduces left out
            seconds = (sum(cost.stage_compute_s(whole, b, first=True, last=True))
                       - sum(cost.stage_tp_comm_s(whole, b, first=True, last=True)))
            assert flops / (tp * seconds / b) <= rate * (1 + 1e-9), (tp, b)


def test_a_slot_powered_card_nobody_measured_takes_the_measured_ones_mean() -> None:
    cal = Calibration({}, gpus={"t4": GpuFactor(0.8, 10, 0.1, "", 0.06), "l4": GpuFactor(0.9, 10, 0.1, "", 0.08),
                                "a100_80gb_sxm": GpuFactor(1.0, 10, 0.1, "", 0.0)})
    unmeasured = dataclasses.replace(T4, id="t4_custom")
    assert cal.load_exponent(unmeasured) == pytest.approx(0.07)
    assert cal.load_exponent(T4) == 0.06
    assert cal.load_exponent(get_gpu("a10")) == 0.0  # 150 W: not slot-powered


def test_an_exponent_round_trips_an_old_file_has_none_and_a_powered_card_ignores_one() -> None:
    shipped = shipped_calibration()
    again = calibration_from_dict(shipped.to_dict())
    assert again.gpus["t4"].load_exponent == shipped.gpus["t4"].load_exponent > 0
    old = shipped.to_dict()
    old["gpus"] = {g: {k: v for k, v in f.items() if k != "load_exponent"} for g, f in old["gpus"].items()}
    assert calibration_from_dict(old).load_exponent(T4) == 0.0
    told = Calibration({}, gpus={"a100_80gb_sxm": GpuFactor(1.0, 10, 0.1, "", 0.1)})
    assert told.load_exponent(get_gpu("a100_80gb_sxm")) == 0.0


def test_a_calibration_file_with_an_exponent_out_of_range_is_refused_in_one_line() -> None:
    data = {"version": 5, "gpus": {"t4": {"compute_scale": 0.8, "load_exponent": 0.9}}}
    with pytest.raises(UserError, match=r"'gpus\.t4\.load_exponent' must be in \[0, 0\.25\]"):
        calibration_from_dict(data)
    data["gpus"]["t4"]["load_exponent"] = 0.05
    assert calibration_from_dict(data).gpus["t4"].load_exponent == 0.05


def test_a_plans_record_keeps_what_an_unmeasured_slot_powered_cards_exponent_is_made_of() -> None:
    """The plan records the calibration of its own GPU types (``compute_model_record``), which ``ethpipe simulate``
    prices the plan with; a slot-powered card nobody measured takes the measured slot-powered cards' mean, so the
    record keeps those cards' factors too, or the reloaded plan would price it at full clocks."""
    from ethpipe.planner import compute_model_record

    shipped = shipped_calibration()
    assert shipped.gpus["l4"].num_observations and shipped.gpus["l4"].load_exponent > 0
    without_t4 = dataclasses.replace(shipped, gpus={g: f for g, f in shipped.gpus.items() if g != "t4"})
    clu = cluster_from_dict({"nodes": [{"gpu": "t4", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 100}]})
    cost = CostModel(clu, load_model_spec("llama2-7b"), 4096, dtype_bytes=2, dtype="fp16", calibration=without_t4)
    recorded = calibration_from_dict(compute_model_record(cost)["calibration"])
    assert recorded.load_exponent(T4) == without_t4.load_exponent(T4) == shipped.gpus["l4"].load_exponent
    measured = CostModel(clu, load_model_spec("llama2-7b"), 4096, dtype_bytes=2, dtype="fp16", calibration=shipped)
    assert set(calibration_from_dict(compute_model_record(measured)["calibration"]).gpus) == {"t4"}  # its own only
