"""A nanoGPT-readable decoder built from a ``ModelSpec``, whole or as one pipeline stage.

Parameters are named by GLOBAL layer index (``layers.7.attn.wq.weight``) so a name means the
same tensor in every pipeline, and each parameter is initialised from a generator seeded by
(seed, name): layer k is bit-identical whichever stage builds it, and the full model equals
the union of the stages. Stages are built on the meta device and only their own parts are
materialised, so a stage of a huge model never allocates the whole model.

Tied embeddings (Megatron's scheme): the head multiplies by the token embedding matrix. A
stage that is last but not first holds its own copy, registered under the same name
``tok_emb.weight`` (so it is initialised from the same (seed, name) and every checkpoint key
is the model's own); training keeps the copies equal by summing their gradients (grad_sync).
"""

from __future__ import annotations

import math
import os
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ethpipe.model_spec import ModelSpec
from ethpipe.model_load import load_model_spec
from ethpipe.sublayers import PARTS, layer_parts
from ethpipe.runtime.model.attention import causal_attention, expand_kv
from ethpipe.runtime.model.kernel_modes import cpu_kernel_cache_dir
from ethpipe.runtime.model.weight_cast import WeightCast, bind_weight_cast, cast
from ethpipe.runtime.model.tensor_parallel import (
    TPGroup, VocabParallelEmbedding, linear, local_slice, tp_input, vocab_parallel_cross_entropy_sum,
)

INIT_STD = 0.02
TIED_WEIGHT = "tok_emb.weight"  # with tie_embeddings: the embedding matrix, also the output head
PARAM_DTYPES = {"fp32": torch.float32, "bf16": torch.float32, "fp16": torch.float32,  # 16-bit: autocast
                "fp64": torch.float64}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms run in at least fp32 (as in Llama), and in fp64 when the model is fp64; RoPE's tables are built in it
    (under autocast then rounded to the compute dtype: ``Decoder.rope``)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = compute_dtype(x.dtype)
        return F.rms_norm(x.to(wide), (x.shape[-1],), self.weight.to(wide), self.eps).type_as(x)


class LayerNorm(nn.Module):
    """``nn.LayerNorm``'s parameters and maths, computed in fp32 (or fp64) whatever the input's dtype, output in
    the input's: the same on every device (CUDA autocast runs ``layer_norm`` in fp32, CPU autocast in 16-bit)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = compute_dtype(x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            out = F.layer_norm(x.to(wide), (x.shape[-1],), self.weight.to(wide), self.bias.to(wide), self.eps)
        return out.type_as(x)


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return RMSNorm(spec.hidden_size, spec.norm_eps)
    return LayerNorm(spec.hidden_size, spec.norm_eps)


def rope_tables(spec: ModelSpec, seq_len: int, device: torch.device,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, head_dim/2), in ``dtype`` (fp32, or fp64); a stage caches them."""
    half = spec.head_dim_resolved // 2
    inv_freq = scale_rope_frequencies(
        spec, 1.0 / (spec.rope_theta ** (torch.arange(0, half, device=device, dtype=dtype) / half)))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=dtype), inv_freq)
    return angles.cos(), angles.sin()


def scale_rope_frequencies(spec: ModelSpec, inv_freq: torch.Tensor) -> torch.Tensor:
    """Context-extension scaling of the RoPE frequencies, as Hugging Face computes it (linear, llama3)."""
    if spec.rope_scaling == "linear":
        return inv_freq / spec.rope_factor
    if spec.rope_scaling != "llama3":
        return inv_freq
    low_wavelen = spec.rope_original_max_seq_len / spec.rope_low_freq_factor
    high_wavelen = spec.rope_original_max_seq_len / spec.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.rope_factor, inv_freq)
    smooth = ((spec.rope_original_max_seq_len / wavelen - spec.rope_low_freq_factor)
              / (spec.rope_high_freq_factor - spec.rope_low_freq_factor))
    smoothed = (1 - smooth) * scaled / spec.rope_factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dim (Llama/HF convention), in the tables' dtype: the
    compute dtype under autocast (``Decoder.rope``), so a 16-bit q or k is not widened and narrowed again."""
    x1, x2 = x.to(cos.dtype).chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    """Causal self-attention; with tensor parallelism this rank computes 1/tp of the (kv) heads."""

    def __init__(self, spec: ModelSpec, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.tp = tp if tp is not None and tp.size > 1 else None
        size = tp.size if tp is not None else 1
        self.num_heads, self.num_kv_heads = spec.num_heads // size, spec.num_kv_heads // size
        qkv_bias = spec.attention_bias or spec.qkv_bias
        h = spec.hidden_size
        self.wq = linear(h, spec.q_dim, qkv_bias, "column", tp)
        self.wk = linear(h, spec.kv_dim, qkv_bias, "column", tp)
        self.wv = linear(h, spec.kv_dim, qkv_bias, "column", tp)
        self.wo = linear(spec.q_dim, h, spec.attention_bias, "row", tp)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, _ = x.shape
        s = self.spec
        x = tp_input(x, self.tp)
        q = self.wq(x).view(b, t, self.num_heads, s.head_dim_resolved).transpose(1, 2)
        k = self.wk(x).view(b, t, self.num_kv_heads, s.head_dim_resolved).transpose(1, 2)
        v = self.wv(x).view(b, t, self.num_kv_heads, s.head_dim_resolved).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # Grouped-query attention: each kv head serves num_heads / num_kv_heads query heads, inside SDPA where
        # its flash kernel runs, else with K and V expanded first so a fused kernel still runs (attention.py).
        expand = expand_kv(q.device, q.dtype, self.num_heads, self.num_kv_heads)
        y = causal_attention(q, k, v, expand)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.num_heads * s.head_dim_resolved))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.swiglu = spec.activation == "swiglu"
        self.relu = spec.activation == "relu"  # OPT
        self.gelu_approximate = "tanh" if spec.activation == "gelu_tanh" else "none"
        h, f = spec.hidden_size, spec.ffn_hidden_size
        self.w1 = linear(h, f, spec.mlp_bias, "column", tp)  # gate (SwiGLU) or up (GELU, ReLU)
        self.w2 = linear(f, h, spec.mlp_bias, "row", tp)  # down
        if self.swiglu:
            self.w3 = linear(h, f, spec.mlp_bias, "column", tp)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = tp_input(x, self.tp)
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        if self.relu:
            return self.w2(F.relu(self.w1(x)))
        return self.w2(F.gelu(self.w1(x), approximate=self.gelu_approximate))


class DecoderLayer(nn.Module):
    """One decoder block, or one of its halves (``parts``: a stage cut between its attention and its MLP,
    ``ethpipe.sublayers``): the same modules under the same names either way."""

    def __init__(self, spec: ModelSpec, tp: TPGroup | None = None, parts: tuple[str, ...] = PARTS) -> None:
        super().__init__()
        self.parts = parts
        if "attn" in parts:
            self.attn_norm = make_norm(spec)
            self.attn = Attention(spec, tp)
        if "mlp" in parts:
            self.mlp_norm = make_norm(spec)
            self.mlp = MLP(spec, tp)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if "attn" in self.parts:
            x = x + self.attn(self.attn_norm(x), rope)
        if "mlp" in self.parts:
            x = x + self.mlp(self.mlp_norm(x))
        return x


class TiedHead(nn.Module):
    """The output projection of a tied model: logits = x @ embedding.weight.T, with no parameter of its own.

    The embedding is kept in a tuple, which ``nn.Module`` does not register, so the matrix has
    one name (``tok_emb.weight``) in ``named_parameters`` and ``state_dict``. Under tp the matrix is
    vocab-sharded, so this rank's rows give its slice of the logits.
    """

    weight_cast: WeightCast | None = None

    def __init__(self, embedding: nn.Module) -> None:
        super().__init__()
        self.embedding_ref = (embedding,)

    @property
    def weight(self) -> nn.Parameter:
        return self.embedding_ref[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, cast(self, self.weight))  # type: ignore[arg-type]


class Decoder(nn.Module):
    """Layers ``[start, end)`` of the model; ``first`` adds the embeddings, ``last`` the norm and head.

    The whole model is ``Decoder(spec, (0, L), first=True, last=True)``: one code path for
    the single-process reference and every pipeline stage. Input: token ids (first stage)
    or hidden states; output: logits (last stage) or hidden states.
    """

    def __init__(self, spec: ModelSpec, layers: tuple[int, int], first: bool, last: bool,
                 recompute: bool = False, tp: TPGroup | None = None,
                 chunks: tuple[tuple[int, int], ...] = (), fp32_residual: bool = False, sublayers: int = 1) -> None:
        super().__init__()
        # Under 16-bit autocast the residual stream runs in the compute dtype (Megatron's default); True keeps it
        # in fp32 (``--fp32-residual``). Norms compute in fp32 either way; outside autocast nothing is cast.
        self.fp32_residual = fp32_residual
        ranges = chunks or (layers,)
        for lo, hi in ranges:
            if not 0 <= lo < hi <= spec.num_layers * sublayers:
                raise ValueError(f"layer range {[lo, hi]} is outside the model's [0, {spec.num_layers * sublayers})")
        # Per chunk, the layers it runs with their halves (``ethpipe.sublayers``; whole layers unless sublayers 2).
        self.chunk_parts = [layer_parts(lo, hi, sublayers) for lo, hi in ranges]
        held = [k for parts in self.chunk_parts for k, _ in parts]
        if len(set(held)) != len(held):
            raise ValueError(f"a layer is split between two chunks of one stage ({list(ranges)}): a valid plan's "
                             "chunks of one stage are other stages apart")
        self.spec, self.layer_range, self.first, self.last = spec, ranges[0], first, last
        self.chunk_ranges = ranges  # an interleaved stage's model chunks: ``forward(x, chunk)`` runs one
        self.recompute = recompute
        self.tp = tp if tp is not None and tp.size > 1 else None  # tensor parallelism (runtime/model/tensor_parallel.py)
        self._rope_cache: dict[tuple[int, str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        tied = spec.tie_embeddings
        if first or (last and tied):  # a tied last stage holds its copy of the embedding matrix
            self.tok_emb = (VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, self.tp) if self.tp else
                            nn.Embedding(spec.vocab_size, spec.hidden_size))
        if first and spec.position == "learned":  # OPT's table has position_offset unused rows first
            self.pos_emb = nn.Embedding(spec.max_seq_len + spec.position_offset, spec.hidden_size)
        self.layers = nn.ModuleDict({str(k): DecoderLayer(spec, self.tp, held_parts)
                                     for parts in self.chunk_parts for k, held_parts in parts})
        if last:
            self.norm = make_norm(spec)
            self.head: nn.Module = (TiedHead(self.tok_emb) if tied else
                                    linear(spec.hidden_size, spec.vocab_size, False, "column", self.tp))
        # The stage's 16-bit weight copies of a step (``weight_cast.py``); the executor opens its ``step``.
        self.weight_cast = WeightCast()
        bind_weight_cast(self, self.weight_cast)

    def forward(self, x: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """Chunk ``chunk`` of the stage (the embedding runs in a first stage's chunk 0, the head in a last
        stage's last chunk)."""
        seq_len = x.shape[1]
        if seq_len > self.spec.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds the model's max_seq_len {self.spec.max_seq_len}")
        if self.first and chunk == 0:
            h = self.tok_emb(x)
            if self.spec.position == "learned":
                h = h + self.pos_emb(torch.arange(seq_len, device=x.device) + self.spec.position_offset)
            x = h
        x = self._stream(x)
        rope = self.rope(seq_len, x.device) if self.spec.position == "rope" else None
        for k, _ in self.chunk_parts[chunk]:
            layer = self.layers[str(k)]
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(layer, x, rope, use_reentrant=False)
            else:
                x = layer(x, rope)
        if self.last and chunk == len(self.chunk_ranges) - 1:
            x = self.head(tp_input(self.norm(x), self.tp))
        return x

    def _stream(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream's dtype: under autocast its compute dtype (or fp32 with ``fp32_residual``), else
        the stage's own (a received activation, in the weights' dtype)."""
        device = x.device.type
        if torch.is_autocast_enabled(device):
            return x.to(torch.float32 if self.fp32_residual else torch.get_autocast_dtype(device))
        return x

    def rope(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables, made once per sequence length, device and dtype (not state: not in the state dict):
        computed in the weights' wide dtype, and under autocast rounded once to its dtype, so RoPE runs on the
        16-bit q and k as Megatron's unfused path and Hugging Face's do (docs/runtime.md: 18 bytes per element
        instead of 48; q and k carry two more roundings, within the bf16/fp16 tolerance tests)."""
        wide = compute_dtype(next(self.parameters()).dtype)
        dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else wide
        key = (seq_len, str(device), dtype)
        if key not in self._rope_cache:
            cos, sin = rope_tables(self.spec, seq_len, device, wide)
            self._rope_cache[key] = (cos.to(dtype), sin.to(dtype))
        return self._rope_cache[key]

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed token cross-entropy of the last stage's logits (vocab-parallel under tp)."""
        if self.tp is None:
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        return vocab_parallel_cross_entropy_sum(logits, targets, self.tp, self.head.weight.shape[0] * self.tp.rank)


INIT_MAX_THREADS = 4


def param_seed(seed: int, name: str) -> int:
    """Stable per-parameter seed (crc32, not Python's salted hash) so every process agrees."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_parameter(spec: ModelSpec, name: str, param: torch.Tensor, seed: int,
                   full_shape: tuple[int, ...] | None = None, tp: TPGroup | None = None) -> None:
    """nanoGPT init: N(0, 0.02) for matrices and embeddings, residual outputs scaled by
    1/sqrt(2L), zero biases, unit norm gains. Drawn on CPU so every device gets the same bits;
    a tensor-parallel shard draws the global tensor (``full_shape``) and keeps its slice."""
    leaf = name.rsplit(".", 1)[-1]
    with torch.no_grad():
        if "norm" in name:
            param.fill_(1.0 if leaf == "weight" else 0.0)
        elif leaf == "bias":
            param.zero_()
        else:
            std = INIT_STD / math.sqrt(2 * spec.num_layers) if (".wo." in name or ".w2." in name) else INIT_STD
            gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
            values = torch.normal(0.0, std, size=full_shape or tuple(param.shape), generator=gen, dtype=torch.float32)
            param.copy_(local_slice(values, name, tp).to(param.dtype))


def build_stage(spec: ModelSpec, layers: tuple[int, int], first: bool, last: bool, seed: int = 0,
                device: torch.device | str = "cpu", recompute: bool = False,
                dtype: torch.dtype = torch.float32, tp: TPGroup | None = None,
                chunks: tuple[tuple[int, int], ...] = (), init: bool = True, fp32_residual: bool = False,
                sublayers: int = 1) -> Decoder:
    """One pipeline stage: built on meta, then only its own parameters are allocated and initialised.

    ``dtype`` is the parameters' (fp32, or fp64 for exactness checks); the init draws fp32
    values either way, so an fp64 model starts from the fp32 model's exact numbers. ``tp``:
    this rank's tensor-parallel group; each parameter holds its slice of the global tensor. ``init`` False:
    allocated only, for a caller that overwrites every parameter (a checkpoint or a state file it loads:
    drawing a 70B stage's global tensors first took minutes on one core).
    """
    with torch.device("meta"):
        module = Decoder(spec, layers, first, last, recompute=recompute, tp=tp, chunks=chunks,
                         fp32_residual=fp32_residual, sublayers=sublayers).to(dtype)
    module = module.to_empty(device=device)
    if not init:
        return module
    full = state_dict_shapes(spec) if module.tp is not None else {}
    params = list(module.named_parameters())  # a tied last stage's copy is `tok_emb.weight` too: same bits

    def draw(item: tuple[str, nn.Parameter]) -> None:
        init_parameter(spec, item[0], item[1], seed, full.get(item[0]), module.tp)

    # Each parameter has its own generator (seeded by name), so drawing them on several threads (torch releases
    # the GIL) gives the same bits as one thread; a thread holds one global tensor at a time.
    with ThreadPoolExecutor(init_threads()) as pool:
        list(pool.map(draw, params))
    return module


def init_threads() -> int:
    """Threads for a stage's random init: this rank's share of the node's cores (torchrun's LOCAL_WORLD_SIZE
    ranks share them), at most ``INIT_MAX_THREADS`` (each holds one global fp32 tensor while it draws)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(INIT_MAX_THREADS, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))))


def compile_blocks(module: Decoder) -> None:
    """``torch.compile`` each decoder block in place (``--compile``): the blocks are identical, so they share
    one compiled graph; the embeddings, head, loss and the executor's communication stay eager. Inductor
    reorders floating-point operations, so results match eager training to the order-noise bound, not
    bitwise (docs/runtime.md, "Kernels")."""
    if next(module.parameters()).device.type == "cpu":
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cpu_kernel_cache_dir(os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    for layer in module.layers.values():
        bind_weight_cast(layer, None)  # inductor traces autocast's casts, not a custom Function's side effect
        layer.compile()


def build_full_model(model: str | ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32) -> Decoder:
    """The whole model in one process (the single-device reference), CPU, fp32 (or ``dtype``)."""
    spec = load_model_spec(model) if isinstance(model, str) else model
    return build_stage(spec, (0, spec.num_layers), first=True, last=True, seed=seed, dtype=dtype)


def state_dict_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the consolidated state dict, without allocating anything."""
    with torch.device("meta"):
        module = Decoder(spec, (0, spec.num_layers), True, True)
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}
