"""Count what one rank of a large plan issues, with the runtime's own code under torch's fake process group.

A rank of a 1024- or 4096-GPU plan is run in this process: ``init_process_group("fake")`` at the plan's
world size, the runtime's ``build_groups`` (the NCCL path: one ``split_group`` per family, recorded by a
stand-in, since a real split needs a GPU), its stage on the meta device, its sync buckets (sharded or not) and
one step's sync, stats and parameter gathers, counting every ``torch.distributed`` call by phase and scope.
Nothing is allocated for real and nothing is sent: the fake group completes every call at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from ethpipe.comm.program import DEFAULT_BUCKET_BYTES, p2p_batches, plan_peers
from ethpipe.plan import Plan
from ethpipe.runtime import groups as groups_module
from ethpipe.runtime.groups import build_groups, group_families
from ethpipe.runtime.model.decoder import Decoder, state_dict_shapes
from ethpipe.runtime.model.tensor_parallel import TPGroup
from ethpipe.runtime.observe.metrics import DEVICE_FIELDS, HOST_FIELDS, gather_stats
from ethpipe.runtime.sync.buckets import GradBuckets
from ethpipe.runtime.sync.grads import stage_sync_units
from ethpipe.runtime.sync.stage_optim import reduce_dtype_of
from ethpipe.runtime.sync.zero import ShardedBuckets
from ethpipe.schedule import actions_of

COUNTED = ("new_group", "split_group", "all_reduce", "reduce_scatter_single", "all_gather_single",
           "reduce_scatter_tensor", "all_gather_into_tensor", "reduce", "broadcast", "all_gather", "gather",
           "all_gather_object", "gather_object", "broadcast_object_list", "barrier", "monitored_barrier",
           "batch_isend_irecv", "send", "recv")
TIMEOUT = timedelta(seconds=60)


@dataclass
class RankCounts:
    """What one rank issued, by phase ("start", "step") and function; ``world_calls`` those over the world."""

    rank: int
    calls: Counter = field(default_factory=Counter)  # (phase, fn) -> calls
    world_calls: Counter = field(default_factory=Counter)  # (phase, fn) -> calls whose group is the world
    num_bucket_tensors: int = 0  # bucket tensors with two or more holders (each: one collective per phase)
    max_holders: int = 0
    num_p2p_batches: int = 0  # non-empty batches of one step (``comm.program.p2p_batches``)
    num_families: int = 0
    num_groups: int = 0  # every group of the plan (what one split per group would cost at start-up)
    member_groups: int = 0  # groups made with this rank in them (the others' calls communicate nothing)

    def total(self, phase: str, exclude: tuple[str, ...] = ()) -> int:
        return sum(n for (p, fn), n in self.calls.items() if p == phase and fn not in exclude)


def _group_size(group: Any) -> int:
    return dist.get_world_size() if group is None else len(dist.get_process_group_ranks(group))


@contextmanager
def counting(counts: RankCounts, phase: list[str]) -> Iterator[None]:
    """Replace ``torch.distributed``'s functions with counting ones (the runtime calls them through the module)."""
    originals = {name: getattr(dist, name) for name in COUNTED}
    world = dist.get_world_size()

    def wrap(name: str):  # type: ignore[no-untyped-def]
        def call(*args: Any, **kwargs: Any) -> Any:
            counts.calls[(phase[0], name)] += 1
            group = kwargs.get("group")
            if name in ("new_group", "split_group"):
                if name == "split_group":  # a split is collective over its parent: the world
                    counts.world_calls[(phase[0], name)] += 1
                    made = _fake_split(originals["new_group"], kwargs["split_ranks"])
                else:
                    made = originals[name](*args, **kwargs)
                counts.member_groups += made is not None and made is not dist.GroupMember.NON_GROUP_MEMBER
                return made
            elif name != "batch_isend_irecv" and _group_size(group) == world:
                counts.world_calls[(phase[0], name)] += 1
            if name == "all_gather_single" and args[0].device.type == "cpu":
                args[0].zero_()  # the fake group leaves outputs as they were: make the stats readable
            return originals[name](*args, **kwargs)
        return call

    try:
        for name in COUNTED:
            setattr(dist, name, wrap(name))
        yield
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _fake_split(new_group: Any, split_ranks: list[list[int]]) -> Any:
    """What ``split_group`` returns: this rank's group of the family, or None (made locally on the fake group)."""
    rank = dist.get_rank()
    mine = next((ranks for ranks in split_ranks if rank in ranks), None)
    return new_group(ranks=mine, timeout=TIMEOUT, use_local_synchronization=True) if mine is not None else None


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def count_rank(plan: Plan, rank: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES, split: bool = True) -> RankCounts:
    """Start-up (groups) and one training step's communication of ``rank``, counted (module docstring);
    ``split`` False: the path of gloo and of NCCL without a bound device (``new_group`` per group)."""
    spec = plan.resolve_model()
    tied = spec.tie_embeddings
    counts = RankCounts(rank)
    families = group_families(plan, tied)
    counts.num_families = len(families.all())
    counts.num_groups = sum(len(f) for f in families.all())
    pos = plan.position_of(rank)
    pipe = plan.pipelines[pos.pipeline]
    stage = pipe.stages[pos.stage]
    phase = ["start"]
    real_can_split = groups_module.can_split
    groups_module.can_split = lambda device: split  # True: the NCCL path (device-bound world)
    try:
        with fake_world(rank, plan.world_size), counting(counts, phase):
            groups = build_groups(plan, rank, TIMEOUT, tied)
            with torch.device("meta"):
                module = Decoder(spec, stage.layers, pos.stage == 0, pos.stage == pipe.depth - 1,
                                 tp=TPGroup(groups.tp_group, pos.tp_rank, stage.tp), chunks=stage.chunks,
                                 sublayers=stage.sublayers)
            _, units = stage_sync_units(plan, rank, module, state_dict_shapes(spec), tied)
            params = dict(module.named_parameters())
            weights = dict(enumerate(plan.shard_weights)) if plan.shard_weights else {}
            reduce = reduce_dtype_of(plan)  # as ``stage_optim.build_stage_optimizer`` builds them
            buckets = (ShardedBuckets(params, units, groups.block_groups, rank, weights, bucket_bytes, reduce)
                       if plan.shard_optimizer else GradBuckets(params, units, groups.block_groups, bucket_bytes, reduce))
            buckets.remove_hooks()
            counts.num_bucket_tensors = len(buckets.posts())
            counts.max_holders = max((len(h) for _, h in buckets.posts()), default=1)
            phase[0] = "step"
            buckets.flush()
            buckets.wait()
            host = [0.0] * len(HOST_FIELDS)
            gather_stats(plan, torch.zeros(len(DEVICE_FIELDS), dtype=torch.float64), lambda: host,
                         torch.device("cpu"))
            if isinstance(buckets, ShardedBuckets):
                buckets.gather_params()
                buckets.wait_params()
    finally:
        groups_module.can_split = real_can_split
    counts.num_p2p_batches = sum(1 for b in p2p_batches(actions_of(pipe, pos.stage), plan_peers(plan, rank)) if b)
    return counts


def sample_ranks(plan: Plan, tied: bool) -> list[int]:
    """Ranks worth counting: the first and last, the one in the most sync groups, a tensor-parallel one."""
    families = group_families(plan, tied)
    membership = Counter(r for family in families.holders for ranks in family for r in ranks)
    busiest = max(range(plan.world_size), key=lambda r: (membership[r], -r))
    tp = next((st.ranks[-1] for p in plan.pipelines for st in p.stages if st.tp > 1), None)
    return sorted({0, plan.world_size - 1, busiest, *([tp] if tp is not None else [])})
