"""What a plan file records under ``predicted``: the estimate of a finished plan and how far it is from the
physical limit (docs/design.md §4), with the efficiency factors that say where the rest goes."""

from __future__ import annotations

from ethpipe.cost.compute import model_train_flops
from ethpipe.cost.model import CostModel
from ethpipe.plan import Plan
from ethpipe.planner.efficiency import efficiency_factors
from ethpipe.planner.estimate import Estimate, estimate_plan, full_ideal_time_s


def predicted_metrics(plan: Plan, cost: CostModel, planning_time_s: float, *, flat_sync: bool = False,
                      est: Estimate | None = None) -> dict:
    """What `ethpipe plan` writes under ``predicted``: times, throughput, efficiency, per device (``est``: the plan's
    detailed estimate, where the caller has it)."""
    est = est or estimate_plan(plan, cost, flat_sync=flat_sync)
    it = est.iteration_time_s
    ideal = full_ideal_time_s(cost, plan.global_batch_size)
    flops = model_train_flops(cost.model, cost.seq_len, plan.global_batch_size)
    peak = sum(d.gpu.peak_tflops * 1e12 for d in cost.cluster.devices)
    devices = [
        {"rank": r, "device": cost.cluster.devices[r].gpu.id, "memory_bytes": est.memory_bytes[r],
         "memory_capacity_bytes": cost.gpu(cost.cluster.devices[r].gpu.id).memory_bytes,
         "busy_fraction": round(est.busy_s[r] / it, 6)}
        for r in sorted(est.memory_bytes)
    ]
    return {
        "iteration_time_s": it,
        "tokens_per_s": plan.global_batch_size * plan.seq_len / it,
        "samples_per_s": plan.global_batch_size / it,
        "balance_efficiency": ideal / it,
        "efficiency_factors": efficiency_factors(plan, cost, est, flat_sync=flat_sync, ideal_s=ideal),
        "ideal_time_s": ideal,
        "mfu": flops / (it * peak),
        "makespan_s": est.makespan_s,
        "pipeline_times_s": list(est.pipeline_times_s),
        "grad_sync_exposed_s": est.grad_sync_exposed_s,
        "optimizer_s": est.optimizer_s,
        "planning_time_s": planning_time_s,
        "devices": devices,
    }
