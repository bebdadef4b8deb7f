"""Turn a chosen set of pipelines into a Plan, and explain plans that cannot fit memory."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from ethpipe.cost.model import CostModel
from ethpipe.errors import Infeasible
from ethpipe.plan import IdleDevice, Pipeline, Plan, Stage, compute_blocks
from ethpipe.planner.predicted import predicted_metrics
from ethpipe.planner.devices.grouping import Group
from ethpipe.planner.layers.partition import Partition
from ethpipe.planner.layers.timing import StageSlot, split_sizes
from ethpipe.units import format_bytes

# A search result: (score, groups, samples per pipeline of each group).
Found = tuple[float, list[Group], list[list[int]]]

IDLE_REASON = "idle: left out of the cluster the plan was made on"  # ``planner/devices/idle.py`` says why


def make_pipeline(slots: Sequence[StageSlot], part: Partition, num_samples: int, micro_batch: int) -> Pipeline:
    stages = tuple(Stage(s.ranks, s.device, rng, s.tp, rc) for s, rng, rc in zip(slots, part.ranges(), part.recompute))
    return Pipeline(stages, split_sizes(num_samples, micro_batch))


def found_pipelines(found: Found) -> list[Pipeline]:
    """The pipelines of a search result: each group's instances with their sample counts."""
    _, groups, samples = found
    return [make_pipeline(slots, gr.template.partition, n, gr.template.micro_batch)
            for gr, row in zip(groups, samples) for slots, n in zip(gr.instances, row)]


def assemble_plan(method: str, cost: CostModel, global_batch: int, pipelines: Sequence[Pipeline], *,
                  started_s: float, search: dict[str, Any], flat_sync: bool = False) -> Plan:
    """Order pipelines by first rank, compute blocks, and price the plan rank by rank."""
    plan = unpriced_plan(method, cost, global_batch, pipelines, search)
    planning_s = time.perf_counter() - started_s
    predicted = predicted_metrics(plan, cost, planning_s, flat_sync=flat_sync)
    return Plan(**{**plan.__dict__, "predicted": predicted})


def unpriced_plan(method: str, cost: CostModel, global_batch: int, pipelines: Sequence[Pipeline],
                  search: dict[str, Any]) -> Plan:
    """The plan without its ``predicted`` record (cheap: what comparing candidates needs)."""
    ordered = tuple(sorted(pipelines, key=lambda p: p.stages[0].ranks[0]))
    used = sorted(r for p in ordered for r in p.ranks)
    assert used == list(range(cost.cluster.num_devices)), "a plan must use every device of its cluster exactly once"
    # On a sub-cluster (``Cluster.without_devices``) the left-out devices are the plan's idle ones.
    idle = tuple(IdleDevice(d.rank, d.gpu.id, IDLE_REASON) for d in cost.cluster.idle_devices)
    return Plan(method=method, model=cost.model.name, global_batch_size=global_batch, seq_len=cost.seq_len,
                pipelines=ordered, blocks=compute_blocks(ordered), model_spec=cost.model, cluster=cost.cluster.source,
                extra={"device_speeds": cost.device_speeds(), "search": search}, idle_devices=idle)


def memory_error(cost: CostModel, recompute: str) -> Infeasible:
    """One line naming the model, the deepest possible pipeline, the binding device and the fix."""
    depth = min(cost.model.num_layers, cost.cluster.num_devices)
    rc = recompute in ("always", "auto")
    fix = "use more nodes or a shorter --seq-len" if rc else "use more nodes or --recompute always"
    by_memory = sorted(cost.cluster.gpu_types, key=lambda t: cost.gpu(t).memory_bytes)
    layers = math.ceil(cost.model.num_layers / depth)
    for device, num_layers, first in ((by_memory[-1], layers, True), (by_memory[0], 1, False)):
        fixed, per_layer = cost.memory_terms(1, 1, depth if first else 1, rc, first=first, last=depth == 1 or not first,
                                             device=device)
        need = fixed + num_layers * per_layer
        if need > cost.usable_memory_bytes(device):
            break
    usable, total = cost.usable_memory_bytes(device), cost.gpu(device).memory_bytes
    short_bytes = math.ceil(need - usable)
    alike = [t for t in by_memory if cost.gpu(t).memory_bytes == total]  # types of the same memory: all named
    device = " / ".join(alike) if len(alike) > 1 else device
    if short_bytes <= 0:  # each stage fits alone; the method's layouts (equal layers, shapes) do not
        return Infeasible(
            f"no layout of {cost.model.name} fits in memory with this method: a depth-{depth} stage alone needs "
            f"{format_bytes(need)} on {device} (of its {format_bytes(usable)} usable), but the layouts the method "
            f"may use put more on some device: {fix}, or plan with --method eth")
    return Infeasible(
        f"{cost.model.name} needs {format_bytes(need)} per stage at depth {depth} on {device}, "
        f"{format_bytes(short_bytes)} ({short_bytes} bytes) more than its {format_bytes(usable)} usable "
        f"(of {format_bytes(total)}): {fix}"
    )
