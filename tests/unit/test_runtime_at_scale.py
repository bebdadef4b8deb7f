"""The runtime at the scale the planner plans: the planner's own 1024- and 4096-GPU plans, a sample of their
ranks run through the runtime's start-up (groups) and one step's communication under torch's fake process
group with meta-device stages (``_scale.py``), counted at the torch.distributed API.

Per rank: at most 8 world-wide collectives at start-up (the group families' splits plus the three fixed ones:
the settled checks, the control group, the barrier before the first step); per step one collective per bucket
tensor and phase (one reduce-scatter or all-reduce, one all-gather when sharded) plus the stats, however many
holders a bucket has; no world-wide operation in a step but the stats' one all-gather on the device group.
The code before this round issued, on the same 4096-GPU plans, one reduce and one broadcast per holder per
bucket tensor (101,376 of each per step on rank 0 of gpt3-1.3b at one sample per GPU) and one world-wide
split per group at start-up (1029-2572): docs/runtime.md, "At scale".
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest
import torch
import torch.distributed as dist

from ethpipe.cluster import Cluster, cluster_from_dict
from ethpipe.model_load import load_model_spec
from ethpipe.plan import Plan
from ethpipe.planner import make_plan
from ethpipe.runtime.sync.zero import ShardedBuckets

from _comm_plans import even_pipeline
from _comm_plans import make_plan as make_small_plan
from _scale import count_rank, sample_ranks

pytestmark = pytest.mark.slow

FIXED_START_COLLECTIVES = 3  # settle (checks, plan key, devices), the control group, the start-up barrier
MAX_START_COLLECTIVES = 8
NIC_GBIT = {"h100_sxm": 3200, "a100_80gb_sxm": 1600, "a100_40gb_sxm": 1600, "v100_32gb_sxm2": 800, "l4": 400}
MODELS = {"gpt3-1.3b": 2048, "llama2-7b": 4096, "llama2-70b": 4096}
TOKENS_PER_BATCH = 4 * 1024 * 1024


def _cluster(parts: list[tuple[str, int]]) -> Cluster:
    return cluster_from_dict({"nodes": [{"gpu": g, "num_nodes": n // 8, "gpus_per_node": 8, "nic_gbit_s": NIC_GBIT[g]}
                                        for g, n in parts if n]})


def scaling_cluster(num_gpus: int) -> Cluster:
    """benchmarks/planner_scale.py's scaling cluster: four types, equal shares of 8-GPU nodes."""
    types = ["h100_sxm", "a100_80gb_sxm", "a100_40gb_sxm", "v100_32gb_sxm2"]
    nodes = num_gpus // 8
    return _cluster([(t, 8 * (nodes // 4 + (1 if i < nodes % 4 else 0))) for i, t in enumerate(types)])


CLUSTERS = {
    "1024 scaling": lambda: scaling_cluster(1024),
    "4096 scaling": lambda: scaling_cluster(4096),
    "1024 realistic": lambda: _cluster([("h100_sxm", 384), ("a100_80gb_sxm", 256), ("l4", 256),
                                        ("v100_32gb_sxm2", 128)]),
}
CASES = [(c, m, b) for c in CLUSTERS for m in MODELS for b in ("4M tokens", "1/GPU")]


@lru_cache(maxsize=None)
def planned(cluster_name: str, model: str, batch: str) -> Plan:
    cluster = CLUSTERS[cluster_name]()
    seq = MODELS[model]
    return make_plan(cluster, load_model_spec(model), TOKENS_PER_BATCH // seq if batch == "4M tokens"
                     else cluster.num_devices, seq)


@pytest.mark.parametrize("cluster_name,model,batch", CASES)
def test_a_rank_of_the_planners_plan_starts_and_steps_in_work_that_does_not_grow(cluster_name: str, model: str,
                                                                                   batch: str) -> None:
    plan = planned(cluster_name, model, batch)
    spec = plan.resolve_model()
    for rank in sample_ranks(plan, spec.tie_embeddings):
        counts = count_rank(plan, rank)
        where = (cluster_name, model, batch, rank)
        # Start-up: one split per family, nothing else world-wide; the families are few whatever the groups.
        assert counts.calls[("start", "split_group")] == counts.num_families, where
        assert counts.calls[("start", "new_group")] == 0, where
        assert counts.num_families + FIXED_START_COLLECTIVES <= MAX_START_COLLECTIVES, where
        # A step: one collective per bucket tensor and phase, and the stats; nothing per holder.
        tensors = counts.num_bucket_tensors
        scatter, gather, reduce = (counts.calls[("step", fn)] for fn in ("reduce_scatter_single", "all_gather_single",
                                                                         "all_reduce"))
        if plan.shard_optimizer:
            assert (scatter, gather, reduce) == (tensors, tensors + 1, 0), where  # + 1: the stats
        else:
            assert (scatter, gather, reduce) == (0, 1, tensors), where
        assert counts.total("step") == scatter + gather + reduce, where  # no reduce / broadcast / object collective
        assert dict((k, v) for k, v in counts.world_calls.items() if k[0] == "step") == {
            ("step", "all_gather_single"): 1}, where  # the stats, on the device group: nothing else world-wide
        assert counts.max_holders >= 2 or counts.num_bucket_tensors == 0, where


def test_the_harness_sees_holders_in_the_thousands_and_a_per_holder_runtime(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above is not vacuous: buckets of a 4096-GPU plan are held by thousands of ranks at once, and
    the ZeRO of the previous round (one reduce per holder per bucket tensor, restored here) is counted as such."""
    plan = planned("4096 scaling", "gpt3-1.3b", "1/GPU")
    assert plan.shard_optimizer
    counts = count_rank(plan, 0)
    assert counts.max_holders >= 1024 and counts.num_bucket_tensors >= 50
    assert counts.total("step") == 2 * counts.num_bucket_tensors + 1

    def per_holder(self, bucket, tensors):  # type: ignore[no-untyped-def]
        group = self.groups[bucket.holders]
        return [dist.reduce(t.reshape(-1)[a:b], dst=h, group=group, async_op=True)
                for t in tensors for h, (a, b) in zip(bucket.holders, self._bounds(bucket, t.numel()))]

    monkeypatch.setattr(ShardedBuckets, "_reduce", per_holder)
    monkeypatch.setattr(ShardedBuckets, "_finish", lambda self, bucket: None)
    broken = count_rank(plan, 0)
    assert broken.calls[("step", "reduce")] >= 1024 * counts.num_bucket_tensors  # 100k+ collectives a step


def _depth_one(num_pipelines: int) -> Plan:
    """``num_pipelines`` one-stage pipelines of 2 samples each, sharded AdamW: every block held by every rank."""
    plan = make_small_plan([even_pipeline(1, [2]) for _ in range(num_pipelines)])
    return dataclasses.replace(plan, shard_optimizer=True)


@pytest.mark.parametrize("split", [True, False])
def test_eight_pipelines_cost_a_rank_no_more_than_two(split: bool) -> None:
    """A rank of 8 depth-1 sharded pipelines issues no more collectives per step than a rank of 2, and makes no
    more groups at start-up: split (NCCL) one per family; new_group (gloo) those it is a member of, the
    others' calls returning at once without communicating (no device is bound)."""
    two, eight = count_rank(_depth_one(2), 0, split=split), count_rank(_depth_one(8), 0, split=split)
    assert eight.total("step") == two.total("step") and eight.num_bucket_tensors == two.num_bucket_tensors
    assert eight.max_holders == 8 and two.max_holders == 2
    if split:
        assert eight.calls[("start", "split_group")] == two.calls[("start", "split_group")]
    else:
        assert eight.member_groups == two.member_groups == 2  # its pipeline and its block group
        assert eight.calls[("start", "new_group")] > two.calls[("start", "new_group")]  # the others' no-ops


@pytest.mark.parametrize("sharded", [True, False])
def test_a_bf16_gradient_sum_issues_what_the_fp32_one_does(sharded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``grad_reduce: bf16`` casts each bucket tensor and sums it in bf16: at 4096 ranks a rank issues exactly the
    collectives, groups and world-wide calls of the fp32 plan, and every gradient collective carries bf16."""
    base = dataclasses.replace(planned("4096 scaling", "gpt3-1.3b", "1/GPU"), shard_optimizer=sharded)
    low = dataclasses.replace(base, extra={**base.extra, "grad_reduce": "bf16"})
    seen: list[torch.dtype] = []
    for name, arg in (("all_reduce", 0), ("reduce_scatter_single", 1)):
        original = getattr(dist, name)

        def recording(*args, _original=original, _arg=arg, **kwargs):  # type: ignore[no-untyped-def]
            seen.append(args[_arg].dtype)
            return _original(*args, **kwargs)
        monkeypatch.setattr(dist, name, recording)
    full = count_rank(base, 0)
    fp32_dtypes, seen[:] = list(seen), []
    half = count_rank(low, 0)
    assert half.num_bucket_tensors == full.num_bucket_tensors >= 50
    assert (half.calls, half.world_calls, half.member_groups) == (full.calls, full.world_calls, full.member_groups)
    assert seen and set(seen) == {torch.bfloat16} and set(fp32_dtypes) == {torch.float32}
