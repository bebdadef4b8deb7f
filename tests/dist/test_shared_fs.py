"""Checkpoints on node-local disks fail at save and at resume with one line on every rank (issue 10).

One 2-rank world; rank 1's "disk" is another directory (the same --checkpoint-dir resolving to a
different disk on another node). Save: rank 0 writes into the shared dir, rank 1 into its own.
Resume: a checkpoint saved on the shared dir, rank 1 loading (as after a re-plan) what rank 0 saved from a
node-local copy that lacks rank 0's shard (the copy find_resume would not notice when the copy is stale but
complete-looking). Each rank looks only for the files it reads, and rank 0 for every rank's at a save: O(1)
file lookups per rank, O(world) in total.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ethpipe.runtime.checkpoint import shared_fs as ckpt_shared
from ethpipe.runtime.checkpoint.layout import DataCursor, ResumePoint, read_manifest
from ethpipe.runtime.checkpoint.shared_fs import SharedFilesystemError
from ethpipe.runtime.checkpoint.state import load_checkpoint, save_checkpoint

from .harness import run_ranks
from .plans import LLAMA_LIKE, make_plan

pytestmark = pytest.mark.dist

PLAN = make_plan(LLAMA_LIKE, [([(0, (0, 3)), (1, (3, 6))], (2,))])
CURSOR = DataCursor(next_sample=2, shuffle=False, seed=0, num_samples=100)


def _stage(rank: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Distinct keys per rank, so each rank writes a shard of its own; one step makes AdamW state."""
    module = nn.ModuleDict({f"part{rank}": nn.Linear(4, 4)})
    optimizer = torch.optim.AdamW(module.parameters())
    sum(p.sum() for p in module.parameters()).backward()
    optimizer.step()
    return module, optimizer


def _ranks(rank: int, world_size: int, shared: str, local: str, out: str) -> None:
    ckpt_shared.VISIBILITY_WAIT_S = 0.2
    module, optimizer = _stage(rank)
    cpu = torch.device("cpu")
    root = Path(shared if rank == 0 else local)
    with pytest.raises(SharedFilesystemError) as err:
        save_checkpoint(root, 1, module, optimizer, PLAN, LLAMA_LIKE, CURSOR, keep=3, device=cpu)
    Path(out, f"save-{rank}.txt").write_text(str(err.value))
    assert not any(root.iterdir())  # neither the partial save nor a commit is left on either "disk"

    step_dir = save_checkpoint(Path(shared), 2, module, optimizer, PLAN, LLAMA_LIKE, CURSOR, keep=3, device=cpu)
    manifest = read_manifest(step_dir)
    load_checkpoint(ResumePoint(2, 2, step_dir, manifest), module, optimizer, cpu)  # shared: loads
    if rank == 1:
        copy = Path(local) / step_dir.name
        shutil.copytree(step_dir, copy)
        (copy / "__0_0.distcp").unlink()
        step_dir = copy
    dist.barrier()
    other, other_optimizer = _stage(1 - rank)  # as after a re-plan: each rank now holds what the other saved
    with pytest.raises(SharedFilesystemError) as err:
        load_checkpoint(ResumePoint(2, 2, step_dir, manifest), other, other_optimizer, cpu)
    Path(out, f"resume-{rank}.txt").write_text(str(err.value))


def test_node_local_checkpoint_dir_fails_at_save_and_resume_on_every_rank(tmp_path: Path) -> None:
    shared, local, out = tmp_path / "shared", tmp_path / "node1", tmp_path / "out"
    for d in (shared, local, out):
        d.mkdir()
    run_ranks(2, _ranks, (str(shared), str(local), str(out)), tmp_path, deadline_s=120.0)
    hint = "use a shared filesystem (NFS, Lustre, ...) for --checkpoint-dir"
    save = {(out / f"save-{r}.txt").read_text() for r in range(2)}
    assert save == {f"checkpoint dir '{shared}' is not on a filesystem shared by all ranks: rank 0 cannot see "
                    f"rank 1's file '__1_0.distcp'; {hint}"}
    resume = {(out / f"resume-{r}.txt").read_text() for r in range(2)}
    assert resume == {f"checkpoint dir '{shared}' is not on a filesystem shared by all ranks: rank 1 cannot see "
                      f"rank 0's file '__0_0.distcp'; {hint}"}
    assert [p.name for p in shared.iterdir()] and not (shared / "step-00000001").exists()
