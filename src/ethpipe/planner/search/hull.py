"""The lower convex hull of a stage's time in its layers: what the order-free bounds (``bounds.py``) price a
position's layers with."""

from __future__ import annotations

from collections.abc import Sequence


def lower_hull(options: Sequence[tuple[float, int]]) -> list[tuple[float, int]]:
    """The lower convex hull of a stage's time in its layers, as (per-layer slope, layers) segments from 0:
    ``options`` are (per-layer cost, layers that fit) sorted by cost, so k layers cost k times the cheapest
    option that holds them; empty if none holds a layer."""
    hull: list[tuple[float, int]] = []
    held, spent = 0, 0.0
    for per, fit in options:
        if fit > held:
            slope = (fit * per - spent) / (fit - held)
            while hull and hull[-1][0] >= slope:  # keep the slopes non-decreasing: merge with the last one
                last_slope, last_len = hull.pop()
                held, spent = held - last_len, spent - last_slope * last_len
                slope = (fit * per - spent) / (fit - held)
            hull.append((slope, fit - held))
            held, spent = fit, fit * per
    return hull
