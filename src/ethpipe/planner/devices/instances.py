"""A group's pipelines as a rank matrix, their stage slots built only when a plan is assembled.

A replicated layout at thousands of GPUs has hundreds of pipelines per structure, and the search
prices it from node statistics alone (``grouping.make_group``); building every pipeline's
``StageSlot`` tuples up front was a tenth of planning time. ``RankRows`` is the sequence those
tuples would form (same length, same items, compares equal to it), materialised on first use.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from ethpipe.planner.layers.timing import StageSlot


class RankRows(Sequence[tuple[StageSlot, ...]]):
    """Pipeline i's stage s is ``StageSlot(devices[s], tp, ranks[i, s*tp:(s+1)*tp])``."""

    def __init__(self, devices: Sequence[str], tp: int, ranks: np.ndarray) -> None:
        assert ranks.ndim == 2 and ranks.shape[1] == len(devices) * tp, "one row of depth x tp ranks per pipeline"
        self.devices, self.tp, self.ranks = tuple(devices), tp, ranks
        self._rows: tuple[tuple[StageSlot, ...], ...] | None = None

    def _row(self, ranks: list[int]) -> tuple[StageSlot, ...]:
        tp = self.tp
        return tuple(StageSlot(d, tp, tuple(ranks[s * tp:(s + 1) * tp])) for s, d in enumerate(self.devices))

    def _all(self) -> tuple[tuple[StageSlot, ...], ...]:
        if self._rows is None:
            self._rows = tuple(self._row(r) for r in self.ranks.tolist())
        return self._rows

    def __len__(self) -> int:
        return self.ranks.shape[0]

    @overload
    def __getitem__(self, i: int) -> tuple[StageSlot, ...]: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[tuple[StageSlot, ...]]: ...

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if isinstance(i, int) and self._rows is None:  # a representative: no need to build the others
            return self._row(self.ranks[i].tolist())
        return self._all()[i]

    def __iter__(self) -> Iterator[tuple[StageSlot, ...]]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(self._all())
