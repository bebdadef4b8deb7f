"""Memory per pipeline stage under 1F1B (reference/formulas.md sections 2 and 3).

Model states: ethpipe's runtime keeps fp32 weights, fp32 gradients (the sync's bucket buffers: the
gradients are views of them) and fp32 AdamW moments, 4 + 4 + 8 = 16 bytes/param in every precision (18 with a
plan's ``grad_reduce: bf16``: the bf16 copy each bucket is summed in),
plus under 16-bit autocast one 16-bit copy of the weights per step (``autocast_weight_bytes``). (The
same 16 as Megatron's 16-bit weights + 16-bit gradients + fp32 master, m, v: ZeRO's K = 12.) Activations per
decoder block and sample are counted tensor by tensor for a FlashAttention block without
dropout (no s x s term): two norm inputs and outputs (4h), Q, K, V (q + 2kv) and the attention
output (q), and the MLP intermediates (3f for SwiGLU, 2f for GeLU). With TP the norm-side
tensors are replicated and the rest is split (Korthikanti's 10 + 24/t pattern). Full
recomputation keeps only each block's input and materialises one block at a time in backward.
"""

from __future__ import annotations

from ethpipe.model_spec import ModelSpec

# Fraction of a device's memory the planner lets a stage use: CUDA context, allocator
# fragmentation and communication buffers take the rest.
USABLE_MEMORY_FRACTION = 0.9
GRAD_BYTES_PER_PARAM = 4  # fp32 gradients: what the block sync all-reduces, also under 16-bit autocast
# What the block sync sums each gradient element in (a plan's ``grad_reduce``): the gradients' own fp32 (default), or
# bf16 (half the bytes on the wire; runtime/sync/buckets.py casts each bucket, sums it, casts back).
GRAD_REDUCE_BYTES = {"fp32": GRAD_BYTES_PER_PARAM, "bf16": 2}
GRAD_REDUCE_CHOICES = tuple(GRAD_REDUCE_BYTES)
LOGITS_BYTES_PER_ELEMENT = 4  # fp32 logits for a stable cross-entropy
# Boundary tensors a stage with a neighbour holds besides its stashed inputs (runtime/pipeline/executor.py): while
# one p2p batch is in flight, the payload it sends and the buffer it receives into (during a backward:
# the output gradient received and the input gradient it produces). Every send is waited before the
# next action and then dropped, and no forward output is kept for the backward.
P2P_BUFFERS = 2
# Beyond the log-softmax output it keeps, the last stage's loss holds for one micro-batch at a time two more
# fp32 logits-sized tensors at its peak: the fp32 logits beside that output in the forward, and the output
# gradient and the input gradient beside it in the log-softmax backward.
LOSS_TRANSIENT_LOGITS = 2


def state_bytes_per_param(dtype_bytes: int, holders: int = 1, grad_reduce: str = "fp32") -> float:
    """Weights + gradients + AdamW's two moments per parameter, as the runtime keeps them: all in the weights'
    dtype, fp32 under every 16-bit precision (autocast) and in fp32 training (4 + 4 + 8 = 16), fp64 in the
    exactness mode (32). ``holders`` > 1: the moments are sharded over that many holders of each block (ZeRO-1
    across pipelines, ``runtime/sync/zero.py``): 8 + 8 / k bytes. Weights and gradients stay whole (the all-gather
    and the reduce run in place in the persistent buffers: no extra buffer). ``grad_reduce`` bf16: the
    low-precision copy each bucket is summed in (``reduce_copy_bytes``), counted whole."""
    return 2 * weight_bytes(dtype_bytes) + moment_bytes_per_param(dtype_bytes, holders) + reduce_copy_bytes(grad_reduce)


def reduce_copy_bytes(grad_reduce: str) -> int:
    """Per parameter, the copy a ``grad_reduce`` other than the gradients' own dtype sums in: alive from its bucket's
    issue in the last backward to the wait, so at the end of the last backward all of a stage's at once. Counted
    for every parameter of every stage, also where a block has one holder (whose bucket makes no copy): the stage
    memory model does not know the holders, so this errs on the safe side."""
    return 0 if grad_reduce == "fp32" else GRAD_REDUCE_BYTES[grad_reduce]


def weight_bytes(dtype_bytes: int) -> int:
    """One weight (or gradient) element as the runtime keeps it: fp32 under 16-bit autocast."""
    return max(dtype_bytes, GRAD_BYTES_PER_PARAM)


def moment_bytes_per_param(dtype_bytes: int, holders: int = 1) -> float:
    """AdamW's exp_avg and exp_avg_sq per parameter on one holder of ``holders`` equal shards."""
    return 2 * weight_bytes(dtype_bytes) / holders


def block_activation_bytes(model: ModelSpec, seq_len: int, dtype_bytes: int, tp: int) -> float:
    """Saved activations of one decoder block for one sample (no recomputation)."""
    f_mult = 3 if model.activation == "swiglu" else 2
    replicated = 4 * model.hidden_size
    split = 2 * model.q_dim + 2 * model.kv_dim + f_mult * model.ffn_hidden_size
    return seq_len * dtype_bytes * (replicated + split / tp)


def boundary_bytes(model: ModelSpec, seq_len: int, dtype_bytes: int) -> float:
    """One sample's activation (or its gradient) crossing a stage boundary: s x h elements."""
    return seq_len * dtype_bytes * model.hidden_size


def stashed_input_bytes(model: ModelSpec, seq_len: int, dtype_bytes: int) -> float:
    """What a non-first stage keeps per in-flight sample besides its blocks' saved tensors: the received
    16-bit boundary tensor (for its gradient; the first norm saves its own fp32 copy, counted with the block). In
    fp32 (or fp64) the received tensor is that saved input itself, counted with the block."""
    return boundary_bytes(model, seq_len, dtype_bytes) if dtype_bytes < 4 else 0.0


def loss_transient_bytes(model: ModelSpec, seq_len: int, tp: int) -> float:
    """The loss's transient fp32 logits-sized tensors of one sample (``LOSS_TRANSIENT_LOGITS``), vocab-parallel."""
    return LOSS_TRANSIENT_LOGITS * seq_len * LOGITS_BYTES_PER_ELEMENT * model.vocab_size / tp


def block_input_bytes(model: ModelSpec, seq_len: int, dtype_bytes: int) -> float:
    """What full recomputation keeps per block and sample: the block's input."""
    return seq_len * dtype_bytes * model.hidden_size


def block_activation_bytes_materialised(model: ModelSpec, seq_len: int, dtype_bytes: int, tp: int) -> float:
    """Saved activations of one block without FlashAttention: the ``s x s`` softmax output is kept.

    Tensor inventory of Megatron's unfused path, checked against the Sailor artifact's measured
    per-layer memory (llm_info.json, OPT-350/OPT-30/LLaMA at TP 1-8, all within 2%): the block's
    input plus each norm's saved tensors (fused LayerNorm: its output; unfused RMSNorm: 3.5
    tensors of width h), QKV and the attention context (2q + 2kv), the MLP input of the
    activation (f for GeLU, 3f for SwiGLU), RoPE's rotated q and k, and one score matrix per head.
    """
    m = model
    norm_saved = 1.0 if m.norm == "layernorm" else 3.5
    replicated = (1.0 + 2.0 * norm_saved) * m.hidden_size
    f_mult = 3 if m.activation == "swiglu" else 1
    rope = 2 * (m.q_dim + m.kv_dim) if m.position == "rope" else 0
    split = 2 * m.q_dim + 2 * m.kv_dim + f_mult * m.ffn_hidden_size + rope + m.num_heads * seq_len
    return seq_len * dtype_bytes * (replicated + split / tp)


def head_activation_bytes_materialised(model: ModelSpec, seq_len: int, dtype_bytes: int, tp: int) -> float:
    """Unfused fp32 cross-entropy keeps two logits-sized fp32 tensors (logits and softmax), measured."""
    return seq_len * (2 * dtype_bytes * model.hidden_size + 2 * LOGITS_BYTES_PER_ELEMENT * model.vocab_size / tp)


def runtime_block_activation_bytes(model: ModelSpec, seq_len: int, dtype_bytes: int, tp: int,
                                   gqa_expanded: bool = False, half: str | None = None) -> float:
    """What ethpipe's own runtime (runtime/model/decoder.py) keeps for backward per decoder block and sample.

    Counted from autograd's saved tensors (tests/unit/test_activation_inventory.py fits nothing: it
    checks these exactly against ``saved_tensors_hooks`` over several widths). Attention through SDPA
    without the s x s scores, grouped-query attention inside SDPA (K and V kept at kv width). Per token,
    in elements: RMSNorm: each norm's input, normalised values and output (6h) and rsqrt (2); LayerNorm:
    input and output (4h), mean and rstd (4). Attention: Q, K, V as SDPA reads them (q + 2 kv), its
    output (q), the reshaped copy the output projection reads where RoPE left Q contiguous (q), and
    SDPA's log-sum-exp (heads). The MLP: 4f (SwiGLU: gate and up outputs, SiLU's output, their
    product), 2f (GELU: its input and output) or f (ReLU: its output only). Under 16-bit autocast (``dtype_bytes`` 2) each sub-block's input is cast
    once for all its matmuls (2h in 16-bit), the matmul-side tensors are 16-bit, and the norms'
    internals stay fp32 (RMSNorm: 4h + 2; LayerNorm: 2h + 4; plus the fp32 log-sum-exp). Norm-side
    tensors are replicated over TP, the rest split. RoPE's cos/sin tables (head_dim per token, once
    per stage) and the autocast weight copies (``autocast_weight_bytes``) are counted elsewhere.
    ``gqa_expanded``: a GPU that runs SDPA's memory-efficient kernel gets K and V expanded to the query heads
    (``runtime/model/attention.py``), and SDPA keeps those: 2q instead of 2kv.
    ``half`` ("attn" or "mlp"): that half's tensors only (one norm each; ``ethpipe.sublayers``); the halves sum to
    the block.
    """
    h, rms = model.hidden_size, model.norm == "rmsnorm"
    attn_split = ((3 if model.position == "rope" else 2) * model.q_dim
                  + 2 * (model.q_dim if gqa_expanded else model.kv_dim))
    mlp_split = {"swiglu": 4, "relu": 1}.get(model.activation, 2) * model.ffn_hidden_size
    split = attn_split if half == "attn" else mlp_split if half == "mlp" else attn_split + mlp_split
    heads = 0 if half == "mlp" else model.num_heads
    norms = 1 if half else 2
    small = (1 if rms else 2) * norms
    if dtype_bytes >= 4:
        return seq_len * dtype_bytes * ((3 if rms else 2) * norms * h + small + (split + heads) / tp)
    wide = (2 if rms else 1) * norms * h + small + heads / tp
    return seq_len * (dtype_bytes * (norms * h + split / tp) + 4 * wide)


def runtime_head_activation_bytes(model: ModelSpec, seq_len: int, dtype_bytes: int, tp: int) -> float:
    """The final norm's saved tensors and the log-softmax output (vocab-parallel: 1/tp of it) per sample;
    under 16-bit autocast the head's input is kept as a 16-bit cast and the norm in fp32."""
    h, rms = model.hidden_size, model.norm == "rmsnorm"
    logits = max(LOGITS_BYTES_PER_ELEMENT, dtype_bytes) * model.vocab_size / tp
    if dtype_bytes >= 4:
        return seq_len * (dtype_bytes * ((3 * h + 1) if rms else (2 * h + 2)) + logits)
    return seq_len * (dtype_bytes * h + 4 * ((2 * h + 1) if rms else (h + 2)) + logits)


def autocast_weight_bytes(num_params: float, dtype_bytes: int, tp: int) -> float:
    """The 16-bit copy of a stage's weights that autocast keeps for backward (one per step: the
    executor runs the whole step in one autocast region); none outside autocast."""
    return dtype_bytes * num_params / tp if dtype_bytes < 4 else 0.0


def score_bytes(model: ModelSpec, seq_len: int, dtype_bytes: int, tp: int) -> float:
    """The s x s softmax per head that attention without a fused kernel keeps, per sample."""
    return seq_len * seq_len * dtype_bytes * model.num_heads / tp
