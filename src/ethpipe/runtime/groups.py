"""Process groups of a plan: one per pipeline (p2p), one per tensor-parallel stage, and the
gradient sync's groups (``sync_layout.holder_sets``: one per block, plus one per slice pattern
where TP degrees differ, and with tied embeddings the groups of the ranks holding a copy of the
embedding matrix).

Every rank creates every group in the same order (pipelines in plan order, TP stages, then the
sync's holder sets), because ``new_group`` is collective over the world. Each
group gets the timeout explicitly: ``new_group`` does not inherit the one given to
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


def build_groups(plan: Plan, rank: int, timeout: timedelta, tied: bool = False,
                 device: torch.device | None = None) -> RankGroups:
    """This rank's groups; ``tied`` (the model ties its embeddings) adds the tied matrix's groups. With
    ``device``, one collective on the pipeline group warms it up (``comm.program``: a lazily created NCCL
    communicator's first batched p2p would need the whole group at once)."""
    position = plan.position_of(rank)
    created: list[dist.ProcessGroup] = []
    mine_pipe: dist.ProcessGroup | None = None
    for p_idx, pipe in enumerate(plan.pipelines):
        group = dist.new_group(ranks=list(pipe.ranks), timeout=timeout)
        if p_idx == position.pipeline:
            mine_pipe = group
            created.append(group)
    tp_group: dist.ProcessGroup | None = None
    for pipe in plan.pipelines:
        for stage in pipe.stages:
            if len(stage.ranks) > 1:
                group = dist.new_group(ranks=list(stage.ranks), timeout=timeout)
                if rank in stage.ranks:
                    tp_group = group
                    created.append(group)
    blocks: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for holders in holder_sets(plan, tied):
        group = dist.new_group(ranks=list(holders), timeout=timeout)
        if rank in holders:
            blocks[holders] = group
            created.append(group)
    assert mine_pipe is not None
    if device is not None:
        dist.all_reduce(torch.zeros(1, device=device), group=mine_pipe)
    return RankGroups(rank, position, mine_pipe, blocks, tuple(created), plan_peers(plan, rank), tp_group)


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
