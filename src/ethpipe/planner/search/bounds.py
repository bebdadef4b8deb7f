"""Lower bounds on a replicated layout's iteration time, for ``replicated.py``'s branch and bound.

Every bound here must never exceed what ``grouping.group_iteration_s`` prices for any plan of
the layout (equal or balanced data), or the search could skip the best candidate. They use
only per-device facts (memoised): per-sample layer times (the cheapest over micro-batches up
to b), the embedding and head, which layers fit in memory at each pipeline position (with or
without recomputation), and the first stages' gradient all-reduce after the flush. The ordered
ones (``stages_bottleneck_s``, ``ordered_flush_s``: one device order, each stage with its own TP
degree) also prune ETH's type-interleaved and hybrid families (``hybrid.py``) before any template.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from ethpipe.cost.model import CostModel
from ethpipe.cost.sync import SyncShape, distinct_gpus
from ethpipe.planner.search.hull import lower_hull


class LowerBounds:
    """Order-free lower bounds on a replica's pipeline time (compute only, memoised per device)."""

    def __init__(self, cost: CostModel, device_memo: dict | None = None, compute_memo: dict | None = None,
                 sync_memo: dict | None = None) -> None:
        """``device_memo``: the memory-aware memos of another ``LowerBounds`` of the same model, dtype, GPU types
        and optimizer holders (the idle search's sub-clusters): everything but the sync bounds depends on device
        types only. ``compute_memo``: the compute-only ones, which do not depend on the holders either (the
        sharding rounds share them). ``sync_memo``: the sync bounds of another ``LowerBounds`` on the same
        cluster whose sync is priced alike (sharded or not: ``CostModel.sync_s``)."""
        self.cost = cost
        self._memo: dict[tuple, Any] = {} if device_memo is None else device_memo  # memory decides these
        self._compute: dict[tuple, Any] = {} if compute_memo is None else compute_memo  # compute (and content) only
        self._sync: dict[tuple, float] = {} if sync_memo is None else sync_memo  # ranks and nodes: this cluster's own
        self._node_ranks: dict[int, int] = Counter(d.node for d in cost.cluster.devices)

    @property
    def device_memo(self) -> dict:
        return self._memo

    @property
    def compute_memo(self) -> dict:
        return self._compute

    def _multiset(self, devices: Sequence[str]) -> tuple[tuple[str, int], ...]:
        """(device type, count) pairs of a device sequence, sorted: the key of the order-free memos, kept per
        sequence (the searches ask for the same long kinds many times)."""
        key = ("multiset", tuple(devices))
        hit = self._compute.get(key)
        if hit is None:
            hit = self._compute[key] = tuple(sorted(Counter(devices).items()))
        return hit  # type: ignore[no-any-return]

    def per_sample_s(self, device: str, tp: int, b: int) -> float:
        """Cheapest fwd+bwd seconds per sample and layer over micro-batches of at most b samples."""
        key = ("per_sample", device, tp, b)
        hit = self._compute.get(key)  # one hash per call: these memos are read ~10^5 times a plan
        if hit is None:
            hit = self._compute[key] = min(sum(self.cost.layer_times_s(device, x, tp)) / x for x in range(1, b + 1))
        return hit  # type: ignore[no-any-return]

    def ends_per_sample_s(self, device: str, tp: int, b: int, first: bool, last: bool) -> float:
        """Cheapest embedding and/or head seconds per sample over micro-batches of at most b samples."""
        if not (first or last):
            return 0.0
        key = ("ends", device, tp, b, first, last)
        if key not in self._compute:
            self._compute[key] = min(sum(self.cost.end_times_s(device, x, tp, first=first, last=last)) / x
                                  for x in range(1, b + 1))
        return self._compute[key]

    def per_sample_bottleneck_s(self, devices: Sequence[str], tp: int, b: int, layers: Sequence[int] | None,
                                any_order: bool = False) -> float:
        """The bottleneck stage's time per sample (c_i: stage i's per-layer, per-sample time, e_i its
        embedding / head time). A given split: max e_i + l_i c_i. Otherwise whole layers, at least one
        per stage: at least the L-th smallest ``e_i + k c_i`` and every ``e_i + c_i`` (``any_order``:
        for every order of these devices, so without the ends)."""
        depth = len(devices)
        if layers is not None:
            ends = [self.ends_per_sample_s(d, tp, b, i == 0, i == depth - 1) for i, d in enumerate(devices)]
            return max(e + k * self.per_sample_s(d, tp, b) for d, k, e in zip(devices, layers, ends))
        ends_at = (None, None) if any_order else (devices[0], devices[-1])
        key = ("bottleneck", self._multiset(devices), *ends_at, tp, b)
        if key not in self._compute:
            ends = [0.0 if any_order else self.ends_per_sample_s(d, tp, b, i == 0, i == depth - 1)
                    for i, d in enumerate(devices)]
            groups = Counter((self.per_sample_s(d, tp, b), e) for d, e in zip(devices, ends))
            # The L-th smallest e + k c (k >= 1, each stage of a group counted): a merge of the groups' sequences.
            merge = [(e + c, c, e, n, 1) for (c, e), n in groups.items()]
            heapq.heapify(merge)
            held = 0
            while True:
                value, c, e, n, k = heapq.heappop(merge)
                held += n
                if held >= self.cost.model.num_layers:
                    break
                heapq.heappush(merge, (e + (k + 1) * c, c, e, n, k + 1))
            self._compute[key] = max(max(e + c for c, e in groups), value)
        return self._compute[key]

    def _position(self, device: str, tp: int, b: int, in_flight: int, first: bool, last: bool, recompute: str
                  ) -> tuple[tuple[float, int], ...]:
        """(per-sample per-layer seconds, layers that fit) of each recompute choice of a stage position."""
        key = ("position", device, tp, b, in_flight, first, last, recompute)
        hit = self._memo.get(key)
        if hit is None:
            usable = self.cost.usable_memory_bytes(device)
            out = []
            for rc in {"auto": (False, True), "never": (False,), "always": (True,)}[recompute]:
                per_key = ("per_rc", device, tp, b, rc)
                if per_key not in self._compute:  # the same at every position: only memory depends on it
                    self._compute[per_key] = min(sum(self.cost.layer_times_s(device, x, tp, rc)) / x
                                              for x in range(1, b + 1))
                per = self._compute[per_key]
                fixed, per_layer = self.cost.memory_terms(tp, b, in_flight, rc, first=first, last=last, device=device)
                out.append((per, int((usable - fixed) // per_layer) if usable >= fixed else 0))
            hit = self._memo[key] = tuple(out)
        return hit  # type: ignore[no-any-return]

    def memory_bottleneck_s(self, devices: Sequence[str], tp: int, b: int, recompute: str) -> float:
        """Per-sample bottleneck of one device order with memory: each position holds at most what fits
        (recomputing where that holds more); inf if the model cannot fit. The least threshold X at which every
        position holds >= 1 layer and they hold >= L together (``_capped_bottleneck_s``)."""
        depth = len(devices)
        return self._capped_bottleneck_s(
            [self._position(d, tp, b, depth - i, i == 0, i == depth - 1, recompute) for i, d in enumerate(devices)])

    def stages_bottleneck_s(self, stages: Sequence[tuple[str, int]], b: int, recompute: str) -> float:
        """``memory_bottleneck_s`` of (device, TP) stages in order, each with its own TP degree (memoised)."""
        key = ("stages", tuple(stages), b, recompute)
        if key not in self._memo:
            self._memo[key] = self._capped_bottleneck_s(self._stage_terms(stages, b, recompute)[0])
        return self._memo[key]

    def _stage_terms(self, stages: Sequence[tuple[str, int]], b: int, recompute: str
                     ) -> tuple[list[tuple[tuple[float, int], ...]], list[float]]:
        """Each (device, TP) stage's ``_position`` options and per-sample ends in this order (memoised: the
        order bounds and the interleaved family's cutoff ask for the same stages twice)."""
        key = ("stage_terms", tuple(stages), b, recompute)
        hit = self._memo.get(key)
        if hit is None:
            depth, memo = len(stages), self._memo
            options = []
            for i, (d, t) in enumerate(stages):  # ``_position``'s memo read inline: long kinds ask often
                known = memo.get(("position", d, t, b, depth - i, i == 0, i == depth - 1, recompute))
                options.append(known if known is not None else
                               self._position(d, t, b, depth - i, i == 0, i == depth - 1, recompute))
            ends = [0.0] * depth  # only the embedding and the head have ends
            ends[0] = self.ends_per_sample_s(stages[0][0], stages[0][1], b, True, depth == 1)
            if depth > 1:
                ends[-1] = self.ends_per_sample_s(stages[-1][0], stages[-1][1], b, False, True)
            hit = memo[key] = (options, ends)
        return hit  # type: ignore[no-any-return]

    def fits(self, stages: Sequence[tuple[str, int]], layers: Sequence[int], b: int, recompute: str) -> bool:
        """Whether every (device, TP) stage holds its given layers (``fixed_partition``'s check, without timing)."""
        depth = len(stages)
        return all(max(fit for _, fit in self._position(d, t, b, depth - i, i == 0, i == depth - 1, recompute)) >= k
                   for i, ((d, t), k) in enumerate(zip(stages, layers)))

    def ordered_flush_s(self, stages: Sequence[tuple[str, int]], b: int, num_samples: int,
                        layers: Sequence[int] | None, recompute: str) -> float:
        """Stage 0's flush with ``num_samples`` on (device, TP) stages in this order. Stage k cannot finish
        before the first micro-batch crossed the stages before it, it ran every sample and the last
        micro-batch's backward crossed them back: T >= x S_k + n (u_k + e_k) (u, e: per-sample layer and
        end times, S_k their sum before k, x the smallest micro-batch). A given split: the max over k, each
        stage at its cheapest option that holds its layers. Otherwise weighted sums of these (any convex
        weights bound the max), each minimised over splits with at least one layer per stage: a stage's
        time in its layers is bounded by the convex hull of its options (recomputing only past what fits
        without), which a greedy fill minimises exactly; inf if the model cannot fit."""
        depth, n = len(stages), num_samples
        x = n - (-(-n // b) - 1) * b
        options, es = self._stage_terms(stages, b, recompute)
        if layers is not None:
            best, fill = 0.0, 0.0
            for opts, e, k in zip(options, es, layers):
                u = k * min((per for per, fit in opts if fit >= k), default=math.inf) + e
                best, fill = max(best, x * fill + n * u), fill + u
            return best
        hulls = [self._hull(opts) for opts in options]  # (slope, layers) segments, slopes non-decreasing
        if not all(hulls) or sum(length for hull in hulls for _, length in hull) < self.cost.model.num_layers:
            return math.inf
        cs = [hull[0][0] for hull in hulls]  # the first layer's per-sample cost
        index, slopes, lengths = [], [], []  # every stage's segments, flat (the first layer is paid apart)
        for j, hull in enumerate(hulls):
            for k, (slope, length) in enumerate(hull):
                index.append(j)
                slopes.append(slope)
                lengths.append(length - (k == 0))
        equalising, tail = [0.0] * depth, 0.0  # makes every c_j a_j equal: the spare layers cost the same anywhere
        for j in range(depth - 1, -1, -1):
            equalising[j] = max(1.0 / cs[j] - x * tail, 0.0) / n
            tail += equalising[j]
        out = 0.0
        for w in ([0.0] * (depth - 1) + [1.0], [1.0 / depth] * depth, [v / tail for v in equalising]):
            a, after = [0.0] * depth, 0.0
            for j in range(depth - 1, -1, -1):
                a[j] = n * w[j] + x * after
                after += w[j]
            total, left = sum((c + e) * aj for c, e, aj in zip(cs, es, a)), self.cost.model.num_layers - depth
            for cost_s, length in sorted(zip([slope * a[j] for j, slope in zip(index, slopes)], lengths)):
                if left <= 0:
                    break
                total += cost_s * min(length, left)
                left -= min(length, left)
            out = max(out, total)
        return out

    def position_options(self, device: str, tp: int, b: int, in_flight: int, recompute: str
                         ) -> tuple[tuple[float, int], ...]:
        """(per-sample per-layer seconds, layers that fit) per recompute choice of a middle stage position."""
        return self._position(device, tp, b, in_flight, False, False, recompute)

    def relaxed_memory_bottleneck_s(self, devices: Sequence[str], tp: int, b: int, recompute: str) -> float:
        """The same for any order of these devices: each type's stages as if they were the last ones
        (fewest activations in flight) and without embedding or head: memoised per multiset."""
        key = ("relaxed", self._multiset(devices), tp, b, recompute)
        if key not in self._memo:
            self._memo[key] = self._capped_bottleneck_s(
                [self._position(d, tp, b, k, False, False, recompute)
                 for d, n in Counter(devices).items() for k in range(1, n + 1)])
        return self._memo[key]

    def _capped_bottleneck_s(self, opts: Sequence[tuple[tuple[float, int], ...]]) -> float:
        """The least X such that every position holds >= 1 layer and all hold >= L, each layer at most X: a
        position's k-th layer costs k times its cheapest option that holds k layers (options: (per-layer
        seconds, layers that fit)), so X is the larger of every position's first layer and the L-th smallest
        of these thresholds (``_thresholds``; a selection, not a merge: only the value matters); inf if the
        model cannot fit."""
        num_layers = self.cost.model.num_layers
        parts, times, total, first = [], [], 0, 0.0
        for options, count in Counter(opts).items():  # positions with the same options: once, counted
            thresholds = self._thresholds(options)
            if not thresholds.size:
                return math.inf
            total += count * thresholds.size
            first = max(first, float(thresholds[0]))
            parts.append(thresholds)
            times.append(count)
        if total < num_layers:
            return math.inf
        union = np.concatenate(parts) if max(times) == 1 else np.repeat(
            np.concatenate(parts), np.repeat(times, [part.size for part in parts]))
        return max(first, float(np.partition(union, num_layers - 1)[num_layers - 1]))

    def _thresholds(self, options: tuple[tuple[float, int], ...]) -> np.ndarray:
        """A position's k-th layer's threshold for k = 1.. (at most L), increasing: k times the cheapest option
        that holds k layers (memoised: positions repeat across the orders and depths of a search)."""
        key = ("thresholds", options)
        hit = self._compute.get(key)
        if hit is None:
            num_layers = self.cost.model.num_layers
            runs: list[np.ndarray] = []
            held = 0
            for per, fit in sorted(options):
                if fit > held:
                    upto = min(fit, num_layers)
                    runs.append(np.arange(held + 1, upto + 1, dtype=float) * per)
                    held = upto
                if held >= num_layers:
                    break
            thresholds = np.concatenate(runs) if runs else np.empty(0)
            thresholds.setflags(write=False)  # shared by every position with these options
            hit = self._compute[key] = thresholds
        return hit  # type: ignore[no-any-return]

    def _hull(self, options: tuple[tuple[float, int], ...]) -> list[tuple[float, int]]:
        """``lower_hull`` of a position's options (memoised like ``_thresholds``)."""
        key = ("hull", options)
        if key not in self._compute:
            self._compute[key] = lower_hull(sorted(options))
        return self._compute[key]

    def chain_s(self, devices: Sequence[str], tp: int, b: int, num_samples: int, layers: Sequence[int] | None,
                any_order: bool = False) -> float:
        """One micro-batch of x samples crosses every layer (at least one per stage), the embedding and head
        (``any_order``: the cheapest of these devices for each)."""
        x = min(b, num_samples)
        firsts, lasts = (set(devices), set(devices)) if any_order else ({devices[0]}, {devices[-1]})
        key = ("chain", self._multiset(devices) if layers is None else tuple(zip(devices, layers)),
               tuple(sorted(firsts)), tuple(sorted(lasts)), len(devices), tp, b, x)
        if key not in self._compute:
            per = [self.per_sample_s(d, tp, b) for d in devices]
            ends = min(sum(self.cost.end_times_s(d, x, tp, first=True, last=len(devices) == 1)) for d in firsts) + (
                min(sum(self.cost.end_times_s(d, x, tp, first=False, last=True)) for d in lasts)
                if len(devices) > 1 else 0.0)
            work = sum(c * k for c, k in zip(per, layers)) if layers is not None else (
                sum(per) + (self.cost.model.num_layers - len(per)) * min(per))
            self._compute[key] = x * work + ends
        return self._compute[key]

    def makespan_s(self, kinds: Counter, tp: int, b: int, global_batch: int, layers: Sequence[int] | None,
                   recompute: str | None = None, any_order: bool = False) -> float:
        """Any split of the batch (equal or balanced): pipeline p needs >= n_p X_p, so the makespan is at
        least B / sum_p 1/X_p (one kind: ceil(B/P) X); and some pipeline runs a whole micro-batch.
        ``any_order`` (one kind, no given split): a bound for every order of its devices, memoised once."""
        num_pipes = sum(kinds.values())
        if layers is None and len(kinds) == 1:  # the layer-balanced space: the same for every type order
            (kind,) = kinds
            ends_at = (None, None) if any_order else (kind[0], kind[-1])
            key = ("makespan", self._multiset(kind), *ends_at, tp, b, global_batch, num_pipes, recompute)
            memo = self._compute if recompute is None else self._memo  # with recompute: memory-aware
            if key not in memo:
                memo[key] = self._makespan_s(kinds, tp, b, global_batch, layers, recompute, any_order)
            return memo[key]
        if recompute is None:  # compute only (the uniform space's enumeration, every round alike): memoised too,
            # keyed in the kinds' own order (the sums over them run in it)
            key = ("makespan_of", tuple(kinds.items()), tp, b, global_batch, None if layers is None else tuple(layers))
            hit = self._compute.get(key)
            if hit is None:
                hit = self._compute[key] = self._makespan_s(kinds, tp, b, global_batch, layers, recompute)
            return hit  # type: ignore[no-any-return]
        return self._makespan_s(kinds, tp, b, global_batch, layers, recompute)

    def _makespan_s(self, kinds: Counter, tp: int, b: int, global_batch: int, layers: Sequence[int] | None,
                    recompute: str | None, any_order: bool = False) -> float:
        num_pipes = sum(kinds.values())
        x = {k: self.per_sample_bottleneck_s(k, tp, b, layers, any_order) for k in kinds}
        if layers is None and recompute is not None:
            x = {k: max(v, self.relaxed_memory_bottleneck_s(k, tp, b, recompute)) for k, v in x.items()}
        share = -(-global_batch // num_pipes)
        if len(kinds) == 1:
            (kind,) = kinds
            last_micro_batch = share - (-(-share // b) - 1) * b
            slope, offset = self.fill_line_s(kind, tp, b, last_micro_batch, layers)
            steady = max(share * x[kind], slope * share + offset)
        else:
            steady = global_batch / sum(c / x[k] for k, c in kinds.items())
            lines = {k: self.fill_line_s(k, tp, b, 1, layers) for k in kinds}
            filled = (global_batch + sum(c * lines[k][1] / lines[k][0] for k, c in kinds.items())) / sum(
                c / lines[k][0] for k, c in kinds.items())
            steady = max(steady, filled, max(a + o for a, o in lines.values()))
        return max(steady, min(self.chain_s(k, tp, b, share, layers, any_order) for k in kinds))

    def fill_line_s(self, devices: Sequence[str], tp: int, b: int, x: int, layers: Sequence[int] | None
                    ) -> tuple[float, float]:
        """T(n) >= slope n + offset, with the fill and drain: stage k cannot start before micro-batch 1
        crossed the stages before it, nor finish before the last one's backward crosses them back, so
        T >= sum_{j<k} l_j c_j x + n l_k c_k for every k (x: the smallest micro-batch); averaged over k
        and minimised over whole-layer splits and device orders (or for the given split and order)."""
        per = [self.per_sample_s(d, tp, b) for d in devices]
        depth = len(per)
        slopes = [c / depth for c in per]
        if layers is not None:
            offsets = [c * (depth - 1 - j) * x / depth for j, c in enumerate(per)]
            return sum(k * a for k, a in zip(layers, slopes)), sum(k * o for k, o in zip(layers, offsets))
        # Any order of these devices: the fastest on the most-weighted positions (rearrangement inequality).
        offsets = [c * (depth - 1 - j) * x / depth for j, c in enumerate(sorted(per))]
        # One layer each, the rest on the position with the smallest coefficient (at the given n: the bound's
        # own minimiser depends on n, so use the cheapest coefficient of each part separately).
        spare = self.cost.model.num_layers - depth
        return sum(slopes) + spare * min(slopes), sum(offsets) + spare * min(offsets)

    def first_stage_sync_s(self, heads: Sequence[int], tp: int, depth: int, crossing: bool, num_layers: int = 1
                           ) -> float:
        """The first stages' blocks are all-reduced after the pipeline flushes: at least the embedding and
        ``num_layers`` layers (the whole model at depth 1). A node's NIC is shared by its ranks in
        cross-node groups: all of them when every block crosses (``crossing``), else at least the heads'."""
        if len(heads) < 2:
            return 0.0
        key = (tuple(heads), tp, depth, crossing, num_layers)
        if key not in self._sync:  # type orders that start with the same type share their heads
            self._sync[key] = self._first_stage_sync_s(heads, tp, depth, crossing, num_layers)
        return self._sync[key]

    def _first_stage_sync_s(self, heads: Sequence[int], tp: int, depth: int, crossing: bool, num_layers: int
                            ) -> float:
        devs = self.cost.cluster.devices
        here: dict[int, int] = {}
        for r in heads:
            here[devs[r].node] = here.get(devs[r].node, 0) + 1
        num_layers = num_layers if depth > 1 else self.cost.model.num_layers
        num_bytes = self.cost.grad_sync_bytes(num_layers, first=True, last=depth == 1) / tp
        intra = min(devs[r].gpu.intra_node_gbps for r in heads)
        first_rank = {devs[r].node: r for r in reversed(heads)}
        nic = min(devs[first_rank[n]].nic_gbps / max((self._node_ranks[n] if crossing else c * tp) / c, 1.0)
                  for n, c in here.items()) if len(here) > 1 else devs[heads[0]].nic_gbps
        # Rails only lower the exact price's NIC share, so the whole NIC keeps this a bound; the intra-node
        # curves must be the exact ones (a measured curve may beat the flat figure).
        return self.cost.sync_s(SyncShape(num_bytes, len(heads), len(here), max(here.values()), intra, nic,
                                          distinct_gpus(devs[r].gpu for r in heads)))
