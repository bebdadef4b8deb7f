"""The Plan: the one contract between planner, simulator and runtime (docs/design.md §3).

A plan is plain data (frozen dataclasses <-> versioned JSON). ``Plan.load`` validates the
whole structure so that a hand-edited, inconsistent plan is rejected before any process
starts. This module must not import torch or the planner.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ethpipe.atomic import write_text_atomic
from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec, load_model_spec, spec_from_dict

if TYPE_CHECKING:
    from ethpipe.cluster import Cluster

PLAN_VERSION = 1

_T = TypeVar("_T")


class _derived(Generic[_T]):
    """``functools.cached_property`` without its lock, which Python 3.11 takes on every first read: plans the
    planner prices are made of fresh stages, each read a few times (first reads were a sixth of an estimate's time
    at 4096 GPUs). Computed on first read, then an ordinary instance attribute (as Python 3.12 does)."""

    def __init__(self, fn: Callable[[Any], _T]) -> None:
        self.fn, self.name, self.__doc__ = fn, fn.__name__, fn.__doc__

    def __get__(self, obj: Any, owner: type | None = None) -> _T:
        if obj is None:
            return self  # type: ignore[return-value]
        value = obj.__dict__[self.name] = self.fn(obj)  # frozen: the field setter is bypassed, as cached_property does
        return value


@dataclass(frozen=True)
class Stage:
    ranks: tuple[int, ...]  # tp ranks of this stage
    device: str  # GPU type id (catalog id, or an emulated type name)
    layers: tuple[int, int]  # half-open range of decoder blocks (an interleaved stage: its chunk 0)
    tp: int = 1
    recompute: bool = False
    # An interleaved pipeline's stage holds several model chunks: their layer ranges, chunk 0 first (= layers).
    chunks: tuple[tuple[int, int], ...] = ()

    # Derived from frozen fields, computed once per stage (the planner reads them millions of times).
    @_derived
    def layer_ranges(self) -> tuple[tuple[int, int], ...]:
        """The stage's layer ranges, one per model chunk (one range unless interleaved)."""
        return self.chunks or (self.layers,)

    @_derived
    def chunk_layers(self) -> tuple[int, ...]:
        """Layers per model chunk (one entry unless interleaved)."""
        return tuple(hi - lo for lo, hi in self.layer_ranges)

    @_derived
    def num_layers(self) -> int:
        return sum(self.chunk_layers)

    def holds(self, layer: int) -> bool:
        if not self.chunks:  # the common case, on the planner's hot path
            return self.layers[0] <= layer < self.layers[1]
        return any(lo <= layer < hi for lo, hi in self.chunks)

    def chunk(self, c: int) -> Stage:
        """Model chunk ``c`` as a one-range stage (what the cost model prices per chunk)."""
        return Stage(self.ranks, self.device, self.layer_ranges[c], self.tp, self.recompute)


@dataclass(frozen=True)
class Pipeline:
    stages: tuple[Stage, ...]
    micro_batch_sizes: tuple[int, ...]
    schedule: str = "1f1b"  # ``ethpipe.schedule.SCHEDULES``: the order its stages run their actions

    @property
    def depth(self) -> int:
        return len(self.stages)

    @property
    def num_microbatches(self) -> int:
        return len(self.micro_batch_sizes)

    @property
    def num_samples(self) -> int:
        return sum(self.micro_batch_sizes)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for s in self.stages for r in s.ranks)

    @property
    def num_chunks(self) -> int:
        """Model chunks per stage (``interleaved`` schedules hold 2 or more; chunk c of stage s is virtual
        stage ``c * depth + s``)."""
        return len(self.stages[0].layer_ranges)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Inner stage (virtual-stage) boundaries: layer indices where a new stage or chunk starts."""
        return tuple(sorted(lo for st in self.stages for lo, _ in st.layer_ranges if lo > 0))


@dataclass(frozen=True)
class Block:
    """A maximal run of layers lying inside one stage of every pipeline (docs/design.md §2.2)."""

    layers: tuple[int, int]
    ranks: tuple[int, ...]  # the holding stage's ranks, pipeline by pipeline


@dataclass(frozen=True)
class RankPosition:
    pipeline: int
    stage: int
    tp_rank: int


@dataclass(frozen=True)
class IdleDevice:
    """A cluster device the plan leaves idle: it gets no rank and runs no process (docs/plan-format.md)."""

    device_index: int  # index in the cluster's device order (``cluster_from_dict(plan.cluster).devices``)
    device: str  # its GPU type id
    reason: str


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
        return self.pipelines[0].stages[-1].layer_ranges[-1][1]

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
        from ethpipe.plan_validate import plan_from_dict

        return plan_from_dict(data)

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


def compute_blocks(pipelines: tuple[Pipeline, ...] | list[Pipeline]) -> tuple[Block, ...]:
    """Common refinement of every pipeline's stage boundaries, with each block's holders."""
    num_layers = pipelines[0].stages[-1].layer_ranges[-1][1]
    owners = layer_owners(pipelines, num_layers)
    cuts = sorted({0, num_layers, *(b for p in pipelines for b in p.boundaries)})
    return tuple(Block((lo, hi), tuple(r for pipe, owner in zip(pipelines, owners) for r in pipe.stages[owner[lo]].ranks))
                 for lo, hi in zip(cuts[:-1], cuts[1:]))


def layer_owners(pipelines: Sequence[Pipeline], num_layers: int) -> list[list[int]]:
    """Per pipeline, the stage holding each layer (computed once per stage layout: pipelines repeat them)."""
    owners: dict[tuple, list[int]] = {}
    out = []
    for pipe in pipelines:
        layout = tuple(st.layer_ranges for st in pipe.stages)
        if layout not in owners:
            owner = [0] * num_layers
            for i, ranges in enumerate(layout):
                for lo, hi in ranges:
                    owner[lo:hi] = [i] * (hi - lo)
            owners[layout] = owner
        out.append(owners[layout])
    return out


__all__ = [
    "PLAN_VERSION", "Block", "IdleDevice", "Pipeline", "Plan", "RankPosition", "Stage", "compute_blocks", "layer_owners",
    "spec_from_dict", "write_text_atomic",
]
