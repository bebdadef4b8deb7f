"""Re-planning a run: a new plan for a changed cluster with the old plan's model, batch, precision, kernels,
compute constants and schedules, and what a person needs to compare the two.

Shared by `ethpipe replan` (``replan_cmds``), `train --replan-cluster` / `--replan-after` (``train_cmds``,
``learn``). This is CLI-layer code: the runtime never imports the planner.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ethpipe.cluster import Cluster, cluster_from_dict, load_cluster
from ethpipe.cost import hardware
from ethpipe.cost.hardware import Calibration, shipped_calibration
from ethpipe.cost.profile import MeasuredProfile
from ethpipe.errors import UserError
from ethpipe.plan import Plan
from ethpipe.plan_text import plan_shape
from ethpipe.precision import AUTO, plan_dtype, without_bf16

if TYPE_CHECKING:
    from ethpipe.planner import PlannerOptions


def replan(old: Plan, cluster: Cluster, *, allow_idle: bool = True, calibration: Calibration | None = None,
           profiles: Mapping[str, MeasuredProfile] | None = None) -> Plan:
    """Plan ``old``'s model, global batch and seq_len on ``cluster`` (tp = 1: what the runtime runs), with
    its dtype, TF32 setting, attention kernels, compute constants and allowed schedules, so the new plan is
    priced as the old one was.

    ``allow_idle=False`` when the world is already running on every device of ``cluster``; ``calibration``
    replaces the plan's own constants (a fit of the run: `ethpipe replan --catalog`, `train --replan-after`)."""
    from ethpipe.planner import METHODS, make_plan

    method = old.method if old.method in METHODS else "eth"
    dtype = str(old.extra.get("dtype", AUTO))
    if dtype == "bf16" and old.extra.get("dtype_requested") == AUTO and old.cluster is not None and without_bf16(
            d.gpu for d in cluster_from_dict(old.cluster).devices) is not None:
        dtype = AUTO  # bf16 because its devices without bf16 were idle: judged again on the new plan's devices
    else:
        dtype = plan_dtype(dtype, cluster, source="the plan's dtype bf16 on the new cluster",
                           fix="re-make the plan with `ethpipe plan --dtype fp16` (or fp32) and train in that dtype")
    new = make_plan(cluster, old.resolve_model(), old.global_batch_size, old.seq_len, method, max_tp=1, dtype=dtype,
                    profiles=profiles,
                    options=recorded_options(old, allow_idle), tf32=bool(old.extra.get("tf32", True)),
                    calibration=calibration or recorded_calibration(old),
                    attention=str(old.extra.get("attention", "auto")),
                    schedules=recorded_schedules(old), grad_reduce=str(old.extra.get("grad_reduce", "fp32")),
                    layer_code=str(old.extra.get("layer_code", "ethpipe")))
    emulation = old.extra.get("emulation")
    if emulation is not None and "emulation" not in new.extra:  # the same emulated devices: time scale, profiles
        from ethpipe.runtime.adapt.emulate import pinned_emulation

        new = dataclasses.replace(new, extra={**new.extra, "emulation": pinned_emulation(old)})
    return new


def recorded_options(plan: Plan, allow_idle: bool) -> "PlannerOptions":
    """The planner options ``plan`` was made with (``search.options``: a `--no-sublayer-cuts` plan is re-planned
    without sub-layer cuts too), ``allow_idle`` decided by the caller (a running world uses every device). Plans
    that record none, or fields this version does not know, fall back to the defaults field by field."""
    recorded = (plan.extra.get("search") or {}).get("options")
    if recorded is not None and not isinstance(recorded, Mapping):
        raise UserError("plan field 'search.options' must be an object of planner options: fix it or delete it")
    from ethpipe.planner import PlannerOptions

    known = {f.name for f in dataclasses.fields(PlannerOptions)}
    kept = {k: v for k, v in (recorded or {}).items() if k in known and k != "allow_idle"}
    for k, v in kept.items():
        if k != "balance" and not isinstance(v, bool):
            raise UserError(f"plan field 'search.options.{k}' must be true or false, got {v!r}: fix it or delete it")
    return PlannerOptions(**kept, allow_idle=allow_idle)


def recorded_calibration(plan: Plan) -> Calibration | None:
    """The compute constants the plan was priced with (a user's `--catalog` fit, and the fallback for families
    nobody measured), over the shipped ones for families the plan did not use; None for plans that record
    none, or constants of an earlier compute model (the shipped ones then price the re-plan)."""
    recorded = hardware.recorded_calibration((plan.extra.get("compute_model") or {}).get("calibration"),
                                             "plan field 'compute_model.calibration'")
    if recorded is None:
        return None
    merged = shipped_calibration().merged(recorded)
    return dataclasses.replace(merged, fallback=recorded.fallback or merged.fallback, devices=recorded.devices)


def first_devices(cluster: Cluster, world_size: int) -> Cluster:
    """The cluster's first ``world_size`` devices in rank order (torchrun renumbers survivors densely;
    give a cluster file whose device order puts the ones likely to leave last)."""
    if not 1 <= world_size <= cluster.num_devices:
        raise UserError(f"the world has {world_size} ranks but the --replan-cluster has {cluster.num_devices} "
                        "devices: describe at least the surviving devices")
    source = dict(cluster.source)
    left = world_size
    groups: list[dict[str, Any]] = []
    for group in source["nodes"]:
        per_node = int(group["gpus_per_node"])
        whole = min(int(group["num_nodes"]), left // per_node)
        if whole:
            groups.append({**group, "num_nodes": whole})
            left -= whole * per_node
        if left and whole < int(group["num_nodes"]) and left < per_node:
            groups.append({**group, "num_nodes": 1, "gpus_per_node": left})
            left = 0
        if not left:
            break
    return cluster_from_dict({**source, "nodes": groups})


def plan_for_world(old: Plan, cluster_path: Path, world_size: int) -> Plan:
    """``old`` if it fits the world, else a fresh plan for the world's devices of ``cluster_path``."""
    if world_size == old.world_size:
        return old
    return replan(old, first_devices(load_cluster(cluster_path), world_size), allow_idle=False)  # world is fixed


def describe_changes(old: Plan, new: Plan, old_repriced_s: float | None = None) -> list[str]:
    """What a person needs to know: world, pipelines, split, predicted iteration time. ``old_repriced_s``: the
    old plan priced with the new plan's constants (``replan --catalog``), the fair pair of the new price."""
    lines = [f"world size {old.world_size} -> {new.world_size}, pipelines {len(old.pipelines)} -> {len(new.pipelines)}",
             f"old: {plan_shape(old)}", f"new: {plan_shape(new)}"]
    if new.idle_devices:
        lines.append(f"new plan leaves {len(new.idle_devices)} devices idle (no rank, start no process there): "
                     f"{new.idle_devices[0].reason}")
    if old.extra.get("dtype") != new.extra.get("dtype"):
        lines.append(f"dtype {old.extra.get('dtype')} -> {new.extra.get('dtype')} (auto: bf16 only where every device "
                     f"with a rank has it): resume with `ethpipe train --dtype {new.extra.get('dtype')}`")
    old_t = (old.predicted or {}).get("iteration_time_s")
    new_t = (new.predicted or {}).get("iteration_time_s")
    if new_t is not None and old_repriced_s is not None:
        own = f"; the old plan's own price was {old_t:.4f} s" if old_t is not None else ""
        lines.append(f"predicted iteration {old_repriced_s:.4f} s -> {new_t:.4f} s (both with the new constants{own})")
    elif new_t is not None:
        before = f"{old_t:.4f} s -> " if old_t is not None else ""
        lines.append(f"predicted iteration {before}{new_t:.4f} s")
    return lines


def recorded_schedules(plan: Plan) -> tuple[str, ...] | None:
    """The schedules ``plan`` was allowed (``search.schedules``); for a plan without that record (written by hand,
    or before schedules existed), the ones its pipelines run."""
    recorded = (plan.extra.get("search") or {}).get("schedules")
    if isinstance(recorded, list) and recorded and all(isinstance(s, str) for s in recorded):
        return tuple(recorded)
    return tuple(sorted({p.schedule for p in plan.pipelines}))
