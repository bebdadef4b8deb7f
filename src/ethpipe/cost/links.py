"""Measured link bandwidth as a function of message size (intra-node NCCL curves).

A datasheet figure (NVLink 600 GB/s bidirectional -> 300 per direction) is what a link reaches
for huge messages at best; NCCL reaches far less on the MB-sized messages pipelines and TP
all-reduces send. Where a GPU type has a measured curve (``data/link_curves.yaml``), the cost
model prices intra-node transfers on it:

    GB/s = c2 x^2 + c1 x + c0,  x = log2(bytes / 1e6)   (Sailor's fit of NCCL send/recv)

capped by the highest measured value, per number of GPUs communicating at once inside the
node. The quadratic is trusted from ``MIN_FIT_BYTES`` up (below it turns negative); smaller
messages see the bandwidth at ``MIN_FIT_BYTES`` (already far below peak) plus the caller's per-message
latency (the alpha of ``comm.p2p_s`` / the ring's steps). Past a concave
curve's vertex the vertex value holds (the fit would fall again where nothing was measured).
Types without a curve keep the flat ``intra_node_gbps`` (and ``ethpipe plan`` says so).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from ethpipe.catalog import GpuSpec, gpu_catalog
from ethpipe.errors import UserError

MIN_FIT_BYTES = 1e6  # smallest message the quadratic fits are evaluated at (they go negative below ~0.5 MB)
LINK_CURVES_VERSION = 1


@dataclass(frozen=True)
class LinkCurve:
    """Per-direction bandwidth of one GPU type's intra-node link for one GPU count."""

    c2: float
    c1: float
    c0: float
    max_gbps: float  # highest measured bandwidth (cap)

    def gbps(self, num_bytes: float) -> float:
        """Bandwidth a message of ``num_bytes`` sees (GB/s per direction)."""
        x = math.log2(max(num_bytes, MIN_FIT_BYTES) / 1e6)
        if self.c2 < 0:
            x = min(x, -self.c1 / (2 * self.c2))
        return min(self.c2 * x * x + self.c1 * x + self.c0, self.max_gbps)

    def transfer_s(self, num_bytes: float) -> float:
        return num_bytes / (self.gbps(num_bytes) * 1e9) if num_bytes > 0 else 0.0


@dataclass(frozen=True)
class LinkCurves:
    """Curves by catalog GPU id and GPU count, with their source."""

    curves: Mapping[str, Mapping[int, LinkCurve]]
    source: str = ""

    def curve(self, gpu_id: str, num_gpus: int) -> LinkCurve | None:
        """The curve measured with ``num_gpus`` GPUs, else the nearest larger count, else the largest."""
        counts = self.curves.get(gpu_id)
        if not counts:
            return None
        larger = [c for c in counts if c >= num_gpus]
        return counts[min(larger) if larger else max(counts)]


def link_curves_from_dict(data: Any, where: str = "link curves") -> LinkCurves:
    if not isinstance(data, dict) or data.get("version") != LINK_CURVES_VERSION:
        raise UserError(f"{where} field 'version' must be {LINK_CURVES_VERSION}")
    out: dict[str, dict[int, LinkCurve]] = {}
    for gpu_id, counts in (data.get("gpus") or {}).items():
        try:
            out[str(gpu_id)] = {int(n): LinkCurve(float(c["c2"]), float(c["c1"]), float(c["c0"]), float(c["max_gbps"]))
                                for n, c in counts.items()}
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise UserError(f"{where} field 'gpus.{gpu_id}' is malformed ({err}): each count needs c2, c1, c0, max_gbps") from None
        if any(c.c0 <= 0 or c.max_gbps <= 0 for c in out[str(gpu_id)].values()):
            raise UserError(f"{where} field 'gpus.{gpu_id}': c0 and max_gbps must be positive")
    return LinkCurves(out, str(data.get("source", "")))


@lru_cache(maxsize=1)
def shipped_link_curves() -> LinkCurves:
    text = resources.files("ethpipe").joinpath("data/link_curves.yaml").read_text()
    return link_curves_from_dict(yaml.safe_load(text), "shipped link_curves.yaml")


def link_note(gpu: GpuSpec) -> str:
    """How the cost model prices ``gpu``'s intra-node link (the plan's compute-model notes)."""
    if intra_curve(gpu, 2) is not None:
        return f"intra-node link: measured NCCL curve ({shipped_link_curves().source})"
    return f"intra-node link: flat {gpu.intra_node_gbps:g} GB/s (datasheet or cluster spec; no measured curve)"


def intra_curve(gpu: GpuSpec, num_gpus: int, curves: LinkCurves | None = None) -> LinkCurve | None:
    """The measured curve of a GPU type, or None (no curve, or the cluster overrides ``intra_node_gbps``)."""
    if curves is None:
        return _shipped_intra_curve(gpu.id, gpu.intra_node_gbps, num_gpus)
    catalog = gpu_catalog().get(gpu.id)
    if catalog is None or catalog.intra_node_gbps != gpu.intra_node_gbps:
        return None  # inline GPU or an explicit cluster override: the user's flat figure wins
    return curves.curve(gpu.id, num_gpus)


@lru_cache(maxsize=256)
def _shipped_intra_curve(gpu_id: str, intra_node_gbps: float, num_gpus: int) -> LinkCurve | None:
    """``intra_curve`` on the shipped curves, memoised: the planner asks it for every link it prices."""
    catalog = gpu_catalog().get(gpu_id)
    if catalog is None or catalog.intra_node_gbps != intra_node_gbps:
        return None
    return shipped_link_curves().curve(gpu_id, num_gpus)


def intra_gbps(gpu: GpuSpec, num_gpus: int, num_bytes: float) -> float:
    """Per-direction intra-node bandwidth for a message: the measured curve, else the flat figure."""
    curve = intra_curve(gpu, num_gpus)
    return curve.gbps(num_bytes) if curve is not None else gpu.intra_node_gbps


HOST_STAGED_CROSSINGS = 2  # without PCIe peer-to-peer every ring step goes GPU -> host memory -> GPU


def allreduce_gbps(gpu: GpuSpec, num_gpus: int, num_bytes: float) -> float:
    """Per-direction bandwidth of a ring all-reduce over ``num_gpus`` GPUs of one node (TP groups).

    With peer-to-peer (NVLink, or PCIe P2P on data-centre cards) a ring step is one send at the measured rate of
    that many GPUs talking at once (``intra_gbps``). Without it (GeForce, ``GpuSpec.pcie_p2p`` False) NCCL stages
    every step through host memory: each crosses PCIe twice, and every GPU of the ring sends and receives at once,
    so the ring runs at half the slowest rate measured for any group size up to ``num_gpus`` (the 8-GPU curve of
    such a node can read higher than the 2-GPU one: pairs on separate switches). Inferred from the TP > 1 layer
    rows of the Sailor profiles (RTX 2080 Ti, Titan RTX, RTX 3090; docs/benchmarks/calibration.md)."""
    if gpu.pcie_p2p or num_gpus < 2:
        return intra_gbps(gpu, num_gpus, num_bytes)
    rates = [intra_gbps(gpu, k, num_bytes) for k in range(2, num_gpus + 1)]
    return min(rates) / HOST_STAGED_CROSSINGS


def slowest_intra(gpus: Iterable[GpuSpec], num_gpus: int) -> tuple[float, LinkCurve | None]:
    """(flat GB/s, curve) of the slowest intra-node link among ``gpus`` (by peak: curve max or flat)."""
    best: tuple[float, float, LinkCurve | None] | None = None
    for g in gpus:
        curve = intra_curve(g, num_gpus)
        key = curve.max_gbps if curve is not None else g.intra_node_gbps
        if best is None or key < best[0]:
            best = (key, g.intra_node_gbps, curve)
    if best is None:
        raise ValueError("no GPUs")
    return best[1], best[2]


def collective_intra(gpus: Iterable[GpuSpec], num_gpus: int, num_bytes: float) -> tuple[float | None, LinkCurve | None]:
    """How a collective's in-node ring over ``num_gpus`` GPUs of ``gpus`` is priced: (flat GB/s, None) where one of
    them has no PCIe peer-to-peer (GeForce: NCCL stages every ring step through host memory, as for the TP
    all-reduces, ``allreduce_gbps``), else (None, the slowest measured curve or None for the flat figure)."""
    gpus = tuple(gpus)
    staged = [g for g in gpus if not g.pcie_p2p]
    if staged and num_gpus >= 2:  # the slowest node's ring: a staged one, or another type's curve or flat figure
        return min([allreduce_gbps(g, num_gpus, num_bytes) for g in staged]
                   + [intra_gbps(g, num_gpus, num_bytes) for g in gpus if g.pcie_p2p]), None
    return None, slowest_intra(gpus, num_gpus)[1]
