"""The Plan: the one contract between planner, simulator and runtime (docs/design.md §3).

A plan is plain data (frozen dataclasses <-> versioned JSON). ``Plan.load`` validates the
whole structure so that a hand-edited, inconsistent plan is rejected before any process
starts. This module must not import torch or the planner.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ethpipe.atomic import write_text_atomic
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec
from ethpipe.model_load import load_model_spec
from ethpipe.plan_parts import (PLAN_VERSION, Block, IdleDevice, Pipeline, RankPosition, Stage, compute_blocks,
                                layer_owners)
from ethpipe.plan_validate import plan_fields

if TYPE_CHECKING:
    from ethpipe.cluster import Cluster

# The parts a plan is made of live in ``plan_parts`` (below the validation); they are part of this contract.
__all__ = ["PLAN_VERSION", "Block", "IdleDevice", "Pipeline", "Plan", "RankPosition", "Stage", "compute_blocks",
           "layer_owners"]


@dataclass(frozen=True)
class Plan:
    method: str
    model: str
    global_batch_size: int
    seq_len: int
    pipelines: tuple[Pipeline, ...]
    blocks: tuple[Block, ...]
    model_spec: ModelSpec | None = None
    cluster: dict[str, Any] | None = None
    predicted: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # unknown top-level fields, preserved on save
    version: int = PLAN_VERSION
    idle_devices: tuple[IdleDevice, ...] = ()  # ranks 0..world-1 are the other devices, in cluster order
    # ZeRO-1 across pipelines: each holder of a sync unit keeps the AdamW moments of its shard only
    # (docs/runtime.md, "Optimizer sharding"); ``shard_weights`` per rank (empty: equal shards).
    shard_optimizer: bool = False
    shard_weights: tuple[float, ...] = ()

    # -- derived views -------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return sum(len(p.ranks) for p in self.pipelines)

    @property
    def num_layers(self) -> int:
        """Units the stages tile: decoder layers, or half layers where ``sublayers`` is 2."""
        return self.pipelines[0].stages[-1].layer_ranges[-1][1]

    @property
    def sublayers(self) -> int:
        """The unit of every layer index in the plan (``ethpipe.sublayers``): 1 = layers, 2 = half layers."""
        return self.pipelines[0].stages[0].sublayers

    @property
    def idle_device_indices(self) -> tuple[int, ...]:
        return tuple(d.device_index for d in self.idle_devices)

    def active_cluster(self) -> Cluster:
        """The devices the ranks run on: the plan's cluster without its idle devices (rank r = the r-th)."""
        from ethpipe.cluster import cluster_from_dict

        if self.cluster is None:
            raise UserError("plan field 'cluster' is missing: re-make the plan with `ethpipe plan`")
        full = cluster_from_dict(self.cluster)
        return full.without_devices(self.idle_device_indices) if self.idle_devices else full

    def resolve_model(self) -> ModelSpec:
        """The model spec embedded in the plan, or the preset/file the ``model`` field names."""
        return self.model_spec if self.model_spec is not None else load_model_spec(self.model)

    def position_of(self, rank: int) -> RankPosition:
        for p_idx, pipe in enumerate(self.pipelines):
            for s_idx, stage in enumerate(pipe.stages):
                if rank in stage.ranks:
                    return RankPosition(p_idx, s_idx, stage.ranks.index(rank))
        raise ValueError(f"rank {rank} is not in the plan (world size {self.world_size})")

    def sample_offsets(self) -> tuple[int, ...]:
        """First sample (within a global batch) of each pipeline: plan order is data order."""
        offsets, acc = [], 0
        for pipe in self.pipelines:
            offsets.append(acc)
            acc += pipe.num_samples
        return tuple(offsets)

    def microbatch_slices(self, pipeline: int) -> tuple[tuple[int, int], ...]:
        """[start, end) sample indices within the global batch of each micro-batch of a pipeline."""
        start = self.sample_offsets()[pipeline]
        out = []
        for size in self.pipelines[pipeline].micro_batch_sizes:
            out.append((start, start + size))
            start += size
        return tuple(out)

    def blocks_of_stage(self, pipeline: int, stage: int) -> tuple[int, ...]:
        """Indices of the blocks held by a stage, ascending (the sync runs them in ``cost/sync.block_sync_order``)."""
        st = self.pipelines[pipeline].stages[stage]
        return tuple(i for i, b in enumerate(self.blocks) if st.holds(b.layers[0]))

    # -- (de)serialisation ----------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "version": self.version,
            "method": self.method,
            "model": self.model,
            "global_batch_size": self.global_batch_size,
            "seq_len": self.seq_len,
            "pipelines": [
                {
                    "stages": [
                        {"ranks": list(s.ranks), "device": s.device,
                         **({"chunks": [list(r) for r in s.chunks]} if s.chunks else {"layers": list(s.layers)}),
                         "tp": s.tp, "recompute": s.recompute}
                        for s in p.stages
                    ],
                    "micro_batch_sizes": list(p.micro_batch_sizes),
                    "schedule": p.schedule,
                }
                for p in self.pipelines
            ],
            "blocks": [{"layers": list(b.layers), "ranks": list(b.ranks)} for b in self.blocks],
        }
        if self.sublayers != 1:
            out["sublayers"] = self.sublayers
        if self.model_spec is not None:
            out["model_spec"] = self.model_spec.to_dict()
        if self.cluster is not None:
            out["cluster"] = self.cluster
        if self.idle_devices:
            out["idle_devices"] = [{"device_index": d.device_index, "device": d.device, "reason": d.reason}
                                   for d in self.idle_devices]
        if self.shard_optimizer:
            out["shard_optimizer"] = True
        if self.shard_weights:
            out["shard_weights"] = list(self.shard_weights)
        if self.predicted is not None:
            out["predicted"] = self.predicted
        out.update(self.extra)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        """Atomic write: a crash never leaves a half-written plan behind."""
        write_text_atomic(Path(path), self.to_json() + "\n")

    @staticmethod
    def from_dict(data: Any) -> Plan:
        """A validated plan from its JSON form (``plan_validate``): every field checked, one line per problem."""
        return Plan(**plan_fields(data))

    @staticmethod
    def load(path: str | Path) -> Plan:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"plan file '{path}' not found: make one with `ethpipe plan ... --out {path}`")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise UserError(f"plan file '{path}' is not valid JSON: {err}") from None
        return Plan.from_dict(data)


def layout_key(plan: Plan) -> int:
    """A checksum of the plan's stages (ranks, devices, layers, TP, chunks, schedules), not of its data split: the
    steps of a run measured under one layout (rebalancing moves only the split) carry it in their metrics
    (``layout``), so a fit of a run's steps takes those of the plan it is given and no other."""
    stages: list = [[p.schedule, [[list(s.ranks), s.device, list(s.layers), s.tp, [list(c) for c in s.chunks]]
                                  for s in p.stages]] for p in plan.pipelines]
    if plan.sublayers != 1:
        stages.append(plan.sublayers)
    return zlib.crc32(json.dumps(stages).encode())
