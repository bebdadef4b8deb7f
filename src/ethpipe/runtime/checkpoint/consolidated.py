"""Consolidated state dicts keyed by global parameter names (``--init-from`` / ``--save-final``).

The names of ``build_full_model(spec).state_dict()`` are the contract, so a file written by a
pipelined run loads into a plain single-process model and vice versa. ``.safetensors`` files
are read lazily (each stage reads only its own tensors); anything else goes through
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ethpipe.atomic import atomic_path
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec
from ethpipe.plan import Plan
from ethpipe.sublayers import unit_of_parameter
from ethpipe.runtime.checkpoint.stream import write_safetensors
from ethpipe.runtime.model.decoder import state_dict_shapes
from ethpipe.runtime.model.tensor_parallel import gather_full, local_slice, shard_dim


def _is_safetensors(path: Path) -> bool:
    return path.suffix == ".safetensors"


def checkpoint_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--init-from file '{path}' not found")
    try:
        if _is_safetensors(path):
            with safe_open(str(path), framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # shapes only: nothing read
    except Exception as err:  # noqa: BLE001 - any unreadable file is the same user error
        raise UserError(f"--init-from file '{path}' is not a readable state dict: {str(err).splitlines()[0]}") from None
    if not isinstance(state, dict):
        raise UserError(f"--init-from file '{path}' does not hold a state dict (name -> tensor)")
    return {k: tuple(v.shape) for k, v in state.items()}


def check_checkpoint(path: str | Path, spec: ModelSpec) -> None:
    """The file must hold exactly the model's parameters with the model's shapes; a directory is a
    Hugging Face model whose config.json must describe the plan's model (ethpipe.hf.load)."""
    if Path(path).is_dir():
        from ethpipe.hf.load import check_init_dir

        check_init_dir(path, spec)
        return
    have = checkpoint_shapes(path)
    want = state_dict_shapes(spec)
    missing = sorted(set(want) - set(have))
    if missing:
        raise UserError(f"--init-from file '{path}' has no parameter '{missing[0]}': it is not a '{spec.name}' model")
    extra = sorted(set(have) - set(want))
    if extra:
        raise UserError(f"--init-from file '{path}' has parameter '{extra[0]}' that model '{spec.name}' does not have")
    for name, shape in want.items():
        if have[name] != shape:
            raise UserError(
                f"--init-from file '{path}' has '{name}' of shape {list(have[name])} but model '{spec.name}' "
                f"needs {list(shape)}: it was saved from another model shape"
            )


def load_into(module: nn.Module, path: str | Path) -> None:
    """Copy this module's own parameters from a consolidated file (names are global) or a HF directory."""
    path = Path(path)
    if path.is_dir():
        from ethpipe.hf.load import load_stage

        load_stage(module, path)
        return
    tp = getattr(module, "tp", None)
    params = module.state_dict()
    with torch.no_grad():
        if _is_safetensors(path):
            for name, param in params.items():  # this rank's slice, through its own mapping: its pages go with it
                with safe_open(str(path), framework="pt") as f:
                    param.copy_(_slice_read(f.get_slice(name), name, tp))
            return
        # A .pt mapping costs a parse of the whole pickle (60 ms for 723 tensors), so it is re-made only before a
        # read would take the pages read through it past the largest tensor's bytes (a row-parallel slice touches
        # every page of its tensor): about one tensor's pages are resident at a time, never the file's.
        state: dict[str, torch.Tensor] | None = None
        touched = budget = 0
        for name, param in params.items():
            if state is None:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
                budget = budget or max(state[n].numel() * state[n].element_size() for n in params)
            nbytes = state[name].numel() * state[name].element_size()
            if touched and touched + nbytes > budget:
                state, touched = torch.load(path, map_location="cpu", weights_only=True, mmap=True), 0
            param.copy_(local_slice(state[name], name, tp))
            touched += nbytes


def _slice_read(full: Any, name: str, tp: Any) -> torch.Tensor:
    """This TP rank's part of a safetensors slice, read as that part only (``local_slice`` on the file)."""
    dim = shard_dim(name)
    if tp is None or tp.size == 1 or dim is None:
        return full[:]
    start, end = tp.part(full.get_shape()[dim])
    return full[start:end] if dim == 0 else full[:, start:end]


def save_atomic(state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Write durably via ``atomic_path`` (fsync, rename, directory fsync): a crash never leaves half a file."""
    path = Path(path)
    tensors = {k: _own_cpu(v) for k, v in state.items()}
    with atomic_path(path) as tmp:
        if _is_safetensors(path):
            save_file(tensors, str(tmp))
        else:
            torch.save(tensors, tmp)


def owner_stage(plan: Plan, name: str) -> int:
    """The stage of pipeline 0 that holds global parameter ``name`` (a tied matrix: the first stage's copy)."""
    stages = plan.pipelines[0].stages
    if name.startswith("layers."):
        unit = unit_of_parameter(name, plan.sublayers)
        return next(i for i, s in enumerate(stages) if s.holds(unit))
    return 0 if name.startswith(("tok_emb.", "pos_emb.")) else len(stages) - 1


def consolidated_tensors(module: nn.Module, plan: Plan, rank: int, spec: ModelSpec,
                         group: dist.ProcessGroup | None) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Every tensor of the consolidated state dict, one at a time, as (name, CPU tensor) on rank 0 (the tensor
    is None elsewhere): every rank must drain the iterator, in step with rank 0.

    Each comes from the pipeline-0 stage holding it (a tensor-parallel stage gathers its slices over its
    TP group first: one global tensor on its devices at a time, and its first TP rank sends) as a CPU tensor
    over ``group`` (gloo): no object collective, no pickled state in GPU memory, and no rank holds more than
    one tensor in flight. Every rank walks the names in the same order, so the sends pair with rank 0's
    receives one by one.
    """
    tp = getattr(module, "tp", None)
    local = module.state_dict()
    dtype = next(module.parameters()).dtype
    for name, shape in state_dict_shapes(spec).items():
        stage = plan.pipelines[0].stages[owner_stage(plan, name)]
        owner = 0 if 0 in stage.ranks else stage.ranks[0]
        full = gather_full(local[name].detach(), name, tp) if rank in stage.ranks else None  # TP: collective
        if rank == owner == 0:
            assert full is not None
            yield name, _own_cpu(full)
        elif rank == owner:
            assert full is not None
            dist.send(full.to("cpu").contiguous(), dst=0, group=group)
            yield name, None
        elif rank == 0:
            buf = torch.empty(shape, dtype=dtype)
            dist.recv(buf, src=owner, group=group)
            yield name, buf
        else:
            yield name, None


def save_consolidated(module: nn.Module, plan: Plan, rank: int, spec: ModelSpec, group: dist.ProcessGroup | None,
                      path: str | Path) -> None:
    """``--save-final``: collective; rank 0 writes. A ``.safetensors`` file is streamed (stream.py: one tensor
    in memory at a time); a ``.pt`` pickle needs every tensor at once, so rank 0 holds the model once."""
    tensors = consolidated_tensors(module, plan, rank, spec, group)
    if rank != 0:
        for _ in tensors:
            pass
        return
    dtype = next(module.parameters()).dtype
    if _is_safetensors(Path(path)):
        entries = [(name, shape, dtype) for name, shape in state_dict_shapes(spec).items()]
        write_safetensors(path, entries, ((n, t) for n, t in tensors if t is not None))
        return
    state = {name: t for name, t in tensors if t is not None}
    save_atomic(state, path)


def _own_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns exactly its elements: copied only where it is a device tensor, a non-contiguous one
    or a view into a larger storage (a parameter living in a sync bucket's flat buffer), so a state already on the
    CPU is written without a second copy of the model."""
    out = tensor.detach().to("cpu").contiguous()
    if out.storage_offset() or out.untyped_storage().nbytes() != out.numel() * out.element_size():
        out = out.clone()
    return out
