"""Planners: ETH (hierarchical workload balance) and the baselines, all in one cost model."""

from __future__ import annotations

import dataclasses

from collections.abc import Mapping

from ethpipe.cluster import Cluster
from ethpipe.cost.model import CostModel, dtype_bytes
from ethpipe.cost.profile import MeasuredProfile
from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Plan
from ethpipe.planner.estimate import Estimate, estimate_iteration_s, estimate_plan, ideal_time_s
from ethpipe.planner.options import PlannerOptions

METHODS = ("eth", "uniform", "layer-balanced")
RECOMPUTE_MODES = ("auto", "never", "always")


def make_plan(cluster: Cluster, model: ModelSpec, global_batch_size: int, seq_len: int, method: str = "eth", *,
              max_tp: int = 8, profiles: Mapping[str, MeasuredProfile] | None = None, recompute: str = "auto",
              time_budget_s: float | None = None, options: PlannerOptions | None = None,
              dtype: str = "bf16") -> Plan:
    """Plan one training iteration of ``model`` on ``cluster`` with ``method``.

    ``time_budget_s`` only bounds the exhaustive layer-balanced search (its best plan so far is
    returned, and the plan's ``search`` record says it timed out). ``options`` are ETH's
    ablation knobs (``PlannerOptions``); the baselines ignore them. ``dtype`` is the training
    precision the runtime will use (activation and gradient bytes); it is recorded in the plan
    (``extra["dtype"]``) so the simulator prices the plan the same way.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method '{method}': use one of {', '.join(METHODS)}")
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"unknown recompute mode '{recompute}': use one of {', '.join(RECOMPUTE_MODES)}")
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global batch size must be a positive integer, got {global_batch_size!r}")
    if max_tp < 1:
        raise ValueError(f"--max-tp must be >= 1, got {max_tp}")
    cost = CostModel(cluster, model, seq_len, dtype_bytes=dtype_bytes(dtype), profiles=profiles)
    if method == "eth":
        from ethpipe.planner.eth import plan_eth

        plan = plan_eth(cost, global_batch_size, max_tp=max_tp, recompute=recompute, options=options)
    else:
        from ethpipe.planner.baselines import plan_layer_balanced, plan_uniform

        if method == "uniform":
            plan = plan_uniform(cost, global_batch_size, max_tp=max_tp, recompute=recompute)
        else:
            plan = plan_layer_balanced(cost, global_batch_size, max_tp=max_tp, recompute=recompute,
                                       time_budget_s=time_budget_s)
    return dataclasses.replace(plan, extra={**plan.extra, "dtype": dtype})


__all__ = ["METHODS", "CostModel", "Estimate", "PlannerOptions", "estimate_iteration_s", "estimate_plan", "ideal_time_s",
           "make_plan"]
