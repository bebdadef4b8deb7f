"""Zorse's measured decoder layers in 16-bit, as calibration observations (a converter; the data is not shipped).

Source: Zorse artifact, benson-guo/zorse commit 2fd6330 (MIT), ``data/model_latencies.json``. The CI checkout
has the shared data beside the clone (``<repo>/../shared/reference/measured/zorse``); ``zorse_root`` returns
None when it is absent so callers can skip with a reason.

What was measured (the artifact's ``utils/runtime_estimator.py``): one transformer layer, fp32 parameters
under ``torch.autocast(float16)`` (ethpipe's runtime's scheme), forward 15 times and
``output.backward(grad, retain_graph=True)`` 15 times (weight gradients accumulate into fp32 ``.grad``), each
time the **sum of GPU kernel durations** from a profiler trace: no host gaps, no launch latency. So each
point is priced without the per-layer host term and without the launch floor (``layer_passes=0``,
``launch_floor=False``), as the per-op profiles are. Attention: FlashAttention-2 on Ampere and newer, SDPA on
Volta / Turing / Pascal P100 (multi-head: the memory-efficient kernel), eager on the P40 (the s x s scores).

Used: the decoder layers whose shapes the README gives and whose cells hold the per-micro-batch timings (three
Llama shapes, HF and Meta-style, MHA), fp16, every GPU with a catalog entry. Left out: the GPT-2 blocks (their
cells keep only Zorse's fitted lines, converted here but skipped: no timings), encoder models (BERT, ViT: no
causal mask), the ``gpt_*`` shapes (not documented), fp32 (16-bit prices are the point; fp32 is fitted on the
Sailor and Aceso data), GPUs the catalog lacks (listed by ``missing_gpus``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ethpipe.catalog import gpu_catalog
from ethpipe.cost import calibrate as cal
from ethpipe.cost.profile import LayerTiming, MeasuredProfile
from ethpipe.model_spec import ModelSpec

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE = "Zorse artifact, benson-guo/zorse commit 2fd6330, fp16-autocast layer kernel times (data/model_latencies.json)"

GPU_IDS = {  # Zorse's key -> ethpipe catalog id (None: no catalog entry yet)
    "a100x40": "a100_40gb_sxm", "a100x80": "a100_80gb_sxm", "h100-nvl": "h100_nvl", "a10g": "a10g", "l4": "l4",
    "l40s": "l40s", "a6000": "rtx_a6000", "t4": "t4", "v100x16": "v100_16gb_sxm2", "v100x32": "v100_32gb_sxm2",
    "v100-pciex16": "v100_16gb_pcie", "v100": "v100_16gb", "p100": "p100", "p40": "p40", "rtx3090": "rtx_3090",
    "rtx_3090": "rtx_3090", "w6800": None,
}
EAGER_ATTENTION = {"p40"}
# Autocast's 16-bit copy of each weight is made once per autocast region: the forwards here are priced without it
# (one region over the timed iterations). Pricing a cast in every forward was tried and fits worse (leave one
# model out, median |error|: T4 14.8% -> 21.1%, L4 9.5% -> 13.4%), so the data shows no per-forward cast.  # the artifact runs eager attention there: the s x s scores

_LLAMA = dict(activation="swiglu", norm="rmsnorm", position="rope", vocab_size=32000, max_seq_len=4096)
_GPT = dict(activation="gelu", norm="layernorm", position="learned", attention_bias=True, mlp_bias=True,
            vocab_size=50304, max_seq_len=4096)


def _llama(name: str, h: int, f: int, heads: int) -> ModelSpec:
    return ModelSpec(name=name, num_layers=1, hidden_size=h, num_heads=heads, num_kv_heads=heads,
                     ffn_hidden_size=f, **_LLAMA)


def _gpt(name: str, h: int, heads: int) -> ModelSpec:
    return ModelSpec(name=name, num_layers=1, hidden_size=h, num_heads=heads, num_kv_heads=heads,
                     ffn_hidden_size=4 * h, **_GPT)


MODELS = {  # the README's shapes; one name per shape (the HF and Meta-style Llama layers are one model)
    "deepspeedllama_tiny": _llama("zorse-llama-tiny", 2048, 5632, 32),
    "deepspeedllama_3b": _llama("zorse-llama-3b", 3200, 8640, 32),
    "deepspeedllama_13b": _llama("zorse-llama-13b", 5120, 13824, 40),
    "deepspeedgpt_1.3b": _gpt("zorse-gpt-1.3b", 2048, 128),
    "deepspeedgpt_2.7b": _gpt("zorse-gpt-2.7b", 2560, 80),
    "deepspeedgpt_6.7b": _gpt("zorse-gpt-6.7b", 4096, 128),
}
MODELS.update({k.replace("deepspeedllama_", "deepspeedllamav2_"): v for k, v in list(MODELS.items())
               if k.startswith("deepspeedllama_")})


@dataclass(frozen=True)
class ZorsePoint:
    key: str  # Zorse's GPU key
    gpu: str  # catalog id
    model: str  # ethpipe model name
    seq_len: int
    obs: cal.Observation


def zorse_root(repo_root: Path = REPO_ROOT) -> Path | None:
    root = Path(repo_root).parent / "shared" / "reference" / "measured" / "zorse"
    return root if (root / "model_latencies.json").is_file() else None


def missing_gpus(root: Path) -> list[str]:
    """Zorse GPU keys with 16-bit data and no catalog entry."""
    data = json.loads((root / "model_latencies.json").read_text())
    keys = {g for m in data.values() for g, by_seq in m.items() if any("float16" in d for d in by_seq.values())}
    catalog = gpu_catalog()
    return sorted(k for k in keys if GPU_IDS.get(k) not in catalog)


def points(root: Path) -> list[ZorsePoint]:
    """Every fp16 forward and backward of the used models on catalog GPUs, one observation each."""
    data = json.loads((root / "model_latencies.json").read_text())
    catalog = gpu_catalog()
    out = []
    for zmodel, spec in MODELS.items():
        for key, by_seq in data.get(zmodel, {}).items():
            gpu_id = GPU_IDS.get(key)
            if gpu_id not in catalog:
                continue
            for seq, by_dtype in by_seq.items():
                cell = by_dtype.get("float16")
                if not isinstance(cell, list) or len(cell) != 4:  # some cells keep only the fitted lines
                    continue
                _, _, fwd_ms, bwd_ms = cell
                layers = {"block": {b + 1: LayerTiming(f / 1e3, g / 1e3)
                                    for b, (f, g) in enumerate(zip(fwd_ms, bwd_ms)) if f > 0 and g > 0}}
                profile = MeasuredProfile(f"cuda: zorse {key}", "cuda", "fp16", spec.to_dict(), int(seq), layers, 0.0,
                                          attention="materialised" if key in EAGER_ATTENTION else "auto",
                                          grad_accumulation="autocast",  # plain autocast over fp32 weights
                                          layer_code="hf")  # transformers' eager layer, fp32 stream
                for o in cal.observations(profile, catalog[gpu_id]):
                    o = cal.Observation(o.arch, o.gpu, o.model, o.kind, o.backward, o.micro_batch, o.tp, o.measured_s,
                                        o.terms, o.comm_s, layer_passes=0.0, launch_floor=False)
                    out.append(ZorsePoint(key, gpu_id, spec.name, int(seq), o))
    return out
