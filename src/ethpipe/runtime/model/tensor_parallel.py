"""Megatron-style tensor parallelism of one stage: the layers, the conjugate collectives, the loss.

A stage with ``tp = t`` splits attention heads and the MLP's hidden dimension over its t ranks
(column-parallel Q/K/V/gate/up, row-parallel output/down), keeps norms replicated, and splits
the vocabulary of the embedding and the LM head; the cross-entropy is computed vocab-parallel,
so no rank materialises the full logits. Parameters keep their global names and hold the
rank's slice of the global tensor along ``shard_dim(name)``.

Why hand-written rather than ``torch.distributed.tensor.parallelize_module``: the stage's
parameters stay plain tensors, so block-wise gradient aggregation across pipelines of other TP
degrees (runtime/sync/grads.py) slices them by plain index arithmetic, and the model code is the
same module tree at every degree (docs/runtime.md, "Tensor parallelism").

``f`` (``copy_to_tp``): identity forward, all-reduce backward — once at the input of each
sub-block (attention, MLP, LM head), in the compute dtype (``tp_input``): the gradients of Q, K and V
(gate and up) sum before the one all-reduce, so a layer all-reduces 2 x b*s*h elements forward (``g``
after attention and after the MLP) and 2 x b*s*h backward, in bf16/fp16 under autocast: Megatron's 4.
``g`` (``reduce_from_tp``): all-reduce forward, in place, identity backward — after a row-parallel matmul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ethpipe.runtime.model.weight_cast import WeightCast, cast

_COLUMN = ("attn.wq.", "attn.wk.", "attn.wv.", "mlp.w1.", "mlp.w3.")
_ROW_WEIGHTS = ("attn.wo.weight", "mlp.w2.weight")


@dataclass(frozen=True)
class TPGroup:
    """This rank's tensor-parallel group: ``rank`` is its index in the stage's ``ranks``."""

    group: dist.ProcessGroup | None
    rank: int
    size: int

    def part(self, n: int) -> tuple[int, int]:
        """The [start, end) of this rank's equal share of n elements."""
        assert n % self.size == 0, (n, self.size)
        share = n // self.size
        return self.rank * share, (self.rank + 1) * share


def shard_dim(name: str) -> int | None:
    """Along which dim a TP stage splits the global parameter ``name`` (None: replicated)."""
    if name in ("tok_emb.weight", "head.weight") or any(f".{c}" in name for c in _COLUMN):
        return 0
    if any(name.endswith(r) for r in _ROW_WEIGHTS):
        return 1
    return None


def local_slice(full: torch.Tensor, name: str, tp: TPGroup | None) -> torch.Tensor:
    """This rank's part of a global tensor (the whole tensor when replicated or tp is 1)."""
    dim = shard_dim(name)
    if tp is None or tp.size == 1 or dim is None:
        return full
    start, end = tp.part(full.shape[dim])
    return full.narrow(dim, start, end - start)


def gather_full(local: torch.Tensor, name: str, tp: TPGroup | None) -> torch.Tensor:
    """The global tensor from every TP rank's part (collective over the TP group when sharded)."""
    dim = shard_dim(name)
    if tp is None or tp.size == 1 or dim is None:
        return local
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(parts, local.contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()  # autograd's own (summed) gradient: reduced in place, as Megatron does
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """In place: its input (a row-parallel matmul's output) must not be saved by another op; autograd
    raises if it is, and the layers of this module never save it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        else:
            ctx.mark_dirty(x)  # the partial sums are not needed again: reduce them in place
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, tp.group)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, tp.group)


def compute_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype its matmuls run in: the autocast dtype inside an autocast region (cast once
    for all the sub-block's matmuls, which would otherwise each keep their own cast), else unchanged."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


def tp_input(x: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """A sub-block's input to its column-parallel matmuls: in the compute dtype, and under tp through
    ``f`` once (one backward all-reduce of the summed gradients, in that dtype)."""
    x = compute_input(x)
    return copy_to_tp(x, tp) if tp is not None and tp.size > 1 else x


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same names) multiplying by the step's 16-bit weight copy where its stage
    casts (``weight_cast.WeightCast``: the gradient goes straight into the fp32 ``.grad``)."""

    weight_cast: WeightCast | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, cast(self, self.weight), cast(self, self.bias))  # type: ignore[arg-type]


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local: this rank's share of the output features. Its input has been
    through ``f`` already (``tp_input``, once for all the sub-block's column-parallel layers)."""

    weight_cast: WeightCast | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features // tp.size, in_features))
        self.bias = nn.Parameter(torch.empty(out_features // tp.size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, cast(self, self.weight), cast(self, self.bias))  # type: ignore[arg-type]


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_local W_local^T, then + b (replicated): the input features are split."""

    weight_cast: WeightCast | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, cast(self, self.weight)), self.tp)  # type: ignore[arg-type]
        return y + cast(self, self.bias) if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the token embedding; tokens outside the range contribute zeros."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.start, self.end = tp.part(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        h = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(h, self.tp)


def linear(in_features: int, out_features: int, bias: bool, style: str, tp: TPGroup | None) -> nn.Module:
    """``Linear`` at tp 1, else the column- or row-parallel layer (same parameter names)."""
    if tp is None or tp.size == 1:
        return Linear(in_features, out_features, bias=bias)
    cls = ColumnParallelLinear if style == "column" else RowParallelLinear
    return cls(in_features, out_features, bias, tp)


def vocab_parallel_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup,
                                     vocab_start: int) -> torch.Tensor:
    """Sum over tokens of -log softmax(logits)[target], with each rank holding a vocabulary slice; targets below 0
    (padding, ``runtime/data.IGNORE_TARGET``) are not counted, as ``F.cross_entropy``'s ``ignore_index``.

    The max is only a shift (no gradient); the sum of exponentials and the target logit are
    all-reduced with identity backward, so each rank's logits get exactly their softmax gradient.
    """
    logits = logits.reshape(-1, logits.shape[-1])
    targets = targets.reshape(-1)
    shift = logits.detach().max(dim=-1).values
    dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=tp.group)
    shifted = logits - shift.unsqueeze(-1)
    sum_exp = reduce_from_tp(shifted.exp().sum(dim=-1), tp)
    local = targets - vocab_start
    mine = (local >= 0) & (local < logits.shape[-1])
    picked = shifted.gather(1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(1)).squeeze(1)
    target_logit = reduce_from_tp(picked.masked_fill(~mine, 0.0), tp)
    return (sum_exp.log() - target_logit).masked_fill(targets < 0, 0.0).sum()
