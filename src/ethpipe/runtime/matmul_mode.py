"""Match the GPU's kernel modes to what the plan was priced for: TF32 on or off, attention backend."""

from __future__ import annotations

import torch

from ethpipe.plan import Plan


def apply_tf32(plan: Plan, device: torch.device) -> bool | None:
    """Set ``allow_tf32`` for CUDA matmuls and cuDNN from the plan's ``tf32`` (default on); no-op off CUDA.

    PyTorch's own default for matmuls is off since 1.12, so an fp32 plan priced with TF32 would
    otherwise run ~8x slower GEMMs on an A100 than the planner assumed. Returns the value set.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    tf32 = bool(plan.extra.get("tf32", True))
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    return tf32


def apply_attention(plan: Plan, device: torch.device) -> str | None:
    """Restrict SDPA to what the plan's ``attention`` priced; no-op off CUDA. Returns the choice applied.

    ``auto`` leaves PyTorch's own pick (flash, memory-efficient, cuDNN: all fused, no s x s tensor),
    which is what the cost model prices. ``materialised`` turns the fused backends off so SDPA runs its
    math path, which keeps the score matrix: the memory the plan budgeted and the time it priced. The
    math path would upcast 16-bit inputs to fp32 (scores of twice the bytes priced); it is allowed to
    reduce in the training dtype instead, as a 16-bit Megatron-style runtime does.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    fused = plan.extra.get("attention", "auto") != "materialised"
    set_sdpa_backends(fused)
    return "auto" if fused else "materialised"


def set_sdpa_backends(fused: bool) -> None:
    """Fused SDPA kernels on (PyTorch's default) or off (the math path, reducing in the inputs' dtype)."""
    torch.backends.cuda.enable_flash_sdp(fused)
    torch.backends.cuda.enable_mem_efficient_sdp(fused)
    torch.backends.cuda.enable_cudnn_sdp(fused)
    torch.backends.cuda.enable_math_sdp(True)
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(not fused)


def apply_kernel_modes(plan: Plan, device: torch.device) -> None:
    """Everything a rank sets before training so its kernels are the ones the plan was priced with."""
    apply_tf32(plan, device)
    apply_attention(plan, device)
