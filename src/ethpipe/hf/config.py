"""Hugging Face ``config.json`` <-> ``ModelSpec`` for the architectures ethpipe's decoder computes exactly.

Import refuses what the decoder would compute differently (another activation, sliding windows
shorter than the sequence, GPT-2's per-layer attention scaling, OPT's post-LN or projected embeddings,
...), and export refuses a spec
no HF class computes, so a round trip never silently changes the model. No torch here: the
planner reads HF configs too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ethpipe.errors import UserError
from ethpipe.model_spec import ModelSpec

LLAMA_LIKE = ("llama", "mistral", "qwen2")
SUPPORTED = (*LLAMA_LIKE, "gpt2", "opt")
HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
              "gpt2": "GPT2LMHeadModel", "opt": "OPTForCausalLM"}
_GPT2_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu": "gelu"}
_OPT_ACTS = {"relu": "relu", **_GPT2_ACTS}
_HF_ACT_NAMES = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}  # export: spec activation -> HF name
OPT_POSITION_OFFSET = 2  # OPTLearnedPositionalEmbedding: token i reads row i + 2 of max_position_embeddings + 2
OPT_NORM_EPS = 1e-5  # OPT's nn.LayerNorm default: the config has no eps field


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a HF model directory (or the file itself)."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"'{path}' has no config.json: give a Hugging Face model directory (config.json + "
                        "*.safetensors)")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"'{file}' is not valid JSON: {str(err).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise UserError(f"'{file}' must hold a JSON object")
    return config


def architecture(config: dict[str, Any], where: str = "config.json") -> str:
    """The config's ``model_type`` if ethpipe supports it, else a one-line error naming it."""
    model_type = config.get("model_type")
    if model_type is None and "n_layer" in config:
        model_type = "gpt2"  # hand-written GPT-2 configs often omit model_type
    if model_type is None and "num_hidden_layers" in config:
        model_type = "llama"
    if model_type not in SUPPORTED:
        named = ", ".join(config.get("architectures") or []) or "no architectures field"
        raise UserError(f"{where}: architecture model_type={model_type!r} ({named}) is not supported: "
                        f"ethpipe imports {', '.join(SUPPORTED)}")
    return str(model_type)


def _need(config: dict[str, Any], key: str, where: str) -> Any:
    if key not in config or config[key] is None:
        raise UserError(f"{where}: field '{key}' is missing: is this a decoder-only LM config.json?")
    return config[key]


def _rope_fields(config: dict[str, Any], where: str) -> dict[str, Any]:
    """RoPE base and scaling from transformers 4 (rope_theta + rope_scaling) or 5 (rope_parameters)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    out: dict[str, Any] = {"rope_theta": theta}
    if kind == "default":
        return out
    if kind == "linear":
        return {**out, "rope_scaling": "linear", "rope_factor": float(scaling["factor"])}
    if kind == "llama3":
        return {**out, "rope_scaling": "llama3", "rope_factor": float(scaling["factor"]),
                "rope_low_freq_factor": float(scaling["low_freq_factor"]),
                "rope_high_freq_factor": float(scaling["high_freq_factor"]),
                "rope_original_max_seq_len": int(scaling["original_max_position_embeddings"])}
    raise UserError(f"{where}: rope scaling type {kind!r} is not supported: ethpipe computes default, linear "
                    "and llama3 RoPE")


def _llama_spec(config: dict[str, Any], arch: str, name: str, where: str) -> ModelSpec:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UserError(f"{where}: hidden_act {act!r} is not supported for {arch}: ethpipe's gated MLP is SwiGLU "
                        "(silu)")
    max_len = int(_need(config, "max_position_embeddings", where))
    window = config.get("sliding_window")
    if window is not None and (arch == "mistral" or config.get("use_sliding_window")):
        max_len = min(max_len, int(window))  # within the window, sliding attention is full causal attention
    heads = int(_need(config, "num_attention_heads", where))
    llama = arch == "llama"  # Mistral and Qwen2 have no bias options: Qwen2 always has q/k/v biases
    attention_bias = llama and bool(config.get("attention_bias", False))
    return ModelSpec(
        name=name, num_layers=int(_need(config, "num_hidden_layers", where)),
        hidden_size=int(_need(config, "hidden_size", where)), num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads), head_dim=int(config.get("head_dim") or 0),
        ffn_hidden_size=int(_need(config, "intermediate_size", where)),
        vocab_size=int(_need(config, "vocab_size", where)), max_seq_len=max_len,
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=attention_bias, qkv_bias=arch == "qwen2" and not attention_bias,
        mlp_bias=llama and bool(config.get("mlp_bias", False)), norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        **_rope_fields(config, where),
    )


def _gpt2_spec(config: dict[str, Any], name: str, where: str) -> ModelSpec:
    act = config.get("activation_function", "gelu_new")
    if act not in _GPT2_ACTS:
        raise UserError(f"{where}: activation_function {act!r} is not supported: use one of {', '.join(_GPT2_ACTS)}")
    if config.get("scale_attn_by_inverse_layer_idx") or not config.get("scale_attn_weights", True):
        raise UserError(f"{where}: GPT-2 attention scaling other than 1/sqrt(head_dim) is not supported "
                        "(scale_attn_by_inverse_layer_idx / scale_attn_weights)")
    h = int(_need(config, "n_embd", where))
    heads = int(_need(config, "n_head", where))
    return ModelSpec(
        name=name, num_layers=int(_need(config, "n_layer", where)), hidden_size=h, num_heads=heads,
        num_kv_heads=heads, ffn_hidden_size=int(config.get("n_inner") or 4 * h),
        vocab_size=int(_need(config, "vocab_size", where)), max_seq_len=int(config.get("n_positions", 1024)),
        activation=_GPT2_ACTS[act], norm="layernorm", position="learned",  # type: ignore[arg-type]
        tie_embeddings=bool(config.get("tie_word_embeddings", True)), attention_bias=True, mlp_bias=True,
        norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
    )


def _opt_spec(config: dict[str, Any], name: str, where: str) -> ModelSpec:
    """Pre-LN OPT with word_embed_proj_dim == hidden_size: opt-125m, 1.3b, 2.7b, 6.7b, 13b, 30b, 66b (not 350m)."""
    h = int(_need(config, "hidden_size", where))
    if config.get("do_layer_norm_before") is False:
        raise UserError(f"{where}: OPT with do_layer_norm_before=false (post-LN, as opt-350m) is not supported: "
                        "ethpipe's decoder normalises before attention and the MLP (pre-LN)")
    proj = config.get("word_embed_proj_dim")
    if proj is not None and int(proj) != h:
        raise UserError(f"{where}: OPT with word_embed_proj_dim {proj} != hidden_size {h} (project_in/project_out, as "
                        "opt-350m) is not supported: ethpipe's embedding width is hidden_size")
    if config.get("_remove_final_layer_norm"):
        raise UserError(f"{where}: OPT with _remove_final_layer_norm=true is not supported: ethpipe's pre-LN decoder "
                        "ends with a final layer norm")
    if config.get("layer_norm_elementwise_affine") is False:
        raise UserError(f"{where}: OPT with layer_norm_elementwise_affine=false is not supported: ethpipe's layer "
                        "norms have a weight and a bias")
    act = config.get("activation_function", "relu")
    if act not in _OPT_ACTS:
        raise UserError(f"{where}: activation_function {act!r} is not supported: use one of {', '.join(_OPT_ACTS)}")
    heads = int(_need(config, "num_attention_heads", where))
    bias = bool(config.get("enable_bias", True))  # q/k/v/out_proj and fc1/fc2 (the layer norms keep theirs)
    return ModelSpec(
        name=name, num_layers=int(_need(config, "num_hidden_layers", where)), hidden_size=h, num_heads=heads,
        num_kv_heads=heads, ffn_hidden_size=int(_need(config, "ffn_dim", where)),
        vocab_size=int(_need(config, "vocab_size", where)),
        max_seq_len=int(_need(config, "max_position_embeddings", where)),
        activation=_OPT_ACTS[act], norm="layernorm", position="learned",  # type: ignore[arg-type]
        position_offset=OPT_POSITION_OFFSET,
        tie_embeddings=bool(config.get("tie_word_embeddings", True)), attention_bias=bias, mlp_bias=bias,
        norm_eps=OPT_NORM_EPS,
    )


def spec_from_hf(config: dict[str, Any], name: str = "hf", where: str = "config.json") -> ModelSpec:
    """The spec of a HF Llama / Mistral / Qwen2 / GPT-2 / OPT config; a one-line error for anything else."""
    arch = architecture(config, where)
    try:
        if arch == "gpt2":
            return _gpt2_spec(config, name, where)
        if arch == "opt":
            return _opt_spec(config, name, where)
        return _llama_spec(config, arch, name, where)
    except (TypeError, KeyError) as err:
        raise UserError(f"{where}: field {err} is missing or malformed") from None


def hf_architecture_of(spec: ModelSpec) -> str:
    """The HF model_type that computes exactly this spec; a one-line error naming the obstacle if none does."""
    if spec.position_offset:
        return _opt_architecture(spec)
    learned_gpt = spec.norm == "layernorm" and spec.position == "learned" and spec.activation != "swiglu"
    if learned_gpt:
        if spec.activation == "relu":
            raise UserError(f"model '{spec.name}' cannot be exported to HF: a ReLU model with learned positions is "
                            f"an OPT, which needs position_offset {OPT_POSITION_OFFSET}; export with --format ethpipe")
        if not (spec.attention_bias and spec.mlp_bias) or spec.num_kv_heads != spec.num_heads:
            raise UserError(f"model '{spec.name}' cannot be exported to HF: a GPT-2 needs attention_bias and "
                            "mlp_bias and num_kv_heads == num_heads; export with --format ethpipe")
        if spec.head_dim and spec.head_dim != spec.hidden_size // spec.num_heads:
            raise UserError(f"model '{spec.name}' cannot be exported to HF: GPT-2 needs head_dim = hidden_size / "
                            "num_heads; export with --format ethpipe")
        return "gpt2"
    if spec.norm != "rmsnorm" or spec.position != "rope" or spec.activation != "swiglu":
        raise UserError(f"model '{spec.name}' cannot be exported to HF: norm={spec.norm}, position={spec.position}, "
                        f"activation={spec.activation} matches neither Llama (rmsnorm, rope, swiglu) nor GPT-2 "
                        "(layernorm, learned, gelu); export with --format ethpipe")
    if spec.qkv_bias and not spec.attention_bias:
        if spec.mlp_bias:
            raise UserError(f"model '{spec.name}' cannot be exported to HF: Qwen2 (q/k/v biases) has no mlp_bias; "
                            "export with --format ethpipe")
        return "qwen2"
    return "llama"


def _opt_architecture(spec: ModelSpec) -> str:
    """"opt" if OPTForCausalLM computes ``spec`` (pre-LN, no embedding projection), else a one-line error."""
    why = None
    if spec.position_offset != OPT_POSITION_OFFSET:
        why = f"position_offset {spec.position_offset} (OPT's is {OPT_POSITION_OFFSET})"
    elif spec.norm != "layernorm" or spec.activation == "swiglu":
        why = f"norm={spec.norm}, activation={spec.activation} (OPT: layernorm and relu or gelu)"
    elif spec.attention_bias != spec.mlp_bias or (spec.qkv_bias and not spec.attention_bias):
        why = "attention and MLP biases that differ (OPT's enable_bias sets both)"
    elif spec.num_kv_heads != spec.num_heads or spec.head_dim_resolved * spec.num_heads != spec.hidden_size:
        why = "num_kv_heads != num_heads or head_dim != hidden_size / num_heads"
    elif spec.norm_eps != OPT_NORM_EPS:
        why = f"norm_eps {spec.norm_eps} (OPT's layer norms use {OPT_NORM_EPS})"
    if why is not None:
        raise UserError(f"model '{spec.name}' cannot be exported to HF: an OPT cannot have {why}; export with "
                        "--format ethpipe")
    return "opt"


def _rope_config(spec: ModelSpec) -> dict[str, Any]:
    scaling: dict[str, Any] | None = None
    if spec.rope_scaling == "linear":
        scaling = {"rope_type": "linear", "factor": spec.rope_factor}
    elif spec.rope_scaling == "llama3":
        scaling = {"rope_type": "llama3", "factor": spec.rope_factor, "low_freq_factor": spec.rope_low_freq_factor,
                   "high_freq_factor": spec.rope_high_freq_factor,
                   "original_max_position_embeddings": spec.rope_original_max_seq_len}
    return {"rope_theta": spec.rope_theta, "rope_scaling": scaling}


def hf_config_from_spec(spec: ModelSpec, torch_dtype: str = "float32",
                        token_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``config.json`` that transformers 4 and 5 both read as exactly this spec (4 reads ``torch_dtype``,
    5 ``dtype``). ``token_ids``: the source model's bos/eos/pad ids; without them bos/eos are null."""
    arch = hf_architecture_of(spec)
    common = {"architectures": [HF_CLASSES[arch]], "model_type": arch, "vocab_size": spec.vocab_size,
              "tie_word_embeddings": spec.tie_embeddings, "torch_dtype": torch_dtype, "dtype": torch_dtype,
              "use_cache": True}
    if arch == "opt":
        return {**common, "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size,
                "word_embed_proj_dim": spec.hidden_size, "num_attention_heads": spec.num_heads,
                "ffn_dim": spec.ffn_hidden_size, "max_position_embeddings": spec.max_seq_len,
                "activation_function": _HF_ACT_NAMES[spec.activation], "do_layer_norm_before": True,
                "_remove_final_layer_norm": False, "enable_bias": spec.attention_bias,
                "layer_norm_elementwise_affine": True, "dropout": 0.0, "attention_dropout": 0.0, "layerdrop": 0.0,
                "bos_token_id": None, "eos_token_id": None, "pad_token_id": None, **(token_ids or {})}
    if arch == "gpt2":
        return {**common, "n_layer": spec.num_layers, "n_embd": spec.hidden_size, "n_head": spec.num_heads,
                "n_inner": spec.ffn_hidden_size, "n_positions": spec.max_seq_len,
                "activation_function": _HF_ACT_NAMES[spec.activation],
                "layer_norm_epsilon": spec.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
                "scale_attn_weights": True, "bos_token_id": None, "eos_token_id": None, **(token_ids or {})}
    out = {**common, "num_hidden_layers": spec.num_layers, "hidden_size": spec.hidden_size,
           "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
           "head_dim": spec.head_dim_resolved, "intermediate_size": spec.ffn_hidden_size, "hidden_act": "silu",
           "max_position_embeddings": spec.max_seq_len, "rms_norm_eps": spec.norm_eps, "attention_dropout": 0.0,
           "bos_token_id": None, "eos_token_id": None, **(token_ids or {}), **_rope_config(spec)}
    if arch == "llama":
        out.update(attention_bias=spec.attention_bias, mlp_bias=spec.mlp_bias)
    else:
        out.update(use_sliding_window=False, sliding_window=None)
    return out
