"""Planners: ETH (hierarchical workload balance) and the baselines, all in one cost model."""

from __future__ import annotations

import dataclasses
import functools
import gc
import math

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from ethpipe.catalog import check_one_world
from ethpipe.cluster import Cluster
from ethpipe.cost.model import CostModel, dtype_bytes
from ethpipe.cost.hardware import Calibration, shipped_calibration
from ethpipe.cost.profile import MeasuredProfile
from ethpipe.cost.sustained import slot_powered
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Plan
from ethpipe.planner.estimate import Estimate, estimate_iteration_s, estimate_plan, ideal_time_s
from ethpipe.planner.layers.interleave import with_interleaving
from ethpipe.planner.layers.sublayer_cuts import with_sublayer_cuts
from ethpipe.planner.layers.schedules import with_schedules
from ethpipe.planner.search.options import PlannerOptions
from ethpipe.precision import AUTO, plan_dtype, plan_gpus, without_bf16
from ethpipe.schedule import DEFAULT_SCHEDULE, SCHEDULES, SPLIT_SCHEDULES

METHODS = ("eth", "uniform", "layer-balanced")
RECOMPUTE_MODES = ("auto", "never", "always")
_F = TypeVar("_F", bound=Callable[..., Plan])


def _cyclic_gc_paused(fn: _F) -> _F:
    """Run ``fn`` with Python's cyclic garbage collector paused (reference counting still frees memory).

    A plan allocates millions of short-lived tuples; every few thousand the collector scans the
    planner's caches for cycles it never finds. Pausing it for one call saves ~15% of planning time at
    4096 GPUs (docs/benchmarks/planner_scale.md); the caller's setting is restored, even on error."""
    @functools.wraps(fn)
    def paused(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()
    return paused  # type: ignore[return-value]


# Far above any real step (4M tokens over 1024 GPUs is one 4096-token sample per GPU); the planner's tables grow
# with the samples per pipeline, so a batch with extra zeros would fill memory before any line is printed.
MAX_SAMPLES_PER_DEVICE = 65536


@_cyclic_gc_paused
def make_plan(cluster: Cluster, model: ModelSpec, global_batch_size: int, seq_len: int, method: str = "eth", *,
              max_tp: int = 8, profiles: Mapping[str, MeasuredProfile] | None = None, recompute: str = "auto",
              time_budget_s: float | None = None, options: PlannerOptions | None = None,
              dtype: str = "auto", tf32: bool = True, calibration: Calibration | None = None,
              robust: bool = False, attention: str = "auto", shard_optimizer: bool = True,
              schedules: Sequence[str] | None = None, grad_reduce: str = "fp32", layer_code: str = "ethpipe") -> Plan:
    """Plan one training iteration of ``model`` on ``cluster`` with ``method``.

    ``time_budget_s`` only bounds the exhaustive layer-balanced search (its best plan so far is
    returned, and the plan's ``search`` record says it timed out). ``options`` are ETH's
    ablation knobs (``PlannerOptions``); the baselines ignore them. ``dtype`` is the training
    precision the runtime will use (activation and gradient bytes); ``auto`` is bf16 where every
    device the plan runs on has it (devices it leaves idle do not count), else fp16, and bf16 on a device
    without it is refused (``ethpipe.precision``).
    It is recorded in the plan (``extra["dtype"]``) so the simulator prices the plan the same way.
    ``attention`` (recorded as ``extra["attention"]``): ``auto`` prices the fused kernels PyTorch SDPA
    runs (ethpipe's runtime), ``materialised`` the unfused s x s path of a Megatron-style runtime
    (the runtime then forces SDPA's math backend on CUDA so memory matches). ``layer_code`` prices another
    runtime's elementwise kernels (``cost/elementwise.py``: "megatron" for benchmarks that judge plans by a
    Megatron-style runtime's measured profiles; recorded as ``extra["layer_code"]``).
    ``robust`` (eth only): pick the best worst case under per-type speed perturbations among the
    best few candidates (``planner/robust.py``) and record it in ``predicted`` (``worst_case_time_s``,
    ``worst_scenario``, ``scenario_times_s``); ``robust.robust_record`` prices any plan the same way.
    eth with ``options.allow_idle`` (the default) may leave the slowest GPU types' nodes idle where
    that is predicted faster (``planner/devices/idle.py``): the plan's ``idle_devices`` lists them.
    ``shard_optimizer`` (eth only): also plan with the AdamW state sharded across pipelines and keep that where
    it is predicted faster (``planner/devices/sharding.py``; the plan's ``shard_optimizer`` says which).
    ``schedules``: the pipeline schedules each pipeline may run (``ethpipe.schedule.SCHEDULES``); default all
    for eth and 1F1B for the baselines (their published method). Each pipeline gets the fastest one its memory
    allows (``planner/layers/schedules.py``; interleaving: ``planner/layers/interleave.py``, a pipeline that
    cannot interleave keeps 1F1B); the plan records it per pipeline.
    ``grad_reduce``: what the block sync sums gradients in (``fp32``, or ``bf16``: half the sync's bytes, priced,
    with one bf16 copy per synced parameter in memory, and a rounding docs/runtime.md bounds; sharded, the
    reduce-scatter sums in bf16 and the all-gather after the optimizer still moves fp32 weights). Recorded as
    ``extra["grad_reduce"]``.
    """
    if method not in METHODS:
        raise UserError(f"unknown method '{method}': use one of {', '.join(METHODS)}")
    if recompute not in RECOMPUTE_MODES:
        raise UserError(f"unknown recompute mode '{recompute}': use one of {', '.join(RECOMPUTE_MODES)}")
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise UserError(f"global batch size must be a positive integer, got {global_batch_size!r}")
    if global_batch_size > MAX_SAMPLES_PER_DEVICE * cluster.num_devices:
        raise UserError(f"--global-batch {global_batch_size} is {global_batch_size // cluster.num_devices} samples per "
                        f"device, above {MAX_SAMPLES_PER_DEVICE}: a batch that size is a typo (extra zeros?); give "
                        "the samples of one optimizer step")
    if max_tp < 1:
        raise UserError(f"--max-tp must be >= 1, got {max_tp}")
    if robust and method != "eth":
        raise UserError(f"--robust applies to --method eth only, not '{method}': drop --robust or use eth")
    chosen = tuple(schedules) if schedules is not None else (SCHEDULES if method == "eth" else (DEFAULT_SCHEDULE,))
    for name in chosen:
        if name not in SCHEDULES:
            raise UserError(f"unknown schedule '{name}' in --schedules: use one or more of {', '.join(SCHEDULES)}")
    if not chosen:
        raise UserError(f"--schedules needs at least one of {', '.join(SCHEDULES)}")
    check_one_world((d.gpu for d in cluster.devices))
    requested_dtype, dtype = dtype, plan_dtype(dtype, cluster)
    cost = CostModel(cluster, model, seq_len, dtype_bytes=dtype_bytes(dtype), profiles=profiles, dtype=dtype,
                     tf32=tf32, calibration=calibration, attention_mode=attention, grad_reduce=grad_reduce,
                     layer_code=layer_code)
    # Interleaving is priced inside the search (each finalist's pipelines, ``layers/schedules.py``) where zb-h1 is
    # not allowed: there it is what shortens the bubble, and it changes which layout wins (docs/design.md,
    # "Schedules"). Where zb-h1 is allowed (and not robust) eth interleaves its final plan only: measured on 30
    # random 512-4096-GPU cases at one sample per GPU it changed no predicted efficiency and took 1.18x the time.
    in_search = robust or not any(s in SPLIT_SCHEDULES for s in chosen)
    searched = chosen if in_search else (tuple(x for x in chosen if x != "interleaved") or (DEFAULT_SCHEDULE,))
    if method == "eth":
        from ethpipe.planner.devices.eth import plan_eth
        from ethpipe.planner.devices.idle import plan_with_idle
        from ethpipe.planner.devices.sharding import with_sharding

        templates: dict = {}  # by optimizer_holders: shared by the idle search's sub-clusters (same node types)
        per_cluster: dict = {}  # what depends on a cluster's devices alone, shared by every holder count's cache
        compute_bounds: dict = {}  # the lower bounds that memory does not decide (``search.memo.shared_bounds``)
        timings: dict = {}  # finalists' pipelines' T(n) per schedule (``layers/schedules.pipeline_timings``)
        template_timings: dict = {}  # shapes' T(n) per layer split (``devices/templates.build_template``)

        def cache_of(on: CostModel) -> dict:
            return templates.setdefault(on.optimizer_holders, {("cluster_memo",): per_cluster,
                                                                ("compute_bounds",): compute_bounds,
                                                                ("schedule_timings",): timings,
                                                                ("template_timings",): template_timings})

        def plan_on(on: CostModel, incumbent_s: float = math.inf) -> Plan | None:
            # robust plans are compared by their worst case, which the search does not bound: no pruning
            return plan_eth(on, global_batch_size, max_tp=max_tp, recompute=recompute, options=options, robust=robust,
                            cache=cache_of(on), incumbent_s=math.inf if robust else incumbent_s, schedules=searched)

        def plan_eth_on(on: CostModel) -> tuple[Plan, CostModel]:
            if (options or PlannerOptions()).allow_idle:  # the chosen plan's cost model: its devices and speeds
                return plan_with_idle(on, global_batch_size, plan_on)
            found = plan_on(on)
            assert found is not None, "with nothing to beat, a plan or Infeasible"
            return found, on

        def refine_on(on: CostModel, incumbent_s: float) -> Plan | None:
            return plan_eth(on, global_batch_size, max_tp=max_tp, recompute=recompute, options=options,
                            robust=robust, cache=cache_of(on), incumbent_s=incumbent_s, schedules=searched)

        eth_options = options or PlannerOptions()

        def finish(plan: Plan, on: CostModel, full: bool = True) -> Plan:
            """The decided plan's last two passes (sharded or not is compared after them: ``with_sharding``;
            ``full`` False: the cuts alone)."""
            if "interleaved" in chosen and not robust and full:  # its pipelines, and why each kept its schedule
                plan = with_interleaving(plan, on, flat_sync=not eth_options.block_sync)
            if eth_options.sublayer_cuts and eth_options.balance_layers and not robust:  # stages inside layers
                plan = with_sublayer_cuts(plan, on, flat_sync=not eth_options.block_sync)
            return plan

        if shard_optimizer:
            plan, cost = with_sharding(cost, plan_eth_on, flat_sync=not eth_options.block_sync,
                                       robust=robust, refine_fn=refine_on, finish_fn=finish)
        else:
            plan, cost = plan_eth_on(cost)
            plan = finish(plan, cost)
    else:
        from ethpipe.planner.baselines.baselines import plan_layer_balanced, plan_uniform

        if method == "uniform":
            plan = plan_uniform(cost, global_batch_size, max_tp=max_tp, recompute=recompute)
        else:
            plan = plan_layer_balanced(cost, global_batch_size, max_tp=max_tp, recompute=recompute,
                                       time_budget_s=time_budget_s)
    if method != "eth" and chosen != (DEFAULT_SCHEDULE,):  # eth chose per layout (``devices/eth.py``)
        plan = with_schedules(plan, cost, chosen)
    plan = dataclasses.replace(plan, extra={**plan.extra, "search": {**(plan.extra.get("search") or {}),
                                                                     "schedules": list(chosen)}})
    if requested_dtype == AUTO and dtype == "fp16" and without_bf16(plan_gpus(plan)) is None:
        # Every device without bf16 is idle: the plan trains in bf16 (no loss scaling), priced exactly as fp16
        # (same 16-bit peak, same 2-byte elements).
        dtype = "bf16"
    plan = dataclasses.replace(plan, extra={**plan.extra, "dtype": dtype, "dtype_requested": requested_dtype,
                                            "tf32": tf32, "attention": attention, "grad_reduce": grad_reduce,
                                            "compute_model": compute_model_record(cost),
                                            **({"layer_code": layer_code} if layer_code != "ethpipe" else {})})
    if robust:  # the robust search ranks its own candidates; the nominal plan may still hold the lower worst case
        nominal = make_plan(cluster, model, global_batch_size, seq_len, method, max_tp=max_tp, profiles=profiles,
                            recompute=recompute, time_budget_s=time_budget_s, options=options, dtype=requested_dtype,
                            tf32=tf32, calibration=calibration, attention=attention,
                            shard_optimizer=shard_optimizer, schedules=schedules, grad_reduce=grad_reduce,
                            layer_code=layer_code)
        from ethpipe.planner.robust import robust_record

        record = robust_record(nominal, CostModel.for_plan(nominal))
        if record["worst_case_time_s"] < plan.predicted["worst_case_time_s"]:
            search = {**(nominal.extra.get("search") or {}), "robust": True, "robust_choice": "the nominal plan"}
            plan = dataclasses.replace(nominal, predicted={**nominal.predicted, **record},
                                       extra={**nominal.extra, "search": search})
    return plan


def compute_model_record(cost: CostModel) -> dict:
    """What priced the plan's compute, written into the plan so `ethpipe simulate` prices it the same way."""
    used = {cost.gpu(t).arch for t in cost.device_speeds()}
    cal = cost.calibration or shipped_calibration()
    types = set(cost.device_speeds())
    ids = {cost.gpu(t).id for t in types}
    if any(slot_powered(cost.gpu(t)) and not getattr(cal.gpus.get(cost.gpu(t).id), "num_observations", 0)
           for t in types):  # its load exponent is the measured slot-powered cards' mean: keep what it is made of
        ids |= set(cal.measured_slot_powered())
    record = Calibration({a: c for a, c in cal.architectures.items() if a in used}, cal.source, cal.fallback,
                         {t: d for t, d in cal.devices.items() if t in types},
                         {g: f for g, f in cal.gpus.items() if g in ids})
    return {"devices": cost.compute_model_notes(), "calibration": record.to_dict()}


__all__ = ["METHODS", "CostModel", "Estimate", "PlannerOptions", "estimate_iteration_s", "estimate_plan", "ideal_time_s",
           "make_plan"]
