"""`ethpipe cluster detect`: describe this node (or every node of a torchrun/srun world) as a cluster file.

Two layers, so the mapping is testable without hardware. The QUERY layer (``gather_facts``) reads what
the machine reports (torch.cuda or nvidia-smi, NVML or ``nvidia-smi topo -m``, NIC speeds under a
configurable sysfs root) into a frozen ``NodeFacts``. The MAPPER/WRITER (``detect_cluster``,
``cluster_yaml``) are pure: facts -> cluster spec -> YAML text, with a note wherever a value is a guess
the user must check, because a wrong GPU id or NIC speed silently skews every plan made from the file.
Gathering the facts of a torchrun/srun world is the command's transport: ``cli/cluster_cmds.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ethpipe.catalog import get_gpu
from ethpipe.cluster import cluster_from_dict
from ethpipe.errors import UserError

# Written where nothing could be read; each one is marked FILL IN in the file and named in the output.
NIC_PLACEHOLDER_GBIT_S = 10.0
INLINE_PEAK_PLACEHOLDER_TFLOPS = 1.0  # low on purpose: an unfilled unknown GPU looks slow, not fast
# A CPU device as the repo's CPU clusters describe it (examples/clusters/cpu_tp.yaml).
CPU_PEAK_TFLOPS = 0.05
_SUBPROCESS_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class GpuFacts:
    """One accelerator as the device reports it."""

    name: str  # "NVIDIA H100 80GB HBM3"
    memory_bytes: int  # CUDA-visible total memory
    compute_capability: tuple[int, int] | None = None  # (major, minor) where torch tells


@dataclass(frozen=True)
class NicFacts:
    """One network port with a readable speed."""

    name: str  # "eth0", "mlx5_0 port 1"
    gbit_s: float
    kind: str  # "ethernet" | "infiniband"
    raw: str  # what sysfs said: "25000 Mb/s", "200 Gb/sec (4X HDR)"


@dataclass(frozen=True)
class NodeFacts:
    """Everything the mapper needs about one node; the query layer's only output."""

    hostname: str
    gpus: tuple[GpuFacts, ...] = ()
    nics: tuple[NicFacts, ...] = ()
    nvlink: bool | None = None  # None: nothing could tell (or fewer than two GPUs)
    nvlink_source: str = ""  # "NVML", "nvidia-smi topo -m"
    host_memory_bytes: int = 0


# ---------------------------------------------------------------------------------------------- query layer

def _read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:  # sysfs answers EINVAL for the speed of a down or virtual link
        return None


def _run(cmd: Sequence[str]) -> str | None:
    """A tool's stdout, or None where it is missing, fails or hangs (a detect must never crash on a tool)."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=_SUBPROCESS_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


_VIRTUAL_PREFIXES = ("docker", "veth", "br-", "virbr", "ifb", "tun", "tap", "dummy", "cni", "flannel", "cali",
                     "vxlan", "kube", "lxc", "wg")


def _is_virtual(iface: Path) -> bool:
    """lo, bridges, veths, tunnels: their 'speed' is not the node's network (bonds are kept: their sum is)."""
    name = iface.name
    if name == "lo" or name.startswith(_VIRTUAL_PREFIXES):
        return True
    return "/devices/virtual/" in str(iface.resolve()) and not name.startswith(("bond", "team"))


def read_nics(sysfs_root: Path = Path("/sys")) -> tuple[NicFacts, ...]:
    """Ethernet speeds (``class/net/*/speed``, Mb/s) and active InfiniBand port rates (``class/infiniband``)."""
    nics: list[NicFacts] = []
    net = sysfs_root / "class" / "net"
    for iface in sorted(net.iterdir()) if net.is_dir() else ():
        if _is_virtual(iface):
            continue
        text = _read_text(iface / "speed")
        speed_mbps = int(text) if text and text.lstrip("-").isdigit() else -1
        if speed_mbps > 0:  # -1: link down or speed unknown (virtio)
            nics.append(NicFacts(iface.name, speed_mbps / 1000.0, "ethernet", f"{speed_mbps} Mb/s"))
    for rate_file in sorted((sysfs_root / "class" / "infiniband").glob("*/ports/*/rate")):
        port = rate_file.parent
        state = _read_text(port / "state")
        rate = _read_text(rate_file) or ""
        match = re.match(r"([\d.]+)\s*Gb/sec", rate)
        if match and float(match.group(1)) > 0 and (state is None or "ACTIVE" in state):  # a down port keeps a rate
            port_name = f"{port.parent.parent.name} port {port.name}"
            nics.append(NicFacts(port_name, float(match.group(1)), "infiniband", rate))
    return tuple(nics)


def parse_smi_gpus(text: str) -> tuple[GpuFacts, ...]:
    """``nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits`` (memory in MiB)."""
    gpus = []
    for line in text.splitlines():
        name, _, mib = line.rpartition(",")
        if name.strip() and mib.strip().isdigit():
            gpus.append(GpuFacts(name.strip(), int(mib.strip()) * 2**20))
    return tuple(gpus)


def read_gpus() -> tuple[GpuFacts, ...]:
    """torch.cuda where it sees devices (CUDA or ROCm), else nvidia-smi (a CPU-only torch on a GPU node)."""
    try:
        import torch

        if torch.cuda.is_available():
            props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
            return tuple(GpuFacts(p.name, int(p.total_memory), (p.major, p.minor)) for p in props)
    except ImportError:
        pass
    text = _run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"])
    return parse_smi_gpus(text) if text else ()


def parse_topo_nvlink(text: str) -> bool | None:
    """True if any GPU pair of ``nvidia-smi topo -m`` is joined by NV#, False if none is, None without GPU rows."""
    rows = [line.split() for line in text.splitlines() if re.match(r"GPU\d+\s", line)]  # not the indented header
    return any(re.fullmatch(r"NV\d+", cell) for row in rows for cell in row) if rows else None


def _nvml_nvlink() -> bool | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return any(_nvml_link_up(pynvml, h, link) for h in handles for link in range(pynvml.NVML_NVLINK_MAX_LINKS))
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _nvml_link_up(pynvml: Any, handle: Any, link: int) -> bool:
    try:
        return bool(pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED)
    except pynvml.NVMLError:  # no such link, or no NVLink on this device
        return False


def read_nvlink(num_gpus: int) -> tuple[bool | None, str]:
    """(NVLink present?, how we know); (None, "") where neither NVML nor nvidia-smi can tell."""
    if num_gpus < 2:
        return None, ""
    found = _nvml_nvlink()
    if found is not None:
        return found, "NVML"
    text = _run(["nvidia-smi", "topo", "-m"])
    found = parse_topo_nvlink(text) if text else None
    return (found, "nvidia-smi topo -m") if found is not None else (None, "")


def _host_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def gather_facts(sysfs_root: Path = Path("/sys")) -> NodeFacts:
    """Query this node: GPUs, NICs, NVLink, host memory."""
    gpus = read_gpus()
    nvlink, source = read_nvlink(len(gpus))
    return NodeFacts(socket.gethostname(), gpus, read_nics(sysfs_root), nvlink, source, _host_memory_bytes())


# ---------------------------------------------------------------------------------------------------- mapper

# (pattern on the lower-cased device name, candidate ids, overrides): the first candidate whose pattern matches AND
# whose catalog memory fits the reported memory wins, so the 40 GB and 80 GB parts of one name pick themselves.
_PCIE_GEN3 = {"intra_node_gbps": 16.0}  # per-direction GB/s: no V100 PCIe 32 GB id, so the SXM2 one over PCIe
_RULES: tuple[tuple[str, tuple[str, ...], dict[str, float]], ...] = (
    (r"gh200", ("gh200_96gb",), {}), (r"\bh200(?!.*nvl)", ("h200_sxm",), {}), (r"\bh100.*pcie", ("h100_pcie",), {}),
    (r"\bh100(?!.*nvl)", ("h100_sxm",), {}),  # "H100 80GB HBM3" is the SXM5 part; H100 NVL (94 GB) has no id
    (r"\bh800(?!.*pcie)", ("h800_sxm",), {}), (r"a100.*pcie", ("a100_pcie_40gb", "a100_pcie_80gb"), {}),
    (r"a100", ("a100_40gb_sxm", "a100_80gb_sxm"), {}), (r"a800.*pcie", ("a800_pcie_40gb", "a800_pcie_80gb"), {}),
    (r"a800", ("a800_sxm_80gb",), {}), (r"\bl40s\b", ("l40s",), {}), (r"\bl40\b", ("l40",), {}),
    (r"\bl4\b", ("l4",), {}), (r"\ba40\b", ("a40",), {}), (r"\ba10\b", ("a10",), {}), (r"rtx a6000", ("rtx_a6000",), {}),
    (r"rtx 4090$", ("rtx_4090",), {}), (r"rtx 3090$", ("rtx_3090",), {}), (r"titan rtx", ("titan_rtx",), {}),
    (r"rtx 2080 ti$", ("rtx_2080_ti",), {}), (r"v100.*pcie", ("v100_16gb_pcie",), {}),
    (r"v100s?.*pcie", ("v100_32gb_sxm2",), _PCIE_GEN3), (r"v100", ("v100_16gb_sxm2", "v100_32gb_sxm2"), {}),
    (r"\bt4\b", ("t4",), {}), (r"p100.*pcie", ("p100_pcie",), {}), (r"p100", ("p100_sxm2",), {}),
    (r"mi300x", ("mi300x",), {}),
)
# CUDA-visible memory is 88-99% of the nominal figure (A100-40GB: 39.5 GiB; L4: 22.5; T4: 14.6).
_MEMORY_FIT = (0.85, 1.05)
_NVLINK_CLASS_GBPS = 64.0  # per-direction GB/s above which a catalog link is NVLink-class, not PCIe


@dataclass(frozen=True)
class GpuMatch:
    gpu: str | dict[str, Any]  # a catalog id, or an inline entry
    overrides: dict[str, float]
    note: str  # "" for a clean catalog match


def map_gpu(gpu: GpuFacts) -> GpuMatch:
    """Catalog id from the device name and memory; an inline entry (with a note) where none fits."""
    name = " ".join(gpu.name.lower().replace("_", " ").split())
    memory_gib = gpu.memory_bytes / 2**30
    near: str | None = None
    for pattern, gpu_ids, overrides in _RULES:
        for gpu_id in gpu_ids if re.search(pattern, name) else ():
            nominal = get_gpu(gpu_id).memory_gib
            if _MEMORY_FIT[0] * nominal <= memory_gib <= _MEMORY_FIT[1] * nominal:
                note = (f"'{gpu.name}' has no catalog id of its own: {gpu_id} with intra_node_gbps "
                        f"{overrides['intra_node_gbps']:g} (PCIe Gen3)") if overrides else ""
                return GpuMatch(gpu_id, dict(overrides), note)
            near = near or gpu_id
    entry: dict[str, Any] = {"id": re.sub(r"[^a-z0-9]+", "_", name).strip("_") or "gpu",
                             "memory_gib": math.floor(memory_gib * 10) / 10,
                             "peak_tflops": INLINE_PEAK_PLACEHOLDER_TFLOPS}
    if gpu.compute_capability is not None:
        entry["bf16_supported"] = gpu.compute_capability >= (8, 0)
    why = (f"looks like {near} but reports {memory_gib:.1f} GiB (a MIG slice or another variant?)" if near
           else "is not in the catalog")
    checks = (f"peak_tflops (PLACEHOLDER {INLINE_PEAK_PLACEHOLDER_TFLOPS:g}: dense fp16/bf16 TFLOPS from its "
              "datasheet), memory_bandwidth_gbps, intra_node_gbps" + ("" if gpu.compute_capability else ", bf16_supported"))
    return GpuMatch(entry, {}, f"GPU '{gpu.name}' {why}: wrote an inline entry '{entry['id']}' with the reported "
                               f"memory ({entry['memory_gib']:g} GiB); FILL IN {checks}")


@dataclass(frozen=True)
class Detected:
    """A cluster spec plus, per node entry, the notes the file and the output carry."""

    spec: dict[str, Any]
    notes: tuple[tuple[str, ...], ...]  # per entry of spec["nodes"]
    fill_in: tuple[frozenset[str], ...]  # per entry: keys whose value is a placeholder ("nic_gbit_s", "gpu")

    @property
    def messages(self) -> tuple[str, ...]:
        return tuple(note for notes in self.notes for note in notes)


def _nic(facts: NodeFacts) -> tuple[float | None, list[str]]:
    host = facts.hostname
    if not facts.nics:
        return None, [(f"{host}: no NIC speed readable (no /sys/class/net/*/speed > 0, no active InfiniBand port): "
                       f"nic_gbit_s {NIC_PLACEHOLDER_GBIT_S:g} is a PLACEHOLDER, FILL IN the node's network speed")]
    best = max(facts.nics, key=lambda n: n.gbit_s)
    same = [n for n in facts.nics if n.kind == best.kind and n.gbit_s == best.gbit_s]
    notes = [f"{host}: nic_gbit_s {best.gbit_s:g} from {best.name} ({best.raw}), fastest of {len(facts.nics)} port(s)"]
    if len(same) > 1:
        notes.append(f"{host}: {len(same)} {best.kind} ports at {best.gbit_s:g} Gb/s: if the job uses them all, set "
                     f"nic_gbit_s to {len(same) * best.gbit_s:g} (and nic_rail_gbit_s: {best.gbit_s:g} for one NIC "
                     "per GPU)")
    return best.gbit_s, notes


def _nvlink_note(facts: NodeFacts, gpu_id: str, overrides: Mapping[str, float], count: int) -> str:
    if count < 2:
        return ""
    link = overrides.get("intra_node_gbps", get_gpu(gpu_id).intra_node_gbps)
    nvlink_class, host, seen = link > _NVLINK_CLASS_GBPS, facts.hostname, facts.nvlink_source
    if facts.nvlink is None:
        return (f"{host}: NVLink unknown (no NVML, no nvidia-smi): the intra-node link is assumed from {gpu_id} "
                f"({link:g} GB/s per direction, {'NVLink' if nvlink_class else 'PCIe'}); CHECK it")
    if facts.nvlink and not nvlink_class:
        return (f"{host}: {seen} shows NVLink, but {gpu_id} is priced over PCIe ({link:g} GB/s): bridges pair GPUs "
                "only, so the catalog figure is kept; raise intra_node_gbps if all are linked")
    if not facts.nvlink and nvlink_class:
        return (f"{host}: {seen} shows no NVLink, but {gpu_id} assumes it ({link:g} GB/s): CHECK, and set "
                "intra_node_gbps to the PCIe figure if the GPUs talk over PCIe")
    return f"{host}: NVLink {'yes' if facts.nvlink else 'no'} ({seen}), as {gpu_id} assumes"


def node_entries(facts: NodeFacts) -> tuple[list[dict[str, Any]], list[list[str]], list[frozenset[str]]]:
    """One cluster-file entry per GPU type of the node (one entry in all for a CPU-only node)."""
    nic_gbit_s, nic_notes = _nic(facts)
    nic_fill = frozenset() if nic_gbit_s is not None else frozenset({"nic_gbit_s"})
    base = {"hostname": facts.hostname, "num_nodes": 1}
    nic = {"nic_gbit_s": nic_gbit_s if nic_gbit_s is not None else NIC_PLACEHOLDER_GBIT_S}
    if not facts.gpus:
        memory_gib = math.floor(facts.host_memory_bytes / 2**30 * 10) / 10 or 1.0
        entry = {**base, "gpu": {"id": "cpu", "memory_gib": memory_gib, "peak_tflops": CPU_PEAK_TFLOPS},
                 "gpus_per_node": 1, **nic}
        note = (f"no GPU found on {facts.hostname}: wrote a CPU-only node (1 x cpu, {memory_gib:g} GiB host memory, "
                f"peak_tflops {CPU_PEAK_TFLOPS:g} as in examples/clusters/cpu_tp.yaml)")
        return [_ordered(entry)], [[note, *nic_notes]], [nic_fill]
    groups: dict[str, tuple[GpuMatch, int]] = {}
    for gpu in facts.gpus:
        match = map_gpu(gpu)
        key = json.dumps(match.gpu, sort_keys=True)
        groups[key] = (match, groups[key][1] + 1 if key in groups else 1)
    entries, notes, fills = [], [], []
    for match, count in groups.values():
        entry = {**base, "gpu": match.gpu, "gpus_per_node": count, **nic, **match.overrides}
        label = match.gpu if isinstance(match.gpu, str) else f"{match.gpu['id']} (inline)"
        group_notes = [f"{facts.hostname}: {count} x {label}"]
        group_notes += [f"{facts.hostname}: {match.note}"] if match.note else []
        if isinstance(match.gpu, str):
            group_notes.append(_nvlink_note(facts, match.gpu, match.overrides, count))
        entries.append(_ordered(entry))
        notes.append([n for n in group_notes + nic_notes if n])
        fills.append(nic_fill | (frozenset({"gpu"}) if isinstance(match.gpu, dict) else frozenset()))
    if len(groups) > 1:
        notes[0].append(f"{facts.hostname} has {len(groups)} GPU types: the file lists them as {len(groups)} nodes "
                        "(one per type); CHECK, or hide all but one type with CUDA_VISIBLE_DEVICES")
    return entries, notes, fills


def _ordered(entry: dict[str, Any]) -> dict[str, Any]:
    order = ("hostname", "gpu", "num_nodes", "gpus_per_node", "nic_gbit_s")
    return {**{k: entry[k] for k in order}, **{k: v for k, v in entry.items() if k not in order}}


def detect_cluster(nodes: Sequence[NodeFacts]) -> Detected:
    """The cluster spec of these nodes, in the given (node-rank) order; validated with the repo's own loader."""
    if not nodes:
        raise UserError("no node described: nothing to write")
    entries, notes, fills = [], [], []
    for facts in nodes:
        e, n, f = node_entries(facts)
        entries += e
        notes += [tuple(x) for x in n]
        fills += f
    spec = {"nodes": entries}
    cluster_from_dict(spec)  # a bug here is ours: the file must load
    return Detected(spec, tuple(notes), tuple(fills))


# ---------------------------------------------------------------------------------------------------- writer

def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(int(value)) if float(value).is_integer() else repr(float(value))
    return json.dumps(str(value))  # a JSON string is a YAML double-quoted scalar


def cluster_yaml(detected: Detected, name: str | None = None) -> str:
    """The cluster file: each entry with its notes as comments, placeholders marked FILL IN."""
    hosts = ", ".join(dict.fromkeys(e["hostname"] for e in detected.spec["nodes"]))
    lines = [f"# {name or 'cluster'}: written by `ethpipe cluster detect` on {hosts}.",
             "# Node order = node rank order (ethpipe launch --hosts). Check every line marked FILL IN or CHECK.",
             "nodes:"]
    for entry, notes, fill in zip(detected.spec["nodes"], detected.notes, detected.fill_in, strict=True):
        lines += [f"  # {note}" for note in notes]
        for i, (key, value) in enumerate(entry.items()):
            text = ("{" + ", ".join(f"{k}: {_scalar(v)}" for k, v in value.items()) + "}" if isinstance(value, dict)
                    else _scalar(value))
            mark = "  # FILL IN" if key in fill else ""
            lines.append(f"  {'- ' if i == 0 else '  '}{key}: {text}{mark}")
    text = "\n".join(lines) + "\n"
    if yaml.safe_load(text) != detected.spec:  # the writer must round-trip what the mapper made
        raise RuntimeError("cluster_yaml wrote a file that does not read back as its spec")
    return text
