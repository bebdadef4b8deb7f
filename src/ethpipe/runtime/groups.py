"""Process groups of a plan, made family by family: one pipeline group each, one group per tensor-parallel
stage, and the gradient sync's groups (``sync_layout.holder_sets``: one per block, plus one per slice pattern
where TP degrees differ, and with tied embeddings those of the ranks holding a copy of the matrix).

A family is a list of disjoint rank sets (``group_families``): the pipelines, the TP stages, and the holder
sets colored greedily (first fit, in the one order every rank computes; at least as many families as the most
holder sets any rank is in, and 2-3 on the planner's 1024/4096-GPU plans: tests/unit/test_runtime_at_scale.py). On NCCL with the world bound to a GPU (``init_process_group(device_id=...)``) a
group is an ``ncclCommSplit`` of the world's communicator, a collective every rank of the world joins, so
each family is made with ONE ``dist.split_group``: a handful of world-wide splits at start-up instead of one
per group (820-2572 for the planner's 4096-GPU plans). Elsewhere (gloo; NCCL without a bound device, whose
communicators are made lazily at their first use) every rank calls ``new_group`` for every group in the
same order, as torch requires; for a rank outside a group that call returns at once without communicating
(no device bound: torch makes no split), so what a rank communicates at start-up is its own groups' set-up.
Each group gets the timeout explicitly: ``new_group`` does not inherit the one given to
``init_process_group``, and a hang would otherwise wait 30 minutes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ethpipe.comm.program import Peers, plan_peers
from ethpipe.plan import Plan, RankPosition
from ethpipe.runtime.sync.layout import holder_sets, tied_stages

LAZY_GLOO = "TORCH_GLOO_LAZY_INIT"  # gloo connects a pair at its first message instead of at creation


@dataclass(frozen=True)
class RankGroups:
    """The groups this rank takes part in, plus its place in the plan."""

    rank: int
    position: RankPosition
    pipeline_group: dist.ProcessGroup  # this rank's pipeline
    block_groups: dict[tuple[int, ...], dist.ProcessGroup]  # holder ranks -> group, for this rank's sync units
    all_groups: tuple[dist.ProcessGroup, ...]  # every group this rank is in (to destroy afterwards)
    peers: Peers  # where its boundary tensors come from and go to (``comm.program.plan_peers``)
    tp_group: dist.ProcessGroup | None = None  # this stage's TP group (None at tp 1)


def tied_ranks(plan: Plan) -> tuple[int, ...]:
    """Ranks holding a copy of a tied embedding, in plan order: each pipeline's first-stage ranks, then
    its last-stage ranks (a depth-1 pipeline's one stage uses its one copy twice and is listed once)."""
    return tuple(r for ranks in tied_stages(plan) for r in ranks)


@dataclass(frozen=True)
class GroupFamilies:
    """A plan's groups as families of disjoint rank sets (module docstring)."""

    pipelines: list[tuple[int, ...]]  # every pipeline, one-rank ones too
    tp_stages: list[tuple[int, ...]]  # every stage of tp > 1 (empty: no TP family)
    holders: list[list[tuple[int, ...]]]  # the sync's holder sets of two or more ranks, greedily colored

    def all(self) -> list[list[tuple[int, ...]]]:
        return [self.pipelines, *([self.tp_stages] if self.tp_stages else []), *self.holders]


def group_families(plan: Plan, tied: bool = False) -> GroupFamilies:
    """Every group of ``plan`` in families of disjoint rank sets, in the one order every rank computes: the
    pipelines; the TP stages; then the sync's holder sets of two or more ranks, each into the first family it
    is disjoint from (greedy coloring)."""
    colored: list[tuple[list[tuple[int, ...]], set[int]]] = []
    for holders in holder_sets(plan, tied):
        if len(holders) < 2:
            continue  # one holder syncs nothing
        family = next((f for f in colored if f[1].isdisjoint(holders)), None)
        if family is None:
            family = ([], set())
            colored.append(family)
        family[0].append(holders)
        family[1].update(holders)
    return GroupFamilies([tuple(pipe.ranks) for pipe in plan.pipelines],
                         [tuple(st.ranks) for pipe in plan.pipelines for st in pipe.stages if len(st.ranks) > 1],
                         [f for f, _ in colored])


def make_family(family: list[tuple[int, ...]], rank: int, timeout: timedelta,
                split: bool) -> tuple[tuple[int, ...], dist.ProcessGroup] | None:
    """This rank's group of ``family`` (None if it is in none): one ``split_group`` of the world (``split``), or
    one ``new_group`` per member set (module docstring). Every rank of the world calls it alike."""
    mine = next((ranks for ranks in family if rank in ranks), None)
    if split:
        group = dist.split_group(split_ranks=[list(ranks) for ranks in family], timeout=timeout)
        return (mine, group) if mine is not None and group is not None else None
    made = None
    for ranks in family:
        group = dist.new_group(ranks=list(ranks), timeout=timeout)
        if ranks == mine:
            made = (mine, group)
    return made


def can_split(device: torch.device | None) -> bool:
    """Whether groups are made by splitting the world's communicator: NCCL with the world bound to a GPU."""
    return (device is not None and device.type == "cuda" and dist.get_backend() == "nccl"
            and getattr(dist.group.WORLD, "bound_device_id", None) is not None)  # the world, through public API


def build_groups(plan: Plan, rank: int, timeout: timedelta, tied: bool = False,
                 device: torch.device | None = None) -> RankGroups:
    """This rank's groups, family by family (module docstring); ``tied`` (the model ties its embeddings) adds the
    tied matrix's groups. With ``device``, one collective on the pipeline group warms it up (``comm.program``: a
    lazily created NCCL communicator's first batched p2p would need the whole group at once)."""
    position = plan.position_of(rank)
    split = can_split(device)
    families = group_families(plan, tied)
    pipeline = make_family(families.pipelines, rank, timeout, split)
    assert pipeline is not None, "every rank is in one pipeline"
    tp = make_family(families.tp_stages, rank, timeout, split) if families.tp_stages else None
    blocks = dict(m for m in (make_family(f, rank, timeout, split) for f in families.holders) if m is not None)
    if device is not None:
        dist.all_reduce(torch.zeros(1, device=device), group=pipeline[1])
    created = (pipeline[1], *([tp[1]] if tp is not None else []), *blocks.values())
    return RankGroups(rank, position, pipeline[1], blocks, created, plan_peers(plan, rank),
                      tp[1] if tp is not None else None)


def destroy_groups(groups: RankGroups) -> None:
    """Free a plan's groups so the same processes can run another plan (tests do)."""
    for group in groups.all_groups:
        dist.destroy_process_group(group)


def control_group(timeout: timedelta) -> dist.ProcessGroup | None:
    """A gloo group over the world for objects and CPU tensors: the placement check, traces, the final
    save and checkpoint bookkeeping (never a training step). On NCCL, object collectives stage their pickles
    in GPU memory on every rank; gloo keeps them on the host. None when the world is gloo already (use the
    default group). Lazily connected (``TORCH_GLOO_LAZY_INIT``, set for its creation only): a rank opens a
    connection to a peer at their first message, not a full mesh of world - 1 sockets at start-up (4095 at
    4096 ranks, above a default ``ulimit -n`` of 1024): a rank connects only to the peers it exchanges with."""
    if dist.get_backend() == "gloo":
        return None
    before = os.environ.get(LAZY_GLOO)
    os.environ[LAZY_GLOO] = "1"
    try:
        return dist.new_group(backend="gloo", timeout=timeout)
    finally:
        if before is None:
            del os.environ[LAZY_GLOO]
        else:
            os.environ[LAZY_GLOO] = before
