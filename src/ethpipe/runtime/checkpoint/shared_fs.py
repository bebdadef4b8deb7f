"""Checkpoints need one filesystem that every rank sees: check it when saving and before loading.

Each rank writes its own shards and rank 0 commits the directory, so on node-local disks a save
"succeeds" while every node holds a different part of it, and the resume fails much later with a
missing file. The check is O(world) in total, not per rank: at a save every rank looks for rank 0's
files only and reports the files it wrote; rank 0 looks for every rank's files; at a load every rank
looks for the files it will read. Rank 0 gathers the reports (``settle_on_rank0``: one gather to it, one
broadcast of its verdict), so every rank raises the same one-line error. A lookup is retried for a
moment so a network filesystem's attribute cache (NFS ``acdirmin``) is not mistaken for a private disk.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ethpipe.errors import UserError

VISIBILITY_WAIT_S = 2.0  # how long a rank keeps looking for a file another rank sees
_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's FileSystemWriter: __<rank>_<i>.distcp


class SharedFilesystemError(UserError):
    """The checkpoint directory is not one filesystem for all ranks (a user error: pick another dir)."""


def _visible(directory: Path, names: Collection[str], wait_s: float) -> list[str]:
    """The names this rank finds in ``directory``, looking again for missing ones for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [n for n in sorted(names) if (directory / n).is_file()]
        if len(found) == len(names) or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def missing(directory: Path, names: Collection[str], wait_s: float | None = None) -> list[str]:
    """The names this rank cannot see in ``directory`` (after looking again for ``wait_s``)."""
    seen = set(_visible(directory, names, VISIBILITY_WAIT_S if wait_s is None else wait_s))
    return sorted(n for n in names if n not in seen)


def writer_of(name: str, writers: Mapping[str, int] | None = None) -> int:
    """The rank that wrote ``name``: as reported, else DCP's shard name, else the coordinator (rank 0)."""
    if writers is not None and name in writers:
        return writers[name]
    match = _SHARD_RE.match(name)
    return int(match.group(1)) if match else 0


def blind_error(root: str, blind: Sequence[tuple[int, Sequence[str]]],
                writers: Mapping[str, int] | None = None) -> SharedFilesystemError | None:
    """``blind``: (rank, the names it cannot see) in report order; the first rank with any names is named."""
    for rank, names in blind:
        if names:
            name = sorted(names)[0]
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            return SharedFilesystemError(
                f"checkpoint dir '{root}' is not on a filesystem shared by all ranks: rank {rank} cannot see rank "
                f"{writer_of(name, writers)}'s file '{name}'{more}; use a shared filesystem (NFS, Lustre, ...) for "
                "--checkpoint-dir")
    return None


def settle_on_rank0(report: Any, decide: Callable[[list[Any]], Any], group: dist.ProcessGroup | None) -> Any:
    """Every rank's ``report`` to rank 0, which ``decide``s from all of them; every rank returns the verdict.
    One ``gather_object`` and one ``broadcast_object_list``: O(1) messages per rank, O(world) on rank 0."""
    rank = dist.get_rank()
    reports: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(report, reports, dst=0, group=group)
    verdict: list[Any] = [decide(reports) if reports is not None else None]
    dist.broadcast_object_list(verdict, src=0, group=group)
    return verdict[0]
