"""On gloo, counted at the torch.distributed API: a rank of 8 depth-1 pipelines with sharded AdamW issues no more
collectives per step than a rank of 2, and makes no more groups at start-up (docs/runtime.md, "At scale").

Every block is held by every pipeline, so each bucket has 2 or 8 holders; the code before this round issued one
reduce and one broadcast per holder per bucket tensor (4x more per step at 8 pipelines than at 2) and made one
group per pipeline on every rank. The fake-process-group harness (tests/unit/test_runtime_at_scale.py) counts the
same on the planner's 4096-GPU plans; this is the real gloo world.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from ethpipe.plan import Plan
from ethpipe.runtime.train import TrainConfig, train
from ethpipe.tokens.texts import prepare_tokens

from .comm_log import CommLog, recording
from .harness import run_ranks
from .plans import LLAMA_LIKE, make_plan

pytestmark = pytest.mark.dist

STEPS = 2


def depth_one(num_pipelines: int) -> Plan:
    plan = make_plan(LLAMA_LIKE, [([(r, (0, LLAMA_LIKE.num_layers))], (2,)) for r in range(num_pipelines)])
    return dataclasses.replace(plan, shard_optimizer=True)


def _ranks(rank: int, world_size: int, data: str, out: str) -> None:
    made: Counter = Counter()
    new_group = dist.new_group

    def counting(*args: Any, **kwargs: Any) -> Any:
        group = new_group(*args, **kwargs)
        made["calls"] += 1
        made["member"] += group is not dist.GroupMember.NON_GROUP_MEMBER
        return group

    dist.new_group = counting  # type: ignore[assignment]
    log = CommLog()
    try:
        with recording(log):
            train(depth_one(world_size), TrainConfig(data=data, steps=STEPS, lr=1e-3, progress=False, timeout_s=60.0),
                  rank, world_size)
    finally:
        dist.new_group = new_group  # type: ignore[assignment]
    steps = [Counter(c.fn for c in calls) for calls in log.steps()[1:]]  # after start-up, one per step
    Path(out, f"{world_size}-{rank}.json").write_text(json.dumps({"steps": steps, "groups": made}))


def test_eight_depth_one_pipelines_cost_a_rank_no_more_than_two(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    data = str(tmp_path / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(["eight", "two", "holders", "shard"], size=2000))], data)
    out = tmp_path / "out"
    out.mkdir()
    for world in (2, 8):
        (tmp_path / f"w{world}").mkdir()
        run_ranks(world, _ranks, (data, str(out)), tmp_path / f"w{world}", deadline_s=120.0)
    got = {w: json.loads((out / f"{w}-0.json").read_text()) for w in (2, 8)}
    two, eight = got[2]["steps"], got[8]["steps"]
    assert len(two) >= STEPS  # (a step's all-gather is issued after its stats: it lands in the next list)
    assert eight == two, got  # the same collectives, kind by kind, every step
    assert eight[0]["reduce_scatter_single"] > 0 and "reduce" not in eight[0] and "broadcast" not in eight[0]
    assert got[8]["groups"]["member"] == got[2]["groups"]["member"], got  # its pipeline and its block group
