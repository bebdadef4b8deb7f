"""What the evaluation runs: clusters users actually have, models at 1, 4 and 16 samples per GPU.

The throughput section uses global batch = samples per GPU x GPUs (SAMPLES_PER_GPU), so every
cluster is seen with little and with much data per GPU. The other sections keep the recipe batches:
global batches follow the models' training recipes: GPT-3 1.3B/2.7B used 1M tokens (512 x 2048),
6.7B 2M tokens (1024 x 2048); Llama 2 used 4M tokens (1024 x 4096). On clusters with more GPUs
than samples the batch grows to one sample per GPU (a plan must give every pipeline >= 1 sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from ethpipe.cluster import Cluster, cluster_from_dict

REPO = Path(__file__).resolve().parents[2]
CLUSTER_DIR = REPO / "examples" / "clusters"


@dataclass(frozen=True)
class ClusterScenario:
    key: str  # short name used in file names
    file: str  # under examples/clusters/
    label: str  # what a reader calls it


@dataclass(frozen=True)
class ModelScenario:
    name: str
    global_batch: int
    seq_len: int


CLUSTERS = (
    ClusterScenario("a100_v100_16", "eval_a100_v100_16.yaml", "8x A100-80 + 8x V100-32"),
    ClusterScenario("a100_v100_t4_48", "eval_a100_v100_t4_48.yaml", "16x A100-40 + 16x V100-16 + 16x T4"),
    ClusterScenario("h100_a100_l4_128", "eval_h100_a100_l4_128.yaml", "32x H100 + 64x A100-80 + 32x L4"),
    ClusterScenario("mix4_1024", "eval_mix4_1024.yaml",
                    "1024 GPUs: 256 H100 + 384 A100-80 + 256 A100-40 + 128 V100-32"),
    ClusterScenario("a100_80_40_32", "eval_a100_80_40_32.yaml", "16x A100-80 + 16x A100-40 (mild)"),
)
MODELS = (
    ModelScenario("gpt3-1.3b", 512, 2048),
    ModelScenario("gpt3-2.7b", 512, 2048),
    ModelScenario("gpt3-6.7b", 1024, 2048),
    ModelScenario("llama2-7b", 1024, 4096),
    ModelScenario("llama2-13b", 1024, 4096),
    ModelScenario("llama2-70b", 1024, 4096),
)
QUICK_CLUSTERS = ("a100_v100_16", "a100_80_40_32")
QUICK_MODELS = ("gpt3-1.3b", "llama2-7b")

# Throughput section: samples per GPU; global batch = samples per GPU x GPUs.
SAMPLES_PER_GPU = (1, 4, 16)
QUICK_SAMPLES_PER_GPU = (1, 16)
# Clusters whose throughput rows use a subset of MODELS (the others use all of them): planning and
# replaying the 1024-GPU cluster takes 10-90 s per case (llama2-70b at 16 samples per GPU over five
# minutes), so it keeps a small and a mid-size model to keep the whole run within its time budget.
THROUGHPUT_MODELS: dict[str, tuple[str, ...]] = {"mix4_1024": ("gpt3-1.3b", "llama2-7b")}

SHORT_NAMES = {
    "h100_sxm": "H100", "a100_80gb_sxm": "A100-80", "a100_40gb_sxm": "A100-40", "v100_32gb_sxm2": "V100-32",
    "v100_16gb": "V100-16", "t4": "T4", "l4": "L4",
}

# Search-time clusters: 8 GPUs per node; 2 types at 16 GPUs, 4 types (equal node shares) from 32 on.
SEARCH_TYPES = (("h100_sxm", 3200), ("a100_80gb_sxm", 1600), ("a100_40gb_sxm", 1600), ("v100_32gb_sxm2", 800))
SEARCH_MODEL = ModelScenario("llama2-7b", 1024, 4096)
SEARCH_SIZES = (16, 64, 256, 1024, 4096)  # every other size of the sweep, to keep the run within budget
QUICK_SEARCH_SIZES = (16, 64)

# Sensitivity: 16 fast + 16 slow GPUs (2 nodes each) with the same memory; the slow type's peak is
# the fast one's divided by the ratio. The bandwidth sweep uses catalog A100-80 + V100-32.
SENSITIVITY_MODEL = ModelScenario("llama2-7b", 1024, 4096)
SPEED_RATIOS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)
QUICK_SPEED_RATIOS = (1.0, 2.0, 8.0)
NIC_GBIT_S = (25, 50, 100, 200, 400, 800, 1600, 3200)
QUICK_NIC_GBIT_S = (100, 1600)

ABLATION_CASES = (("a100_v100_16", "llama2-7b"), ("a100_v100_t4_48", "llama2-7b"), ("h100_a100_l4_128", "llama2-13b"),
                  ("mix4_1024", "llama2-7b"), ("a100_80_40_32", "llama2-70b"))
QUICK_ABLATION_CASES = (("a100_v100_16", "gpt3-1.3b"),)


def short(device: str) -> str:
    return SHORT_NAMES.get(device, device)


def cluster_spec(scenario: ClusterScenario) -> dict:
    return yaml.safe_load((CLUSTER_DIR / scenario.file).read_text())


def load(scenario: ClusterScenario) -> Cluster:
    return cluster_from_dict(cluster_spec(scenario))


def model_scenario(name: str) -> ModelScenario:
    return next(m for m in MODELS if m.name == name)


def cluster_scenario(key: str) -> ClusterScenario:
    return next(c for c in CLUSTERS if c.key == key)


def batch_for(model: ModelScenario, num_gpus: int) -> int:
    return max(model.global_batch, num_gpus)


def search_cluster_spec(num_gpus: int) -> dict:
    types = (SEARCH_TYPES[1], SEARCH_TYPES[3]) if num_gpus <= 16 else SEARCH_TYPES
    nodes = num_gpus // 8
    counts = [nodes // len(types) + (1 if i < nodes % len(types) else 0) for i in range(len(types))]
    return {"nodes": [{"gpu": t, "num_nodes": c, "gpus_per_node": 8, "nic_gbit_s": nic}
                      for (t, nic), c in zip(types, counts) if c]}


def ratio_cluster_spec(ratio: float) -> dict:
    fast = {"id": "fast", "memory_gib": 80, "peak_tflops": 312.0, "efficiency": 0.5, "intra_node_gbps": 300.0,
            "memory_bandwidth_gbps": 2039.0}
    slow = {**fast, "id": "slow", "peak_tflops": 312.0 / ratio}
    return {"nodes": [{"gpu": fast, "num_nodes": 2, "gpus_per_node": 8, "nic_gbit_s": 1600},
                      {"gpu": slow, "num_nodes": 2, "gpus_per_node": 8, "nic_gbit_s": 1600}]}


def bandwidth_cluster_spec(nic_gbit_s: float) -> dict:
    return {"nodes": [{"gpu": "a100_80gb_sxm", "num_nodes": 2, "gpus_per_node": 8, "nic_gbit_s": nic_gbit_s},
                      {"gpu": "v100_32gb_sxm2", "num_nodes": 2, "gpus_per_node": 8, "nic_gbit_s": nic_gbit_s}]}
