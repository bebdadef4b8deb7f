"""Pipeline timing in closed form: what levels 2 and 3 and the estimator price.

A 1F1B pipeline's iteration is modelled as a critical path that carries one micro-batch k
through every stage (fill and drain, ``S(x_k)``) while every other micro-batch passes the
bottleneck stage (``M(x_j)``):

    T(x_1..x_m) = sum_j M(x_j) + max_k (S(x_k) - M(x_k))

With equal micro-batches this is the textbook ``S + (m - 1) M``; with a smaller last
micro-batch it charges the remainder at its own size, and it never decreases when a sample is
added (so the data balancer's binary search is sound). Stage time ``t_i(x)`` = forward +
backward of x samples + receiving the activation from the previous stage and the gradient
from the next.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ethpipe.cost.model import CostModel
from ethpipe.planner.partition import Partition, StageOption


@dataclass(frozen=True)
class StageSlot:
    """A stage position before layers are assigned: its device type, TP degree and ranks."""

    device: str
    tp: int
    ranks: tuple[int, ...]


def p2p_in_s(cost: CostModel, slots: Sequence[StageSlot], i: int, micro_batch: int) -> float:
    """Per micro-batch receive time of stage i: activation from i-1 plus gradient from i+1."""
    t = 0.0
    if i > 0:
        t += cost.p2p_s(slots[i - 1].ranks[0], slots[i].ranks[0], micro_batch)
    if i < len(slots) - 1:
        t += cost.p2p_s(slots[i + 1].ranks[0], slots[i].ranks[0], micro_batch)
    return t


def stage_options(cost: CostModel, slots: Sequence[StageSlot], micro_batch: int, recompute: str
                  ) -> list[list[StageOption]]:
    """Time and memory options of every slot for ``micro_batch`` (recompute: auto|never|always)."""
    depth, out = len(slots), []
    for i, slot in enumerate(slots):
        first, last = i == 0, i == depth - 1
        ends = sum(cost.end_times_s(slot.device, micro_batch, slot.tp, first=first, last=last))
        fixed_s = ends + p2p_in_s(cost, slots, i, micro_batch)
        usable = cost.usable_memory_bytes(slot.device)
        flags = {"auto": (False, True), "never": (False,), "always": (True,)}[recompute]
        options = []
        for rc in flags:
            per_layer_s = sum(cost.layer_times_s(slot.device, micro_batch, slot.tp, rc))
            mem_fixed, mem_per_layer = cost.memory_terms(slot.tp, micro_batch, depth - i, rc, first=first, last=last)
            max_layers = int((usable - mem_fixed) // mem_per_layer) if usable >= mem_fixed else 0
            options.append(StageOption(fixed_s, per_layer_s, max_layers, rc))
        out.append(options)
    return out


class PipelineTiming:
    """S(x), M(x) and each stage's drain offset per micro-batch size x <= ``micro_batch``.

    Sizes are priced lazily (``rows(x)`` is called at most once per size): most templates are
    only ever asked about their full size and one remainder.
    """

    def __init__(self, micro_batch: int, rows: Callable[[int], tuple[float, float, tuple[float, ...]]]) -> None:
        self.micro_batch = micro_batch
        self._rows = rows
        self._cache: dict[int, tuple[float, float, tuple[float, ...]]] = {}

    def _row(self, x: int) -> tuple[float, float, tuple[float, ...]]:
        if x not in self._cache:
            self._cache[x] = self._rows(x)
        return self._cache[x]

    def fill_drain_s(self, x: int) -> float:
        return self._row(x)[0]

    def bottleneck_s(self, x: int) -> float:
        return self._row(x)[1]

    def drain_s(self, x: int) -> tuple[float, ...]:
        """Per stage: time after its last backward (of an x-sample last micro-batch) until the flush."""
        return self._row(x)[2]

    def time_of_sizes_s(self, sizes: Sequence[int]) -> float:
        total = sum(self.bottleneck_s(x) for x in sizes)
        return total + max(self.fill_drain_s(x) - self.bottleneck_s(x) for x in set(sizes))

    def time_s(self, num_samples: int) -> float:
        """T(n) with micro-batches of ``micro_batch`` and a smaller last one."""
        if num_samples <= 0:
            return 0.0
        b = self.micro_batch
        m = -(-num_samples // b)
        r = num_samples - (m - 1) * b
        sr, mr, _ = self._row(r)
        extra = sr - mr
        if m == 1:
            return sr
        sb, mb, _ = self._row(b)
        return (m - 1) * mb + mr + max(extra, sb - mb)

    def _table(self) -> list[tuple[int, float, float, float]]:
        """(r, S(r), M(r), extra when m > 1) for every remainder size r, computed once."""
        if not hasattr(self, "_rows_table"):
            sb, mb, _ = self._row(self.micro_batch)
            table = []
            for r in range(1, self.micro_batch + 1):
                sr, mr, _ = self._row(r)
                table.append((r, sr, mr, mr + max(sr - mr, sb - mb)))
            self._rows_table = table
        return self._rows_table

    def max_samples_within(self, limit_s: float, upper: int) -> int:
        """Largest n <= upper with T(n) <= limit, in closed form over the remainder size."""
        b = self.micro_batch
        mb = self._row(b)[1]
        best = 0
        for r, sr, _, tail in self._table():
            if sr <= limit_s and r > best:
                best = r
            k = math.floor((limit_s - tail) / mb * (1 + 1e-12))
            if k >= 1 and k * b + r > best:
                best = k * b + r
        best = min(best, upper)
        while best > 0 and self.time_s(best) > limit_s:  # guard against float rounding
            best -= 1
        return best


def split_sizes(num_samples: int, micro_batch: int) -> tuple[int, ...]:
    """Micro-batch sizes: full ones then the remainder."""
    full, rest = divmod(num_samples, micro_batch)
    return (micro_batch,) * full + ((rest,) if rest else ())


def stage_times_s(cost: CostModel, slots: Sequence[StageSlot], layers: Sequence[int], recompute: Sequence[bool],
                  micro_batch: int) -> tuple[list[float], list[float]]:
    """(t_i(x), bwd-with-grad-recv_i(x)) per stage for one micro-batch of ``micro_batch`` samples."""
    depth, totals, drains = len(slots), [], []
    for i, slot in enumerate(slots):
        first, last = i == 0, i == depth - 1
        lf, lb = cost.layer_times_s(slot.device, micro_batch, slot.tp, recompute[i])
        ef, eb = cost.end_times_s(slot.device, micro_batch, slot.tp, first=first, last=last)
        fwd, bwd = layers[i] * lf + ef, layers[i] * lb + eb
        grad_in = cost.p2p_s(slots[i + 1].ranks[0], slot.ranks[0], micro_batch) if not last else 0.0
        totals.append(fwd + bwd + p2p_in_s(cost, slots, i, micro_batch))
        drains.append(bwd + grad_in)
    return totals, drains


def pipeline_timing(cost: CostModel, slots: Sequence[StageSlot], layers: Sequence[int], recompute: Sequence[bool],
                    micro_batch: int) -> PipelineTiming:
    def rows(x: int) -> tuple[float, float, tuple[float, ...]]:
        totals, drains = stage_times_s(cost, slots, layers, recompute, x)
        acc, offsets = 0.0, []
        for d in drains:
            offsets.append(acc)
            acc += d
        return sum(totals), max(totals), tuple(offsets)

    return PipelineTiming(micro_batch, rows)


def timing_of_partition(cost: CostModel, slots: Sequence[StageSlot], part: Partition, micro_batch: int
                        ) -> PipelineTiming:
    return pipeline_timing(cost, slots, part.num_layers, part.recompute, micro_batch)
