"""``estimate_plan`` replays the block sync once per class of identical pipelines; that must be exactly the
replay over every (pipeline, stage), on plans whose identical-stage pipelines got different samples (so one
key class splits into several classes), with tied embeddings, sharded or not, block-wise or flat."""

from __future__ import annotations

import dataclasses

import pytest

from ethpipe.cluster import cluster_from_dict
from ethpipe.cost.model import CostModel
from ethpipe.cost.sync import block_sync_order, holder_stages, tied_holder_stages
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Pipeline, Plan
from ethpipe.planner import make_plan
from ethpipe.planner.estimate import _pipeline_finish, estimate_plan, plan_layout
from ethpipe.planner.layers.timing import split_sizes

CLUSTER = {"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 2, "gpus_per_node": 4, "nic_gbit_s": 100},
                     {"gpu": "v100_32gb_sxm2", "num_nodes": 2, "gpus_per_node": 4, "nic_gbit_s": 50}]}


def _per_stage_replay(plan: Plan, cost: CostModel, flat_sync: bool) -> float:
    """The sync, the step's stats all-gather and the optimizer over every (pipeline, stage), each pipeline's
    finishes on its own."""
    layout = plan_layout(plan, cost)
    pcost, cache = layout.cost, {}
    finish = [_pipeline_finish(pipe, pcost, key, cache).tolist() for pipe, key in zip(plan.pipelines, layout.keys)]
    makespan = max(max(f) for f in finish)
    free = {(p, s): (makespan if flat_sync else finish[p][s])
            for p, pipe in enumerate(plan.pipelines) for s in range(pipe.depth)}
    holders, tied = holder_stages(plan), tied_holder_stages(plan)
    syncs = [(holders[k], layout.sync_s[k]) for k in block_sync_order(len(plan.blocks))] + [(tied, layout.tied_sync_s)]

    def run(steps: list) -> None:
        for keys, duration in steps:
            if duration > 0.0:
                start = max(free[h] for h in keys)
                for h in keys:
                    free[h] = start + duration
    run(syncs)
    stats_end = max(max(free[(p, s)], finish[p][s]) for p, s in free) + pcost.stats_gather_s(plan)  # every rank
    for p, pipe in enumerate(plan.pipelines):
        for s, stage in enumerate(pipe.stages):
            free[(p, s)] = stats_end + pcost.optimizer_s(stage, first=s == 0, last=s == pipe.depth - 1)
    if pcost.optimizer_holders > 1:
        run(list(reversed(syncs)))
    return max(free.values())


def _uneven(plan: Plan) -> Plan:
    """Move samples between pipelines of identical stages: 1, 2, 3, ... extra, taken from the last one."""
    pipes = list(plan.pipelines)
    sizes = [p.num_samples for p in pipes]
    for i in range(len(pipes) - 1):
        moved = min(i % 3, sizes[-1] - 1)
        sizes[i] += moved
        sizes[-1] -= moved
    out = [Pipeline(p.stages, split_sizes(n, max(p.micro_batch_sizes)), p.schedule) for p, n in zip(pipes, sizes)]
    return dataclasses.replace(plan, pipelines=tuple(out), predicted=None)


@pytest.mark.parametrize("model, batch", [("gpt3-350m", 256), ("small", 64)])  # tied embeddings, untied
def test_the_per_class_sync_is_the_per_stage_replay(model: str, batch: int) -> None:
    cluster = cluster_from_dict(CLUSTER)
    spec = load_model_spec(model)
    base = make_plan(cluster, spec, batch, 512, "layer-balanced", max_tp=1)  # 8 identical 2-stage pipelines
    checked = 0
    for plan in (base, _uneven(base), make_plan(cluster, spec, batch, 512, max_tp=1)):
        assert len(plan.pipelines) > 2
        for holders in (1, len(plan.pipelines)):
            cost = CostModel.for_plan(plan).with_optimizer_holders(holders)
            for flat in (False, True):
                want = _per_stage_replay(plan, cost, flat)
                assert estimate_plan(plan, cost, flat_sync=flat).iteration_time_s == want
                checked += 1
    layout = plan_layout(_uneven(base), CostModel.for_plan(base))
    assert len(set(layout.key_class)) < len(layout.key_class)  # classes do collapse pipelines here
    assert len({p.micro_batch_sizes for p in _uneven(base).pipelines}) > 2  # and one key class splits
    assert checked == 12
