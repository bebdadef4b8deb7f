"""The parts a Plan is made of: stages, pipelines, gradient blocks, rank positions, idle devices.

Plain frozen data below both the Plan (``plan``) and its validation (``plan_validate``), which builds these
parts from JSON before the Plan exists. This module must not import torch or the planner.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ethpipe.sublayers import attention_units

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
    # The unit of ``layers`` and ``chunks``: 1 = decoder layers; 2 = half layers, so a stage may end between a
    # layer's attention and its MLP (``ethpipe.sublayers``). Every stage of a plan has the plan's.
    sublayers: int = 1

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
        """Units held: decoder layers, or half layers with ``sublayers`` 2."""
        return sum(self.chunk_layers)

    @_derived
    def halves(self) -> tuple[int, int]:
        """(attention halves, MLP halves) the stage runs: a whole layer is one of each."""
        if self.sublayers == 1:
            return self.num_layers, self.num_layers
        attention = sum(attention_units(lo, hi, 2) for lo, hi in self.layer_ranges)
        return attention, self.num_layers - attention

    @_derived
    def lone_attention(self) -> int:
        """Chunks that end inside a layer, after its attention half: that half runs without its layer's MLP
        (what a recomputing stage re-runs of it differs, ``ops.recompute_kernels``)."""
        return 0 if self.sublayers == 1 else sum(hi % 2 for _, hi in self.layer_ranges)

    def holds(self, layer: int) -> bool:
        if not self.chunks:  # the common case, on the planner's hot path
            return self.layers[0] <= layer < self.layers[1]
        return any(lo <= layer < hi for lo, hi in self.chunks)

    def chunk(self, c: int) -> Stage:
        """Model chunk ``c`` as a one-range stage (what the cost model prices per chunk)."""
        return Stage(self.ranks, self.device, self.layer_ranges[c], self.tp, self.recompute, sublayers=self.sublayers)


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


def in_half_layers(pipelines: Sequence[Pipeline]) -> tuple[Pipeline, ...]:
    """The same pipelines with their layer ranges counted in half layers (``Stage.sublayers`` 2): the cuts a
    planner may then move by half a layer (``ethpipe.sublayers``)."""
    def half(st: Stage) -> Stage:
        assert st.sublayers == 1, "already in half layers"
        return Stage(st.ranks, st.device, (2 * st.layers[0], 2 * st.layers[1]), st.tp, st.recompute,
                     tuple((2 * lo, 2 * hi) for lo, hi in st.chunks), 2)
    return tuple(Pipeline(tuple(half(st) for st in p.stages), p.micro_batch_sizes, p.schedule) for p in pipelines)


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
