"""Number formats of the generated markdown (one place, so the smoke test can mirror them)."""

from __future__ import annotations

from typing import Any


def x(v: float | None) -> str:
    """Speedups; three decimals near 1 so that a loss never prints as "1.00x"."""
    if v is None:
        return "n/a"
    return f"{v:.3f}x" if abs(v - 1.0) < 0.005 and v != 1.0 else f"{v:.2f}x"


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 100:.1f}%"


def ktok(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1e3:,.1f}"


def sec(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"


def gib(v: float) -> str:
    return f"{v:.1f}"


def num(v: Any) -> str:
    """Any scalar from a foreign JSON file (measured section)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    return str(v) if isinstance(v, int) else f"{v:.4g}"


def table(header: list[str], rows: list[list[str]], align: str = "") -> list[str]:
    sep = [("---:" if (align[i:i + 1] or "r") == "r" else "---") for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(sep) + "|"] + ["| " + " | ".join(r) + " |" for r in rows]
