"""Held-out tokens for the validation loss: the tail of a prepared token file, cut at a document boundary.

``ethpipe data prepare --val-fraction F`` writes the whole token stream, then moves its last ``F`` (from the first
document separator at or after the cut, so no document is split between the two files) into ``<name>.val.bin``
with its own sidecar, and shortens the training file to what is left. The validation file is written (atomically)
before the training file is cut, so an interrupted split leaves the full training file and at most a stray
validation file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from ethpipe.atomic import atomic_path, write_bytes_atomic
from ethpipe.errors import UserError
from ethpipe.tokens.format import documents_path, sidecar_path

SCAN_TOKENS = 1 << 20  # how far past the cut a separator is looked for, in tokens, one chunk at a time


def val_path(out: Path) -> Path:
    """``tokens.bin`` -> ``tokens.val.bin``."""
    return out.with_name(f"{out.stem}.val{out.suffix or '.bin'}")


def _boundary(tokens: np.ndarray, cut: int, separator: np.ndarray) -> int:
    """The first index at or after ``cut`` where a document starts (just past a separator), else ``cut``."""
    n = len(separator)
    for lo in range(max(0, cut - n + 1), len(tokens), SCAN_TOKENS):
        chunk = np.asarray(tokens[lo:lo + SCAN_TOKENS + n - 1])
        if n == 1:
            hits = np.flatnonzero(chunk == separator[0])
        else:
            windows = np.lib.stride_tricks.sliding_window_view(chunk, n)
            hits = np.flatnonzero((windows == separator).all(axis=1))
        for hit in hits:
            end = lo + int(hit) + n
            if end >= cut:
                return end if end < len(tokens) else cut
        if lo + SCAN_TOKENS >= len(tokens):
            break
    return cut


def split_validation(out: Path, fraction: float) -> tuple[int, int]:
    """Move the last ``fraction`` of ``out``'s tokens into ``val_path(out)``; (training, validation) token counts."""
    if not 0.0 < fraction < 1.0:
        raise UserError(f"--val-fraction must be between 0 and 1 (exclusive), got {fraction}")
    meta = json.loads(sidecar_path(out).read_text())
    dtype = np.dtype(meta["dtype"])
    tokens = np.memmap(out, dtype=dtype, mode="r")
    total = len(tokens)
    separator = np.asarray([meta["eos_id"]] if "eos_id" in meta else list(b"\n\n"), dtype=dtype)
    cut = _boundary(tokens, int(round(total * (1.0 - fraction))), separator)
    if cut < 2 or total - cut < 2:
        raise UserError(f"--val-fraction {fraction} of {total} tokens leaves too little for training or validation: "
                        "give more text or another fraction")
    target = val_path(out)
    with atomic_path(target) as tmp, open(tmp, "wb") as f:
        for lo in range(cut, total, SCAN_TOKENS):
            f.write(np.asarray(tokens[lo:min(total, lo + SCAN_TOKENS)]).tobytes())
    docs = documents_path(out)
    starts = np.fromfile(docs, dtype=np.int64) if docs.is_file() else None
    val_meta, train_meta = {**meta, "num_tokens": total - cut}, {**meta, "num_tokens": cut}
    if starts is not None:  # the document index, cut where the tokens are (the cut is a document's start)
        held = starts[starts >= cut] - cut
        if not held.size or held[0] != 0:  # cut inside a document (no separator near): its tail is one of its own
            held = np.concatenate([np.zeros(1, dtype=np.int64), held])
        write_bytes_atomic(documents_path(target), held.tobytes())
        val_meta["num_documents"], train_meta["num_documents"] = len(held), int((starts < cut).sum())
    write_bytes_atomic(sidecar_path(target), json.dumps(val_meta).encode())
    del tokens
    os.truncate(out, cut * dtype.itemsize)
    if starts is not None:
        write_bytes_atomic(docs, starts[starts < cut].tobytes())
    write_bytes_atomic(sidecar_path(out), json.dumps(train_meta).encode())
    return cut, total - cut
