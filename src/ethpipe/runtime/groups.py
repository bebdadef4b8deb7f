"""Process groups of a plan: one per pipeline (p2p), one per gradient block (all-reduce), and
with tied embeddings one "tied group" of every rank holding a copy of the embedding matrix.

Every rank creates every group in the same order (pipelines in plan order, then blocks in
block order, then the tied group), because ``new_group`` is collective over the world. Each
group gets the timeout explicitly: ``new_group`` does not inherit the one given to
``init_process_group``, and a hang would otherwise wait 30 minutes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ethpipe.plan import Plan, RankPosition


@dataclass(frozen=True)
class RankGroups:
    """The groups this rank takes part in, plus its place in the plan."""

    rank: int
    position: RankPosition
    pipeline_group: dist.ProcessGroup  # this rank's pipeline
    block_groups: dict[int, dist.ProcessGroup]  # block index -> group, for this rank's blocks
    all_groups: tuple[dist.ProcessGroup, ...]  # every group this rank is in (to destroy afterwards)
    prev_rank: int | None  # previous stage's rank in this pipeline (global rank)
    next_rank: int | None
    tied_group: dist.ProcessGroup | None = None  # the tied group, if the model ties and this rank holds a copy


def tied_ranks(plan: Plan) -> tuple[int, ...]:
    """Ranks holding a copy of a tied embedding, in plan order: each pipeline's first-stage ranks, then
    its last-stage ranks (a depth-1 pipeline's one stage uses its one copy twice and is listed once)."""
    out: list[int] = []
    for pipe in plan.pipelines:
        for stage in (pipe.stages[0], pipe.stages[-1]):
            out.extend(r for r in stage.ranks if r not in out)
    return tuple(out)


def build_groups(plan: Plan, rank: int, timeout: timedelta, tied: bool = False) -> RankGroups:
    """This rank's groups; ``tied`` (the model ties its embeddings) adds the tied group after the blocks."""
    position = plan.position_of(rank)
    created: list[dist.ProcessGroup] = []
    mine_pipe: dist.ProcessGroup | None = None
    for p_idx, pipe in enumerate(plan.pipelines):
        group = dist.new_group(ranks=list(pipe.ranks), timeout=timeout)
        if p_idx == position.pipeline:
            mine_pipe = group
            created.append(group)
    blocks: dict[int, dist.ProcessGroup] = {}
    for b_idx, block in enumerate(plan.blocks):
        group = dist.new_group(ranks=list(block.ranks), timeout=timeout)
        if rank in block.ranks:
            blocks[b_idx] = group
            created.append(group)
    tied_group: dist.ProcessGroup | None = None
    if tied:
        holders = tied_ranks(plan)
        group = dist.new_group(ranks=list(holders), timeout=timeout)
        if rank in holders:
            tied_group = group
            created.append(group)
    assert mine_pipe is not None
    stages = plan.pipelines[position.pipeline].stages
    prev_rank = stages[position.stage - 1].ranks[position.tp_rank] if position.stage > 0 else None
    next_rank = stages[position.stage + 1].ranks[position.tp_rank] if position.stage + 1 < len(stages) else None
    return RankGroups(rank, position, mine_pipe, blocks, tuple(created), prev_rank, next_rank, tied_group)


def destroy_groups(groups: RankGroups) -> None:
    """Free a plan's groups so the same processes can run another plan (tests do)."""
    for group in groups.all_groups:
        dist.destroy_process_group(group)
