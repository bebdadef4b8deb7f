"""Byte sizes: human-readable for messages and tables (a 20 MiB emulated device must not read
"0.0 GiB"), and cutting a sequence into runs of bounded size (all-reduce buckets, file shards)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(num_bytes: float) -> str:
    """``num_bytes`` in the largest binary unit that keeps the number >= 1 (whole bytes below 1 KiB)."""
    size, sign = abs(float(num_bytes)), "-" if num_bytes < 0 else ""
    for unit in BYTE_UNITS:
        if size < 1024 or unit == BYTE_UNITS[-1]:
            return f"{sign}{size:.0f} {unit}" if unit == "B" else f"{sign}{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable: the last unit always returns")


def runs_of_bytes(items: Sequence[T], num_bytes: Callable[[T], int], max_bytes: int) -> list[list[T]]:
    """Consecutive runs of ``items`` of at most ``max_bytes`` each (an item bigger than that is a run of
    its own; ``max_bytes`` <= 0: one run of everything)."""
    if max_bytes <= 0:
        return [list(items)]
    out: list[list[T]] = [[]]
    size = 0
    for item in items:
        nbytes = num_bytes(item)
        if out[-1] and size + nbytes > max_bytes:
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes
    return out


def index_ranges(indices: Sequence[int]) -> str:
    """Sorted indices as runs: [0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8' (a 1024-pipeline plan prints one run)."""
    runs: list[tuple[int, int]] = []
    for i in sorted(indices):
        if runs and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
