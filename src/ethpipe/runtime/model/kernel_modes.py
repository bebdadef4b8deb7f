"""Match the GPU's kernel modes to what the plan was priced for: TF32 on or off, attention backend.

The switches are data (``_tf32_switches``, ``_sdpa_switches``): the runtime sets them for a plan, and the
profiler sets the same ones for a profile and puts them back (``set_switches`` returns what to restore).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence

import torch

from ethpipe.plan import Plan

# (setter, getter, value) of one process-wide CUDA switch.
Switch = tuple[Callable[[bool], None], Callable[[], bool], bool]


def _tf32_switches(tf32: bool) -> list[Switch]:
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    return [(lambda v: setattr(matmul, "allow_tf32", v), lambda: matmul.allow_tf32, tf32),
            (lambda v: setattr(cudnn, "allow_tf32", v), lambda: cudnn.allow_tf32, tf32)]


def _sdpa_switches(fused: bool) -> list[Switch]:
    """Fused SDPA kernels on (PyTorch's default) or off: the math path, reducing in the inputs' dtype."""
    cuda = torch.backends.cuda
    return [(cuda.enable_flash_sdp, cuda.flash_sdp_enabled, fused),
            (cuda.enable_mem_efficient_sdp, cuda.mem_efficient_sdp_enabled, fused),
            (cuda.enable_cudnn_sdp, cuda.cudnn_sdp_enabled, fused),
            (cuda.enable_math_sdp, cuda.math_sdp_enabled, True),
            (cuda.allow_fp16_bf16_reduction_math_sdp, cuda.fp16_bf16_reduction_math_sdp_allowed, not fused)]


def set_switches(switches: Sequence[Switch]) -> list[tuple[Callable[[bool], None], bool]]:
    """Set each switch; returns (setter, previous value) pairs, for ``restore_switches``."""
    previous = [(setter, getter()) for setter, getter, _ in switches]
    for setter, _, value in switches:
        setter(value)
    return previous


def restore_switches(previous: Sequence[tuple[Callable[[bool], None], bool]]) -> None:
    for setter, value in previous:
        setter(value)


def kernel_mode_switches(tf32: bool, attention: str) -> list[Switch]:
    """Every switch a plan's (or profile's) kernel times depend on."""
    return _tf32_switches(tf32) + _sdpa_switches(attention != "materialised")


def apply_tf32(plan: Plan, device: torch.device) -> bool | None:
    """Set ``allow_tf32`` for CUDA matmuls and cuDNN from the plan's ``tf32`` (default on); no-op off CUDA.

    PyTorch's own default for matmuls is off since 1.12, so an fp32 plan priced with TF32 would
    otherwise run ~8x slower GEMMs on an A100 than the planner assumed. Returns the value set.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    tf32 = bool(plan.extra.get("tf32", True))
    set_switches(_tf32_switches(tf32))
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
    set_switches(_sdpa_switches(fused))


def apply_kernel_modes(plan: Plan, device: torch.device) -> None:
    """Everything a rank sets before training so its kernels are the ones the plan was priced with."""
    apply_tf32(plan, device)
    apply_attention(plan, device)


def cpu_kernel_cache_dir(chosen: str | None) -> str:
    """Inductor's cache folder for a CPU run: a subfolder per ATen CPU capability of the folder in force (the
    user's ``TORCHINDUCTOR_CACHE_DIR``, or torch's default). Inductor's caches are not keyed by the capability
    (torch 2.13): C++ generated for AVX2 and reused under ``ATEN_CPU_CAPABILITY=default`` fails to build
    ("'at::vec' has not been declared"). Idempotent."""
    base = chosen or os.path.join(tempfile.gettempdir(), f"torchinductor_{os.getuid()}")
    leaf = f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"
    return base if os.path.basename(os.path.normpath(base)) == leaf else os.path.join(base, leaf)
