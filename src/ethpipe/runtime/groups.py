"""Process groups of a plan: one per pipeline (p2p) and one per gradient block (all-reduce).

Every rank creates every group in the same order (pipelines in plan order, then blocks in
block order), because ``new_group`` is collective over the world. Each group gets the
timeout explicitly: ``new_group`` does not inherit the one given to ``init_process_group``,
and a hang would otherwise wait 30 minutes.
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


def build_groups(plan: Plan, rank: int, timeout: timedelta) -> RankGroups:
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
    assert mine_pipe is not None
    stages = plan.pipelines[position.pipeline].stages
    prev_rank = stages[position.stage - 1].ranks[position.tp_rank] if position.stage > 0 else None
    next_rank = stages[position.stage + 1].ranks[position.tp_rank] if position.stage + 1 < len(stages) else None
    return RankGroups(rank, position, mine_pipe, blocks, tuple(created), prev_rank, next_rank)


def destroy_groups(groups: RankGroups) -> None:
    """Free a plan's groups so the same processes can run another plan (tests do)."""
    for group in groups.all_groups:
        dist.destroy_process_group(group)
