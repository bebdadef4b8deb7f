"""Checkpoint bookkeeping is O(world) in total: a rank's file-system lookups per save and load do not grow with
the world; rank 0's grow by a few per rank (it alone looks for every rank's files at a save).

The same save and cross-plan load run in a world of 2 and of 6 ranks; every ``os.stat`` / ``os.listdir`` /
``os.scandir`` a rank makes inside ``save_checkpoint`` and ``load_checkpoint`` (DCP's own included) is counted.
The code before this round had every rank list the directory and look for every file, at each save and load.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from ethpipe.runtime.checkpoint.layout import DataCursor, ResumePoint, read_manifest
from ethpipe.runtime.checkpoint.state import load_checkpoint, save_checkpoint

from .harness import run_ranks
from .plans import LLAMA_LIKE, make_plan
from .test_shared_fs import _stage  # distinct keys per rank, with AdamW state

pytestmark = pytest.mark.dist

PLAN = make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6))], (2,))])
CURSOR = DataCursor(next_sample=2, shuffle=False, seed=0, num_samples=100)
LOOKUPS = ("stat", "lstat", "listdir", "scandir")


@contextmanager
def counted(into: Counter) -> Iterator[None]:
    """Count the file-system lookups made inside, by name (``mock.patch`` with ``wraps``: the real calls run)."""
    with ExitStack() as stack:
        mocks = {name: stack.enter_context(mock.patch.object(os, name, wraps=getattr(os, name))) for name in LOOKUPS}
        try:
            yield
        finally:
            into.update({name: m.call_count for name, m in mocks.items()})


def _ranks(rank: int, world_size: int, root: str, out: str) -> None:
    module, optimizer = _stage(rank)
    cpu = torch.device("cpu")
    save, load = Counter(), Counter()
    with counted(save):
        step_dir = save_checkpoint(Path(root), 1, module, optimizer, PLAN, LLAMA_LIKE, CURSOR, keep=3, device=cpu)
    other, other_optimizer = _stage((rank + 1) % world_size)  # as after a re-plan: another rank's keys
    with counted(load):
        load_checkpoint(ResumePoint(1, 2, step_dir, read_manifest(step_dir)), other, other_optimizer, cpu)
    Path(out, f"{world_size}-{rank}.json").write_text(json.dumps({"save": sum(save.values()),
                                                                  "load": sum(load.values())}))


def test_a_ranks_lookups_per_save_and_load_do_not_grow_with_the_world(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    for world in (2, 6):
        root = tmp_path / f"ckpt{world}"
        (tmp_path / f"w{world}").mkdir()
        run_ranks(world, _ranks, (str(root), str(out)), tmp_path / f"w{world}", deadline_s=120.0)
    counts = {(w, r): json.loads((out / f"{w}-{r}.json").read_text()) for w in (2, 6) for r in range(w)}
    for phase in ("save", "load"):
        small, large = ([counts[(w, r)][phase] for r in range(1, w)] for w in (2, 6))
        # every rank but 0: the same few lookups in both worlds (one more where a rank loses the race to create
        # the save's directory: os.makedirs looks again)
        assert max(large) <= max(small) + 1 and max(large) <= 10, (phase, counts)
        grew = counts[(6, 0)][phase] - counts[(2, 0)][phase]
        assert 0 <= grew <= 8 * (6 - 2), (phase, counts)  # rank 0: a few lookups per extra rank at most
    Path(tmp_path, "counts.json").write_text(json.dumps({f"{w}-{r}": c for (w, r), c in counts.items()}))
