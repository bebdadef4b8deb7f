"""Sailor's measured GPU profiles in ethpipe's profile format (a converter; the data is not shipped).

Source: Sailor artifact, eth-easl/sailor commit cf2c8e3c, Megatron-DeepSpeed fp32 profiles. The
CI checkout has the shared data beside the clone (``<repo>/../shared/reference/measured/sailor``);
``sailor_root`` returns None when it is absent so callers can skip with a reason.

Conversion: one ``MeasuredProfile`` per (model, GPU, TP degree); ``embedding`` = layer 0 (its
backward was not captured: stored as 0 and ignored by calibration), ``block`` = layer 2 (the
profiler copies the second block to layers 2..L), ``head`` = the final norm + head + loss layer
(LLaMA: layers 33 + 34). ``peak_memory_bytes`` = llm_info's ``act_mem_bytes`` at micro-batch 1.
``optimizer_s_per_param`` = the profile's optimizer step / the 2-block profiling model's
parameters (0 where the artifact recorded 0).

V100-16 is the SXM2 part (``v100_16gb_sxm2``: 15.7 TFLOP/s fp32): the artifact's intra-node curve for it
peaks at 68 GB/s, which only NVLink gives (PCIe Gen3 x16 carries ~12). Attention is Megatron's unfused
fp32 path (``attention="materialised"``): the per-layer memory keeps one s x s matrix per head.

TF32: the runs used PyTorch's default math mode, which the profiles do not record. OPT-350 on
every Ampere/Hopper GPU runs its blocks faster than the fp32 CUDA-core peak allows (A100-40:
~30 TFLOP/s against 19.5), so TF32 was on. OPT-30 and LLaMA on A100-40 (the files written by
"a different averaging script", README) run their GEMM-bound blocks at 16-18 TFLOP/s, below
the fp32 peak and only 1.4-1.5x a V100, which TF32 (156 TFLOP/s) cannot explain: marked
``tf32=False``. This is an inference from the data, stated in docs/benchmarks/calibration.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ethpipe.cost.profile import LayerTiming, MeasuredProfile
from ethpipe.model_spec import ModelSpec

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE = "Sailor artifact, eth-easl/sailor commit cf2c8e3c, Megatron-DeepSpeed fp32 profiles"

GPU_IDS = {  # Sailor's name -> ethpipe catalog id
    "A100-40": "a100_40gb_sxm", "A100-80": "a100_80gb_sxm", "V100-16": "v100_16gb_sxm2", "GH-96": "gh200_96gb",
    "RTX-3090": "rtx_3090", "Titan-RTX": "titan_rtx", "RTX-2080": "rtx_2080_ti",
}
GPUS_PER_NODE = {"A100-40": 4, "V100-16": 4, "A100-80": 4, "GH-96": 4, "Titan-RTX": 8, "RTX-2080": 8, "RTX-3090": 8}
NOT_TF32 = {("OPT-30", "A100-40"), ("LLAMA-3-8", "A100-40")}

# The profiled architectures (Megatron-DeepSpeed GPT with the GPT-2 BPE vocab padded to 50304).
_GPT = dict(activation="gelu", norm="layernorm", position="learned", attention_bias=True, mlp_bias=True,
            vocab_size=50304)
MODELS = {
    "OPT-350": ModelSpec(name="sailor-opt-350", num_layers=24, hidden_size=1024, num_heads=16, num_kv_heads=16,
                         ffn_hidden_size=4096, max_seq_len=2048, **_GPT),
    "OPT-30": ModelSpec(name="sailor-opt-30", num_layers=48, hidden_size=7168, num_heads=56, num_kv_heads=56,
                        ffn_hidden_size=28672, max_seq_len=2048, **_GPT),
    # llm_info: 16 h^2 + 15 h params per block = MHA + SwiGLU of width 4h, with biases; RoPE, RMSNorm.
    "LLAMA-3-8": ModelSpec(name="sailor-llama-3-8", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
                           ffn_hidden_size=16384, vocab_size=50304, max_seq_len=8192, activation="swiglu",
                           norm="rmsnorm", position="rope", attention_bias=True, mlp_bias=True),
}
SEQ_LEN = {"OPT-350": 2048, "OPT-30": 2048, "LLAMA-3-8": 8192}


@dataclass(frozen=True)
class SailorProfile:
    model: str  # Sailor's model name
    gpu: str  # Sailor's GPU name
    profile: MeasuredProfile


def sailor_root(repo_root: Path = REPO_ROOT) -> Path | None:
    root = Path(repo_root).parent / "shared" / "reference" / "measured" / "sailor"
    return root if (root / "profiles").is_dir() else None


def _llm_info(root: Path) -> dict:
    return json.loads((root / "llm_info.json").read_text())


def convert(root: Path, model: str, gpu: str) -> list[SailorProfile]:
    """One profile per TP degree of ``profiles/<model>/<gpu>/profile.json``."""
    raw = json.loads((root / "profiles" / model / gpu / "profile.json").read_text())
    info = _llm_info(root).get(model, {})
    spec = MODELS[model]
    by_tp: dict[int, dict[str, dict[int, LayerTiming]]] = {}
    opt: dict[int, float] = {}
    for mbs, tps in raw.items():
        for tp, layers in tps.items():
            keys = sorted(layers, key=int)
            last = [layers[k] for k in keys[spec.num_layers + 1:]]  # norm (+ head) layers after the blocks
            head = LayerTiming(sum(x[0] for x in last), sum(x[1] for x in last))
            kinds = by_tp.setdefault(int(tp), {"embedding": {}, "block": {}, "head": {}})
            kinds["embedding"][int(mbs)] = LayerTiming(layers[keys[0]][0], 0.0)
            kinds["block"][int(mbs)] = LayerTiming(layers[keys[2]][0], layers[keys[2]][1])
            kinds["head"][int(mbs)] = head
            opt[int(tp)] = float(layers[keys[0]][2])
    out = []
    for tp, layers in sorted(by_tp.items()):
        tinfo = info.get(str(tp), {})
        ends = [k for k in tinfo if int(k) > spec.num_layers]  # final norm / head layers
        params = sum(float(tinfo[k]["params_floats"]) for k in [*ends, "0", "1", "2"] if k in tinfo)
        memory = {}
        if tinfo:
            memory = {"block": {1: int(tinfo["2"]["act_mem_bytes"])},
                      "head": {1: int(sum(tinfo[k]["act_mem_bytes"] for k in ends))},
                      "embedding": {1: int(tinfo["0"]["act_mem_bytes"])}}
        prof = MeasuredProfile(
            device_name=f"cuda: {gpu} (Sailor)", device_kind="cuda", dtype="fp32", model=spec.to_dict(),
            seq_len=SEQ_LEN[model], layers=layers,
            optimizer_s_per_param=opt[tp] / params if params and opt[tp] > 0 else 0.0,
            peak_memory_bytes=memory, tp=tp, tf32=(model, gpu) not in NOT_TF32, attention="materialised",
            grad_accumulation="fused",  # Megatron's contiguous main_grad buffer: accumulation fused or absent
            layer_code="megatron")
        out.append(SailorProfile(model, gpu, prof))
    return out


def all_profiles(root: Path) -> list[SailorProfile]:
    out = []
    for model_dir in sorted((root / "profiles").iterdir()):
        for gpu_dir in sorted(model_dir.iterdir()):
            if (gpu_dir / "profile.json").is_file():
                out.extend(convert(root, model_dir.name, gpu_dir.name))
    return out


def write_profiles(root: Path, out_dir: Path) -> list[Path]:
    """Write every converted profile as ``<model>_<gpu>_tp<t>.json`` (for `ethpipe calibrate`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for sp in all_profiles(root):
        path = out_dir / f"{sp.model}_{sp.gpu}_tp{sp.profile.tp}.json"
        sp.profile.save(path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the converted profiles")
    args = ap.parse_args()
    root = sailor_root()
    if root is None:
        raise SystemExit("shared Sailor data not found at ../shared/reference/measured/sailor")
    for p in write_profiles(root, args.out):
        print(p)
