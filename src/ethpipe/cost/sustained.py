"""Slot-powered cards under a sustained load: why a T4's or L4's long layer passes run slower than their work.

A card powered by the PCIe slot alone (75 W, no auxiliary connector: the 70 W T4, the 72 W L4) cannot hold its
clocks through a long pass: measured (Zorse's 16-bit layer passes, docs/benchmarks/calibration.md), both cards'
pass times grow faster than their work within one sequence length, where every card with its own power connector
tracks its work. So a pass of ``t`` seconds priced at full clocks takes ``t * max(1, t / LOAD_REF_S) ** exponent``
on such a card, the exponent fitted per card with its compute factor (``cost/calibrate.py``); a slot-powered card
nobody measured takes the measured ones' mean (``hardware.Calibration.load_exponent``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ethpipe.catalog import GpuSpec, gpu_catalog

SLOT_POWER_W = 75.0
LOAD_REF_S = 1e-3  # a pass shorter than this runs at the card's clocks (no sustained load)
LOAD_EXPONENT_SD = 0.05  # the fit's prior on the exponent, around 0 (no slowdown)
LOAD_EXPONENT_MAX = 0.25


def slot_powered(gpu: GpuSpec) -> bool:
    """A card whose published board power fits the PCIe slot's 75 W (an unknown power is not)."""
    return 0.0 < gpu.tdp_w <= SLOT_POWER_W


def slot_powered_id(gpu_id: str) -> bool:
    """``slot_powered`` of a catalog GPU named by id (an id the catalog lacks is not)."""
    gpu = gpu_catalog().get(gpu_id)
    return gpu is not None and slot_powered(gpu)


def sustained_s(seconds: float | np.ndarray, exponent: float | np.ndarray) -> float | np.ndarray:
    """A pass's time at full clocks -> under a slot-powered card's sustained-load clocks."""
    if np.isscalar(exponent) and exponent == 0.0:
        return seconds
    return seconds * np.maximum(1.0, seconds / LOAD_REF_S) ** exponent


def sample_floor_s(full_clock_s: Callable[[int], float], marginal_s: float, exponent: float, most: int = 64) -> float:
    """The fewest seconds per sample any micro-batch b >= 1 takes, for a pass whose full-clock time
    ``full_clock_s(b)`` is convex in b with marginal step ``marginal_s`` (so ``full_clock_s(b) / b >= marginal_s``)
    and which is slowed by ``sustained_s``: each b up to ``most`` priced, and past it the marginal step times the
    slowdown at ``most`` (the slowdown only grows with the pass)."""
    if exponent == 0.0:
        return marginal_s
    inside = min(float(sustained_s(full_clock_s(b), exponent)) / b for b in range(1, most + 1))
    return min(inside, marginal_s * max(1.0, full_clock_s(most) / LOAD_REF_S) ** exponent)
