"""The token file format shared by its writer (``ethpipe data prepare``) and its reader (the runtime).

A token file is nanoGPT's ``.bin`` (a flat uint16/uint32 array); its ``.bin.json`` sidecar records the
dtype and vocabulary (and EOS id).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MAX_UINT16_VOCAB = 65536


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (nanoGPT's choice), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= MAX_UINT16_VOCAB else np.uint32)


def sidecar_path(path: Path) -> Path:
    """The ``.bin.json`` beside a token file: its dtype and vocabulary (and EOS id)."""
    return path.with_name(path.name + ".json")


def documents_path(path: Path) -> Path:
    """The ``.bin.docs`` beside a token file: each document's first token offset (int64), for samples that start
    at a document (``train --samples documents``)."""
    return path.with_name(path.name + ".docs")

