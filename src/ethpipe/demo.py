"""The CPU demo's pieces: an emulated mixed cluster, its measured profile, plans, runs and predictions.

Consistency is the point. A profile of this CPU is mapped onto each emulated device type as
``layer time x time_scale / speed``; the planner and the simulator price plans with it, and the
same cost model's per-stage forward/backward times are written into each plan as the runtime's
pacing targets (``ethpipe.runtime.adapt.emulate``), so the emulated compute is what was predicted and
everything else (schedule, bubbles, p2p, gradient sync, optimizer, runtime overheads) is real.
Optimizer, p2p and all-reduce are not paced, so the mapped profile keeps the measured optimizer
cost. ``benchmarks/fidelity.py`` uses the same functions.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from ethpipe.cluster import Cluster, load_cluster
from ethpipe.cost.model import CostModel
from ethpipe.cost.profile import LayerTiming, MeasuredProfile
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Plan
from ethpipe.runtime.adapt.emulate import auto_time_scale, local_cores, pacing_targets, with_emulation

METHODS = ("eth", "uniform", "layer-balanced")
ACTIVATION_BYTES = 4  # the runtime trains in fp32 and sends fp32 activations and gradients
WARMUP_STEPS = 1  # steps left out of the measured step time (process and allocator warm-up)


def demo_cluster_path() -> Path:
    """The shipped demo cluster (package data, also in examples/clusters/cpu_demo.yaml)."""
    return Path(str(resources.files("ethpipe") / "data" / "cpu_demo.yaml"))


def demo_cluster() -> Cluster:
    return load_cluster(demo_cluster_path())


def cluster_speeds(cluster: Cluster, model: ModelSpec, seq_len: int) -> dict[str, float]:
    """Relative speed of each device type from the catalog/spec FLOP/s (fastest = 1.0)."""
    return CostModel(cluster, model, seq_len).device_speeds()


def cluster_time_scale(cluster: Cluster, speeds: Mapping[str, float], num_cores: int | None = None) -> float:
    """The runtime's default emulation time scale for a plan using every device of ``cluster``."""
    rank_speeds = [speeds[d.gpu.id] for d in cluster.devices]
    return auto_time_scale(rank_speeds, num_cores if num_cores is not None else local_cores())


def emulated_profile(profile: MeasuredProfile, speed: float, time_scale: float) -> MeasuredProfile:
    """What ``--emulate`` makes of this CPU for a device of relative ``speed``: layers x time_scale / speed.

    The optimizer is not paced by the emulation, so its measured cost is kept as is.
    """
    factor = time_scale / speed
    layers = {kind: {b: LayerTiming(t.fwd_s * factor, t.bwd_s * factor) for b, t in points.items()}
              for kind, points in profile.layers.items()}
    return dataclasses.replace(profile, layers=layers)


def emulated_profiles(profile: MeasuredProfile, speeds: Mapping[str, float],
                      time_scale: float) -> dict[str, MeasuredProfile]:
    return {device: emulated_profile(profile, speed, time_scale) for device, speed in speeds.items()}


def measure_profile(model: ModelSpec, seq_len: int, micro_batch_sizes: Sequence[int], rounds: int = 2,
                    repeats: int = 5) -> MeasuredProfile:
    """``ethpipe profile`` of this CPU (one thread), the fastest of ``rounds`` runs per layer and size:
    other processes sharing the cores only ever add time."""
    from ethpipe.profiler import ProfileSettings, profile_model

    settings = ProfileSettings(seq_len, tuple(micro_batch_sizes), repeats=repeats, warmup=2)
    runs = [profile_model(model, settings) for _ in range(max(1, rounds))]
    layers = {kind: {b: LayerTiming(min(r.layers[kind][b].fwd_s for r in runs),
                                    min(r.layers[kind][b].bwd_s for r in runs))
                     for b in points}
              for kind, points in runs[0].layers.items()}
    return dataclasses.replace(runs[0], layers=layers,
                               optimizer_s_per_param=min(r.optimizer_s_per_param for r in runs))


def emulated_cost(cluster: Cluster, model: ModelSpec, seq_len: int,
                  profiles: Mapping[str, MeasuredProfile]) -> CostModel:
    """The cost model of an emulated run: fp32 activations and gradients, the emulated profiles."""
    return CostModel(cluster, model, seq_len, dtype_bytes=ACTIVATION_BYTES, profiles=profiles)


@dataclass(frozen=True)
class Prediction:
    simulated_s: float  # discrete-event simulator
    estimate_s: float  # the planner's closed form


def predict(plan: Plan, cost: CostModel) -> Prediction:
    """Iteration time of ``plan`` as run with ``--emulate``, priced by the emulated cost model (of the whole
    cluster: a plan's idle devices are left out, so its ranks price as the devices they run on)."""
    from ethpipe.planner import estimate_iteration_s
    from ethpipe.sim import simulate

    if plan.idle_devices:
        cost = cost.on_cluster(cost.cluster.without_devices(plan.idle_device_indices))
    return Prediction(simulate(plan, cost).iteration_time_s, estimate_iteration_s(plan, cost))


def make_plans(cluster: Cluster, model: ModelSpec, global_batch: int, seq_len: int,
               profiles: Mapping[str, MeasuredProfile], time_scale: float,
               methods: Sequence[str] = METHODS, paced: bool = True) -> dict[str, Plan]:
    """One plan per method (tp = 1: what the runtime executes) carrying its emulation settings:
    ``time_scale`` and, if ``paced``, the per-rank pacing targets from the emulated profiles."""
    from ethpipe.planner import make_plan

    cost = emulated_cost(cluster, model, seq_len, profiles)
    plans = {}
    for method in methods:
        plan = make_plan(cluster, model, global_batch, seq_len, method, max_tp=1, profiles=profiles, dtype="fp32")
        plans[method] = with_emulation(plan, time_scale, pacing_targets(plan, cost) if paced else None)
    return plans


def measured_step_s(records: Sequence[Mapping[str, Any]], warmup: int = WARMUP_STEPS) -> float:
    """Median iteration time, leaving out the first ``warmup`` steps (when there are enough)."""
    times = [float(r["iteration_time_s"]) for r in records]
    if not times:
        raise UserError("no steps were measured: run at least one step")
    return statistics.median(times[warmup:] if len(times) > warmup else times)


def last_step_events(events_by_rank: Mapping[int, Sequence[Any]]) -> dict[int, list[Any]]:
    """Per rank, the events after its second-to-last optimizer step: the final training step."""
    out = {}
    for rank, events in events_by_rank.items():
        ordered = sorted(events, key=lambda e: e.start_s)
        ends = [e.end_s for e in ordered if e.name == "optimizer"]
        cut = ends[-2] if len(ends) >= 2 else float("-inf")
        out[rank] = [e for e in ordered if e.start_s >= cut]
    return out
