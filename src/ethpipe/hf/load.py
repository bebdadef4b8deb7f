"""Reading a Hugging Face model directory (config.json + safetensors, sharded or not) into ethpipe.

``open_hf`` reads only headers: the config, the shard index and each file's tensor table, and
checks them against the config before any rank starts. ``load_stage`` then has each rank open
just the files holding its stage's tensors and ``get_tensor`` just those keys, so no rank ever
loads the whole model; it returns what it read, so that claim is measured, not assumed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from ethpipe.errors import UserError
from ethpipe.hf.config import architecture, read_config, spec_from_hf
from ethpipe.hf.convert import IGNORED, PREFIXES, Source, from_hf, hf_shapes, hf_sources
from ethpipe.model_spec import ModelSpec
from ethpipe.runtime.model.decoder import state_dict_shapes
from ethpipe.runtime.model.tensor_parallel import shard_dim

INDEX = "model.safetensors.index.json"
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class HFCheckpoint:
    """A checked HF directory: its spec, architecture, where every tensor is, and ethpipe's name table."""

    path: Path
    arch: str
    spec: ModelSpec
    tensors: dict[str, TensorInfo]  # every HF key of the files -> file, shape, size
    sources: dict[str, Source]  # ethpipe name -> HF key

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass(frozen=True)
class ReadStats:
    """What one rank read from the checkpoint (``load_stage``)."""

    tensors: int
    bytes: int
    files: int


def _shard_files(path: Path) -> list[Path]:
    index = path / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"'{index}' is not a valid safetensors index (no weight_map): re-save the model") from None
        files = sorted({path / name for name in weight_map.values()})
        missing = [f for f in files if not f.is_file()]
        if missing:
            raise UserError(f"'{missing[0]}' named by {INDEX} is missing: copy the whole model directory")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"'{path}' has no *.safetensors weights: save the model with safe_serialization=True")
    return files


def _read_headers(files: list[Path]) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    shape = tuple(int(d) for d in sl.get_shape())
                    numel = 1
                    for d in shape:
                        numel *= d
                    tensors[key] = TensorInfo(file, shape, numel * _DTYPE_BYTES.get(sl.get_dtype(), 4))
        except (SafetensorError, OSError) as err:
            raise UserError(f"'{file}' is not a readable safetensors file ({str(err).splitlines()[0]}): it is "
                            "truncated or corrupt; copy it again") from None
    return tensors


def _key_prefix(arch: str, tensors: dict[str, TensorInfo]) -> str | None:
    """GPT-2's ``transformer.`` / OPT's ``model.`` where the files' keys carry it, else ""; None: no such prefix."""
    prefix = PREFIXES.get(arch)
    if prefix is None:
        return None
    return prefix if any(k.startswith(prefix) for k in tensors) else ""


def open_hf(path: str | Path) -> HFCheckpoint:
    """Config, spec and tensor table of a HF directory, checked against each other (headers only)."""
    path = Path(path)
    if not path.is_dir():
        raise UserError(f"--init-from '{path}' is not a directory: give a Hugging Face model directory")
    config = read_config(path)
    where = str(path / "config.json")
    arch = architecture(config, where)
    spec = spec_from_hf(config, name=path.resolve().name, where=where)
    tensors = _read_headers(_shard_files(path))
    sources = hf_sources(spec, arch, _key_prefix(arch, tensors))
    want = hf_shapes(spec, sources)
    missing = sorted(set(want) - set(tensors))
    if missing:
        raise UserError(f"'{path}' has no tensor '{missing[0]}' that its config.json ({arch}) needs: the weights "
                        "and the config are of different models")
    tied_head = {"lm_head.weight"} if spec.tie_embeddings else set()
    extra = sorted(k for k in set(tensors) - set(want) - tied_head if not IGNORED.search(k))
    if extra:
        raise UserError(f"'{path}' has tensor '{extra[0]}' that a {arch} model of its config.json does not have: "
                        "the weights and the config are of different models")
    for key, shape in want.items():
        if tensors[key].shape != shape:
            raise UserError(f"'{tensors[key].file}' has '{key}' of shape {list(tensors[key].shape)} but config.json "
                            f"needs {list(shape)}: the weights and the config disagree")
    return HFCheckpoint(path, arch, spec, tensors, sources)


def first_difference(a: ModelSpec, b: ModelSpec) -> str | None:
    """The first field (other than the name) in which two specs differ, or None."""
    if replace(a, name="") == replace(b, name=""):
        return None
    return next(f.name for f in fields(ModelSpec) if f.name != "name" and getattr(a, f.name) != getattr(b, f.name))


def check_init_dir(path: str | Path, spec: ModelSpec) -> HFCheckpoint:
    """``--init-from DIR`` must hold the plan's model exactly (before any rank starts)."""
    ckpt = open_hf(path)
    field = first_difference(ckpt.spec, spec)
    if field is not None:
        raise UserError(f"--init-from '{path}' is a model with {field}={getattr(ckpt.spec, field)!r} but the plan's "
                        f"model has {field}={getattr(spec, field)!r}: plan with --model {path}")
    return ckpt


def _read(ckpt: HFCheckpoint, keys: set[str]) -> tuple[dict[str, torch.Tensor], int]:
    """The HF tensors ``keys``, each file opened once; and how many files were opened."""
    by_file: dict[Path, list[str]] = {}
    for key in sorted(keys):
        by_file.setdefault(ckpt.tensors[key].file, []).append(key)
    read: dict[str, torch.Tensor] = {}
    for file, file_keys in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for key in file_keys:
                read[key] = f.get_tensor(key)
    return read, len(by_file)


def _stored_region(src: Source, name: str, full_shape: tuple[int, ...], tp: Any) -> tuple[slice, ...]:
    """The part of HF tensor ``src.key`` (as stored) that this rank's parameter ``name`` is: ``src.rows`` of a
    fused tensor, then the TP rank's share along ``shard_dim(name)``, swapped back for a transposed key."""
    start = src.rows[0] if src.rows else 0
    region = [slice(start, start + full_shape[0]), *(slice(0, n) for n in full_shape[1:])]
    dim = shard_dim(name) if tp is not None and tp.size > 1 else None
    if dim is not None:
        lo, hi = tp.part(full_shape[dim])
        base = region[dim].start
        region[dim] = slice(base + lo, base + hi)
    return tuple(reversed(region)) if src.transpose else tuple(region)


def load_stage(module: nn.Module, path: str | Path) -> ReadStats:
    """Copy this stage's parameters from a HF directory, one tensor at a time, reading only this rank's part of
    each (a tensor-parallel rank's slice, a fused tensor's rows) through safetensors' slice reads."""
    ckpt = open_hf(path)
    tp = getattr(module, "tp", None)
    full_shapes = state_dict_shapes(ckpt.spec)
    params = module.state_dict()
    num_bytes = 0
    with torch.no_grad():
        for name, param in params.items():  # each read through its own mapping: its pages go with it
            src = ckpt.sources[name]
            with safe_open(str(ckpt.tensors[src.key].file), framework="pt") as f:
                part = f.get_slice(src.key)[_stored_region(src, name, full_shapes[name], tp)]
            param.copy_(part.T if src.transpose else part)
            num_bytes += part.numel() * part.element_size()
            del part
    keys = {ckpt.sources[name].key for name in params}
    return ReadStats(tensors=len(keys), bytes=num_bytes, files=len({ckpt.tensors[k].file for k in keys}))


def load_full(path: str | Path) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    """The whole model as an ethpipe state dict, in this process (conversions and tests)."""
    ckpt = open_hf(path)
    read, _ = _read(ckpt, {s.key for s in ckpt.sources.values()})
    return ckpt.spec, from_hf(list(ckpt.sources), ckpt.sources, read.__getitem__)
