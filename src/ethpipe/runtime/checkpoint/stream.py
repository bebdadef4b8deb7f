"""Whole-model files written one tensor at a time: ``--save-final`` and ``ethpipe export``.

A 70B model is 276 GB in fp32: the writing rank cannot hold it. safetensors' own writer takes every tensor at
once, so ``.safetensors`` files are streamed here in the library's file format (an 8-byte little-endian
header length, a JSON header of dtype / shape / byte offsets, the tensors' bytes in header order); the shapes
and dtypes are known before any tensor is, so the header goes first and each tensor's bytes follow as it
arrives, then is dropped. Files are read back with safetensors itself (tests). A ``.pt`` file is one pickle of
every tensor, so it is built in memory (docs/checkpoints.md says so: use ``.safetensors`` for big models).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ethpipe.atomic import atomic_path

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}

Entry = tuple[str, tuple[int, ...], torch.dtype]


def _header(entries: list[Entry], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, shape, dtype in entries:
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    return text + b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it


def write_safetensors(path: str | Path, entries: list[Entry], tensors: Iterable[tuple[str, torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (name, tensor; in ``entries``' order, each of its shape and dtype) as one safetensors
    file, durably (``atomic_path``), holding one tensor at a time. If writing fails, ``tensors`` is still
    drained before the error is raised: on the writing rank it is a collective's receiving end."""
    it: Iterator[tuple[str, torch.Tensor]] = iter(tensors)
    try:
        with atomic_path(Path(path)) as tmp, open(tmp, "wb") as f:
            header = _header(entries, metadata)
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for name, shape, dtype in entries:
                got, tensor = next(it)
                assert got == name and tuple(tensor.shape) == tuple(shape) and tensor.dtype == dtype, (got, name)
                data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                f.write(memoryview(data.numpy()))
                del data, tensor
    except BaseException:
        for _ in it:  # the senders of the remaining tensors must not wait forever
            pass
        raise
