"""16-bit weights for a 16-bit step, with each micro-batch's gradient added straight into the fp32 ``.grad``.

Under plain autocast a matmul casts its fp32 weight to 16-bit (autocast caches the copy for the region)
and autograd sends the 16-bit weight gradient back through that cast: it is cast to fp32 (read 2 bytes,
write 4), then ``AccumulateGrad`` adds the fp32 copy into ``.grad`` (read 4 + 4, write 4): 18 bytes per
parameter and micro-batch after the weight-gradient GEMM wrote its 2. ``WeightCast`` makes the same
16-bit copy once per step and sends its gradient back through ``_CastAccumulate``, whose backward adds
the 16-bit gradient into the fp32 ``.grad`` in place, in one mixed-dtype kernel (read 2 + 4, write 4:
10 bytes), and hands autograd nothing more to accumulate. Megatron's fused accumulation (the
weight-gradient GEMM adding into an fp32 buffer: 8 bytes, counted with the GEMM) needs a GEMM with an
fp32 output from 16-bit inputs, which public torch has on CUDA only (``torch.mm(..., out_dtype=)``) and
which a linear's single autograd node could not keep apart from its input gradient (the B/W split:
``pipeline/split_backward.py``); docs/runtime.md, "Mixed precision", says what each moves.

``AccumulateGrad`` still runs for the weight (with nothing to add), so its post-accumulate-grad hooks fire
after the in-place add, as the gradient sync needs (``sync/buckets.py``). Outside ``step`` (fp32, fp64,
the single-process reference, a compiled block) a weight passes through unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


class _CastAccumulate(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.weight = weight  # the parameter itself (not saved: the optimizer updates it in place between steps)
        return weight.detach().to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None]:
        weight = ctx.weight
        if weight.grad is None:
            weight.grad = grad.to(weight.dtype)
        else:
            weight.grad.add_(grad)  # fp32 += 16-bit, in place: the fused cast-and-add
        return None, None


class WeightCast:
    """A stage's 16-bit weight copies for one step (``step``), made on first use and dropped at its end.

    One object per stage (``Decoder.weight_cast``), held by each module that multiplies by a weight; not
    global: two stages in one process (tests) keep their own copies.
    """

    def __init__(self) -> None:
        self.dtype: torch.dtype | None = None
        self._copies: dict[nn.Parameter, torch.Tensor] = {}

    def __call__(self, weight: torch.Tensor | None) -> torch.Tensor | None:
        if self.dtype is None or weight is None or not weight.requires_grad or not torch.is_grad_enabled():
            return weight if self.dtype is None or weight is None else self._no_grad(weight)
        copy = self._copies.get(weight)  # type: ignore[call-overload]
        if copy is None:
            copy = self._copies[weight] = _CastAccumulate.apply(weight, self.dtype)  # type: ignore[index]
        return copy

    def _no_grad(self, weight: torch.Tensor) -> torch.Tensor:
        """Without autograd (a validation pass, a frozen weight): one plain 16-bit copy per weight for the step
        (a copy made with autograd serves too, detached)."""
        copy = self._copies.get(weight)  # type: ignore[call-overload]
        if copy is None:
            copy = self._copies[weight] = weight.detach().to(self.dtype)  # type: ignore[index,arg-type]
        return copy.detach()

    def copies(self) -> list[torch.Tensor]:
        """The step's 16-bit copies so far (the memory a profile must not count as activations)."""
        return list(self._copies.values())

    @contextlib.contextmanager
    def step(self, dtype: torch.dtype | None) -> Iterator[None]:
        """Cast to ``dtype`` (bf16/fp16) inside; None: weights pass through (fp32, fp64)."""
        self.dtype, self._copies = dtype, {}
        try:
            yield
        finally:
            self.dtype, self._copies = None, {}


def bind_weight_cast(module: nn.Module, cast: WeightCast | None) -> None:
    """Give every weight-multiplying submodule of ``module`` the stage's ``cast`` (None: plain weights)."""
    for sub in module.modules():
        if hasattr(sub, "weight_cast"):
            sub.weight_cast = cast


def cast(module: nn.Module, weight: torch.Tensor | None) -> torch.Tensor | None:
    """``weight`` as ``module`` multiplies by it: the step's 16-bit copy where its stage casts, else itself."""
    fn = module.weight_cast
    return weight if fn is None else fn(weight)
