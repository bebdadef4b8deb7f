"""Held-out tokens for the validation loss: the tail of a prepared token file, cut at a document boundary.

``ethpipe data prepare --val-fraction F`` writes the whole token stream, then moves its last ``F`` (from the first
document that starts at or after the cut, by the document index it wrote, so no document is split between the two
files) into ``<name>.val.bin`` with its own sidecar and index, and shortens the training file to what is left. The validation file is written (atomically)
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

COPY_TOKENS = 1 << 20  # the held-out tail is copied this many tokens at a time


def val_path(out: Path) -> Path:
    """``tokens.bin`` -> ``tokens.val.bin``."""
    return out.with_name(f"{out.stem}.val{out.suffix or '.bin'}")


def split_validation(out: Path, fraction: float) -> tuple[int, int]:
    """Move the last ``fraction`` of ``out``'s tokens into ``val_path(out)``; (training, validation) token counts."""
    if not 0.0 < fraction < 1.0:
        raise UserError(f"--val-fraction must be between 0 and 1 (exclusive), got {fraction}")
    meta = json.loads(sidecar_path(out).read_text())
    dtype = np.dtype(meta["dtype"])
    tokens = np.memmap(out, dtype=dtype, mode="r")
    total = len(tokens)
    docs = documents_path(out)
    starts = np.fromfile(docs, dtype=np.int64)  # ``write_tokens`` wrote it: each document's first token
    want = int(round(total * (1.0 - fraction)))
    later = starts[starts >= want]
    cut = int(later[0]) if later.size else want  # the first document that starts at or after the cut
    if cut < 2 or total - cut < 2:
        raise UserError(f"--val-fraction {fraction} of {total} tokens leaves too little for training or validation: "
                        "give more text or another fraction")
    target = val_path(out)
    with atomic_path(target) as tmp, open(tmp, "wb") as f:
        for lo in range(cut, total, COPY_TOKENS):
            f.write(np.asarray(tokens[lo:min(total, lo + COPY_TOKENS)]).tobytes())
    held = starts[starts >= cut] - cut  # the document index, cut where the tokens are
    if not held.size or held[0] != 0:  # cut inside a document (none starts after it): its tail is one of its own
        held = np.concatenate([np.zeros(1, dtype=np.int64), held])
    write_bytes_atomic(documents_path(target), held.tobytes())
    val_meta = {**meta, "num_tokens": total - cut, "num_documents": len(held)}
    train_meta = {**meta, "num_tokens": cut, "num_documents": int((starts < cut).sum())}
    write_bytes_atomic(sidecar_path(target), json.dumps(val_meta).encode())
    del tokens
    os.truncate(out, cut * dtype.itemsize)
    write_bytes_atomic(docs, starts[starts < cut].tobytes())
    write_bytes_atomic(sidecar_path(out), json.dumps(train_meta).encode())
    return cut, total - cut
