"""Counting what a layer runs, as a GPU would run it, on CPU (helpers of the counting tests).

``OpRecorder`` records each aten op's tensors. Two ops are made opaque, so the recorder sees one kernel where a
GPU runs one: attention (priced on its own, by FLOPs: ``ops._attention_kernels``; the stand-in returns its output
in flash's memory layout, [b, s, heads, d] under a [b, heads, s, d] view, so the runtime's reshape after it is a
view as on a GPU) and RMSNorm (on CUDA ``F.rms_norm`` is one fused kernel, ``aten._fused_rms_norm``, forward and
backward; on CPU it decomposes into six): a fused kernel reads its inputs and writes its outputs once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops that move no bytes (views) or are priced apart (GEMMs: by FLOPs and their own operands).
NOT_ELEMENTWISE = {
    "aten.view.default", "aten.transpose.int", "aten.t.default", "aten.expand.default", "aten.unsqueeze.default",
    "aten.detach.default", "aten.alias.default", "aten.slice.Tensor", "aten.select.int", "aten.permute.default",
    "aten.split.Tensor", "aten.split_with_sizes.default", "aten.as_strided.default", "aten._unsafe_view.default",
    "aten.reshape.default", "aten.chunk.default", "aten.squeeze.dim", "aten.view_as_real.default",
    "aten.view_as_complex.default", "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten.zeros.default",  # an autograd buffer for a norm weight's gradient: h elements, written by the kernel
}


class OpRecorder(TorchDispatchMode):
    """Every aten op: (name, input tensors' (ptr, bytes), output tensors' (ptr, bytes), input tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, list[tuple[int, int]], list[tuple[int, int]], list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        info = [(t.data_ptr(), t.numel() * t.element_size()) for t in ins]
        self.ops.append((str(func), info, [(t.data_ptr(), t.numel() * t.element_size()) for t in outs], ins))
        return out

    def elementwise_bytes(self, grads: set[int] = frozenset()) -> float:
        """Bytes of every op but views, GEMMs, collectives and the opaque attention, and but the accumulation into the
        ``.grad`` tensors at ``grads`` (priced apart: ``ops.grad_accumulation_kernels``): the in-place adds into
        them and the casts that make what they add (plain autocast's fp32 copy of a 16-bit weight gradient)."""
        into = [(name, ins) for name, ins, _, _ in self.ops if name.endswith("add_.Tensor") and ins[0][0] in grads]
        fed = {ptr for _, ins in into for ptr, _ in ins[1:]}
        total = 0.0
        for name, ins, outs, _ in self.ops:
            if name in NOT_ELEMENTWISE or name.startswith(("counting.attention", "c10d")):
                continue  # communication is priced apart (``CostModel.tp_allreduce_s``)
            if name.endswith("add_.Tensor") and ins[0][0] in grads:
                continue
            if "_to_copy" in name and outs and all(ptr in fed for ptr, _ in outs):
                continue
            total += sum(b for _, b in ins) + sum(b for _, b in outs)
        return total


@torch.library.custom_op("counting::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2).contiguous().transpose(1, 2)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(q)


@torch.library.custom_op("counting::attention_backward", mutates_args=())
def attention_backward(g: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    return [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]  # values are not what is counted


attention.register_autograd(lambda ctx, g: tuple(attention_backward(g, *ctx.saved_tensors)),
                            setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


@torch.library.custom_op("counting::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> list[torch.Tensor]:
    return list(torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps))


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> list[torch.Tensor]:
    return [torch.empty_like(x), x.new_empty((*x.shape[:-1], 1))]


@torch.library.custom_op("counting::rms_norm_backward", mutates_args=())
def rms_norm_backward(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
                      ) -> list[torch.Tensor]:
    return [torch.zeros_like(x), torch.zeros_like(weight)]


rms_norm.register_autograd(lambda ctx, grads: (*rms_norm_backward(grads[0], *ctx.saved_tensors), None),
                           setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0], inputs[1],
                                                                                           output[1]))


def fused_rms_norm(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor, eps: float | None) -> torch.Tensor:
    return rms_norm(x, weight, 1e-6 if eps is None else eps)[0]


def opaque_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = True,
                     enable_gqa: bool = False) -> torch.Tensor:
    return attention(q, k, v)


@contextlib.contextmanager
def as_on_gpu(*modules: object) -> Iterator[None]:
    """Within: each module's ``F.scaled_dot_product_attention`` and ``F.rms_norm`` are the opaque kernels."""
    saved = [(m, m.F) for m in modules]
    for m in modules:
        m.F = _Functional(m.F)
    try:
        yield
    finally:
        for m, f in saved:
            m.F = f


class _Functional:
    """``torch.nn.functional`` with the two opaque kernels in place."""

    def __init__(self, base: object) -> None:
        self._base = base

    def __getattr__(self, name: str) -> Callable:
        if name == "rms_norm":
            return fused_rms_norm
        if name == "scaled_dot_product_attention":
            return opaque_attention
        return getattr(self._base, name)
