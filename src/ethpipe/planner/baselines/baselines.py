"""Baselines in ETH's cost model (docs/design.md §2.1): what Megatron and Metis/AMP-style planners choose.

* ``uniform`` (Megatron-LM): one (PP, TP) shape replicated over DP replicas taken in rank
  order, equal layers per stage (remainder to the earliest non-last stages), equal data; the
  best micro-batch size and recomputation are searched, as a tuned Megatron run would be.
* ``layer-balanced`` (Metis/AMP): one pipeline shape replicated over DP replicas, each replica
  holding an equal share of every GPU type, unequal layers, equal data. Exhaustive over DP x
  TP degree, the order of GPU types along the pipeline, micro-batch size and recomputation;
  the layer split is the exact optimum for each order (``partition_layers``).
Both get the same memory model, per-stage recomputation and sync pricing as ``eth``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence

from ethpipe.cost.model import CostModel
from ethpipe.plan import Plan
from ethpipe.planner.assemble import assemble_plan, make_pipeline, memory_error
from ethpipe.planner.devices.grouping import Group, equal_split, evaluate_groups, make_group
from ethpipe.planner.layers.partition import partition_layers
from ethpipe.planner.devices.templates import (MICRO_BATCH_CANDIDATES, Template, divisors, equal_layers, fixed_partition,
                                       pools_of, slots_for)
from ethpipe.planner.layers.timing import StageSlot, link_key, stage_options, timing_of_partition

__all__ = ["equal_split", "plan_layer_balanced", "plan_uniform"]


def _groups(cost: CostModel, instances: Sequence[tuple[StageSlot, ...]], make) -> list[Group] | None:
    """Group replicas with the same structure; ``make(slots)`` returns their Template or None."""
    by_key: dict[tuple, list[tuple[StageSlot, ...]]] = {}
    for slots in instances:
        by_key.setdefault((tuple((s.device, s.tp) for s in slots), link_key(cost, slots)), []).append(slots)
    groups = []
    for members in by_key.values():
        tpl = make(members[0])
        if tpl is None:
            return None
        groups.append(make_group(cost, tpl, members))
    return groups


def _better(cost: CostModel, instances: Sequence[tuple[StageSlot, ...]], make,  # type: ignore[no-untyped-def]
            global_batch: int, best):
    """Price one replicated layout with equal data; return it if it beats ``best`` (else ``best``)."""
    groups = _groups(cost, instances, make)
    if groups is None:
        return best
    score, samples = evaluate_groups(cost, groups, global_batch, equal_data=True)
    return (score, groups, samples) if best is None or score < best[0] else best


def _finish(method: str, cost: CostModel, global_batch: int, best, started: float, search: dict) -> Plan:
    if best is None:
        raise memory_error(cost, search["recompute"])
    _, groups, samples = best
    pipelines = [make_pipeline(slots, gr.template.partition, n, gr.template.micro_batch)
                 for gr, row in zip(groups, samples) for slots, n in zip(gr.instances, row)]
    return assemble_plan(method, cost, global_batch, pipelines, started_s=started, search=search)


def plan_uniform(cost: CostModel, global_batch: int, *, max_tp: int = 8, recompute: str = "auto") -> Plan:
    started = time.perf_counter()
    n, num_layers = cost.cluster.num_devices, cost.model.num_layers
    node_sizes = {len(p.nodes[0]) for p in pools_of(cost)}
    tps = [t for t in divisors(min(node_sizes)) if t <= max_tp and all(g % t == 0 for g in node_sizes)
           and cost.model.tp_problem(t) is None]
    ranked = [(cost.cluster.devices[r].gpu.id, r) for r in range(n)]
    best, evaluated = None, 0
    for t in tps:
        for d in divisors(n // t):
            replicas = n // (d * t)
            if d > num_layers or replicas > global_batch:
                continue
            instances = [slots_for(ranked[i * d * t:(i + 1) * d * t], t) for i in range(replicas)]
            layers = equal_layers(num_layers, d)
            for b in (x for x in MICRO_BATCH_CANDIDATES if x <= -(-global_batch // replicas)):
                def make(slots: tuple[StageSlot, ...], b: int = b) -> Template | None:
                    part = fixed_partition(cost, slots, layers, b, recompute)
                    return None if part is None else Template(-1, len(slots), t, b, 1, slots, part,
                                                              timing_of_partition(cost, slots, part, b))
                best = _better(cost, instances, make, global_batch, best)
                evaluated += 1
    search = {"candidates_evaluated": evaluated, "recompute": recompute}
    return _finish("uniform", cost, global_batch, best, started, search)


def plan_layer_balanced(cost: CostModel, global_batch: int, *, max_tp: int = 8, recompute: str = "auto",
                        time_budget_s: float | None = None) -> Plan:
    started = time.perf_counter()
    pools = pools_of(cost)
    by_type: dict[str, list[int]] = {}
    for p in pools:
        by_type.setdefault(p.device, []).extend(r for node in p.nodes for r in node)
    types = list(by_type)
    counts = [len(by_type[t]) for t in types]
    node_sizes = [p.gpus_per_node for p in pools]
    num_layers = cost.model.num_layers
    best, evaluated, timed_out = None, 0, False
    cache: dict = {}
    for dp in (k for k in divisors(min(counts)) if all(c % k == 0 for c in counts) and k <= global_batch):
        for t in (x for x in divisors(min(node_sizes)) if x <= max_tp and all(g % x == 0 for g in node_sizes)
                  and cost.model.tp_problem(x) is None):
            if any((c // dp) % t for c in counts) or sum(c // dp for c in counts) // t > num_layers:
                continue
            for order in itertools.permutations(range(len(types))):
                instances = []
                for r in range(dp):
                    devices = [(types[i], rank) for i in order
                               for rank in by_type[types[i]][r * counts[i] // dp:(r + 1) * counts[i] // dp]]
                    instances.append(slots_for(devices, t))
                for b in (x for x in MICRO_BATCH_CANDIDATES if x <= -(-global_batch // dp)):
                    if best is not None and time_budget_s is not None and \
                            time.perf_counter() - started > time_budget_s:
                        timed_out = True
                        break

                    def make(slots: tuple[StageSlot, ...], b: int = b) -> Template | None:
                        key = (tuple((s.device, s.tp, s.ranks[0]) for s in slots), b)
                        if key not in cache:
                            part = partition_layers(stage_options(cost, slots, b, recompute), num_layers)
                            cache[key] = None if part is None else Template(
                                -1, len(slots), t, b, 1, slots, part, timing_of_partition(cost, slots, part, b))
                        return cache[key]
                    best = _better(cost, instances, make, global_batch, best)
                    evaluated += 1
                if timed_out:
                    break
            if timed_out:
                break
        if timed_out:
            break
    search = {"candidates_evaluated": evaluated, "timed_out": timed_out, "recompute": recompute}
    return _finish("layer-balanced", cost, global_batch, best, started, search)
