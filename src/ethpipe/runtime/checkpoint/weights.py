"""A checkpoint's model weights, read one tensor at a time (``ethpipe export``, library callers).

``consolidated_weights`` verifies the checkpoint (manifest, files, crc32 of every file, the model's shapes)
and returns a read-only mapping from global names to tensors that reads a tensor from DCP's files only when
it is asked for (DCP reads exactly that tensor's bytes), so a caller that streams (``export_checkpoint`` to
``.safetensors``, the Hugging Face export's shards) holds one tensor, or one output shard, at a time.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from ethpipe.model_spec import ModelSpec, spec_from_dict
from ethpipe.runtime.checkpoint.consolidated import save_atomic
from ethpipe.runtime.checkpoint.layout import (
    Manifest, check_files, check_model, corrupt_error, corrupt_files, read_manifest, resolve_checkpoint,
)
from ethpipe.runtime.checkpoint.stream import write_safetensors
from ethpipe.runtime.model.decoder import state_dict_shapes


class CheckpointWeights(Mapping[str, torch.Tensor]):
    """Global name -> tensor, each read from the checkpoint when asked for (never cached)."""

    def __init__(self, step_dir: Path, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype]) -> None:
        self.step_dir, self.shapes, self.dtypes = step_dir, shapes, dtypes

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.shapes:
            raise KeyError(name)
        out = {name: torch.empty(self.shapes[name], dtype=self.dtypes[name])}
        with warnings.catch_warnings():  # DCP warns that it loads in one process: that is the intent here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(out, storage_reader=FileSystemReader(str(self.step_dir)), no_dist=True)
        return out[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def consolidated_weights(path: str | Path) -> tuple[Manifest, ModelSpec, CheckpointWeights]:
    """A checkpoint's model weights (global names, read lazily), checksums verified first."""
    step_dir = resolve_checkpoint(path)
    manifest = read_manifest(step_dir)
    metadata = check_files(step_dir, manifest)
    spec = spec_from_dict(manifest.model_spec)
    check_model(step_dir, metadata, spec)
    bad = corrupt_files(step_dir, manifest, sorted(manifest.files))
    if bad:
        raise corrupt_error(step_dir, bad[0])
    entries = metadata.state_dict_metadata
    shapes = state_dict_shapes(spec)
    dtypes = {name: entries[name].properties.dtype for name in shapes}  # type: ignore[union-attr]
    return manifest, spec, CheckpointWeights(step_dir, shapes, dtypes)


def export_checkpoint(path: str | Path, out: str | Path) -> Manifest:
    """Consolidate a checkpoint's model weights into one state-dict file (global names), in this process: a
    ``.safetensors`` file streamed one tensor at a time, a ``.pt`` pickle built whole (it needs every tensor)."""
    manifest, _, weights = consolidated_weights(path)
    if Path(out).suffix == ".safetensors":
        entries = [(name, shape, weights.dtypes[name]) for name, shape in weights.shapes.items()]
        write_safetensors(out, entries, ((name, weights[name]) for name in weights))
    else:
        save_atomic(dict(weights), out)
    return manifest
