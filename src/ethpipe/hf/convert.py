"""Where each of ethpipe's global parameters lives in a Hugging Face checkpoint, and back.

One table (ethpipe name -> ``Source``) serves import and export, so the two can never disagree:
import reads a source key (once per rank, however many ethpipe tensors it feeds), transposes
GPT-2's Conv1D matrices and slices its fused q/k/v rows; export concatenates and transposes back.
Llama, Mistral and Qwen2 share one layout (HF's q/k weights already use the rotate-half RoPE
order that ``runtime.model.apply_rope`` implements, so no permutation is needed). OPT's are plain
``nn.Linear``s, one per projection; its position table keeps its 2 offset rows (``position_offset``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec
from ethpipe.runtime.model.decoder import state_dict_shapes

GPT2_PREFIX = "transformer."  # GPT2LMHeadModel.save_pretrained; the original hub files have none
OPT_PREFIX = "model."  # OPTForCausalLM.save_pretrained; the original hub files (saved from OPTModel) have none
PREFIXES = {"gpt2": GPT2_PREFIX, "opt": OPT_PREFIX}  # architectures whose keys may or may not carry a prefix


@dataclass(frozen=True)
class Source:
    """An ethpipe tensor is ``key`` (transposed if ``transpose``), rows ``rows`` of it if given."""

    key: str
    transpose: bool = False
    rows: tuple[int, int] | None = None


_LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj",
    "attn.wo": "self_attn.o_proj", "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj",
}
_GPT2_LAYER = {"attn_norm": "ln_1", "mlp_norm": "ln_2", "attn.wo": "attn.c_proj", "mlp.w1": "mlp.c_fc",
               "mlp.w2": "mlp.c_proj"}
_OPT_LAYER = {"attn_norm": "self_attn_layer_norm", "mlp_norm": "final_layer_norm", "attn.wq": "self_attn.q_proj",
              "attn.wk": "self_attn.k_proj", "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.out_proj",
              "mlp.w1": "fc1", "mlp.w2": "fc2"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.(weight|bias)$")
# Buffers some HF checkpoints carry that are not parameters: ignored on import.
IGNORED = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")


def _llama_source(name: str) -> Source:
    fixed = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "head.weight": "lm_head.weight"}
    if name in fixed:
        return Source(fixed[name])
    layer, module, leaf = _LAYER.match(name).groups()  # type: ignore[union-attr]
    part = _LLAMA_LAYER.get(f"{module}.{leaf}") or _LLAMA_LAYER[module] + f".{leaf}"
    return Source(f"model.layers.{layer}.{part}")


def _gpt2_source(name: str, spec: ModelSpec, prefix: str) -> Source:
    fixed = {"tok_emb.weight": "wte.weight", "pos_emb.weight": "wpe.weight", "norm.weight": "ln_f.weight",
             "norm.bias": "ln_f.bias"}
    if name == "head.weight":
        return Source("lm_head.weight")
    if name in fixed:
        return Source(prefix + fixed[name])
    layer, module, leaf = _LAYER.match(name).groups()  # type: ignore[union-attr]
    matrix = leaf == "weight" and "norm" not in module
    qkv = {"attn.wq": 0, "attn.wk": 1, "attn.wv": 2}
    if module in qkv:
        h = spec.hidden_size
        lo = qkv[module] * h
        return Source(f"{prefix}h.{layer}.attn.c_attn.{leaf}", transpose=matrix, rows=(lo, lo + h))
    return Source(f"{prefix}h.{layer}.{_GPT2_LAYER[module]}.{leaf}", transpose=matrix)


def _opt_source(name: str, prefix: str) -> Source:
    fixed = {"tok_emb.weight": "embed_tokens.weight", "pos_emb.weight": "embed_positions.weight",
             "norm.weight": "final_layer_norm.weight", "norm.bias": "final_layer_norm.bias"}
    if name == "head.weight":
        return Source("lm_head.weight")
    if name in fixed:
        return Source(f"{prefix}decoder.{fixed[name]}")
    layer, module, leaf = _LAYER.match(name).groups()  # type: ignore[union-attr]
    return Source(f"{prefix}decoder.layers.{layer}.{_OPT_LAYER[module]}.{leaf}")


def hf_sources(spec: ModelSpec, arch: str, prefix: str | None = None) -> dict[str, Source]:
    """Every ethpipe global name of ``spec`` -> its place in a HF checkpoint of architecture ``arch``.

    ``prefix``: of a GPT-2's or OPT's keys (None: what ``save_pretrained`` writes, ``PREFIXES``)."""
    names = state_dict_shapes(spec)
    prefix = PREFIXES.get(arch, "") if prefix is None else prefix
    if arch == "gpt2":
        return {n: _gpt2_source(n, spec, prefix) for n in names}
    if arch == "opt":
        return {n: _opt_source(n, prefix) for n in names}
    return {n: _llama_source(n) for n in names}


def hf_shapes(spec: ModelSpec, sources: Mapping[str, Source]) -> dict[str, tuple[int, ...]]:
    """The shape each HF key must have for ``spec`` (fused and transposed as stored)."""
    ours = state_dict_shapes(spec)
    out: dict[str, list[int]] = {}
    for name, src in sources.items():
        shape = list(ours[name])
        if src.rows is not None:
            shape[0] = max(src.rows[1], out.get(src.key, [0])[0])
        out[src.key] = shape
    return {k: tuple(reversed(v)) if _transposed(sources, k) else tuple(v) for k, v in out.items()}


def _transposed(sources: Mapping[str, Source], key: str) -> bool:
    return any(s.transpose for s in sources.values() if s.key == key)


def from_hf(names: Iterable[str], sources: Mapping[str, Source],
            read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ethpipe tensors ``names``, reading each needed HF key once through ``read``."""
    cache: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name in names:
        src = sources[name]
        if src.key not in cache:
            cache[src.key] = read(src.key)
        tensor = cache[src.key].T if src.transpose else cache[src.key]
        if src.rows is not None:
            tensor = tensor[src.rows[0]:src.rows[1]]
        out[name] = tensor.contiguous()
    return out


def to_hf(state: Mapping[str, torch.Tensor], sources: Mapping[str, Source],
          dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF-keyed tensors from ethpipe's consolidated state (fused rows concatenated, Conv1D transposed), cast
    to ``dtype`` (None: as they are) one key at a time, so a bf16 export of fp32 weights adds half the fp32
    size in memory, not a whole fp32 copy."""
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        if name not in sources:
            raise UserError(f"parameter '{name}' has no Hugging Face counterpart: export with --format ethpipe")
        src = sources[name]
        parts.setdefault(src.key, []).append((src.rows[0] if src.rows else 0, tensor))
    out: dict[str, torch.Tensor] = {}
    for key, pieces in parts.items():
        fused = torch.cat([t if dtype is None else t.to(dtype) for _, t in sorted(pieces, key=lambda p: p[0])])
        out[key] = (fused.T if _transposed(sources, key) else fused).contiguous()
    return out
