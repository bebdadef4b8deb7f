"""Tiny random Hugging Face models of every architecture ethpipe imports, built by transformers itself."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

_LLAMA = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=64, vocab_size=128, max_position_embeddings=64)
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}

ARCHS = ("llama", "llama3", "mistral", "qwen2", "gpt2", "gpt2-untied")


def make_config(arch: str) -> Any:
    """A transformers config object (no download) of the named test architecture."""
    t = transformers
    if arch == "llama":  # Llama 1/2 layout with GQA
        return t.LlamaConfig(**_LLAMA)
    if arch == "llama3":  # Llama 3.1 rope scaling; sequences longer than original_max_position_embeddings
        return t.LlamaConfig(**_LLAMA, rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE))
    if arch == "mistral":
        return t.MistralConfig(**_LLAMA, head_dim=8, sliding_window=None)
    if arch == "qwen2":  # q/k/v biases, tied embeddings (as Qwen2-0.5B)
        return t.Qwen2Config(**_LLAMA, tie_word_embeddings=True)
    if arch == "gpt2":  # Conv1D weights, learned positions, tied embeddings, tanh GELU
        return t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64,
                            bos_token_id=0, eos_token_id=0)
    if arch == "gpt2-untied":  # exact GELU and an own lm_head
        return t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64, n_inner=48,
                            activation_function="gelu", tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    raise AssertionError(arch)


def make_model(arch: str, seed: int = 0) -> Any:
    """A random model whose biases and norm gains are non-trivial too, so a misplaced one shows in the logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(make_config(arch))
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def save_model(model: Any, out: Path, sharded: bool = False) -> Path:
    """save_pretrained as safetensors; ``sharded`` cuts it into many small shards with an index."""
    transformers.logging.set_verbosity_error()
    model.save_pretrained(out, safe_serialization=True, **({"max_shard_size": "20KB"} if sharded else {}))
    return out


def hf_logits(model: Any, tokens: Any) -> Any:
    with torch.no_grad():
        return model(tokens).logits


def load_clean(path, capsys, caplog):  # type: ignore[no-untyped-def]
    """from_pretrained, asserting that no key was missing, unexpected or mismatched, and nothing warned."""
    capsys.readouterr()
    with caplog.at_level(logging.WARNING):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    printed = capsys.readouterr()
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    said = (printed.out + printed.err + caplog.text).lower()
    assert "missing" not in said and "unexpected" not in said and "newly initialized" not in said, said
    return model.eval()
