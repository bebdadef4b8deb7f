"""The one way every test compares a run with the single-process reference, and why it holds on any CPU.

Both sides train in float64 (``TrainConfig(dtype="fp64")``, ``reference_train(dtype=float64)``).
Why not fp32: AdamW divides by sqrt(v), so an element whose gradient is tiny turns float
summation-order noise (which differs between CPU kernels: AVX-512, AVX2, default) into
parameter differences far above the noise itself. Two fp32 references of the same model that
differ only in summation order (whole batch vs one sample at a time) differ by up to 7e-6 here
and 1.4e-4 on an AVX2 machine (16 samples, 3 steps, lr 3e-3) — a fixed fp32 tolerance is tuned
to one CPU.

The tolerances, derived rather than tuned:

- The order noise scales with the unit roundoff u. The worst fp32 order noise ever measured,
  1.4e-4, is 2.4e3 u_fp32 (u_fp32 = 6.0e-8). The same amplification in float64
  (u_fp64 = 1.1e-16) is 2.6e-13. ``PARAM_ATOL`` = 1e-9 leaves a factor ~4e3 above that, and
  ``test_exactness_tolerance.py`` measures the float64 order-noise floor (3e-14 here) and
  asserts it stays 1e3 below the tolerance.
- A real bug moves parameters by far more: weight decay on a norm gain moves it by
  lr * wd = 1e-4 per step; a skipped block all-reduce or a wrong sample weighting moves
  gradients by O(1) relative, so parameters by O(lr). Both are >= 1e5 x ``PARAM_ATOL``.
- Loss and gradient norm are sums of N terms: relative order noise <= N u_fp64 ~ 1e-12 for
  the ~1e4 terms of these runs; ``STAT_RTOL`` = 1e-9. They catch what AdamW's scale invariance
  hides from the parameters (a loss scaled by 1/samples instead of 1/tokens changes both by
  seq_len x).

``test_broken_runtime.py`` shows each check failing on a deliberately wrong runtime.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from .reference import ReferenceRun

PARAM_ATOL = 1e-9
STAT_RTOL = 1e-9


def assert_params_match(label: str, got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                        atol: float = PARAM_ATOL) -> None:
    """Same names, and every element within ``atol`` (compared in float64)."""
    assert set(got) == set(want), f"{label}: names differ: {sorted(set(got) ^ set(want))[:5]}"
    for key, value in want.items():
        torch.testing.assert_close(got[key].double(), value.double(), atol=atol, rtol=0,
                                   msg=lambda m, k=key: f"{label} {k}: {m}")


def assert_stats_match(label: str, records: Sequence[Mapping[str, float]], ref: ReferenceRun,
                       first_step: int = 0) -> None:
    """Per-step loss and (pre-clip) gradient norm equal the reference's from ``first_step`` on."""
    steps = len(records)
    np.testing.assert_allclose([r["loss"] for r in records], ref.losses[first_step:first_step + steps],
                               rtol=STAT_RTOL, atol=0, err_msg=f"{label}: loss")
    np.testing.assert_allclose([r["grad_norm"] for r in records], ref.grad_norms[first_step:first_step + steps],
                               rtol=STAT_RTOL, atol=0, err_msg=f"{label}: grad_norm")


def assert_matches_reference(label: str, got: Mapping[str, torch.Tensor], records: Sequence[Mapping[str, float]],
                             ref: ReferenceRun, first_step: int = 0) -> None:
    """Parameters, per-step losses and gradient norms: the three checks every exactness test makes."""
    assert_stats_match(label, records, ref, first_step)
    assert_params_match(label, got, ref.state)


def fails(check: Callable[[], None]) -> bool:
    """Whether ``check`` raises AssertionError: how a test shows a check catches a deliberately broken run."""
    try:
        check()
    except AssertionError:
        return True
    return False
