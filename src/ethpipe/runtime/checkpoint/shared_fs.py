"""Checkpoints need one filesystem that every rank sees: check it when saving and before loading.

Each rank writes its own shards and rank 0 commits the directory, so on node-local disks a save
"succeeds" while every node holds a different part of it, and the resume fails much later with a
missing file. After the shards are written (and before a resume loads), every rank reports the
files it can see; if some rank cannot see a file another rank sees, every rank raises the same
one-line error. A lookup is retried for a moment so a network filesystem's attribute cache
(NFS ``acdirmin``) is not mistaken for a private disk.
"""

from __future__ import annotations

import re
import time
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ethpipe.errors import UserError

VISIBILITY_WAIT_S = 2.0  # how long a rank keeps looking for a file another rank sees
_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's FileSystemWriter: __<rank>_<i>.distcp


class SharedFilesystemError(UserError):
    """The checkpoint directory is not one filesystem for all ranks (a user error: pick another dir)."""


def _holder(name: str, seen: Sequence[Collection[str]]) -> int:
    """The rank that wrote ``name`` (DCP names shards by rank; the coordinator writes the rest), else the
    lowest rank that sees it."""
    match = _SHARD_RE.match(name)
    writer = int(match.group(1)) if match else 0
    if writer < len(seen) and name in seen[writer]:
        return writer
    return min(r for r, mine in enumerate(seen) if name in mine)


def visibility_error(root: str, seen: Sequence[Collection[str]]) -> SharedFilesystemError | None:
    """``seen[r]``: the file names rank r sees. None when every rank sees every file some rank sees."""
    every = set().union(*seen)
    for rank, mine in enumerate(seen):
        missing = sorted(every - set(mine))
        if missing:
            name = missing[0]
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            return SharedFilesystemError(
                f"checkpoint dir '{root}' is not on a filesystem shared by all ranks: rank {rank} cannot see rank "
                f"{_holder(name, seen)}'s file '{name}'{more}; use a shared filesystem (NFS, Lustre, ...) for "
                "--checkpoint-dir")
    return None


def _listing(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file()) if directory.is_dir() else []


def _visible(directory: Path, names: Collection[str], wait_s: float) -> list[str]:
    """The names this rank finds in ``directory``, looking again for missing ones for up to ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while True:
        found = [n for n in sorted(names) if (directory / n).is_file()]
        if len(found) == len(names) or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def check_shared(root: Path, directory: Path, names: Collection[str] | None = None,
                 group: dist.ProcessGroup | None = None) -> list[str]:
    """Collective over the world: every rank sees ``names`` in ``directory`` (default: every file any
    rank lists there). Returns the names, sorted and the same on every rank; raises the same
    ``SharedFilesystemError`` on every rank otherwise (``root`` as rank 0 names it)."""
    world = dist.get_world_size()
    if names is None:
        listings: list[Any] = [None] * world
        dist.all_gather_object(listings, _listing(directory), group=group)
        names = set().union(*listings)
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, (str(root), _visible(directory, names, VISIBILITY_WAIT_S)), group=group)
    error = visibility_error(parts[0][0], [set(seen) for _, seen in parts])
    if error is not None:
        raise error
    return sorted(names)
