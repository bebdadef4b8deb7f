"""Cluster description: which GPUs, how many per node, how the nodes are wired.

The YAML/JSON format is a public contract (other tools write it), so it is validated with
pydantic at the boundary and turned into a frozen ``Cluster`` the planner works with.
Global ranks are numbered in the order the node groups are listed; a plan's idle devices get
none (``Cluster.without_devices``: the others, renumbered in the same order).
"""

from __future__ import annotations

import difflib

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ethpipe.catalog import GpuSpec, get_gpu
from ethpipe.errors import UserError, parse_error_summary


class InlineGpu(BaseModel):
    """A GPU that is not in the catalog (or a catalog GPU with every field restated)."""

    model_config = ConfigDict(extra="forbid")
    id: str
    memory_gib: float = Field(gt=0)
    peak_tflops: float = Field(gt=0)
    intra_node_gbps: float = Field(default=16.0, gt=0)
    efficiency: float = Field(default=0.4, gt=0, le=1)
    memory_bandwidth_gbps: float = Field(default=0.0, ge=0)
    bf16_supported: bool = True  # false for a device without bf16 (V100-, T4-like): plans refuse --dtype bf16


class NodeGroup(BaseModel):
    model_config = ConfigDict(extra="forbid")
    gpu: str | InlineGpu
    num_nodes: int = Field(gt=0)
    gpus_per_node: int = Field(gt=0)
    nic_gbit_s: float = Field(gt=0)  # the node's whole inter-node network (all its NICs together)
    # One NIC rail per GPU (DGX-style): what one GPU's traffic can use; unset = one NIC shared by the node.
    nic_rail_gbit_s: float | None = Field(default=None, gt=0)
    intra_node_gbps: float | None = Field(default=None, gt=0)  # override, per-direction GB/s
    efficiency: float | None = Field(default=None, gt=0, le=1)  # override achievable fraction of peak
    # The node's host name (`ethpipe cluster detect` writes it): names one node, so only with num_nodes: 1.
    hostname: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _hostname_names_one_node(self) -> NodeGroup:
        if self.hostname is not None and self.num_nodes != 1:
            raise ValueError(f"hostname '{self.hostname}' names one node, but num_nodes is {self.num_nodes}: "
                             "give each named node its own entry with num_nodes: 1")
        return self


# A rank's NCCL communicators: the world's, its pipeline's and the gradient sync's families it is in (the
# planner's 1024/4096-GPU plans put a rank in 2-3 groups besides the world: tests/unit/test_runtime_at_scale.py).
NCCL_COMMUNICATORS_PER_RANK = 4
# 656 MiB (688 MB) each: NVIDIA/nccl#964, a 4-GPU A100 NVLink node through PyTorch, 544 MB for a 2-rank group
# and 688 MB for larger ones (#864 reports about 1.6 GB for one communicator on another system).
NCCL_COMMUNICATOR_MIB = 656.0


class ClusterModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    nodes: list[NodeGroup] = Field(min_length=1)
    inter_node_latency_us: float = Field(default=10.0, ge=0)
    intra_node_latency_us: float = Field(default=5.0, ge=0)
    # GPU memory NCCL's communicators take on each rank, outside the allocator (docs/cost-model.md, "Memory"):
    # communicators per rank x memory per communicator, kept free on every catalog GPU.
    nccl_communicators_per_rank: int = Field(default=NCCL_COMMUNICATORS_PER_RANK, ge=0)
    nccl_communicator_mib: float = Field(default=NCCL_COMMUNICATOR_MIB, ge=0)


@dataclass(frozen=True)
class Device:
    """One GPU of the cluster, by global rank."""

    rank: int
    node: int  # global node index
    local_rank: int
    gpu: GpuSpec
    nic_gbps: float  # per-direction GB/s of its node's network (nic_gbit_s / 8)
    rail_gbps: float = 0.0  # per-direction GB/s one GPU's traffic can use (0 = the whole nic_gbps)

    @functools.cached_property  # fields are frozen; the planner asks millions of times at 4096 GPUs
    def flow_gbps(self) -> float:
        """Inter-node bandwidth of one flow from this GPU: its rail, capped by the node's NIC."""
        return min(self.rail_gbps, self.nic_gbps) if self.rail_gbps > 0 else self.nic_gbps


@dataclass(frozen=True)
class DeviceColumns:
    """Per-rank device fields as arrays (index: rank), for the planner's vectorised node statistics: at
    thousands of GPUs, reading them device by device was a fifth of planning time."""

    node: np.ndarray
    nic_gbps: np.ndarray
    flow_gbps: np.ndarray
    intra_gbps: np.ndarray  # the GPU type's intra-node bandwidth
    gpu: np.ndarray  # index into ``gpus``
    gpus: tuple[GpuSpec, ...]  # the devices' spec objects, by identity, first seen first
    gpu_type: np.ndarray  # index into ``gpu_types`` (the spec's id)
    gpu_types: tuple[str, ...]
    link: np.ndarray  # index of the rank's (flow_gbps, nic_gbps): what a cross-node link depends on at this end


@dataclass(frozen=True)
class Cluster:
    devices: tuple[Device, ...]
    inter_node_latency_s: float
    intra_node_latency_s: float
    source: dict[str, Any]  # the validated spec, for writing into plans
    # Devices of ``source`` left out by ``without_devices``; each one's ``rank`` is its index in the full cluster.
    idle_devices: tuple[Device, ...] = ()
    comm_reserve_bytes: int = 0  # GPU memory NCCL takes per rank (``ClusterModel.nccl_*``), outside the allocator

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def device_indices(self) -> tuple[int, ...]:
        """Each device's index in the full cluster's device order (``source``): rank r is device_indices[r]."""
        idle = {d.rank for d in self.idle_devices}
        return tuple(i for i in range(len(self.devices) + len(idle)) if i not in idle)

    def without_devices(self, indices: Iterable[int]) -> Cluster:
        """The cluster without the devices at ``indices`` (this cluster's ranks), the rest renumbered 0..n-1.

        Node ids and NIC figures stay, so intra-node links and NIC sharing price as on the full
        cluster; ``local_rank`` counts the remaining devices of each node; ``source`` stays the full spec.
        """
        drop = set(indices)
        bad = [i for i in drop if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_devices]
        if bad:
            raise ValueError(f"device index {bad[0]!r} is not a device of this cluster (0..{self.num_devices - 1})")
        if len(drop) == self.num_devices:
            raise ValueError("without_devices would leave no device: keep at least one")
        key = frozenset(drop)
        if key not in self._without:
            self._without[key] = self._without_devices(drop)
        return self._without[key]

    @functools.cached_property  # fields are frozen: one sub-cluster object per index set
    def _without(self) -> dict[frozenset[int], Cluster]:
        return {}

    def _without_devices(self, drop: set[int]) -> Cluster:
        """``without_devices``'s cluster, built."""
        full_index = self.device_indices
        kept: list[Device] = []
        per_node: dict[int, int] = {}
        for d in self.devices:
            if d.rank not in drop:
                local = per_node.get(d.node, 0)
                per_node[d.node] = local + 1
                kept.append(replace(d, rank=len(kept), local_rank=local))
        idle = self.idle_devices + tuple(replace(self.devices[i], rank=full_index[i]) for i in drop)
        return replace(self, devices=tuple(kept), idle_devices=tuple(sorted(idle, key=lambda d: d.rank)))

    @functools.cached_property  # fields are frozen: built once per cluster
    def columns(self) -> DeviceColumns:
        gpus: dict[int, int] = {}
        specs: list[GpuSpec] = []
        types: dict[str, int] = {}
        links: dict[tuple[float, float], int] = {}
        for d in self.devices:
            if id(d.gpu) not in gpus:
                gpus[id(d.gpu)] = len(specs)
                specs.append(d.gpu)
            types.setdefault(d.gpu.id, len(types))
            links.setdefault((d.flow_gbps, d.nic_gbps), len(links))
        devs = self.devices
        return DeviceColumns(
            np.array([d.node for d in devs], dtype=np.int64), np.array([d.nic_gbps for d in devs], dtype=np.float64),
            np.array([d.flow_gbps for d in devs], dtype=np.float64),
            np.array([d.gpu.intra_node_gbps for d in devs], dtype=np.float64),
            np.array([gpus[id(d.gpu)] for d in devs], dtype=np.int64), tuple(specs),
            np.array([types[d.gpu.id] for d in devs], dtype=np.int64), tuple(types),
            np.array([links[(d.flow_gbps, d.nic_gbps)] for d in devs], dtype=np.int64))

    @property
    def gpu_types(self) -> tuple[str, ...]:
        """Distinct GPU ids in first-seen order."""
        return tuple(dict.fromkeys(d.gpu.id for d in self.devices))

    def gpu_specs(self) -> dict[str, GpuSpec]:
        """Each GPU id's spec, in first-seen order; one id with two different specs is refused."""
        types: dict[str, GpuSpec] = {}
        for d in self.devices:
            if types.setdefault(d.gpu.id, d.gpu) != d.gpu:
                raise UserError(f"cluster GPU id '{d.gpu.id}' appears with different overrides in two node groups: "
                                "give one of them an inline GPU spec with its own id")
        return types

    def link_gbps(self, rank_a: int, rank_b: int) -> float:
        """Per-direction bandwidth between two ranks (the slower end sets it; across nodes one GPU's rail)."""
        a, b = self.devices[rank_a], self.devices[rank_b]
        if a.node == b.node:
            return min(a.gpu.intra_node_gbps, b.gpu.intra_node_gbps)
        return min(a.flow_gbps, b.flow_gbps)

    def link_latency_s(self, rank_a: int, rank_b: int) -> float:
        same = self.devices[rank_a].node == self.devices[rank_b].node
        return self.intra_node_latency_s if same else self.inter_node_latency_s


def _resolve_gpu(group: NodeGroup) -> GpuSpec:
    if isinstance(group.gpu, InlineGpu):
        g = group.gpu
        spec = GpuSpec(
            id=g.id,
            name=g.id,
            memory_bytes=int(g.memory_gib * 2**30),
            peak_tflops=g.peak_tflops,
            memory_bandwidth_gbps=g.memory_bandwidth_gbps,
            intra_node_gbps=g.intra_node_gbps,
            efficiency=g.efficiency,
            bf16_supported=g.bf16_supported,
        )
    else:
        spec = get_gpu(group.gpu)
    overrides: dict[str, Any] = {}
    if group.intra_node_gbps is not None:
        overrides["intra_node_gbps"] = group.intra_node_gbps
    if group.efficiency is not None:
        overrides["efficiency"] = group.efficiency
    if overrides:
        spec = GpuSpec(**{**spec.__dict__, **overrides})
    return spec


def _first_error(err: ValidationError) -> str:
    """One line for the first problem; an unknown key first (a typo there also makes a required key "missing"),
    naming the nearest valid key."""
    errors = err.errors()
    e = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
    where = ".".join(str(p) for p in e["loc"]) or "cluster"
    if e["type"] == "extra_forbidden":
        model = NodeGroup if len(e["loc"]) > 1 and e["loc"][0] == "nodes" else ClusterModel
        near = difflib.get_close_matches(str(e["loc"][-1]), list(model.model_fields), n=1)
        hint = f": did you mean '{near[0]}'?" if near else f": use one of {', '.join(model.model_fields)}"
        return f"cluster spec field '{where}' is not a known key{hint}"
    return f"cluster spec field '{where}': {e['msg']}"


def cluster_from_dict(data: Any) -> Cluster:
    """Validate a parsed cluster spec; raises UserError with a one-line message."""
    try:
        model = ClusterModel.model_validate(data)
    except ValidationError as err:
        raise UserError(_first_error(err)) from None
    devices: list[Device] = []
    node = 0
    for index, group in enumerate(model.nodes):
        try:
            gpu = _resolve_gpu(group)
        except UserError as err:
            raise UserError(f"cluster spec field 'nodes.{index}.gpu': {err}") from None
        for _ in range(group.num_nodes):
            for local in range(group.gpus_per_node):
                rail = min(group.nic_rail_gbit_s, group.nic_gbit_s) / 8.0 if group.nic_rail_gbit_s else 0.0
                devices.append(Device(len(devices), node, local, gpu, group.nic_gbit_s / 8.0, rail))
            node += 1
    return Cluster(
        devices=tuple(devices),
        inter_node_latency_s=model.inter_node_latency_us * 1e-6,
        intra_node_latency_s=model.intra_node_latency_us * 1e-6,
        source=model.model_dump(mode="json", exclude_none=True),
        comm_reserve_bytes=int(model.nccl_communicators_per_rank * model.nccl_communicator_mib * 2**20),
    )


def load_cluster(path: str | Path) -> Cluster:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"cluster file '{path}' not found: pass --cluster with a YAML or JSON file")
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as err:
        raise UserError(f"cluster file '{path}' is not valid YAML/JSON: {parse_error_summary(err)}") from None
    return cluster_from_dict(data)
