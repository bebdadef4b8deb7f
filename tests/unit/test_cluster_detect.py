"""`ethpipe cluster detect`: faked query-layer facts (and a fake sysfs tree) through the real mapper and writer."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import ethpipe.cli.commands  # noqa: F401  (registers the commands on the app)
from ethpipe.cli.app import app
from ethpipe.cli.cluster_cmds import world_from_env
from ethpipe.cluster import cluster_from_dict, load_cluster
from ethpipe.cluster_detect import (
    NIC_PLACEHOLDER_GBIT_S,
    GpuFacts,
    NicFacts,
    NodeFacts,
    cluster_yaml,
    detect_cluster,
    map_gpu,
    parse_smi_gpus,
    parse_topo_nvlink,
    read_nics,
)
from ethpipe.errors import UserError

MIB = 2**20
ETH_25G = NicFacts("eth0", 25.0, "ethernet", "25000 Mb/s")

# CUDA-visible total memory as the devices report it (torch.cuda.get_device_properties(i).total_memory).
KNOWN = [
    ("NVIDIA H100 80GB HBM3", 85_520_809_984, "h100_sxm"),
    ("NVIDIA A100-SXM4-40GB", 42_505_273_344, "a100_40gb_sxm"),
    ("NVIDIA A100-SXM4-80GB", 85_198_045_184, "a100_80gb_sxm"),
    ("NVIDIA A100 80GB PCIe", 85_198_045_184, "a100_pcie_80gb"),
    ("Tesla V100-SXM2-32GB", 34_089_730_048, "v100_32gb_sxm2"),
    ("Tesla V100-SXM2-16GB", 16_945_512_448, "v100_16gb_sxm2"),
    ("NVIDIA L4", 23_034 * MIB, "l4"),
    ("Tesla T4", 15_655_829_504, "t4"),
    ("NVIDIA GeForce RTX 4090", 25_393_692_672, "rtx_4090"),
]


def _load(text: str):
    return cluster_from_dict(yaml.safe_load(text))


@pytest.mark.parametrize("name, memory_bytes, gpu_id", KNOWN)
def test_known_gpus_map_to_catalog_ids_and_the_file_loads(name: str, memory_bytes: int, gpu_id: str) -> None:
    facts = NodeFacts("gpu-01", (GpuFacts(name, memory_bytes, (8, 0)),) * 4, (ETH_25G,), nvlink=None)
    detected = detect_cluster([facts])
    entry = detected.spec["nodes"][0]
    assert entry["gpu"] == gpu_id and entry["gpus_per_node"] == 4 and entry["nic_gbit_s"] == 25.0
    cluster = _load(cluster_yaml(detected))
    assert cluster.num_devices == 4 and cluster.gpu_types == (gpu_id,)
    assert cluster.source["nodes"][0]["hostname"] == "gpu-01"
    assert any("NVLink unknown" in m for m in detected.messages)  # four GPUs, nothing told: marked unknown


def test_v100_pcie_32gb_uses_the_sxm2_id_over_pcie() -> None:
    match = map_gpu(GpuFacts("Tesla V100-PCIE-32GB", 34_089_730_048))
    assert match.gpu == "v100_32gb_sxm2" and match.overrides == {"intra_node_gbps": 16.0} and "PCIe" in match.note


@pytest.mark.parametrize("name, memory_bytes, why", [
    ("NVIDIA A10G", 23_836_033_024, "is not in the catalog"),
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", 4_864 * MIB, "looks like a100_40gb_sxm"),  # the name matches, memory not
])
def test_unknown_gpu_becomes_inline_entry_naming_fields_to_check(name: str, memory_bytes: int, why: str) -> None:
    facts = NodeFacts("odd-01", (GpuFacts(name, memory_bytes, (8, 6)),) * 2, (ETH_25G,), nvlink=False,
                      nvlink_source="nvidia-smi topo -m")
    detected = detect_cluster([facts])
    gpu = detected.spec["nodes"][0]["gpu"]
    assert isinstance(gpu, dict) and gpu["memory_gib"] == pytest.approx(memory_bytes / 2**30, abs=0.1)
    assert gpu["bf16_supported"] is True  # compute capability 8.6
    message = next(m for m in detected.messages if "inline entry" in m)
    assert why in message and "peak_tflops" in message and "memory_bandwidth_gbps" in message
    text = cluster_yaml(detected)
    assert "gpu: {id: " in text and "# FILL IN" in text.split("gpu: {")[1].splitlines()[0]
    cluster = _load(text)
    assert cluster.devices[0].gpu.memory_gib == pytest.approx(gpu["memory_gib"])


def _iface(root: Path, name: str, speed: str) -> None:
    (root / "class" / "net" / name).mkdir(parents=True)
    (root / "class" / "net" / name / "speed").write_text(speed + "\n")


def _ib_port(root: Path, dev: str, port: int, rate: str, state: str = "4: ACTIVE") -> None:
    path = root / "class" / "infiniband" / dev / "ports" / str(port)
    path.mkdir(parents=True)
    (path / "rate").write_text(rate + "\n")
    (path / "state").write_text(state + "\n")


def test_ethernet_speed_in_mbps_becomes_gbit_s_skipping_lo_and_virtual(tmp_path: Path) -> None:
    _iface(tmp_path, "eth0", "25000")
    _iface(tmp_path, "lo", "100000")
    _iface(tmp_path, "docker0", "100000")
    virtual = tmp_path / "devices" / "virtual" / "net" / "ens9"
    virtual.mkdir(parents=True)
    (virtual / "speed").write_text("400000\n")
    (tmp_path / "class" / "net" / "ens9").symlink_to(virtual)
    nics = read_nics(tmp_path)
    assert [(n.name, n.gbit_s) for n in nics] == [("eth0", 25.0)]
    entry = detect_cluster([NodeFacts("n", nics=nics)]).spec["nodes"][0]
    assert entry["nic_gbit_s"] == 25.0


def test_infiniband_rate_wins_over_slower_ethernet_and_down_ports_are_skipped(tmp_path: Path) -> None:
    _iface(tmp_path, "eth0", "25000")
    _ib_port(tmp_path, "mlx5_0", 1, "200 Gb/sec (4X HDR)")
    _ib_port(tmp_path, "mlx5_1", 1, "400 Gb/sec (4X NDR)", state="1: DOWN")
    nics = read_nics(tmp_path)
    detected = detect_cluster([NodeFacts("ib-01", nics=nics)])
    assert detected.spec["nodes"][0]["nic_gbit_s"] == 200.0
    assert any("mlx5_0 port 1 (200 Gb/sec (4X HDR))" in m for m in detected.messages)


def test_several_equal_ib_ports_suggest_their_sum() -> None:
    nics = tuple(NicFacts(f"mlx5_{i} port 1", 200.0, "infiniband", "200 Gb/sec (4X HDR)") for i in range(8))
    detected = detect_cluster([NodeFacts("dgx", nics=nics)])
    assert detected.spec["nodes"][0]["nic_gbit_s"] == 200.0
    assert any("nic_gbit_s to 1600" in m and "nic_rail_gbit_s: 200" in m for m in detected.messages)


def test_no_readable_nic_writes_a_marked_placeholder(tmp_path: Path) -> None:
    _iface(tmp_path, "eth0", "-1")  # virtio: speed unknown
    nics = read_nics(tmp_path)
    assert nics == ()
    detected = detect_cluster([NodeFacts("vm-01", (GpuFacts("NVIDIA L4", 23_034 * MIB),), nics)])
    assert detected.spec["nodes"][0]["nic_gbit_s"] == NIC_PLACEHOLDER_GBIT_S
    assert any("PLACEHOLDER" in m and "FILL IN" in m for m in detected.messages)
    nic_line = next(line for line in cluster_yaml(detected).splitlines() if "nic_gbit_s:" in line)
    assert nic_line.endswith("# FILL IN")


def test_nvlink_facts_are_checked_against_the_catalog_link() -> None:
    gpus = (GpuFacts("NVIDIA A100-SXM4-80GB", 85_198_045_184),) * 8
    said_yes = detect_cluster([NodeFacts("a", gpus, (ETH_25G,), True, "NVML")]).messages
    said_no = detect_cluster([NodeFacts("a", gpus, (ETH_25G,), False, "nvidia-smi topo -m")]).messages
    assert any("NVLink yes (NVML)" in m for m in said_yes)
    assert any("shows no NVLink" in m and "CHECK" in m for m in said_no)


def test_topo_and_smi_parsers() -> None:
    topo = ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV12\t0-63\nGPU1\tNV12\t X \t0-63\n\nLegend:\n  X    = Self\n"
            "  NV#  = Connection traversing a bonded set of # NVLinks\n")
    assert parse_topo_nvlink(topo) is True
    assert parse_topo_nvlink(topo.replace("NV12", "PHB")) is False
    assert parse_topo_nvlink("No devices were found\n") is None
    assert parse_smi_gpus("NVIDIA H100 80GB HBM3, 81559\nTesla T4, 15360\n") == (
        GpuFacts("NVIDIA H100 80GB HBM3", 81559 * MIB), GpuFacts("Tesla T4", 15360 * MIB))


def test_nodes_keep_their_order_and_mixed_gpu_node_is_flagged() -> None:
    first = NodeFacts("node-a", (GpuFacts("NVIDIA H100 80GB HBM3", 85_520_809_984),) * 8, (ETH_25G,))
    mixed = NodeFacts("node-b", (GpuFacts("NVIDIA GeForce RTX 4090", 25_393_692_672),
                                 GpuFacts("Tesla T4", 15_655_829_504)), (ETH_25G,))
    detected = detect_cluster([first, mixed])
    nodes = detected.spec["nodes"]
    assert [(n["hostname"], n["gpu"], n["gpus_per_node"]) for n in nodes] == [
        ("node-a", "h100_sxm", 8), ("node-b", "rtx_4090", 1), ("node-b", "t4", 1)]
    assert any("node-b has 2 GPU types" in m for m in detected.messages)
    assert [d.node for d in _load(cluster_yaml(detected)).devices][-2:] == [1, 2]


def test_hostname_field_round_trips_and_names_one_node() -> None:
    spec = {"nodes": [{"gpu": "l4", "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 50, "hostname": "l4-07"}]}
    source = cluster_from_dict(spec).source
    assert source["nodes"][0]["hostname"] == "l4-07"
    assert cluster_from_dict(source).source == source
    assert "hostname" not in cluster_from_dict({"nodes": [{**spec["nodes"][0], "hostname": None}]}).source["nodes"][0]
    with pytest.raises(UserError, match="names one node") as err:
        cluster_from_dict({"nodes": [{**spec["nodes"][0], "num_nodes": 2}]})
    assert "\n" not in str(err.value)


def test_world_from_env_reads_torchrun_and_srun() -> None:
    assert world_from_env({}) is None
    assert world_from_env({"RANK": "0", "WORLD_SIZE": "1"}) is None
    tr = world_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1"})
    assert tr is not None and (tr.rank, tr.local_rank, tr.node_rank, tr.init_method) == (3, 1, 1, "env://")
    srun = world_from_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NODEID": "1",
                           "SLURM_JOB_NODELIST": "gpu[07-08],cpu1"})
    assert srun is not None and srun.init_method == "tcp://gpu07:29500" and srun.node_rank == 1
    with pytest.raises(UserError, match="not an integer"):
        world_from_env({"RANK": "x", "WORLD_SIZE": "2"})


def _no_gpu_here() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            return False
    except ImportError:
        pass
    return shutil.which("nvidia-smi") is None


cpu_only = pytest.mark.skipif(not _no_gpu_here(), reason="this machine has a GPU")


@cpu_only
def test_cli_on_this_machine_writes_loadable_cpu_only_cluster(tmp_path: Path) -> None:
    out = tmp_path / "here.yaml"
    res = CliRunner().invoke(app, ["cluster", "detect", "--out", str(out), "--name", "mine", "--local"])
    assert res.exit_code == 0, res.output
    assert f"no GPU found on {socket.gethostname()}: wrote a CPU-only node" in res.output
    assert f"wrote {out}" in res.output
    cluster = load_cluster(out)
    assert cluster.num_devices == 1 and cluster.gpu_types == ("cpu",)
    assert cluster.source["nodes"][0]["hostname"] == socket.gethostname()
    assert out.read_text().startswith("# mine: ")


@cpu_only
def test_cli_refuses_to_overwrite_without_force(tmp_path: Path) -> None:
    out = tmp_path / "c.yaml"
    out.write_text("keep me\n")
    fake_sys = tmp_path / "sys"
    _iface(fake_sys, "eth0", "25000")
    args = ["cluster", "detect", "--out", str(out), "--local", "--sysfs-root", str(fake_sys)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2 and "--force" in res.output and len(res.output.strip().splitlines()) == 1
    assert out.read_text() == "keep me\n"
    res = CliRunner().invoke(app, [*args, "--force"])
    assert res.exit_code == 0, res.output
    assert load_cluster(out).devices[0].nic_gbps == 25.0 / 8
    res = CliRunner().invoke(app, ["cluster", "detect", "--out", str(tmp_path), "--local"])
    assert res.exit_code == 2 and "is a directory" in res.output


@cpu_only
def test_two_process_world_gathers_both_nodes_in_node_order(tmp_path: Path) -> None:
    """Two real processes over gloo (env:// as torchrun sets it): rank 0 writes one file with both nodes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fake_sys = tmp_path / "sys1"
    _iface(fake_sys, "eth0", "100000")
    out = tmp_path / "world.yaml"
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "GROUP_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        sysfs = str(fake_sys) if rank == 1 else str(tmp_path / "empty")
        procs.append(subprocess.Popen([sys.executable, "-m", "ethpipe", "cluster", "detect", "--out", str(out),
                                       "--sysfs-root", sysfs], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    nodes = load_cluster(out).source["nodes"]
    assert [n["nic_gbit_s"] for n in nodes] == [NIC_PLACEHOLDER_GBIT_S, 100.0]  # node rank 0 first
    assert "wrote" in outputs[0] and outputs[1].strip() == ""
