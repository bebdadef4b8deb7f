"""The exactness tolerances hold with a wide margin on this CPU, whatever its kernels (exactness.py).

The reference is trained twice in float64, in two summation orders (the whole batch at once, and
one sample at a time with gradients accumulated): the same maths, different rounding. That
difference is the order-noise floor any exact implementation sits on; it must stay far below
the tolerances, so that another CPU (other kernels, other orders) cannot push an exact run over
them. CI runs this under ATEN_CPU_CAPABILITY=default and avx2 too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ethpipe.tokens.texts import prepare_tokens

from .exactness import PARAM_ATOL, STAT_RTOL
from .plans import GPT_LIKE, LLAMA_LIKE
from .reference import reference_train

pytestmark = pytest.mark.exactness

MARGIN = 1e3  # the floor must sit this far below each tolerance


def _relative(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("spec", [LLAMA_LIKE, GPT_LIKE], ids=["llama-like", "gpt-like"])
def test_float64_order_noise_is_far_below_the_tolerances(tmp_path: Path, spec) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    data = str(tmp_path / "tokens.bin")
    prepare_tokens([" ".join(rng.choice(["order", "noise", "is", "not", "a", "bug", "."], size=3000))], data)
    kwargs = dict(global_batch=16, seq_len=16, steps=6, lr=3e-3, weight_decay=0.1, clip_grad=0.0, seed=0)
    whole = reference_train(spec, data, **kwargs)  # type: ignore[arg-type]
    per_sample = reference_train(spec, data, per_sample=True, **kwargs)  # type: ignore[arg-type]
    assert all(v.dtype == torch.float64 for v in whole.state.values())
    param_floor = max(float((whole.state[k] - per_sample.state[k]).abs().max()) for k in whole.state)
    assert param_floor < PARAM_ATOL / MARGIN, f"fp64 parameter order noise {param_floor:.1e}"
    assert _relative(whole.losses, per_sample.losses) < STAT_RTOL / MARGIN
    assert _relative(whole.grad_norms, per_sample.grad_norms) < STAT_RTOL / MARGIN
