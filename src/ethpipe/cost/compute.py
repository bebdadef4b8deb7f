"""Analytic FLOPs of the model's pieces (reference/formulas.md section 1, SwiGLU/GQA-aware).

Only GEMMs count (2 FLOPs per multiply-add); backward = 2 x forward; full activation
recomputation adds one forward of every decoder block (not of the head). These are *model*
FLOPs per sample at a given sequence length: what MFU and the ideal time are defined on.
"""

from __future__ import annotations

from ethpipe.model_spec import ModelSpec

BACKWARD_FLOPS_FACTOR = 2.0


def block_matmul_params(model: ModelSpec) -> int:
    """Weights of one decoder block that take part in GEMMs (norms and biases excluded)."""
    h = model.hidden_size
    num_mats = 3 if model.activation == "swiglu" else 2
    return h * model.q_dim + 2 * h * model.kv_dim + model.q_dim * h + num_mats * h * model.ffn_hidden_size


def block_fwd_flops(model: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs of one decoder block for one sample (full s x s scores, as Megatron counts)."""
    per_token = 2.0 * block_matmul_params(model) + 4.0 * seq_len * model.q_dim
    return per_token * seq_len


def head_fwd_flops(model: ModelSpec, seq_len: int) -> float:
    """Forward FLOPs of the LM head (logits) for one sample; the embedding lookup has none."""
    return 2.0 * seq_len * model.hidden_size * model.vocab_size


def model_train_flops(model: ModelSpec, seq_len: int, num_samples: int) -> float:
    """Model FLOPs (forward + backward, no recomputation) of one iteration over ``num_samples``."""
    per_sample = model.num_layers * block_fwd_flops(model, seq_len) + head_fwd_flops(model, seq_len)
    return (1.0 + BACKWARD_FLOPS_FACTOR) * per_sample * num_samples
