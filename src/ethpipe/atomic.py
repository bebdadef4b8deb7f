"""Atomic file output: a crash or an error never leaves a half-written file behind.

Every output of ethpipe (plans, profiles, token files, weights, pictures, checkpoint manifests)
goes through here: write to a temporary name in the same directory, fsync it, ``os.replace`` it
onto the final name, fsync the directory. Without the two fsyncs a power cut after the rename
can leave an empty or missing file although the command reported success.
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


def fsync_path(path: str | Path) -> None:
    """Flush a file's data, or a directory's entries (a rename is durable only once its directory is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | Path, *, tmp_prefix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; it durably replaces ``path`` only if the block succeeds.

    The temporary name keeps ``path``'s suffix, so writers that choose a format by extension
    (matplotlib, safetensors) behave as for the final name. ``tmp_prefix`` lets a caller that
    sweeps leftovers of killed writes (checkpoints: ``.tmp-``) recognise them.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{path.name}." if tmp_prefix is None else tmp_prefix
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=f".tmp{path.suffix}")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.chmod(tmp, _default_mode())
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes_atomic(path: str | Path, payload: bytes, *, tmp_prefix: str | None = None) -> None:
    with atomic_path(path, tmp_prefix=tmp_prefix) as tmp:
        tmp.write_bytes(payload)


def write_text_atomic(path: str | Path, text: str, *, tmp_prefix: str | None = None) -> None:
    with atomic_path(path, tmp_prefix=tmp_prefix) as tmp:
        tmp.write_text(text)
