"""Human-readable sizes for messages and tables: a 20 MiB emulated device must not read "0.0 GiB"."""

from __future__ import annotations

BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(num_bytes: float) -> str:
    """``num_bytes`` in the largest binary unit that keeps the number >= 1 (whole bytes below 1 KiB)."""
    size, sign = abs(float(num_bytes)), "-" if num_bytes < 0 else ""
    for unit in BYTE_UNITS:
        if size < 1024 or unit == BYTE_UNITS[-1]:
            return f"{sign}{size:.0f} {unit}" if unit == "B" else f"{sign}{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable: the last unit always returns")
