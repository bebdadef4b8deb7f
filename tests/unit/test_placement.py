"""Ranks on the devices the plan assumed: the start-up placement check, the one-world check, device names."""

from __future__ import annotations

import pytest

from ethpipe.catalog import check_one_world, get_gpu
from ethpipe.cluster import cluster_from_dict
from ethpipe.errors import UserError
from ethpipe.model_load import load_model_spec
from ethpipe.planner import PlannerOptions, make_plan
from ethpipe.runtime.start.placement import DeviceInfo, check_placement, device_matches, identify_gpu

GIB = 2**30
# (name torch reports, total memory it reports in GiB, catalog id)
REPORTED = [
    ("NVIDIA H100 80GB HBM3", 79.1, "h100_sxm"),
    ("NVIDIA H100 PCIe", 79.1, "h100_pcie"),
    ("NVIDIA H200", 139.8, "h200_sxm"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100_40gb_sxm"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "a100_80gb_sxm"),
    ("NVIDIA A100 80GB PCIe", 79.2, "a100_pcie_80gb"),
    ("Tesla V100-SXM2-32GB", 31.7, "v100_32gb_sxm2"),
    ("Tesla V100-SXM2-16GB", 15.8, "v100_16gb_sxm2"),
    ("Tesla V100-PCIE-16GB", 15.8, "v100_16gb_pcie"),
    ("NVIDIA L4", 22.5, "l4"),
    ("NVIDIA L40S", 44.4, "l40s"),
    ("Tesla T4", 14.7, "t4"),
    ("NVIDIA GeForce RTX 4090", 23.6, "rtx_4090"),
    ("NVIDIA RTX A6000", 47.5, "rtx_a6000"),
    ("NVIDIA A10G", 22.3, "a10"),
]


@pytest.mark.parametrize("name,gib,want", REPORTED)
def test_reported_devices_identify_and_match_their_catalog_type(name: str, gib: float, want: str) -> None:
    assert identify_gpu(name, int(gib * GIB)) == want
    assert device_matches(get_gpu(want), DeviceInfo("h", "cuda", name, int(gib * GIB), "8.0"), inline=False)


@pytest.mark.parametrize("name,gib,planned", [
    ("NVIDIA L4", 22.5, "l40"),  # "l4" is not "l40" (whole words)
    ("NVIDIA L4", 22.5, "h100_sxm"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100_80gb_sxm"),  # the memory tells the 40 GB part
    ("NVIDIA A100 80GB PCIe", 79.2, "a100_80gb_sxm"),  # the form factor both name
    ("NVIDIA H200", 139.8, "gh200_96gb"),
])
def test_other_devices_do_not_match(name: str, gib: float, planned: str) -> None:
    assert not device_matches(get_gpu(planned), DeviceInfo("h", "cuda", name, int(gib * GIB)), inline=False)


def test_the_sm_count_tells_form_factors_apart_and_no_fit_is_none() -> None:
    sxm_name = "NVIDIA H100 80GB HBM3"
    assert identify_gpu(sxm_name, int(79.1 * GIB), multiprocessors=132) == "h100_sxm"
    assert identify_gpu(sxm_name, int(79.1 * GIB), multiprocessors=114) == "h100_pcie"
    assert not device_matches(get_gpu("h100_sxm"), DeviceInfo("h", "cuda", sxm_name, int(79.1 * GIB),
                                                                multiprocessors=114), inline=False)
    assert identify_gpu("NVIDIA H100 NVL", int(93.6 * GIB)) == "h100_nvl"  # the 94 GB H100 NVL entry
    assert identify_gpu("Tesla V100-PCIE-32GB", int(31.7 * GIB)) is None  # nor a 32 GB PCIe V100
    assert identify_gpu("Some Unknown Accelerator", int(16 * GIB)) is None


def _plan(nodes: list[dict]):  # type: ignore[no-untyped-def]
    cluster = cluster_from_dict({"nodes": nodes})
    return make_plan(cluster, load_model_spec("gpt3-350m"), 16, 1024, max_tp=1,
                     options=PlannerOptions(allow_idle=False))


def test_a_rank_on_another_gpu_type_gets_one_line_naming_rank_host_devices_and_fix() -> None:
    plan = _plan([{"gpu": "h100_sxm", "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 400},
                  {"gpu": "l4", "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 100}])
    devices = [d.gpu.id for d in plan.active_cluster().devices]
    reported = {"h100_sxm": ("NVIDIA H100 80GB HBM3", 79.1), "l4": ("NVIDIA L4", 22.5)}
    right = [DeviceInfo(f"node{i // 2}", "cuda", reported[d][0], int(reported[d][1] * GIB), "9.0")
             for i, d in enumerate(devices)]
    check_placement(plan, right)
    swapped = right[2:] + right[:2]  # torchrun numbered the L4 node first
    with pytest.raises(UserError) as err:
        check_placement(plan, swapped)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("rank 0 on host node1 runs on NVIDIA L4 (22.5 GiB, compute capability 9.0)")
    assert "h100_sxm" in text and "--node-rank" in text and "re-plan" in text
    check_placement(plan, [DeviceInfo("cpu-host", "cpu", "cpu")] * len(devices))  # a CPU run: no check


def test_an_inline_gpu_matches_by_memory_within_ten_percent() -> None:
    gpu = {"id": "mystery", "memory_gib": 40, "peak_tflops": 100}
    plan = _plan([{"gpu": gpu, "num_nodes": 1, "gpus_per_node": 2, "nic_gbit_s": 100}])
    check_placement(plan, [DeviceInfo("h", "cuda", "Vendor X 40G", int(37 * GIB))] * 2)
    with pytest.raises(UserError, match="rank 0 on host h runs on Vendor X"):
        check_placement(plan, [DeviceInfo("h", "cuda", "Vendor X", int(35 * GIB))] * 2)


def test_a_world_of_two_vendors_or_without_nccl_is_refused_at_plan_time() -> None:
    with pytest.raises(UserError) as err:
        _plan([{"gpu": "h100_sxm", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 400},
               {"gpu": "mi300x", "num_nodes": 1, "gpus_per_node": 8, "nic_gbit_s": 400}])
    assert str(err.value) == ("the cluster mixes NVIDIA 'h100_sxm' (NCCL) and AMD 'mi300x' (RCCL): one training "
                              "world needs one collective library; plan each vendor's nodes as their own cluster")
    with pytest.raises(UserError, match="'tpu_v4' .*trains with XLA, not NCCL"):
        _plan([{"gpu": "tpu_v4", "num_nodes": 1, "gpus_per_node": 4, "nic_gbit_s": 400}])
    check_one_world([get_gpu("mi300x"), get_gpu("mi250x")])  # one vendor: fine
    inline = cluster_from_dict({"nodes": [{"gpu": {"id": "x", "memory_gib": 8, "peak_tflops": 1}, "num_nodes": 1,
                                           "gpus_per_node": 1, "nic_gbit_s": 1}]}).devices[0].gpu
    check_one_world([inline, get_gpu("h100_sxm")])  # inline devices (the CPU demo's) go anywhere
