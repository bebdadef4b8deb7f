"""A planner that learns the user's devices: fit a run's measured stage times, re-plan, decide whether to switch.

Used by `ethpipe calibrate --from-run` (fit and report), `ethpipe replan --catalog` (plan with a fit) and
`ethpipe train --replan-after N` (all three in the running job: ``RunReplanner``). The fit is
``cost/run_fit.py``'s; this module joins it to the planner (the runtime never imports the planner: train
receives a ``RunReplanner`` from the command line). A plan for emulated devices that carries their profiles
(``emulation.profiles``) is priced with them, as the emulation paces it: the belief the fit corrects.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ethpipe.cost.hardware import Calibration, DeviceScale, shipped_calibration
from ethpipe.plan import Plan
from ethpipe.runtime.adapt.emulate import emulation_profiles, pinned_emulation

# Switch only for a predicted gain above this: the fit's own scatter (median stage ratios of a few steps move by
# ~1-2% between windows on a loaded CPU; device timers on GPUs less) and the switch's cost (one checkpoint
# save and load, ~1-3 steps of a large model) must not make a switch that loses time; 5% of every later step
# pays for both within a few dozen steps.
DEFAULT_MIN_GAIN = 0.05


@dataclass(frozen=True)
class RunFit:
    """A run's fit: the per-type scales, the calibration to plan with, and the stage table before / after."""

    scales: Mapping[str, DeviceScale]
    calibration: Calibration
    before: Sequence[Mapping[str, Any]]
    after: Sequence[Mapping[str, Any]]


def fit_run(plan: Plan, records: Sequence[Mapping[str, Any]], source: str = "") -> RunFit:
    """Fit ``records`` (one run's metrics lines under ``plan``) to per-type scales over the plan's constants."""
    from ethpipe.cli.replanning import recorded_calibration
    from ethpipe.cost.model import CostModel
    from ethpipe.cost.run_fit import fit_device_scales, fitted_calibration, stage_errors, stage_observations

    records = _steps_of(plan, records)
    cost = CostModel.for_plan(plan, profiles=emulation_profiles(plan))
    obs = stage_observations(plan, records, cost)
    if not obs:
        from ethpipe.errors import UserError

        raise UserError(f"the run has {len(records)} step(s): at least 2 are needed (the first is warm-up)")
    source = source or f"ethpipe train run of {plan.model} ({len({o.step for o in obs})} steps)"
    scales = fit_device_scales(obs, source)
    base = recorded_calibration(plan) or shipped_calibration()
    return RunFit(scales, fitted_calibration(base, scales, source), stage_errors(obs), stage_errors(obs, scales))


def _steps_of(plan: Plan, records: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The steps measured under ``plan``'s layout (a run that switched plans, ``--replan-after``, has steps of
    two); metrics written before steps recorded their layout are taken as they are."""
    from ethpipe.errors import UserError
    from ethpipe.plan import layout_key

    key = layout_key(plan)
    mine = [r for r in records if r.get("layout", key) == key]
    if records and not mine:
        raise UserError("no step of these metrics ran under this --plan's layout: give the plan the run trained "
                        "with (after a --replan-after switch, the re-planned one saved beside its checkpoints)")
    return mine


def priced_with(plan: Plan, calibration: Calibration) -> float:
    """``plan``'s predicted iteration time with ``calibration``'s constants (the same plan, re-priced)."""
    return _estimate(*_repriced(plan, calibration))


def _estimate(plan: Plan, cost: Any) -> float:
    from ethpipe.planner.estimate import estimate_iteration_s

    return estimate_iteration_s(plan, cost)


@dataclass(frozen=True)
class RunReplanner:
    """`train --replan-after N`: after N steps, fit, re-plan on the same devices, switch if faster by ``min_gain``.

    Called on rank 0 with the records so far; returns the plan to switch to (or None) and the record of the
    decision that goes into the metrics and the console."""

    after_steps: int
    min_gain: float = DEFAULT_MIN_GAIN
    dtype: str | None = None  # the run's --dtype: a candidate must fit memory in it
    emulate: bool = False  # an emulated run: a candidate must be emulatable

    def __call__(self, plan: Plan, records: Sequence[Mapping[str, Any]]) -> tuple[Plan | None, dict[str, Any]]:
        from ethpipe.cli.replanning import plan_shape, replan

        fit = fit_run(plan, records)
        start = time.perf_counter()
        new = replan(plan, plan.active_cluster(), allow_idle=False, calibration=fit.calibration,
                     profiles=emulation_profiles(plan))
        if self.emulate:  # the emulated devices stay what they were: the fit changes the belief, not them
            new = dataclasses.replace(new, extra={**new.extra, "emulation": pinned_emulation(plan)})
        planning_s = time.perf_counter() - start
        repriced, cost = _repriced(plan, fit.calibration)
        old_s = _estimate(repriced, cost)
        new_s = float((new.predicted or {})["iteration_time_s"])
        gain = 1.0 - new_s / old_s if old_s > 0 else 0.0
        refused = self._refusal(new, plan.world_size)
        switch = gain >= self.min_gain and not same_execution(new, plan) and refused is None
        decision = {
            "after_steps": len(records),
            "scales": {t: {"fwd": round(s.fwd_scale, 4), "bwd": round(s.bwd_scale, 4)} for t, s in fit.scales.items()},
            "relative_speeds": _speeds(cost),
            "old_predicted_s": old_s, "new_predicted_s": new_s, "gain": gain, "min_gain": self.min_gain,
            "switched": switch, "planning_s": planning_s,
            "new_shape": plan_shape(new), "old_shape": plan_shape(plan),
            **({"refused": refused} if refused else {}),
        }
        decision["line"] = decision_line(decision)
        if switch:
            new = dataclasses.replace(new, extra={**new.extra, "replanned_from_run": {
                "step": len(records), "old_predicted_s": old_s, "gain": gain}})
        return (new if switch else None), decision

    def _refusal(self, new: Plan, world_size: int) -> str | None:
        """Why the run could not train ``new`` (checked before any rank checkpoints for the switch), or None."""
        from ethpipe.errors import UserError
        from ethpipe.precision import check_dtype_fits
        from ethpipe.runtime.start.checks import check_plan_runnable
        from ethpipe.runtime.adapt.emulate import check_emulation

        try:
            check_plan_runnable(new, world_size)
            if self.dtype is not None:
                check_dtype_fits(new, self.dtype)
            if self.emulate:
                check_emulation(new)
        except UserError as err:
            return str(err).splitlines()[0]
        return None


def same_execution(a: Plan, b: Plan) -> bool:
    """Whether two plans run alike: what every rank's check of the plan compares (runtime/train.py)."""
    da, db = a.to_dict(), b.to_dict()
    keys = ("pipelines", "blocks", "global_batch_size")
    return ([da.get(k) for k in keys] == [db.get(k) for k in keys]
            and (a.shard_optimizer, tuple(a.shard_weights)) == (b.shard_optimizer, tuple(b.shard_weights))
            and a.extra.get("grad_reduce", "fp32") == b.extra.get("grad_reduce", "fp32"))


def fitted_speeds(plan: Plan, calibration: Calibration) -> dict[str, float]:
    """Each device type's achievable speed relative to the fastest, as ``calibration`` prices the plan's model."""
    return _speeds(_repriced(plan, calibration)[1])


def _speeds(cost: Any) -> dict[str, float]:
    return {t: round(v, 4) for t, v in sorted(cost.device_speeds().items())}


def _repriced(plan: Plan, calibration: Calibration) -> tuple[Plan, Any]:
    """``plan`` recording ``calibration`` as its constants, and its cost model (emulated devices' profiles kept)."""
    from ethpipe.cost.model import CostModel

    record = {**(plan.extra.get("compute_model") or {}), "calibration": calibration.to_dict()}
    repriced = dataclasses.replace(plan, extra={**plan.extra, "compute_model": record})
    return repriced, CostModel.for_plan(repriced, profiles=emulation_profiles(plan))


def decision_line(decision: Mapping[str, Any]) -> str:
    """The console line of a re-plan decision."""
    scales = ", ".join(f"{t} x{s['fwd']:.2f}/{s['bwd']:.2f}" for t, s in decision["scales"].items())
    head = (f"re-plan after {decision['after_steps']} steps: measured/model compute (fwd/bwd) {scales}; "
            f"plan {decision['old_predicted_s']:.4f} s -> {decision['new_predicted_s']:.4f} s "
            f"({100 * decision['gain']:+.1f}%)")
    if decision["switched"]:
        return f"{head}: switching to {decision['new_shape']} (checkpoint, reload, continue)"
    if decision.get("refused"):
        return f"{head}: keeping the plan (the new one cannot run here: {decision['refused']})"
    if decision["gain"] >= decision["min_gain"]:
        return f"{head}: keeping the plan (the new one runs alike)"
    return f"{head}: keeping the plan (gain under {100 * decision['min_gain']:.0f}%)"
