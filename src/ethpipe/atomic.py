"""Atomic file output: a crash or an error never leaves a half-written file behind.

Every output of ethpipe (plans, profiles, token files, weights, pictures) goes through here:
write to a temporary name in the same directory, then ``os.replace`` onto the final name.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _default_mode() -> int:
    """The permissions a plain ``open`` would give (``mkstemp`` makes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; it replaces ``path`` only if the block succeeds.

    The temporary name keeps ``path``'s suffix, so writers that choose a format by extension
    (matplotlib, safetensors) behave as for the final name.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=f".tmp{path.suffix}")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, _default_mode())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: str | Path, payload: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(payload)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
