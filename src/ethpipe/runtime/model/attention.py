"""Which SDPA kernel a decoder block's attention gets, and grouped-query K/V shaped so it stays a fused one.

SDPA's ``enable_gqa=True`` (K and V at their own, smaller head count) is taken by the flash kernel only (CUDA:
sm80+, 16-bit inputs) in torch 2.13: anywhere else on a GPU (fp32 on any GPU, fp16 on Volta and Turing) it
falls back to the math kernel, which keeps the ``s x s`` scores in fp32 and runs the full ``s^2`` FLOPs, where
the cost model prices the memory-efficient kernel (no scores in memory). There, K and V are expanded to the
query heads first (``repeat_interleave``, as transformers' ``repeat_kv`` does) and SDPA runs without GQA, so
the memory-efficient kernel takes it; the cost model prices the expansion and the wider saved K and V
(``cost/ops.py``, ``cost/memory.py``: ``gqa_expanded``). CPU runs keep ``enable_gqa`` (no pricing rests on
them, and the activation inventory is counted there).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

FLASH_MIN_CAPABILITY = (8, 0)
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def flash_runs(device: torch.device, dtype: torch.dtype, capability: tuple[int, int] | None = None) -> bool:
    """Whether SDPA's flash kernel takes inputs of ``dtype`` on ``device`` (``capability``: the CUDA device's
    compute capability; None: read it)."""
    if device.type != "cuda":
        return True  # not a CUDA kernel choice: inputs go to SDPA as they are
    if capability is None:
        capability = _capability(device.index if device.index is not None else torch.cuda.current_device())
    return dtype in FLASH_DTYPES and capability >= FLASH_MIN_CAPABILITY


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    """A CUDA device's compute capability, read once (every attention forward asks)."""
    return torch.cuda.get_device_capability(index)


def expand_kv(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
              capability: tuple[int, int] | None = None) -> bool:
    """Whether grouped-query K and V must be expanded to the query heads before SDPA (module docstring)."""
    return num_kv_heads < num_heads and not flash_runs(device, dtype, capability)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, expand: bool) -> torch.Tensor:
    """SDPA over [batch, heads, tokens, head_dim] inputs, K and V with fewer heads under GQA; ``expand``: K and
    V repeated to the query heads first (``expand_kv``)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and expand:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
