"""Per-kernel work of one layer: what the compute model prices, operation by operation.

A layer (embedding, decoder block, final norm + head + loss) is a list of ``Kernel``s, each
with the FLOPs it does on matrix units and the bytes it moves through device memory. The
inventory follows Megatron-style training: fused LayerNorm, GEMMs with the bias folded in or
added by the next elementwise kernel, no dropout (the calibration profiles keep no dropout
masks). Attention is priced by the implementation that runs it (``attention_impl``):

* ``flash``: FlashAttention-2 (PyTorch SDPA's flash backend: 16-bit on sm80+): one kernel, no
  score matrix in memory, the causal half of the FLOPs, backward recomputes ``QK^T``.
* ``efficient``: SDPA's memory-efficient backend (CUTLASS FMHA), what ethpipe's runtime gets in
  fp32 everywhere and in fp16 on Volta/Turing: the same fused shape as flash; in fp32 on sm80+
  its matmuls run as 3xTF32 on tensor cores (three TF32 MMAs per fp32 product), elsewhere on the
  layer's own math unit. It takes no grouped-query K/V, so the runtime expands them to the query
  heads first (``runtime/model/attention.py``): a ``kv_expand`` kernel (its backward sums the copies)
  and K/V read at query width.
* ``materialised``: the unfused path (Megatron-DeepSpeed without its fused softmax, which the
  Sailor profiles measured): ``QK^T`` writes the ``s x s`` scores, elementwise scale / mask /
  softmax passes, ``P V``.

Times come from ``cost/hardware.py``; this module only counts, so it is exact arithmetic that
tests can check by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ethpipe.cost.elementwise import LAYER_CODES, LayerCode, block_elementwise, norm_bytes  # noqa: F401
from ethpipe.model_spec import ModelSpec

Attention = Literal["flash", "efficient", "materialised"]
ATTENTION_CHOICES: tuple[str, ...] = ("auto", "materialised")  # a plan's choice: auto = what PyTorch SDPA runs
KernelKind = Literal["gemm", "mem"]
# Math unit of a kernel: "" = the layer's GEMM mode (hardware.math_mode); "fmha" = the memory-efficient
# attention kernel's own: 3xTF32 tensor cores for fp32 where the GPU has TF32 (whatever the plan's TF32
# setting), CUDA cores for fp32 elsewhere, tensor cores for 16-bit (hardware.DeviceCompute prices it).
KernelUnit = Literal["", "fmha"]
FLASH_ARCHS = ("ampere", "ada", "hopper", "cdna")  # sm80+, and ROCm (CK / aotriton flash kernels)
LOGITS_BYTES = 4  # cross-entropy runs on fp32 logits
FLASH_CAUSAL_FRACTION = 0.5  # FlashAttention skips the masked upper triangle
FLASH_BWD_FLOPS_FACTOR = 2.5  # backward recomputes QK^T: 5 s x s GEMMs against forward's 2
# Elementwise passes over the score matrix (each pass = one read or one write of every element).
# Megatron's fused scale+mask+softmax kernel exists for 16-bit inputs only; in fp32 the scale
# rides on baddbmm's alpha and masked_fill + softmax run as two torch kernels (2 passes each);
# their backwards (softmax, masked_fill, the scale) take 7. Fused: one kernel each way.
SOFTMAX_PASSES = {"fused": (2, 3), "unfused": (4, 7)}  # (forward, backward)
CE_PASSES = (8, 2)  # vocab-parallel cross-entropy: max, subtract, exp, sum, normalise / scale grad
# Autograd's backward of a block's elementwise kernels moves about twice the bytes of the pass
# counts above (saved-input reads, gradient sums where a tensor fans out, zero-fills): an
# implementation constant shared by every GPU, fitted once on the Sailor profiles (in-sample
# block backward median error 25% -> 4%; docs/cost-model.md).
BWD_ELEMENTWISE_FACTOR = 2.0
WEIGHT_CAST_BYTES = 6  # per parameter and step: the 16-bit copy of an fp32 weight (read 4, write 2)
# How a backward puts a 16-bit weight gradient into the fp32 ``.grad``, per parameter and micro-batch, after the
# weight-gradient GEMM wrote it (priced with the GEMM): ``cast_add`` is ethpipe's runtime (one mixed-dtype in-place
# add: read 2 + 4, write 4; runtime/model/weight_cast.py); ``autocast`` is plain autocast over fp32 weights (cast
# to fp32: read 2, write 4; then add: read 4 + 4, write 4), what ethpipe ran before and the Zorse harness runs;
# ``fused`` is Megatron's accumulation inside the GEMM (nothing more).
GRAD_ACCUM_BYTES_16BIT = {"cast_add": 10, "autocast": 18, "fused": 0}
ACCUMULATIONS = tuple(GRAD_ACCUM_BYTES_16BIT)


@dataclass(frozen=True)
class Kernel:
    """One kernel launch: matrix FLOPs (as executed on ``unit``) and device-memory bytes."""

    name: str
    kind: KernelKind
    flops: float
    num_bytes: float
    unit: KernelUnit = ""


def gemm(name: str, m: float, n: float, k: float, elem_bytes: int, batch: float = 1.0) -> Kernel:
    """C[m,n] = A[m,k] B[k,n] (``batch`` times): 2mnk FLOPs, each operand read or written once."""
    return Kernel(name, "gemm", 2.0 * batch * m * n * k, elem_bytes * batch * (m * k + k * n + m * n))


def mem(name: str, num_bytes: float) -> Kernel:
    return Kernel(name, "mem", 0.0, num_bytes)


def attention_impl(arch: str, dtype: str, choice: str = "auto") -> Attention:
    """The attention kernel a plan's layers run: SDPA's pick under ``auto``, else the forced one.

    PyTorch SDPA (ethpipe's runtime) takes FlashAttention-2 for 16-bit inputs on sm80+ and the
    memory-efficient kernel otherwise (fp32 on any GPU, fp16 on Volta/Turing); ``materialised``
    is the unfused path of runtimes without a fused kernel (Megatron-DeepSpeed in fp32).
    """
    if choice == "materialised":
        return "materialised"
    if choice != "auto":
        raise ValueError(f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {choice!r}")
    if dtype in ("bf16", "fp16") and arch in FLASH_ARCHS:
        return "flash"
    return "efficient"


def gqa_expanded(attention: Attention, q: float, kv: float) -> bool:
    """Whether the runtime expands grouped-query K/V to the query heads (the memory-efficient kernel's input)."""
    return attention == "efficient" and kv < q


def _linear(name: str, tokens: float, k_in: float, n_out: float, e: int, backward: bool) -> list[Kernel]:
    if not backward:
        return [gemm(name, tokens, n_out, k_in, e)]
    # dgrad dX = dY W^T and wgrad dW = X^T dY: the same FLOPs as forward, each.
    return [gemm(name + ".dgrad", tokens, k_in, n_out, e), gemm(name + ".wgrad", k_in, n_out, tokens, e)]


def block_kernels(model: ModelSpec, seq_len: int, micro_batch: int, tp: int, elem_bytes: int,
                  attention: Attention, backward: bool, code: str = "ethpipe", stream_bytes: int | None = None,
                  half: str | None = None) -> list[Kernel]:
    """Kernels of one decoder block's forward (or backward) on one TP rank, as ``code`` runs its elementwise
    work (``cost/elementwise.py``; ``stream_bytes``: the residual stream's dtype, default the compute dtype).
    ``half``: "attn" or "mlp", that half's kernels only (a stage cut between them, ``ethpipe.sublayers``): the two
    lists partition the block's."""
    assert half in (None, "attn", "mlp"), half
    if code not in LAYER_CODES:
        raise ValueError(f"layer code must be one of {', '.join(LAYER_CODES)}, got {code!r}")
    m, s, e, t = model, seq_len, elem_bytes, tp
    tokens = float(micro_batch * s)
    h, q, kv, d = m.hidden_size, m.q_dim / t, m.kv_dim / t, m.head_dim_resolved
    heads = m.num_heads / t
    f = m.ffn_hidden_size / t
    fc1_out = 2 * f if m.activation == "swiglu" else f
    attn = _attention_kernels(micro_batch, s, heads, d, tokens, q, kv, e, attention, backward)
    gemms = {name: _linear(name, tokens, k_in, n_out, e, backward)
             for name, k_in, n_out in (("qkv", h, q + 2 * kv), ("proj", q, h), ("fc1", h, fc1_out), ("fc2", f, h))}
    if code != "megatron":
        steps = {**gemms, "attention": attn}  # and each elementwise step, named "residual" where it is one
        steps.update({k: [mem("residual" if k.endswith("residual") else k, v)]
                      for k, v in block_elementwise(code, m, tokens, t, e, e if stream_bytes is None else stream_bytes,
                                                    backward).items() if v})
        forward = ["attn_norm", "attn_cast", "qkv", "rope", "attention", "proj", "attn_row_bias", "attn_residual",
                   "mlp_norm", "mlp_cast", "fc1", "act", "fc2", "mlp_row_bias", "mlp_residual"]
        order = forward if not backward else [
            "mlp_residual", "fc2", "act", "fc1", "mlp_grad_sum", "mlp_cast", "mlp_norm", "stream_grad_sum",
            "attn_residual", "proj", "attention", "rope", "qkv", "attn_grad_sum", "attn_cast", "attn_norm",
            "stream_grad_sum_attn", "bias_grad"]
        if half is not None:
            order = [name for name in order if (name in ATTENTION_STEPS) == (half == "attn")]
        return [k for name in order for k in steps.get(name, [])]
    th = tokens * h * e
    norm = mem("norm", (4 if backward else 2) * th)
    residual = mem("residual", 3 * th)
    attn_half: list[Kernel] = [norm, *gemms["qkv"]]
    if m.position == "rope":
        attn_half.append(mem("rope", 2 * tokens * (q + kv) * e))
    attn_half += [*attn, *gemms["proj"], residual]
    act_passes = (5 if backward else 3) if m.activation == "swiglu" else (3 if backward else 2)
    mlp_half = [norm, *gemms["fc1"], mem("act", act_passes * tokens * f * e), *gemms["fc2"], residual]
    ks = attn_half if half == "attn" else mlp_half if half == "mlp" else attn_half + mlp_half
    if backward:
        ks = [Kernel(k.name, k.kind, k.flops, k.num_bytes * BWD_ELEMENTWISE_FACTOR) if k.kind == "mem" else k
              for k in ks]
    return ks


# The steps of a block's attention half (``block_kernels``'s names); the others are its MLP half's.
ATTENTION_STEPS = frozenset(("attn_norm", "attn_cast", "qkv", "rope", "attention", "proj", "attn_row_bias",
                             "attn_residual", "attn_grad_sum", "stream_grad_sum_attn", "bias_grad"))


def _attention_kernels(micro_batch: int, s: int, heads: float, d: int, tokens: float, q: float, kv: float, e: int,
                       attention: Attention, backward: bool) -> list[Kernel]:
    batch = micro_batch * heads
    if attention in ("flash", "efficient"):
        # Both skip the masked upper triangle and recompute QK^T in backward; both read Q, K, V and
        # write O (backward: reads them and dO, writes dQ, dK, dV).
        flops = 4.0 * batch * s * s * d * FLASH_CAUSAL_FRACTION * (FLASH_BWD_FLOPS_FACTOR if backward else 1.0)
        if attention == "flash":
            return [Kernel("flash_attn", "gemm", flops, tokens * (2 * q + 2 * kv) * e * (2 if backward else 1))]
        expanded = gqa_expanded(attention, q, kv)
        io = tokens * (2 * q + 2 * (q if expanded else kv)) * e * (2 if backward else 1)
        expand = [mem("kv_expand", tokens * 2 * (kv + q) * e)] if expanded else []  # read K, V; write the copies
        return [*expand, Kernel("efficient_attn", "gemm", flops, io, unit="fmha")]
    scores = batch * s * s * e
    passes = SOFTMAX_PASSES["fused" if e < 4 else "unfused"][1 if backward else 0]
    permute = mem("permute", 2 * tokens * q * e)
    if not backward:
        return [gemm("qk", s, s, d, e, batch), mem("softmax", passes * scores), gemm("pv", s, d, s, e, batch), permute]
    return [permute, gemm("pv.dp", s, s, d, e, batch), gemm("pv.dv", s, d, s, e, batch),
            mem("softmax", passes * scores), gemm("qk.dq", s, d, s, e, batch), gemm("qk.dk", s, d, s, e, batch)]


def recompute_kernels(model: ModelSpec, seq_len: int, micro_batch: int, tp: int, elem_bytes: int,
                      attention: Attention, code: str = "ethpipe", half: str | None = None) -> list[Kernel]:
    """What a recomputing block's backward runs again: torch's non-reentrant checkpoint stops once every tensor
    the backward needs is back, so the block's forward without its last GEMM (fc2: its output only feeds the
    residual add, whose backward needs neither input) and the last residual add; under TP, without the
    all-reduce after fc2 (``RECOMPUTE_TP_ALLREDUCES``). ``half``: a lone half layer checkpointed alone (a stage
    cut inside a layer, ``ethpipe.sublayers``) stops the same way before its own last GEMM: a lone attention half
    re-runs neither its output projection nor that projection's all-reduce. Counted by
    tests/unit/test_counted_work.py and tests/unit/test_sublayers.py."""
    ks = block_kernels(model, seq_len, micro_batch, tp, elem_bytes, attention, False, code, half=half)
    last_gemm = "proj" if half == "attn" else "fc2"
    last_residual = max(i for i, k in enumerate(ks) if k.name == "residual")
    return [k for i, k in enumerate(ks) if k.name.split(".")[0] != last_gemm and i != last_residual]


RECOMPUTE_TP_ALLREDUCES = 1  # after attention; the one after the MLP is not re-run


def embedding_kernels(model: ModelSpec, seq_len: int, micro_batch: int, tp: int, elem_bytes: int,
                      backward: bool) -> list[Kernel]:
    """Token (+ learned position) lookup and the [b,s,h] -> [s,b,h] copy; backward scatter-adds."""
    th = float(micro_batch * seq_len * model.hidden_size * elem_bytes)
    if backward:
        return [mem("embed.grad", 3 * th)]
    ks = [mem("embed.lookup", 2 * th), mem("embed.transpose", 2 * th)]
    if model.position == "learned":
        ks += [mem("embed.pos", 2 * th), mem("embed.add", 3 * th)]
    return ks


def head_kernels(model: ModelSpec, seq_len: int, micro_batch: int, tp: int, elem_bytes: int,
                 backward: bool, code: str = "ethpipe") -> list[Kernel]:
    """Final norm (as ``code`` runs a norm: ``elementwise.norm_bytes``), LM head GEMM (vocab split over TP) and
    the fp32 cross-entropy."""
    tokens = float(micro_batch * seq_len)
    h, vocab = model.hidden_size, model.vocab_size / tp
    th = tokens * h * elem_bytes
    logits = tokens * vocab * LOGITS_BYTES
    ce = mem("cross_entropy", CE_PASSES[1 if backward else 0] * logits)
    norm = mem("final_norm", (4 if backward else 2) * th if code == "megatron" else
               tokens * h * norm_bytes(code, elem_bytes, max(4, elem_bytes), backward))
    head = _linear("lm_head", tokens, h, vocab, elem_bytes, backward)
    return [ce, *head, norm] if backward else [norm, *head, ce]


def grad_accumulation_kernels(kind: str, model: ModelSpec, tp: int, elem_bytes: int,
                              accumulation: str = "cast_add", half: str | None = None) -> list[Kernel]:
    """What a runtime does per parameter and micro-batch after its backward GEMMs: the new gradient added into
    the parameter's ``.grad`` (fp32 under 16-bit precision), as ``accumulation`` does it
    (``GRAD_ACCUM_BYTES_16BIT``); in one dtype the add (3 x its bytes). The embedding's gradient is dense
    (``embedding_dense_backward`` zero-fills a vocab x h fp32 tensor, then it is added): 4 + 12. ``fused``
    (Megatron: ``MeasuredProfile.grad_accumulation``) is priced without any of these."""
    if accumulation not in GRAD_ACCUM_BYTES_16BIT:
        raise ValueError(f"accumulation must be one of {', '.join(ACCUMULATIONS)}, got {accumulation!r}")
    if accumulation == "fused":
        return []
    wide = max(elem_bytes, 4)
    if kind == "embedding":
        return [mem("embed.grad_accum", model.embedding_params() / tp * (wide + 3 * wide))]
    params = ((model.attention_params_per_layer() if half == "attn" else model.mlp_params_per_layer() if half
               else model.params_per_layer()) if kind == "block" else model.head_params())
    per_param = GRAD_ACCUM_BYTES_16BIT[accumulation] if elem_bytes < 4 else 3 * elem_bytes
    return [mem("grad_accum", params / tp * per_param)]


def layer_kernels(kind: str, model: ModelSpec, seq_len: int, micro_batch: int, tp: int, elem_bytes: int,
                  attention: Attention, backward: bool, accumulation: str = "cast_add",
                  code: str = "ethpipe", half: str | None = None) -> list[Kernel]:
    """One layer pass's kernels as a runtime runs them (``accumulation``: how its backward puts each new
    gradient into ``.grad``, ethpipe's runtime by default; ``code``: whose elementwise kernels,
    ``cost/elementwise.py``; ``half``: a block's attention or MLP half only, ``block_kernels``)."""
    assert half is None or kind == "block", (kind, half)
    if kind == "block":
        ks = block_kernels(model, seq_len, micro_batch, tp, elem_bytes, attention, backward, code, half=half)
    elif kind == "head":
        ks = head_kernels(model, seq_len, micro_batch, tp, elem_bytes, backward, code)
    elif kind == "embedding":
        ks = embedding_kernels(model, seq_len, micro_batch, tp, elem_bytes, backward)
    else:
        raise ValueError(f"unknown layer kind '{kind}'")
    if backward:
        ks = ks + grad_accumulation_kernels(kind, model, tp, elem_bytes, accumulation, half)
    return ks


def tp_allreduce_bytes(kind: str, model: ModelSpec, seq_len: int, micro_batch: int, elem_bytes: int,
                       backward: bool, wide_bytes: int | None = None) -> list[float]:
    """The tensor-parallel all-reduces of one layer pass (sizes in bytes), Megatron's and ethpipe's runtime's:
    a block's in the compute dtype (``elem_bytes``); the embedding's partial lookups and the loss's three
    per-token sums in ``wide_bytes`` (ethpipe looks the embedding up in its fp32 weights and computes the loss in
    fp32; Megatron's 16-bit run: ``elem_bytes``, the default)."""
    wide = elem_bytes if wide_bytes is None else wide_bytes
    act = float(micro_batch * seq_len * model.hidden_size * elem_bytes)
    if kind == "block":
        return [act, act]  # after attention and after the MLP (forward); at their inputs (backward)
    if kind == "embedding":  # vocab-parallel embedding sums its partial lookups
        return [] if backward else [float(micro_batch * seq_len * model.hidden_size * wide)]
    if kind == "head":
        tokens = float(micro_batch * seq_len * max(LOGITS_BYTES, wide))
        return [act] if backward else [tokens, tokens, tokens]  # max, predicted logit, sum of exp
    raise ValueError(f"unknown layer kind '{kind}'")
