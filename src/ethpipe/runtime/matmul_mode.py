"""Match the GPU's fp32 matmul mode to what the plan was priced for (TF32 on or off)."""

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
