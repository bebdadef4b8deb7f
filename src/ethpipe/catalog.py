"""Built-in GPU catalog, generated at import from the shipped ``data/gpus.yaml``.

The YAML keeps every number's source as package data; this module only reads the
fields the cost model needs. Default achievable-FLOPs efficiencies live here because they
are a property of the GPU generation, not of a cluster; a cluster spec may override them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

import yaml

from ethpipe.errors import UserError

# Fraction of dense 16-bit peak a well-tuned transformer layer reaches. Hopper/Ampere/Ada:
# ~0.5 (Megatron-class MFU 40-56%, reference/formulas.md section 6). Older generations land
# lower: Sailor's measured A100:V100 ratio is 3.0-5.5x against a 2.5x peak ratio
# (formulas.md section 7.2), i.e. V100 at ~0.35 of peak when A100 is at 0.5.
_EFFICIENCY_BY_ARCH = {
    "hopper": 0.5,
    "ampere": 0.5,
    "ada": 0.45,
    "cdna": 0.4,
    "volta": 0.35,
    "turing": 0.35,
    "pascal": 0.3,
}
_DEFAULT_EFFICIENCY = 0.4
# Intra-node link when the catalog has none (PCIe Gen3 x16, bidirectional GB/s).
_DEFAULT_INTRA_NODE_BIDIR_GBPS = 32.0


@dataclass(frozen=True)
class GpuSpec:
    """What the cost model needs to know about one accelerator type."""

    id: str
    name: str
    memory_bytes: int
    peak_tflops: float  # dense 16-bit matrix peak (fp32 peak where no 16-bit path exists)
    memory_bandwidth_gbps: float
    intra_node_gbps: float  # per-direction GB/s of the intra-node link (half the bidirectional figure)
    efficiency: float  # achievable fraction of peak_tflops
    bf16_supported: bool = True
    architecture: str = ""  # the catalog's architecture text, e.g. "Ampere (GA100)"; "" for inline GPUs
    peak_fp32_tflops: float = 0.0  # CUDA-core fp32 peak (0 = unknown)
    tf32_tflops: float = 0.0  # dense TF32 tensor-core peak (0 = the chip has none)
    vendor: str = ""  # the catalog's vendor ("NVIDIA", "AMD", ...); "" for inline GPUs
    pcie_p2p: bool = True  # False: the driver gives no PCIe peer-to-peer (GeForce): NCCL stages through host memory
    tdp_w: float = 0.0  # published maximum board power (0 = unknown): a slot-powered card's clocks sag under load

    @property
    def arch(self) -> str:
        """Architecture family key of the calibration constants ('ampere', 'hopper', ...; '' if unknown)."""
        return arch_family(self.architecture)

    @property
    def achievable_flops(self) -> float:
        return self.peak_tflops * 1e12 * self.efficiency

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 2**30


def arch_family(architecture: str) -> str:
    """'Ampere (GA100, 108 SMs)' -> 'ampere'; '' when the text names no known family."""
    text = architecture.lower()
    return next((key for key in _EFFICIENCY_BY_ARCH if key in text), "")


def _efficiency_for(arch: str) -> float:
    arch = arch.lower()
    for key, eff in _EFFICIENCY_BY_ARCH.items():
        if key in arch:
            return eff
    return _DEFAULT_EFFICIENCY


# Variant keys that name a form factor (``{sxm2: 15.7, pcie: 14}``): their ids are ``<entry id>_<key>``.
_FORM_FACTORS = ("sxm", "sxm2", "sxm4", "sxm5", "pcie")


def _scalar(value: Any, variant: str | None) -> Any:
    """Some catalog fields list per-variant values ({a100_pcie_40gb: 40, ...} or {sxm2: 15.7, pcie: 14})."""
    if isinstance(value, dict):
        return value.get(variant) if variant in value else min(value.values())
    return value


def _expand_variants(entry: dict[str, Any]) -> list[tuple[str, str | None]]:
    """(id, variant) pairs: the entry's own id (smallest variant, conservative) plus one per variant.

    A variant keyed by its own id (``a100_pcie_40gb``) keeps it; a form-factor key (``sxm2``) gets
    ``<entry id>_<key>`` (``v100_16gb_sxm2``), so the NVLink part can be named where it is the one used.
    """
    variant_keys = {k for v in entry.values() if isinstance(v, dict) for k in v}
    named = sorted(k for k in variant_keys if k.startswith(entry["id"].split("_")[0]))
    forms = sorted(k for k in variant_keys if k in _FORM_FACTORS)
    return [(entry["id"], None)] + [(v, v) for v in named] + [(f"{entry['id']}_{f}", f) for f in forms]


def _from_entry(entry: dict[str, Any], gpu_id: str, variant: str | None) -> GpuSpec | None:
    peak = _scalar(entry.get("peak_fp16_bf16_dense_tflops"), variant) or _scalar(
        entry.get("peak_fp32_tflops"), variant
    )
    mem = _scalar(entry.get("memory_gib"), variant)
    if not peak or not mem:
        return None
    link = entry.get("intra_node_interconnect") or {}
    if variant in link and isinstance(link[variant], dict):  # per-form-factor link ({sxm2: {...}, pcie: {...}})
        link = link[variant]
    elif link and all(isinstance(v, dict) for v in link.values()):  # no variant chosen: the slowest link
        link = min(link.values(), key=lambda v: float(v.get("per_gpu_bidir_gbps") or 0.0))
    bidir = _scalar(link.get("per_gpu_bidir_gbps"), variant) or _DEFAULT_INTRA_NODE_BIDIR_GBPS
    return GpuSpec(
        id=gpu_id,
        name=entry.get("name", entry["id"]),
        memory_bytes=int(float(mem) * 2**30),
        peak_tflops=float(peak),
        memory_bandwidth_gbps=float(_scalar(entry.get("memory_bandwidth_gbps"), variant) or 0.0),
        intra_node_gbps=float(bidir) / 2.0,
        efficiency=_efficiency_for(str(entry.get("architecture", ""))),
        bf16_supported=bool(entry.get("bf16_supported", True)),
        architecture=str(entry.get("architecture", "")),
        peak_fp32_tflops=float(_scalar(entry.get("peak_fp32_tflops"), variant) or 0.0),
        tf32_tflops=float(_scalar(entry.get("tf32_dense_tflops"), variant) or 0.0),
        vendor=str(entry.get("vendor", "")),
        pcie_p2p=bool(entry.get("pcie_p2p", True)),
        tdp_w=float(_scalar(entry.get("tdp_w"), variant) or 0.0),
    )


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, GpuSpec]:
    """All catalog GPUs with enough data to be priced, keyed by id."""
    text = resources.files("ethpipe").joinpath("data/gpus.yaml").read_text()
    entries = yaml.safe_load(text)["gpus"]
    specs = (_from_entry(e, gid, var) for e in entries for gid, var in _expand_variants(e))
    return {s.id: s for s in specs if s is not None}


# The collective library each vendor's devices train with under torch.distributed. One training world needs
# one: NCCL and RCCL do not talk to each other, and TPUs / Ascend NPUs have no NCCL backend at all.
_COLLECTIVES_BY_VENDOR = {"nvidia": "NCCL", "amd": "RCCL", "google": "XLA", "huawei": "HCCL"}
_RUNTIME_COLLECTIVES = ("NCCL", "RCCL")  # what ethpipe's runtime trains with (torch's "nccl" backend)


def collective_library(gpu: GpuSpec) -> str | None:
    """'NCCL' for an NVIDIA GPU, 'RCCL' for AMD, ...; None for an inline GPU (any: the CPU demo's devices)."""
    return _COLLECTIVES_BY_VENDOR.get(gpu.vendor.lower()) if gpu.vendor else None


def check_one_world(gpus: Iterable[GpuSpec], source: str = "the cluster") -> None:
    """Refuse devices that cannot train in one torch.distributed world: two collective libraries, or one
    ethpipe's runtime does not run on (TPU, Ascend)."""
    by_library: dict[str, GpuSpec] = {}
    for gpu in gpus:
        library = collective_library(gpu)
        if library is None:
            continue
        if library not in _RUNTIME_COLLECTIVES:
            raise UserError(f"{source} has device type '{gpu.id}' ({gpu.vendor}), which trains with {library}, not "
                            "NCCL: ethpipe trains on NVIDIA (NCCL) or AMD (RCCL) GPUs; leave those nodes out")
        by_library.setdefault(library, gpu)
    if len(by_library) > 1:
        (lib_a, a), (lib_b, b) = list(by_library.items())[:2]
        raise UserError(f"{source} mixes {a.vendor} '{a.id}' ({lib_a}) and {b.vendor} '{b.id}' ({lib_b}): one "
                        "training world needs one collective library; plan each vendor's nodes as their own cluster")


def get_gpu(gpu_id: str) -> GpuSpec:
    catalog = gpu_catalog()
    if gpu_id not in catalog:
        known = ", ".join(sorted(catalog))
        raise UserError(f"unknown GPU id '{gpu_id}': use one of {known}, or give an inline spec")
    return catalog[gpu_id]
