"""Writing a Hugging Face model directory: config.json, sharded safetensors, model.safetensors.index.json,
and for publishing generation_config.json and the tokenizer files (``hf/publish.py``).

The directory is assembled under a temporary name beside ``out`` and renamed onto it only when
every file is written and flushed, so a crash never leaves a directory that looks loadable but
misses a shard.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ethpipe.atomic import fsync_path
from ethpipe.errors import UserError
from ethpipe.hf.config import hf_architecture_of, hf_config_from_spec
from ethpipe.hf.convert import hf_shapes, hf_sources, to_hf
from ethpipe.hf.load import INDEX
from ethpipe.hf.publish import DTYPES, GENERATION_CONFIG, SourceModel, export_dtype, read_source, tokenizer_files
from ethpipe.model_spec import ModelSpec
from ethpipe.units import runs_of_bytes

DEFAULT_MAX_SHARD = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_TORCH_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.bfloat16: "bfloat16",
                 torch.float16: "float16"}
_NAMED_DTYPES = {name: dtype for dtype, name in _TORCH_DTYPES.items()}


@dataclass(frozen=True)
class ExportReport:
    arch: str
    shards: int
    total_bytes: int
    dtype: str  # config.json's name of the weights' dtype
    source: SourceModel | None = None  # where the token ids and generation config came from
    tokenizer_files: tuple[str, ...] = ()


def parse_size(text: str) -> int:
    """'5GB' (10**9, as transformers), '500MiB', or plain bytes -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise UserError(f"--max-shard-size {text!r} is not a size: use e.g. 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def _shards(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """HF keys in order, cut into shards of at most ``max_bytes`` (a bigger tensor gets a shard of its own)."""
    return runs_of_bytes(list(sizes), sizes.__getitem__, max_bytes)


def check_out_dir(out: str | Path) -> None:
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out '{out}' already exists and is not an empty directory: choose a new directory")


def _umask() -> int:
    """The process umask (os.umask can only be read by setting it; restored at once)."""
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _weights_dtype(state: Mapping[str, torch.Tensor], dtype: str | None) -> torch.dtype:
    """``--dtype``'s torch dtype; None keeps the state's own (library callers that cast themselves)."""
    if dtype is None:
        return next(iter(state.values())).dtype
    return _NAMED_DTYPES[DTYPES[export_dtype(dtype, None)]]


def _check_range(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """fp16 tops out at 65504: an overflowed weight would load as inf and wreck every logit."""
    if dtype != torch.float16:
        return
    bad = next((k for k, t in tensors.items() if not bool(torch.isfinite(t).all())), None)
    if bad is not None:
        raise UserError(f"tensor '{bad}' does not fit fp16 (|value| > 65504, or not finite): export with --dtype "
                        "bf16 or fp32")


def export_hf(state: Mapping[str, torch.Tensor], spec: ModelSpec, out: str | Path,
              max_shard_size: str = DEFAULT_MAX_SHARD, dtype: str | None = None, source: str | Path | None = None,
              tokenizer: str | Path | None = None) -> ExportReport:
    """Write ``state`` (ethpipe global names) as a HF directory that ``from_pretrained`` loads.

    ``dtype``: bf16 / fp16 / fp32 weights (None: the state's own dtype). ``source``: the HF directory the
    model came from, whose bos/eos/pad ids and generation_config.json are carried over. ``tokenizer``: a
    directory whose tokenizer files are copied in. Files get the mode a plain ``open`` would give. Shards are
    cut from the shapes alone and written one at a time, reading only that shard's tensors from ``state``
    (a lazy checkpoint mapping: ``checkpoint/weights.py``), so one output shard is in memory at a time.
    """
    out = Path(out)
    max_bytes = parse_size(max_shard_size)
    arch = hf_architecture_of(spec)
    check_out_dir(out)
    target = _weights_dtype(state, dtype)
    src = read_source(source, spec) if source is not None else None
    tok_files = tokenizer_files(tokenizer) if tokenizer is not None else []
    sources = hf_sources(spec, arch)
    unknown = next((name for name in state if name not in sources), None)
    if unknown is not None:
        raise UserError(f"parameter '{unknown}' has no Hugging Face counterpart: export with --format ethpipe")
    itemsize = torch.empty((), dtype=target).element_size()
    sizes = {key: math.prod(shape) * itemsize for key, shape in hf_shapes(spec, sources).items()}
    dtype_name = _TORCH_DTYPES.get(target, "float32")
    config = hf_config_from_spec(spec, dtype_name, src.token_ids if src else None)
    shards = _shards(sizes, max_bytes)
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        for name, keys in zip(names, shards):
            wanted = set(keys)
            tensors = to_hf({n: state[n] for n in state if sources[n].key in wanted}, sources, target)
            _check_range(tensors, target)
            save_file({k: tensors[k] for k in keys}, str(tmp / name), metadata={"format": "pt"})
            del tensors
        total = sum(sizes.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if src is not None:
            (tmp / GENERATION_CONFIG).write_text(src.generation_config)
        for file in tok_files:
            shutil.copyfile(file, tmp / file.name)
        umask = _umask()
        for file in tmp.iterdir():
            os.chmod(file, 0o666 & ~umask)  # safetensors writes 0600
            fsync_path(file)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; give what mkdir would
        fsync_path(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above); rename cannot replace a directory portably
        os.replace(tmp, out)
        fsync_path(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return ExportReport(arch, len(shards), total, dtype_name, src, tuple(f.name for f in tok_files))
