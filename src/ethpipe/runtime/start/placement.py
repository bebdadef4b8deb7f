"""Start-up placement check: every rank runs on the GPU type its stage was planned for.

torchrun's dynamic rendezvous numbers nodes in arrival order, so without a check a stage sized for an
80 GB H100 can land on a 24 GB L4 (an out-of-memory error hours in, or a silent speed error the
rebalancer then fights). Every rank reports its device (host, name, memory, compute capability); each
rank checks all of them against the plan, so every rank raises the same one-line error naming the
first misplaced rank, what it found, what the plan expected, and the fix. CPU runs (and ``--emulate``,
which runs emulated device types on CPUs) skip it.

A catalog GPU matches by its model in the device name (``h100`` in "NVIDIA H100 80GB HBM3", as a
word: ``l4`` is not ``l40``), its form factor where both say one (PCIe vs SXM), and its memory within
``MEMORY_TOLERANCE`` (CUDA reports a little less than the nominal size: an L4 shows 22.5 of its 24
GiB). A GPU the cluster file describes inline matches by memory alone.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

import torch

from ethpipe.catalog import GpuSpec, gpu_catalog
from ethpipe.cluster import cluster_from_dict
from ethpipe.errors import UserError
from ethpipe.plan import Plan
from ethpipe.units import format_bytes

MEMORY_TOLERANCE = 0.10
_FORM_FACTOR_WORDS = {"sxm", "sxm2", "sxm3", "sxm4", "sxm5", "pcie", "nvl"}
# Catalog ids whose model words are not the id's first part.
_MODEL_WORDS = {"rtx_a6000": ("a6000",), "rtx_4090": ("4090",), "rtx_3090": ("3090",), "titan_rtx": ("titan rtx",),
                "rtx_2080_ti": ("2080 ti",), "a10": ("a10", "a10g")}  # A10G: AWS's A10


@dataclass(frozen=True)
class DeviceInfo:
    """What one rank runs on, as its process sees it."""

    host: str
    kind: str  # "cuda", "cpu", ...
    name: str
    total_memory_bytes: int = 0
    capability: str = ""
    multiprocessors: int = 0  # SMs (0: unknown): tells an H100 SXM (132) from a PCIe card (114)

    def describe(self) -> str:
        if self.kind == "cpu":
            return "a CPU"
        cap = f", compute capability {self.capability}" if self.capability else ""
        return f"{self.name} ({format_bytes(self.total_memory_bytes)}{cap})"


def local_device_info(device: torch.device) -> DeviceInfo:
    host = socket.gethostname()
    if device.type != "cuda":
        return DeviceInfo(host, device.type, device.type)
    props = torch.cuda.get_device_properties(device)
    return DeviceInfo(host, "cuda", props.name, int(props.total_memory), f"{props.major}.{props.minor}",
                      int(props.multi_processor_count))


def _words(text: str) -> str:
    return " " + re.sub(r"[^a-z0-9]+", " ", text.lower()).strip() + " "


def model_words(gpu_id: str) -> tuple[str, ...]:
    """The words a device name must contain (one of) for catalog id ``gpu_id``: 'a100_80gb_sxm' -> ('a100',)."""
    if gpu_id in _MODEL_WORDS:
        return _MODEL_WORDS[gpu_id]
    parts = [p for p in gpu_id.split("_") if p not in _FORM_FACTOR_WORDS and not re.fullmatch(r"\d+gb", p)]
    return (" ".join(parts),)


def memory_matches(gpu: GpuSpec, found_bytes: int) -> bool:
    return abs(found_bytes - gpu.memory_bytes) <= MEMORY_TOLERANCE * gpu.memory_bytes


def _named_form(words: str) -> str | None:
    return "pcie" if " pcie " in words else "sxm" if re.search(r" sxm\d? ", words) else None


def _catalog_sms(gpu: GpuSpec) -> int:
    found = re.search(r"(\d+) SMs", gpu.architecture)
    return int(found.group(1)) if found else 0


def _same_model(gpu: GpuSpec, info: DeviceInfo, words: str) -> bool:
    """The model words, the form factor where the name says one, the SM count where both know it."""
    if not any(f" {w} " in words for w in model_words(gpu.id)):
        return False
    form = _named_form(words)
    planned_pcie = "pcie" in gpu.id.split("_")
    if (form == "sxm" and planned_pcie) or (form == "pcie" and "sxm" in gpu.id):
        return False
    sms = _catalog_sms(gpu)
    return not (sms and info.multiprocessors and sms != info.multiprocessors)


def names_model(gpu: GpuSpec, device_name: str) -> bool:
    """Whether a device name is of ``gpu``'s model (its model words, and its form factor where the name says one)."""
    return _same_model(gpu, DeviceInfo("", "cuda", device_name), _words(device_name))


def device_matches(gpu: GpuSpec, info: DeviceInfo, inline: bool) -> bool:
    """Whether a rank's device is the planned GPU type (module docstring)."""
    if not memory_matches(gpu, info.total_memory_bytes):
        return False
    return inline or _same_model(gpu, info, _words(info.name))


def identify_gpu(name: str, memory_bytes: int = 0, multiprocessors: int = 0) -> str | None:
    """The catalog id of a device a process reports ("NVIDIA H200" -> "h200_sxm"), None if none matches.

    A candidate must match as ``device_matches`` does: the model words, the form factor where the name
    says one, the SM count where both know it, and the memory (reported, else a size in the name, else
    any). Of several left, the SXM part when the name does not say (CUDA names an H100 SXM "NVIDIA H100
    80GB HBM3"), then the shortest id.
    """
    words = _words(name)
    sized = re.search(r" (\d+) ?gb ", words)
    info = DeviceInfo("", "cuda", name, memory_bytes, multiprocessors=multiprocessors)
    found = [g for g in gpu_catalog().values() if g.vendor and _same_model(g, info, words)
             and (memory_matches(g, memory_bytes) if memory_bytes else
                  round(g.memory_gib) == int(sized.group(1)) if sized else True)]
    form = _named_form(words)
    return min(found, key=lambda g: (form is not None and form not in g.id, "pcie" in g.id, len(g.id))).id if found \
        else None


def _planned_gpus(plan: Plan) -> dict[str, tuple[GpuSpec, bool]]:
    """Device type -> (its spec, whether the cluster file describes it inline)."""
    catalog = gpu_catalog()
    if plan.cluster is None:
        return {gid: (spec, False) for gid, spec in catalog.items()}
    inline = {g["gpu"]["id"] for g in plan.cluster.get("nodes", []) if isinstance(g.get("gpu"), dict)}
    return {d.gpu.id: (d.gpu, d.gpu.id in inline) for d in cluster_from_dict(plan.cluster).devices}


def check_placement(plan: Plan, infos: list[DeviceInfo]) -> None:
    """Raise one line for the first rank whose device is not its stage's planned type (``infos`` by rank)."""
    if all(info.kind == "cpu" for info in infos):
        return
    gpus = _planned_gpus(plan)
    nodes = _node_order(plan)
    for rank, info in enumerate(infos):
        pos = plan.position_of(rank)
        planned = plan.pipelines[pos.pipeline].stages[pos.stage].device
        if planned not in gpus:
            continue  # a pseudo-device of a hand-written plan without a cluster: nothing to compare with
        gpu, inline = gpus[planned]
        if device_matches(gpu, info, inline):
            continue
        where = f" (node {nodes[rank]} of the plan's cluster)" if nodes else ""
        raise UserError(
            f"rank {rank} on host {info.host} runs on {info.describe()}, but the plan puts stage {pos.stage} of "
            f"pipeline {pos.pipeline} ({planned}, {format_bytes(gpu.memory_bytes)}) there{where}: start each node "
            "with --node-rank in the cluster file's node order (static rendezvous; `ethpipe launch` prints the "
            "commands), or describe the real nodes in a cluster file and re-plan")


def _node_order(plan: Plan) -> dict[int, int]:
    """Rank -> the node of the plan's cluster its device is on (empty without a cluster)."""
    if plan.cluster is None:
        return {}
    return {d.rank: d.node for d in plan.active_cluster().devices}
