"""A tensor-parallel stage's checkpoint pieces: each TP rank saves and loads its own slice by offset.

Checkpoints hold global tensors under global names (``state.py``), but no rank ever builds one: a TP rank
hands DCP its slice as a ``DTensor`` sharded over the stage's TP group (``Shard(shard_dim)``), so DCP
writes the slice at its offset in the global tensor and, at load, reads exactly the bytes of the slice
from whatever pieces the writing plan left (a whole tensor of a tp-1 stage, or slices of another degree).
The mesh only tells DCP the rank's coordinate: DCP's own collectives run over the group it is given.

One chunking per key: DCP deduplicates identical pieces of replicas, but a whole tensor from a tp-1
pipeline and slices of the same key from a tp-2 pipeline would overlap. So a sharded key is written by
the holders of the smallest TP degree only: every tp-1 holder (whole tensors, deduplicated as before),
or, when every holder is tensor-parallel, the first such stage in plan order. Every rank works this out
from the plan alone: no communication, O(pipelines x layers) once per save.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from ethpipe.plan import Plan
from ethpipe.sublayers import unit_of_parameter
from ethpipe.plan_parts import layer_owners
from ethpipe.runtime.model.tensor_parallel import TPGroup, shard_dim


def global_shape(local: torch.Tensor, dim: int, tp: TPGroup) -> tuple[int, ...]:
    """The global tensor's shape: TP ranks hold equal shares along ``dim``."""
    shape = list(local.shape)
    shape[dim] *= tp.size
    return tuple(shape)


class ShardViews:
    """This TP rank's slices as DTensors over its group, one mesh per device type (GPU tensors, and the CPU
    states of a sharded optimizer)."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self._meshes: dict[str, DeviceMesh] = {}

    def wrap(self, local: torch.Tensor, name: str) -> DTensor:
        """``local`` (this rank's slice of parameter ``name``, or of its AdamW state) as a DTensor view: DCP
        writes from it and loads into it in place."""
        dim = shard_dim(name)
        assert dim is not None, name
        kind = local.device.type
        if kind not in self._meshes:  # public from_group: no communication, the group is only recorded
            self._meshes[kind] = DeviceMesh.from_group(self.tp.group, kind)
        shape = global_shape(local, dim, self.tp)
        return DTensor.from_local(local, self._meshes[kind], [Shard(dim)], run_check=False,
                                  shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())


class KeyWriters:
    """Per sharded parameter: does this rank's stage write it? (The smallest TP degree among its holders;
    at degree > 1, the first holding stage in plan order.)"""

    def __init__(self, plan: Plan, rank: int, tied: bool) -> None:
        pos = plan.position_of(rank)
        self._mine = (pos.pipeline, pos.stage)
        self._tp = plan.pipelines[pos.pipeline].stages[pos.stage].tp
        # For each part (a layer index, "emb", "head"): (smallest tp, first stage holding it at that tp).
        best: dict[object, tuple[int, tuple[int, int]]] = {}
        owners = layer_owners(plan.pipelines, plan.num_layers)  # per pipeline, the stage of each layer
        for p, (pipe, owner) in enumerate(zip(plan.pipelines, owners)):
            last = pipe.depth - 1
            holders: list[tuple[object, int]] = [*enumerate(owner), ("emb", 0), ("emb" if tied else "head", last)]
            for part, s in holders:
                tp = pipe.stages[s].tp
                if part not in best or tp < best[part][0]:
                    best[part] = (tp, (p, s))
        self._best = best
        self._sublayers = plan.sublayers

    def writes(self, name: str) -> bool:
        """Whether this rank presents parameter ``name`` (global, sharded) to DCP's save."""
        if name.startswith("layers."):
            part: object = unit_of_parameter(name, self._sublayers)
        else:
            part = "emb" if name.startswith("tok_emb.") else "head"
        tp, stage = self._best[part]
        return self._tp == tp and (tp == 1 or stage == self._mine)
