"""vidur's fp16 per-op profiles as calibration observations (a converter; the data is not shipped).

Source: microsoft/vidur commit 7d47513363ec447a741ac5e47241580b47724fbf, MIT licence,
``data/profiling/compute/<gpu>/<org>/<model>/mlp.csv`` (times in milliseconds). The CI checkout has the
shared copy beside the clone (``<repo>/../shared/reference/measured/vidur``); ``vidur_root`` returns None
where it is absent so callers can skip with a reason.

How vidur measured (its ``vidur/profiling/mlp/``): one decoder layer (Sarathi's implementation) cast to
fp16, eval mode, forward only, ``num_tokens`` tokens on one GPU, the weights split as on one of
``num_tensor_parallel_workers`` TP ranks (no communication in the timings); each op timed on the device
(CUDA events / the kineto profiler). A device-side time has no host launch floor: these observations
are priced with ``launch_floor=False`` and no ``layer_s`` (one op, not a layer pass), and used only where
the op's ideal time (every kernel at 100% of its roofline) is at least ``MIN_IDEAL_S``, above the few
microseconds any kernel takes on the device. Token counts: the powers of two from ``MIN_TOKENS`` (what
a training micro-batch holds; below it the GEMMs are decode-shaped matrix-vector products); the
artifact's repeated rows of one shape: the lower median.

GPUs: ``a100`` is the A100 80GB SXM and ``h100`` the H100 SXM (vidur's device configs: 80 GB, 312 / 1000
dense fp16 TFLOP/s; its ``a100_dgx`` / ``h100_dgx`` NVSwitch nodes), ``a40`` the A40.

Ops and the kernels of ``cost/ops.py`` they are priced as: ``input_layernorm`` and
``post_attention_layernorm`` -> ``norm``; ``attn_pre_proj`` -> ``qkv``; ``attn_rope`` -> ``rope``;
``attn_post_proj`` -> ``proj``; ``mlp_up_proj`` -> ``fc1`` (gated MLPs: gate and up fused, 2 x FFN
wide); ``mlp_act`` -> ``act`` (SiLU x up, or GeLU); ``mlp_down_proj`` -> ``fc2``; ``add`` -> ``residual``
(phi-2's parallel block adds attention, MLP and residual at once: both of ethpipe's residual adds).
Not used: ``emb`` (the vocab-parallel lookup with its masking kernels; embeddings are not fitted).
"""

from __future__ import annotations

import csv
from functools import lru_cache
from pathlib import Path

from ethpipe.catalog import get_gpu
from ethpipe.cost import calibrate as cal
from ethpipe.cost import ops
from ethpipe.cost.hardware import Calibration, DeviceCompute
from ethpipe.model_spec import ModelSpec

from aceso_data import OpObservation, ideal_s

REPO_ROOT = Path(__file__).resolve().parents[1]
SOURCE = ("microsoft/vidur commit 7d475133, fp16 forward per-op profiles "
          "(data/profiling/compute/{a100,h100,a40}/*/*/mlp.csv)")
GPU_IDS = {"a100": "a100_80gb_sxm", "h100": "h100_sxm", "a40": "a40"}
MODEL_NAMES = {  # vidur's model folder -> the name leave-one-model-out holds out (Sailor's for LLaMA-3-8B)
    "Llama-2-7b-hf": "Llama-2-7b", "Llama-2-70b-hf": "Llama-2-70b", "Meta-Llama-3-8B": "LLAMA-3-8",
    "phi-2": "phi-2",
}
MIN_TOKENS = 512
MIN_IDEAL_S = 10e-6
# Profiled op -> (ethpipe kernel name, occurrences in the block's kernel list it covers).
OPS = {
    "input_layernorm": ("norm", (0,)), "attn_pre_proj": ("qkv", (0,)), "attn_rope": ("rope", (0,)),
    "attn_post_proj": ("proj", (0,)), "post_attention_layernorm": ("norm", (1,)), "mlp_up_proj": ("fc1", (0,)),
    "mlp_act": ("act", (0,)), "mlp_down_proj": ("fc2", (0,)), "add": ("residual", (0,)),
}
PARALLEL_BLOCK_OPS = {"add": ("residual", (0, 1))}  # no post-attention norm: one add of three tensors
GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")


def vidur_root(repo_root: Path = REPO_ROOT) -> Path | None:
    root = Path(repo_root).parent / "shared" / "reference" / "measured" / "vidur"
    return root if any((root / "compute").glob("*/*/*/mlp.csv")) else None


def spec_of(row: dict[str, str], model: str) -> ModelSpec:
    """The measured layer's shape as an ethpipe model spec (LLaMA-style when gated, else phi-2's GeLU block)."""
    h, heads = int(row["n_embd"]), int(row["n_head"])
    gated = row["use_gated_mlp"] == "True"
    return ModelSpec(name=f"vidur-{model.lower()}", num_layers=1, hidden_size=h, num_heads=heads,
                     num_kv_heads=int(row["n_kv_head"]), ffn_hidden_size=int(row["n_expanded_embd"]),
                     vocab_size=int(row["vocab_size"]), max_seq_len=32768,
                     activation="swiglu" if gated else "gelu", norm="rmsnorm" if gated else "layernorm",
                     position="rope", attention_bias=not gated, mlp_bias=not gated)


def _powers_of_two(n: int) -> bool:
    return n >= MIN_TOKENS and n & (n - 1) == 0


@lru_cache(maxsize=8)
def observations(root: Path, min_ideal_s: float = MIN_IDEAL_S) -> tuple[OpObservation, ...]:
    """Every usable forward op timing of every GPU, model, TP shard and token count in ``root``."""
    out: list[OpObservation] = []
    for path in sorted((root / "compute").glob("*/*/*/mlp.csv")):
        gpu_name, model_dir = path.parts[-4], path.parts[-2]
        if gpu_name not in GPU_IDS or model_dir not in MODEL_NAMES:
            continue
        gpu = get_gpu(GPU_IDS[gpu_name])
        device = DeviceCompute.build(gpu, Calibration({}), "fp16", True)
        with path.open() as f:
            rows = list(csv.DictReader(f))
        shapes: dict[tuple[int, int], dict[str, float]] = {}
        for r in rows:
            tokens, tp = int(r["num_tokens"]), int(r["num_tensor_parallel_workers"])
            if not _powers_of_two(tokens):
                continue
            best = shapes.setdefault((tokens, tp), {})
            for op in OPS:
                raw = r.get(f"time_stats.{op}.median", "")
                if raw not in ("", "nan") and float(raw) > 0:
                    best[op] = min(best.get(op, float("inf")), float(raw) * 1e-3)
        spec = spec_of(rows[0], MODEL_NAMES[model_dir])
        parallel = spec.activation != "swiglu"
        for (tokens, tp), times in sorted(shapes.items()):
            kernels = ops.block_kernels(spec, tokens, 1, tp, 2, "flash", False, "megatron")  # vLLM: fused kernels
            group = []
            for op, measured in times.items():
                if parallel and op == "post_attention_layernorm":
                    continue
                name, which = (PARALLEL_BLOCK_OPS if parallel and op in PARALLEL_BLOCK_OPS else OPS)[op]
                mine = [k for k in kernels if k.name == name]
                terms = tuple(device.kernel_terms([mine[i] for i in which]))
                if ideal_s(terms) < min_ideal_s:
                    continue
                group.append((op, terms, measured))
            for op, terms, measured in group:
                o = cal.Observation(gpu.arch, gpu.id, spec.name, "op", False, tokens, tp, measured, terms, 0.0,
                                    layer_passes=0.0, launch_floor=False, weight=len(group) ** -0.5)
                out.append(OpObservation("vidur", gpu_name, MODEL_NAMES[model_dir], "fp16", op,
                                         "gemm" if op in GEMM_OPS else "mem", False, tokens, tp, o))
    return tuple(out)


if __name__ == "__main__":
    root = vidur_root()
    if root is None:
        raise SystemExit("shared vidur profiles not found at ../shared/reference/measured/vidur")
    from collections import Counter

    for key, n in sorted(Counter((o.gpu_name, o.model, o.role) for o in observations(root)).items()):
        print(*key, n)
