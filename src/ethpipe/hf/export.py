"""Writing a Hugging Face model directory: config.json, sharded safetensors, model.safetensors.index.json.

The directory is assembled under a temporary name beside ``out`` and renamed onto it only when
every file is written and flushed, so a crash never leaves a directory that looks loadable but
misses a shard.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ethpipe.atomic import fsync_path
from ethpipe.errors import UserError
from ethpipe.hf.config import hf_architecture_of, hf_config_from_spec
from ethpipe.hf.convert import hf_sources, to_hf
from ethpipe.hf.load import INDEX
from ethpipe.model_spec import ModelSpec
from ethpipe.units import runs_of_bytes

DEFAULT_MAX_SHARD = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_TORCH_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
                 torch.float16: "float16"}


@dataclass(frozen=True)
class ExportReport:
    arch: str
    shards: int
    total_bytes: int


def parse_size(text: str) -> int:
    """'5GB' (10**9, as transformers), '500MiB', or plain bytes -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise UserError(f"--max-shard-size {text!r} is not a size: use e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Keys in order, cut into shards of at most ``max_bytes`` (a bigger tensor gets a shard of its own)."""
    return runs_of_bytes(list(tensors), lambda k: tensors[k].numel() * tensors[k].element_size(), max_bytes)


def check_out_dir(out: str | Path) -> None:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out '{out}' already exists and is not an empty directory: choose a new directory")


def export_hf(state: dict[str, torch.Tensor], spec: ModelSpec, out: str | Path,
              max_shard_size: str = DEFAULT_MAX_SHARD) -> ExportReport:
    """Write ``state`` (ethpipe global names) as a HF directory that ``from_pretrained`` loads."""
    out = Path(out)
    max_bytes = parse_size(max_shard_size)
    arch = hf_architecture_of(spec)
    check_out_dir(out)
    tensors = to_hf(state, hf_sources(spec, arch))
    dtype = next(iter(state.values())).dtype
    config = hf_config_from_spec(spec, _TORCH_DTYPES.get(dtype, "float32"))
    shards = _shards(tensors, max_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        for name, keys in zip(names, shards):
            save_file({k: tensors[k] for k in keys}, str(tmp / name), metadata={"format": "pt"})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for file in tmp.iterdir():
            fsync_path(file)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; give what mkdir would
        fsync_path(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above); rename cannot replace a directory portably
        os.replace(tmp, out)
        fsync_path(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportReport(arch, len(shards), total)
