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
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ethpipe.model_spec import ModelSpec, load_model_spec

INIT_STD = 0.02
TIED_WEIGHT = "tok_emb.weight"  # with tie_embeddings: the embedding matrix, also the output head


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).type_as(x)


def make_norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return RMSNorm(spec.hidden_size, spec.norm_eps)
    return nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)


def rope_tables(spec: ModelSpec, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (seq_len, head_dim/2), computed in fp32 (cheap; recomputed per forward)."""
    half = spec.head_dim_resolved // 2
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, half, device=device, dtype=torch.float32) / half))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the head dim (Llama/HF convention)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        qkv_bias = spec.attention_bias or spec.qkv_bias
        h = spec.hidden_size
        self.wq = nn.Linear(h, spec.q_dim, bias=qkv_bias)
        self.wk = nn.Linear(h, spec.kv_dim, bias=qkv_bias)
        self.wv = nn.Linear(h, spec.kv_dim, bias=qkv_bias)
        self.wo = nn.Linear(spec.q_dim, h, bias=spec.attention_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        b, t, _ = x.shape
        s = self.spec
        q = self.wq(x).view(b, t, s.num_heads, s.head_dim_resolved).transpose(1, 2)
        k = self.wk(x).view(b, t, s.num_kv_heads, s.head_dim_resolved).transpose(1, 2)
        v = self.wv(x).view(b, t, s.num_kv_heads, s.head_dim_resolved).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        repeat = s.num_heads // s.num_kv_heads
        if repeat > 1:  # grouped-query attention: each kv head serves `repeat` query heads
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, s.q_dim))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.swiglu = spec.activation == "swiglu"
        h, f = spec.hidden_size, spec.ffn_hidden_size
        self.w1 = nn.Linear(h, f, bias=spec.mlp_bias)  # gate (SwiGLU) or up (GELU)
        self.w2 = nn.Linear(f, h, bias=spec.mlp_bias)  # down
        if self.swiglu:
            self.w3 = nn.Linear(h, f, bias=spec.mlp_bias)  # up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = make_norm(spec)
        self.attn = Attention(spec)
        self.mlp_norm = make_norm(spec)
        self.mlp = MLP(spec)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class TiedHead(nn.Module):
    """The output projection of a tied model: logits = x @ embedding.weight.T, with no parameter of its own.

    The embedding is kept in a tuple, which ``nn.Module`` does not register, so the matrix has
    one name (``tok_emb.weight``) in ``named_parameters`` and ``state_dict``.
    """

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding_ref = (embedding,)

    @property
    def weight(self) -> nn.Parameter:
        return self.embedding_ref[0].weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Decoder(nn.Module):
    """Layers ``[start, end)`` of the model; ``first`` adds the embeddings, ``last`` the norm and head.

    The whole model is ``Decoder(spec, (0, L), first=True, last=True)``: one code path for
    the single-process reference and every pipeline stage. Input: token ids (first stage)
    or hidden states; output: logits (last stage) or hidden states.
    """

    def __init__(self, spec: ModelSpec, layers: tuple[int, int], first: bool, last: bool,
                 recompute: bool = False) -> None:
        super().__init__()
        if not 0 <= layers[0] < layers[1] <= spec.num_layers:
            raise ValueError(f"layer range {list(layers)} is outside the model's [0, {spec.num_layers})")
        self.spec, self.layer_range, self.first, self.last = spec, layers, first, last
        self.recompute = recompute
        tied = spec.tie_embeddings
        if first or (last and tied):  # a tied last stage holds its copy of the embedding matrix
            self.tok_emb = nn.Embedding(spec.vocab_size, spec.hidden_size)
        if first and spec.position == "learned":
            self.pos_emb = nn.Embedding(spec.max_seq_len, spec.hidden_size)
        self.layers = nn.ModuleDict({str(k): DecoderLayer(spec) for k in range(*layers)})
        if last:
            self.norm = make_norm(spec)
            self.head: nn.Module = (TiedHead(self.tok_emb) if tied else
                                    nn.Linear(spec.hidden_size, spec.vocab_size, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq_len = x.shape[1]
        if seq_len > self.spec.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds the model's max_seq_len {self.spec.max_seq_len}")
        if self.first:
            h = self.tok_emb(x)
            if self.spec.position == "learned":
                h = h + self.pos_emb(torch.arange(seq_len, device=x.device))
            x = h
        rope = rope_tables(self.spec, seq_len, x.device) if self.spec.position == "rope" else None
        for layer in self.layers.values():
            if self.recompute and torch.is_grad_enabled():
                x = checkpoint(layer, x, rope, use_reentrant=False)
            else:
                x = layer(x, rope)
        if self.last:
            x = self.head(self.norm(x))
        return x


def param_seed(seed: int, name: str) -> int:
    """Stable per-parameter seed (crc32, not Python's salted hash) so every process agrees."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_parameter(spec: ModelSpec, name: str, param: torch.Tensor, seed: int) -> None:
    """nanoGPT init: N(0, 0.02) for matrices and embeddings, residual outputs scaled by
    1/sqrt(2L), zero biases, unit norm gains. Drawn on CPU so every device gets the same bits."""
    leaf = name.rsplit(".", 1)[-1]
    with torch.no_grad():
        if "norm" in name:
            param.fill_(1.0 if leaf == "weight" else 0.0)
        elif leaf == "bias":
            param.zero_()
        else:
            std = INIT_STD / math.sqrt(2 * spec.num_layers) if (".wo." in name or ".w2." in name) else INIT_STD
            gen = torch.Generator(device="cpu").manual_seed(param_seed(seed, name))
            values = torch.normal(0.0, std, size=tuple(param.shape), generator=gen, dtype=torch.float32)
            param.copy_(values.to(param.dtype))


def build_stage(spec: ModelSpec, layers: tuple[int, int], first: bool, last: bool, seed: int = 0,
                device: torch.device | str = "cpu", recompute: bool = False) -> Decoder:
    """One pipeline stage: built on meta, then only its own parameters are allocated and initialised."""
    with torch.device("meta"):
        module = Decoder(spec, layers, first, last, recompute=recompute)
    module = module.to_empty(device=device)
    for name, param in module.named_parameters():  # a tied last stage's copy is `tok_emb.weight` too: same bits
        init_parameter(spec, name, param, seed)
    return module


def build_full_model(model: str | ModelSpec, seed: int = 0) -> Decoder:
    """The whole model in one process (the single-device reference), CPU, fp32."""
    spec = load_model_spec(model) if isinstance(model, str) else model
    return build_stage(spec, (0, spec.num_layers), first=True, last=True, seed=seed)


def state_dict_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the consolidated state dict, without allocating anything."""
    with torch.device("meta"):
        module = Decoder(spec, (0, spec.num_layers), True, True)
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}
