"""The elementwise kernels of a decoder block, as each layer implementation runs them ("layer code").

A block's GEMMs and attention are the same work in every implementation; its norms, RoPE, activation, residual
adds, casts and gradient sums are not, and at the micro-batches ETH plans use they are a large share of a
layer's time on bandwidth-poor GPUs. Three implementations are priced:

* ``megatron``: fused norms, RoPE and activation kernels (Megatron-LM with apex / Transformer Engine, vLLM):
  what the Sailor, Aceso and vidur profiles measured. Its backward is its forward's passes times
  ``BWD_ELEMENTWISE_FACTOR``, fitted once on the Sailor profiles.
* ``ethpipe``: this runtime's eager block (``runtime/model/decoder.py``) as a GPU runs it, counted aten op by
  aten op (``tests/unit/test_counted_elementwise.py``): each norm upcasts its input to fp32 around one fused
  kernel (``F.rms_norm`` is ``aten._fused_rms_norm`` on CUDA, ``F.layer_norm`` one kernel everywhere) and casts
  back; RoPE runs in the compute dtype on the two halves of each head (four multiplies, a subtract, an add, a
  ``cat``; its tables rounded to 16-bit once under autocast, as Megatron's unfused path and HF's do); q, k
  and v (gate and up) are separate linears whose input gradients are summed; the residual stream is in the
  compute dtype unless ``--fp32-residual``.
* ``hf``: Hugging Face ``transformers``' eager Llama layer under plain autocast over an fp32 input (what the
  Zorse measurements ran): the residual stream stays fp32, ``LlamaRMSNorm`` runs unfused in fp32 (``pow``,
  ``mean``, ``rsqrt``, two multiplies), every projection casts its input to 16-bit, RoPE by ``rotate_half``.

Each count is bytes per element of the tensor it runs over (read + written), with ``e`` the compute dtype's
bytes, ``s`` the residual stream's and ``w`` the norms' wide dtype (fp32, or fp64 in fp64 runs).
"""

from __future__ import annotations

from typing import Literal

from ethpipe.model_spec import ModelSpec

LayerCode = Literal["megatron", "ethpipe", "hf", "ethpipe_fp32_rope"]
# ``ethpipe_fp32_rope``: this runtime before RoPE rotated in the compute dtype (it widened q and k to fp32 and back):
# what profiles measured by earlier releases ran (``cost/profile.py`` reads them so).
LAYER_CODES: tuple[str, ...] = ("megatron", "ethpipe", "hf", "ethpipe_fp32_rope")


def _cast(a: int, b: int) -> int:
    """A dtype conversion's bytes per element (read one, write the other); none between equal dtypes."""
    return 0 if a == b else a + b


def norm_bytes(code: str, s: int, w: int, backward: bool) -> int:
    """One norm over the residual stream: ``ethpipe`` casts in, one fused kernel (forward reads x, writes y;
    backward reads dy and x, writes dx), casts out; ``hf`` is LlamaRMSNorm's unfused chain in fp32 (forward
    ``pow``, ``mean``, two multiplies and the weight's: 7 passes; backward 24, counted)."""
    if code == "hf":
        return 24 * w if backward else 7 * w
    return 2 * _cast(s, w) + (3 if backward else 2) * w


def rope_bytes(code: str, e: int, backward: bool, w: int = 4) -> int:
    """RoPE per element of q and k, in the compute dtype (``ethpipe`` rounds its tables to it under autocast).
    ``ethpipe``: x1*cos, x2*sin, x2*cos, x1*sin on halves (4e), a subtract and an add (3e), ``cat`` (2e);
    backward the multiplies again, a negate, the halves' sums and their ``cat``: 10e. ``hf``: q*cos,
    ``rotate_half`` (negate a half, ``cat``), *sin, add: 10e; backward 14e (two multiplies, the negate, two
    slice-backward zero-fills and two adds). ``ethpipe_fp32_rope``: the same passes in the wide dtype ``w``, and
    the casts to it and back."""
    if code == "hf":
        return (14 if backward else 10) * e
    if code == "ethpipe_fp32_rope":
        return (10 if backward else 9) * w + 2 * _cast(e, w)
    return (10 if backward else 9) * e


def activation_bytes(model: ModelSpec, e: int, backward: bool) -> int:
    """SwiGLU: silu(gate) (2e) then * up (3e); backward two multiplies and silu's backward (3e each). GELU /
    ReLU: one pass (2e), backward one (3e)."""
    if model.activation == "swiglu":
        return (9 if backward else 5) * e
    return (3 if backward else 2) * e


def block_elementwise(code: str, model: ModelSpec, tokens: float, tp: int, e: int, s: int,
                      backward: bool) -> dict[str, float]:
    """Bytes of each elementwise step of one block pass on one TP rank (``ethpipe`` or ``hf``), by name, in
    the order the block runs them (the caller interleaves the GEMMs). ``s``: the residual stream's bytes."""
    assert code in ("ethpipe", "hf", "ethpipe_fp32_rope"), code
    w = max(4, e)
    rope_code, code = code, "ethpipe" if code == "ethpipe_fp32_rope" else code  # only its RoPE differs
    if code == "hf":
        s = w  # its stream is the fp32 input autocast leaves alone
    h = model.hidden_size
    q, kv, f = model.q_dim / tp, model.kv_dim / tp, model.ffn_hidden_size / tp
    th = tokens * h
    mlp_inputs = 2 if model.activation == "swiglu" else 1
    # Linears reading one sub-block input: ethpipe casts it once per sub-block (``compute_input``), HF once per
    # projection (autocast casts each linear's input; nothing caches activations).
    casts = (1, 1) if code == "ethpipe" else (3, mlp_inputs)
    out: dict[str, float] = {}
    if not backward:
        out["attn_norm"] = th * norm_bytes(code, s, w, False)
        out["attn_cast"] = th * casts[0] * _cast(s, e)
        if model.position == "rope":
            out["rope"] = tokens * (q + kv) * rope_bytes(rope_code, e, False, w)
        # Under tp a row-parallel linear adds its bias after the all-reduce, one more kernel (tp 1: in the GEMM).
        out["attn_row_bias"] = th * 2 * e * (tp > 1 and model.attention_bias)
        out["attn_residual"] = th * (2 * s + e)  # x (stream) + the projection's output (compute dtype)
        out["mlp_norm"] = th * norm_bytes(code, s, w, False)
        out["mlp_cast"] = th * casts[1] * _cast(s, e)
        out["act"] = tokens * f * activation_bytes(model, e, False)
        out["mlp_row_bias"] = th * 2 * e * (tp > 1 and model.mlp_bias)
        out["mlp_residual"] = th * (2 * s + e)
        return out
    # Backward, in autograd's order: the MLP sub-block, then attention.
    out["mlp_residual"] = th * _cast(s, e)  # the branch's gradient, cast to its output's dtype
    out["act"] = tokens * f * activation_bytes(model, e, True)
    out["mlp_grad_sum"] = th * (mlp_inputs - 1) * 3 * (s if code == "hf" else e)  # the linears' input grads
    out["mlp_cast"] = th * casts[1] * _cast(e, s)
    out["mlp_norm"] = th * norm_bytes(code, s, w, True)
    out["stream_grad_sum"] = th * 3 * s  # the stream feeds the norm and the residual: two gradients summed
    out["attn_residual"] = th * _cast(s, e)
    if model.position == "rope":
        # RoPE's output is [b, heads, s, d]-contiguous, the projection's [b, s, heads, d]: its gradient is copied
        # back into the projection's layout (the view's backward).
        out["rope"] = tokens * (q + kv) * (rope_bytes(rope_code, e, True, w) + 2 * e)
    out["attn_grad_sum"] = th * 2 * 3 * (s if code == "hf" else e)  # q, k and v's input gradients summed
    out["attn_cast"] = th * casts[0] * _cast(e, s)
    out["attn_norm"] = th * norm_bytes(code, s, w, True)
    out["stream_grad_sum_attn"] = th * 3 * s
    biased = ((q + 2 * kv) * (model.attention_bias or model.qkv_bias) + h * model.attention_bias
              + (mlp_inputs * f + h) * model.mlp_bias)
    if biased:
        out["bias_grad"] = tokens * biased * e  # each bias's gradient: a sum over the tokens of its output's
    return out
