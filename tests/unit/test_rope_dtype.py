"""RoPE under autocast runs in the 16-bit compute dtype, within its derived rounding bound.

``Decoder.rope`` computes the cos / sin tables in the weights' wide dtype and, under autocast, rounds them once
to the autocast dtype, so ``apply_rope`` neither widens q and k nor narrows them again (docs/runtime.md: 18
bytes per element of q and k instead of 48). The rounding this adds, per output element ``x1 c - x2 s``: the
two table entries (u each), the two products (u each) and the difference (u), so with u the unit roundoff
|out - exact| <= ((1 + u)^3 - 1) (|x1 c| + |x2 s|) + u |exact|, against the exact rotation of the same 16-bit
input by the fp32 tables the runtime rotated with before (fp32 RoPE rounded only its result: u |exact|): at
most about 4u of the terms' magnitude, the bound Megatron's unfused path and Hugging Face's (both in
the input's dtype) carry. Outside autocast nothing changes: fp32 and fp64 runs rotate in their own dtype.
"""

from __future__ import annotations

import pytest
import torch

from ethpipe.model_spec import ModelSpec
from ethpipe.runtime.model.decoder import apply_rope, build_stage, rope_tables

SPEC = ModelSpec(name="rope-test", num_layers=1, hidden_size=256, num_heads=4, num_kv_heads=4, vocab_size=64, max_seq_len=4096,
                 ffn_hidden_size=512)
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _bound_ratio(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> float:
    """max |rotated - exact| / (the bound of the module docstring) over all elements, for a 16-bit ``x``."""
    u = UNIT_ROUNDOFF[dtype]
    c, s = (t.double() for t in rope_tables(SPEC, x.shape[-2], x.device, torch.float32))
    x1, x2 = x.double().chunk(2, dim=-1)
    exact = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    terms = torch.cat(((x1 * c).abs() + (x2 * s).abs(), (x2 * c).abs() + (x1 * s).abs()), dim=-1)
    bound = ((1 + u) ** 3 - 1) * terms + u * exact.abs() + torch.finfo(dtype).tiny
    return float(((apply_rope(x, cos, sin).double() - exact).abs() / bound).max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_rope_under_autocast_rotates_in_the_compute_dtype_within_its_bound(dtype: torch.dtype) -> None:
    stage = build_stage(SPEC, (0, 1), first=False, last=False)
    seq = 4096  # large angles: tables computed in 16-bit (position x frequency rounded) would be far off
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, SPEC.num_heads, seq, SPEC.head_dim_resolved, generator=gen).to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        cos, sin = stage.rope(seq, x.device)
    assert cos.dtype == sin.dtype == dtype
    assert apply_rope(x, cos, sin).dtype == dtype
    assert _bound_ratio(x, cos, sin, dtype) <= 1.0
    # Outside autocast the stage keeps its wide tables (fp32 weights: fp32).
    assert stage.rope(seq, x.device)[0].dtype == torch.float32


def test_the_bound_catches_tables_computed_in_16_bit() -> None:
    """Angles formed in bf16 (position x frequency rounded before cos / sin) are not within the bound: the check
    above can fail."""
    seq, dtype = 4096, torch.bfloat16
    x = torch.randn(1, SPEC.num_heads, seq, SPEC.head_dim_resolved, generator=torch.Generator().manual_seed(1)).to(dtype)
    half = SPEC.head_dim_resolved // 2
    inv_freq = (1.0 / SPEC.rope_theta ** (torch.arange(0, half) / half)).to(dtype)
    angles = torch.outer(torch.arange(seq).to(dtype), inv_freq)
    assert _bound_ratio(x, angles.cos(), angles.sin(), dtype) > 1.0
