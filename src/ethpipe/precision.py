"""Which training precision a plan may use on its devices (the catalog's ``bf16_supported``).

V100, T4 and P100 have no bf16, so a plan or a run in bf16 on them is refused with one line naming
the fix: fp16 (autocast with dynamic loss scaling) or fp32. The planner's ``auto`` picks bf16
where every device has it, else fp16: the 16-bit precision those devices have (their catalog peak),
with the same 2-byte elements as bf16 (``make_plan`` keeps bf16 when the plan leaves every device
without it idle). Inline (pseudo-)devices have bf16 unless their spec says
``bf16_supported: false``: the CPU runtime autocasts to bf16.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from ethpipe.catalog import GpuSpec, gpu_catalog
from ethpipe.cluster import Cluster, cluster_from_dict
from ethpipe.cost.model import DTYPE_BYTES, CostModel, dtype_bytes
from ethpipe.cost.plan_memory import memory_shortfalls
from ethpipe.errors import UserError
from ethpipe.plan import Plan
from ethpipe.units import format_bytes

AUTO = "auto"


def without_bf16(gpus: Iterable[GpuSpec]) -> GpuSpec | None:
    """The first GPU type that cannot compute in bf16, else None."""
    return next((g for g in gpus if not g.bf16_supported), None)


def _named(gpu: GpuSpec) -> str:
    return f"device type '{gpu.id}'" + (f" ({gpu.name})" if gpu.name != gpu.id else "")


def plan_dtype(dtype: str, cluster: Cluster, *, source: str = "--dtype bf16",
               fix: str = "use --dtype fp16 or --dtype fp32") -> str:
    """The precision to price a plan in: ``auto`` resolved; bf16 refused on a cluster with a device without it."""
    lacking = without_bf16(d.gpu for d in cluster.devices)
    if dtype == AUTO:
        return "fp16" if lacking is not None else "bf16"
    dtype_bytes(dtype)
    if dtype == "bf16" and lacking is not None:
        raise UserError(f"{source}: {_named(lacking)} has no bf16: {fix}")
    return dtype


def plan_gpus(plan: Plan) -> list[GpuSpec]:
    """The GPU specs of the plan's device types: from its embedded cluster, else the catalog (unknown ids,
    i.e. pseudo-devices of a hand-written plan, are left out)."""
    if plan.cluster is not None:
        try:
            by_id = {d.gpu.id: d.gpu for d in cluster_from_dict(plan.cluster).devices}
        except UserError as err:
            raise UserError(f"plan field 'cluster' is invalid: {err}") from None
    else:
        by_id = gpu_catalog()
    types = dict.fromkeys(s.device for p in plan.pipelines for s in p.stages)
    return [by_id[t] for t in types if t in by_id]


def check_train_dtype(plan: Plan, requested: str | None) -> None:
    """``ethpipe train``: refuse bf16 (the run's --dtype, or the plan's recorded dtype it defaults to) on a
    device without it."""
    lacking = without_bf16(plan_gpus(plan))
    if lacking is None or train_dtype(plan, requested) != "bf16":
        return
    if requested == "bf16":
        raise UserError(f"--dtype bf16: {_named(lacking)} of the plan has no bf16: use --dtype fp16 or --dtype fp32")
    raise UserError(f"plan field 'dtype' is bf16 but {_named(lacking)} has no bf16: re-make the plan with "
                    "`ethpipe plan --dtype fp16` (or fp32), or train with --dtype fp16")


def train_dtype(plan: Plan, requested: str | None) -> str:
    """The precision a run trains in: ``--dtype`` if given, else the plan's (what its memory was checked
    for), else fp32 (a hand-written plan that records none)."""
    return requested or str(plan.extra.get("dtype") or "fp32")


def check_dtype_fits(plan: Plan, dtype: str) -> None:
    """A run in another precision than the plan's: re-check every stage's memory at that precision.

    Only plans that record their precision and cluster can be checked; fp64 (the exactness mode on CPU)
    has no catalog pricing and is not checked.
    """
    planned = plan.extra.get("dtype")
    if planned is None or dtype == planned or dtype not in DTYPE_BYTES or plan.cluster is None:
        return
    cost = CostModel.for_plan(replace(plan, extra={**plan.extra, "dtype": dtype}))
    short = memory_shortfalls(plan, cost)
    if short:
        s = short[0]
        over = s.need_bytes - s.usable_bytes
        raise UserError(
            f"--dtype {dtype}: stage {s.stage} of pipeline {s.pipeline} on {s.device} would need "
            f"{format_bytes(s.need_bytes)}, {format_bytes(over)} ({over} bytes) more than its "
            f"{format_bytes(s.usable_bytes)} usable (the plan was made for {planned}): re-plan with "
            f"`ethpipe plan --dtype {dtype}`, or train in {planned} (drop --dtype)")


# torch's spellings of the precisions ethpipe names shortly (``torch.bfloat16`` -> bf16, ...).
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
                 "float64": "fp64", "double": "fp64"}


def canonical_dtype(name: str | None) -> str | None:
    """A precision as ethpipe names it, taking torch's spellings too (``--dtype bfloat16``)."""
    if name is None:
        return None
    key = name.strip().lower().removeprefix("torch.")
    return DTYPE_ALIASES.get(key, key)
