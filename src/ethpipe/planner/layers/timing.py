"""Pipeline timing for levels 2 and 3 and the estimator (closed forms in ``cost/pipeline.py``).

A stage's action on a micro-batch of x samples costs its compute plus its receive (the
activation from the previous stage for F, the gradient from the next for B): receives occupy
the receiver, as in the runtime and the simulator; the finish times also price the senders' waits
(``cost/rendezvous.py``) from the receive times (``recv_times_s``). ``PipelineTiming`` answers the data
balancer's questions for one pipeline shape: ``T(n)`` for n samples in micro-batches of
``micro_batch`` with a smaller last one, monotone in n by construction (so the bisection is
sound), and its inverse in closed form; ``finish_s(n)`` gives each stage's gradients-final time for
the gradient sync (the estimator's formula, ``cost.schedule_time.stage_finish_of``: 1F1B's closed form or
a split schedule's replay).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from ethpipe.cluster import Device
from ethpipe.cost.model import CostModel
from ethpipe.cost.pipeline import equal_sizes_makespans, lines_that_can_lead, steady_lines
from ethpipe.cost.schedule_time import replay_counts_s, stage_finish_of
from ethpipe.plan import Pipeline, Stage
from ethpipe.schedule import DEFAULT_SCHEDULE, SPLIT_SCHEDULES
from ethpipe.planner.layers.partition import Partition, StageOption

ActionTimes = Callable[[int], tuple[np.ndarray, np.ndarray]]


class StageSlot(NamedTuple):
    """A stage position before layers are assigned: its device type, TP degree and ranks. A named tuple: the
    replicated family builds one per stage of every replica it prices, and a tuple is built and hashed in C."""

    device: str
    tp: int
    ranks: tuple[int, ...]


def link_key(cost: CostModel, slots: Sequence[StageSlot]) -> tuple:
    """What a shape's receive times depend on besides its devices (``CostModel.p2p_link_gbps``): each link's
    ``rank_link``. Templates are shared by key."""
    devs = cost.cluster.devices
    return tuple(rank_link(devs, a.ranks[0], b.ranks[0]) for a, b in zip(slots, slots[1:]))


def rank_link(devices: Sequence[Device], a: int, b: int) -> bool | tuple[float, ...]:
    """One link of ``link_key``: True inside a node, else both ends' rail and NIC."""
    x, y = devices[a], devices[b]
    return True if x.node == y.node else (x.flow_gbps, x.nic_gbps, y.flow_gbps, y.nic_gbps)


def p2p_in_s(cost: CostModel, slots: Sequence[StageSlot], i: int, micro_batch: int) -> float:
    """Per micro-batch receive time of stage i: activation from i-1 plus gradient from i+1."""
    return _recv_fwd_s(cost, slots, i, micro_batch) + _recv_bwd_s(cost, slots, i, micro_batch)


def _recv_fwd_s(cost: CostModel, slots: Sequence[StageSlot], i: int, x: int) -> float:
    return cost.p2p_s(slots[i - 1].ranks[0], slots[i].ranks[0], x) if i > 0 else 0.0


def _recv_bwd_s(cost: CostModel, slots: Sequence[StageSlot], i: int, x: int) -> float:
    return cost.p2p_s(slots[i + 1].ranks[0], slots[i].ranks[0], x) if i < len(slots) - 1 else 0.0


def stage_options(cost: CostModel, slots: Sequence[StageSlot], micro_batch: int, recompute: str,
                  memo: dict | None = None) -> list[list[StageOption]]:
    """Time and memory options of every slot for ``micro_batch`` (recompute: auto|never|always).

    ``memo`` (optional) shares a slot's options between shapes: they depend only on its device, TP,
    position from the end, ends and receive time."""
    depth, out = len(slots), []
    for i, slot in enumerate(slots):
        first, last = i == 0, i == depth - 1
        p2p_s = p2p_in_s(cost, slots, i, micro_batch)
        key = ("stage_options", slot.device, slot.tp, micro_batch, recompute, depth - i, first, last, p2p_s)
        if memo is not None and key in memo:
            out.append(memo[key])
            continue
        ends, terms = _stage_terms(cost, slot, micro_batch, recompute, depth - i, first, last, memo)
        options = [StageOption(ends + p2p_s, per_layer_s, max_layers, rc) for per_layer_s, max_layers, rc in terms]
        out.append(options)
        if memo is not None:
            memo[key] = options
    return out


def _stage_terms(cost: CostModel, slot: StageSlot, micro_batch: int, recompute: str, from_end: int, first: bool,
                 last: bool, memo: dict | None) -> tuple[float, list[tuple[float, int, bool]]]:
    """A slot's ends seconds and (per-layer seconds, layers that fit, recompute) per option: everything but
    its receives, so shapes whose links differ share it (memoised in ``memo``)."""
    key = ("stage_terms", slot.device, slot.tp, micro_batch, recompute, from_end, first, last)
    if memo is not None and key in memo:
        return memo[key]
    ends = sum(cost.end_times_s(slot.device, micro_batch, slot.tp, first=first, last=last))
    usable = cost.usable_memory_bytes(slot.device)
    terms = []
    for rc in {"auto": (False, True), "never": (False,), "always": (True,)}[recompute]:
        per_layer_s = sum(cost.layer_times_s(slot.device, micro_batch, slot.tp, rc))
        mem_fixed, mem_per_layer = cost.memory_terms(slot.tp, micro_batch, from_end, rc, first=first, last=last,
                                                     device=slot.device)
        terms.append((per_layer_s, int((usable - mem_fixed) // mem_per_layer) if usable >= mem_fixed else 0, rc))
    if memo is not None:
        memo[key] = (ends, terms)
    return ends, terms


# A stage's layers as the timing rows count them: whole layers, or (attention halves, MLP halves, attention halves
# that end it) where the plan cuts inside layers (``Stage.halves``, ``Stage.lone_attention``, ``ethpipe.sublayers``).
LayerCount = int | tuple[int, int, int]


def layer_count(stage: Stage) -> LayerCount:
    """A one-chunk stage's ``LayerCount``."""
    return stage.num_layers if stage.sublayers == 1 else (*stage.halves, stage.lone_attention)


def _layers_s(cost: CostModel, slot: StageSlot, count: LayerCount, recompute: bool,
              micro_batch: int) -> tuple[float, float]:
    """(fwd, bwd) seconds of a stage's layers for one micro-batch (``LayerCount``)."""
    if isinstance(count, tuple):
        return cost.halves_compute_s(slot.device, micro_batch, slot.tp, recompute, count)
    lf, lb = cost.layer_times_s(slot.device, micro_batch, slot.tp, recompute)
    return count * lf, count * lb


def _stage_of(slot: StageSlot, count: LayerCount, recompute: bool) -> Stage:
    """A stage holding ``count`` (any layer range of those halves prices the same)."""
    if not isinstance(count, tuple):
        return Stage(slot.ranks, slot.device, (0, count), slot.tp, recompute)
    attn, mlp, lone_attention = count
    start = mlp - (attn - lone_attention)  # a lone MLP half first (1) or not (0)
    return Stage(slot.ranks, slot.device, (start, start + attn + mlp), slot.tp, recompute, sublayers=2)


def action_times_s(cost: CostModel, slots: Sequence[StageSlot], layers: Sequence[LayerCount],
                   recompute: Sequence[bool], micro_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Per stage: (receive + forward, receive + backward) seconds of one ``micro_batch``-sample micro-batch."""
    depth = len(slots)
    fwd, bwd = np.empty(depth), np.empty(depth)
    for i, slot in enumerate(slots):
        lf, lb = _layers_s(cost, slot, layers[i], recompute[i], micro_batch)
        ef, eb = cost.end_times_s(slot.device, micro_batch, slot.tp, first=i == 0, last=i == depth - 1)
        fwd[i] = lf + ef + _recv_fwd_s(cost, slots, i, micro_batch)
        bwd[i] = lb + eb + _recv_bwd_s(cost, slots, i, micro_batch)
    return fwd, bwd


def recv_times_s(cost: CostModel, slots: Sequence[StageSlot], micro_batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Per stage: (activation, gradient) receive seconds of one ``micro_batch``-sample micro-batch, the receives
    ``action_times_s`` adds to compute: the stage's sends are its neighbours' receives, and the pipeline timing
    prices the senders' waits from them (``cost/rendezvous.py``)."""
    depth = len(slots)
    return (np.array([_recv_fwd_s(cost, slots, i, micro_batch) for i in range(depth)]),
            np.array([_recv_bwd_s(cost, slots, i, micro_batch) for i in range(depth)]))


def weight_times_s(cost: CostModel, slots: Sequence[StageSlot], layers: Sequence[LayerCount],
                   recompute: Sequence[bool], micro_batch: int) -> tuple[np.ndarray]:
    """Per stage: the seconds of a split backward's W (``CostModel.weight_grad_s``; 0 where it recomputes)."""
    depth = len(slots)
    moved = np.array([cost.weight_grad_s(_stage_of(slot, layers[i], recompute[i]), micro_batch, first=i == 0,
                                         last=i == depth - 1)
                      for i, slot in enumerate(slots)])
    return (moved,)


def virtual_stages(pipe: Pipeline) -> tuple[list[StageSlot], list[LayerCount], list[bool]]:
    """A pipeline's stages as the cost model's rows: (slot, layers, recompute) per stage, or per virtual
    stage when interleaved (chunk c of stage s is row ``c * depth + s``: the embedding in row 0, the head in
    the last, and row ``c * depth`` receiving from the last stage)."""
    slots = [StageSlot(s.device, s.tp, s.ranks) for s in pipe.stages]
    rows = [(vs % pipe.depth, vs // pipe.depth) for vs in range(pipe.depth * pipe.num_chunks)]
    layers: list[LayerCount] = [pipe.stages[s].chunk_layers[c] if pipe.stages[s].sublayers == 1 else
                                layer_count(pipe.stages[s].chunk(c)) for s, c in rows]
    return [slots[s] for s, _ in rows], layers, [pipe.stages[s].recompute for s, _ in rows]


def split_sizes(num_samples: int, micro_batch: int) -> tuple[int, ...]:
    """Micro-batch sizes: full ones then the remainder."""
    full, rest = divmod(num_samples, micro_batch)
    return (micro_batch,) * full + ((rest,) if rest else ())


class PipelineTiming:
    """T(n), its inverse and per-stage finish times of one pipeline shape under one schedule.

    ``granularity`` = ``micro_batch`` restricts sample counts to whole micro-batches (the
    ``fine_grained=False`` ablation). T is tabulated lazily, once per shape, as a non-decreasing
    array, so the balancer's inverse is a binary search. 1F1B is priced in closed form
    (``cost/pipeline.py``); a split-backward schedule (``weight_times``: its W seconds per stage;
    ``unsplit``: the stages that never split) by the exact replay (``cost/schedule_time.py``) up to
    ``2 depth + 2`` micro-batches, then by its steady-state growth. ``recv_times`` (``recv_times_s``): the
    receives within the action times, so that the finish times price the senders' waits (``cost/rendezvous.py``);
    T(n) prices sends free under every schedule, a lower bound of the flush it tabulates (the balancer's model,
    cheap: a split schedule's rendezvous replay builds a graph per micro-batch count).
    """

    def __init__(self, micro_batch: int, action_times: ActionTimes, granularity: int = 1,
                 schedule: str = DEFAULT_SCHEDULE, weight_times: Callable[[int], tuple[np.ndarray]] | None = None,
                 unsplit: tuple[bool, ...] = (), recv_times: ActionTimes | None = None) -> None:
        assert (schedule in SPLIT_SCHEDULES) == (weight_times is not None), "a split schedule needs its W times"
        self.micro_batch = micro_batch
        self.granularity = granularity
        self.schedule = schedule
        self.unsplit = unsplit
        self._action_times = action_times
        self._weight_times = weight_times
        self._recv_times = recv_times
        self._weight_rows: dict[int, tuple[np.ndarray]] = {}
        self._recv_rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._finish: dict[int, np.ndarray] = {}
        self._table: np.ndarray | None = None
        self._floor_s: float | None = None

    def rows(self, x: int) -> tuple[np.ndarray, np.ndarray]:
        if x not in self._rows:
            self._rows[x] = self._action_times(x)
        return self._rows[x]

    def weight_rows(self, x: int) -> tuple[np.ndarray]:
        assert self._weight_times is not None
        if x not in self._weight_rows:
            self._weight_rows[x] = self._weight_times(x)
        return self._weight_rows[x]

    def recv_rows(self, x: int) -> tuple[np.ndarray, np.ndarray]:
        assert self._recv_times is not None
        if x not in self._recv_rows:
            self._recv_rows[x] = self._recv_times(x)
        return self._recv_rows[x]

    def _arrays(self, sizes: Sequence[int]) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, np.ndarray] | None]:
        """((fwd, bwd[, moved]), (act, grad) receives or None) for ``stage_finish_of`` / ``replay_finish_s``."""
        matrices = self._matrices(sizes, with_recv=True)
        if self._recv_times is None:
            return matrices, None
        return matrices[:-2], (matrices[-2], matrices[-1])

    def _matrices(self, sizes: Sequence[int], with_recv: bool = False) -> tuple[np.ndarray, ...]:
        """(fwd, bwd[, moved][, act, grad]) as (depth, micro-batches) arrays for these micro-batch sizes (each
        distinct size's rows once: the search asks for thousands of full-then-last splits); the receives only
        ``with_recv`` (T(n) prices sends free and does not read them)."""
        distinct = list(dict.fromkeys(sizes))
        recv = with_recv and self._recv_times is not None
        rows = {x: self.rows(x) + (self.weight_rows(x) if self._weight_times is not None else ())
                + (self.recv_rows(x) if recv else ()) for x in distinct}
        if len(distinct) == 1:
            return tuple(np.repeat(r[:, None], len(sizes), axis=1) for r in rows[distinct[0]])
        index = np.array([distinct.index(x) for x in sizes]) if len(distinct) > 2 else \
            (np.array(sizes) != distinct[0]).astype(int)
        return tuple(np.stack([rows[x][k] for x in distinct], axis=1)[:, index] for k in range(len(rows[distinct[0]])))

    def per_sample_floor_s(self) -> float:
        """A lower bound on every stage finish over n samples, divided by n: some stage runs every sample, a
        micro-batch of x samples at no less than the cheapest per-sample cost of micro-batches up to b."""
        if self._floor_s is None:
            per = [(f + bw) / x for x in range(1, self.micro_batch + 1) for f, bw in [self.rows(x)]]
            self._floor_s = float(np.min(np.stack(per), axis=0).max())
        return self._floor_s

    def _build(self) -> np.ndarray:
        if self._table is None and self._weight_times is not None:
            self._build_replayed()
        if self._table is None:
            b = self.micro_batch
            f_last = np.stack([self.rows(x)[0] for x in range(1, b + 1)])
            b_last = np.stack([self.rows(x)[1] for x in range(1, b + 1)])
            f_full, b_full = f_last[-1], b_last[-1]
            depth = f_full.shape[0]
            self._m_lines = depth + 2  # from here on the makespan is a max of lines
            single = f_last.sum(axis=1) + b_last.sum(axis=1)
            multi = equal_sizes_makespans(f_full, b_full, f_last, b_last, np.arange(2, self._m_lines))
            self._table = np.maximum.accumulate(np.concatenate([single[:, None], multi], axis=1).T.ravel())
            self._c, self._slope = steady_lines(f_full, b_full, f_last, b_last)
        return self._table

    def _build_replayed(self) -> None:
        """T(n) by replay for up to 2 depth + 2 micro-batches (every last size at once), then the steady
        state's lines: each further micro-batch adds the bottleneck stage's work (F + B + W)."""
        b = self.micro_batch
        depth = self.rows(b)[0].shape[0]
        self._m_lines = 2 * depth + 3
        full = tuple(v[:, 0] for v in self._matrices([b]))
        last = tuple(v.T for v in self._matrices(list(range(1, b + 1))))  # (last size, depth)
        columns = replay_counts_s(self.schedule, full, last, self._m_lines - 1, self.unsplit).T  # (count, last size)
        self._table = np.maximum.accumulate(columns.ravel())
        slope = float(np.max(full[0] + full[1]))  # a full micro-batch's F + B on the bottleneck stage
        self._c = (columns[-1] - (self._m_lines - 1) * slope)[:, None]
        self._slope = np.array([slope])

    def _extend(self, upper: int) -> np.ndarray:
        """T(1..upper) as one non-decreasing array (beyond the table: the steady lines)."""
        table = self._build()
        if upper > table.size:
            b = self.micro_batch
            m = np.arange(table.size // b + 1, -(-upper // b) + 1, dtype=float)
            keep = lines_that_can_lead(self._c, self._slope, m[0], m[-1]) if m.size > 1 else slice(None)
            lines = np.max(self._c[None, :, keep] + m[:, None, None] * self._slope[None, None, keep], axis=-1)
            self._table = table = np.maximum.accumulate(np.concatenate([table, lines.ravel()]))
        return table

    def time_s(self, num_samples: int) -> float:
        """T(n) with micro-batches of ``micro_batch`` and a smaller last one; non-decreasing in n."""
        if num_samples <= 0:
            return 0.0
        return float(self._extend(num_samples)[num_samples - 1])

    def _reaching(self, limit_s: float, upper: int) -> np.ndarray:
        """T(1..) far enough to answer where T crosses ``limit_s`` below ``upper``: the table as built if it
        already ends past the limit (T never falls, so what lies beyond cannot be under it), else up to ``upper``."""
        table = self._build()
        return table if table.size < upper and table[-1] > limit_s else self._extend(upper)

    def max_samples_within(self, limit_s: float, upper: int) -> int:
        """Largest n <= upper with T(n) <= limit (a multiple of ``granularity``)."""
        table = self._reaching(limit_s, upper)
        best = min(int(np.searchsorted(table, limit_s, side="right")), upper)
        return best - best % self.granularity

    def samples_below(self, limit_s: float, upper: int) -> int:
        """How many n in 1..upper have T(n) < limit (T is non-decreasing: they are 1..that)."""
        return min(int(np.searchsorted(self._reaching(limit_s, upper), limit_s, side="left")), upper)

    def finish_s(self, num_samples: int) -> np.ndarray:
        """Each stage's gradients-final time for ``num_samples`` (``stage_finish_of``; under 1F1B [0] is the
        pipeline's flush, under any schedule the max)."""
        if num_samples not in self._finish:
            matrices, recv = self._arrays(split_sizes(num_samples, self.micro_batch))
            self._finish[num_samples] = stage_finish_of(self.schedule, *matrices, unsplit=self.unsplit, recv=recv)
        return self._finish[num_samples]


def timing_of_partition(cost: CostModel, slots: Sequence[StageSlot], part: Partition, micro_batch: int,
                        granularity: int = 1, schedule: str = DEFAULT_SCHEDULE) -> PipelineTiming:
    return timing_of_layers(cost, slots, part.num_layers, part.recompute, micro_batch, granularity, schedule)


def timing_of_layers(cost: CostModel, slots: Sequence[StageSlot], layers: Sequence[int], recompute: Sequence[bool],
                     micro_batch: int, granularity: int = 1, schedule: str = DEFAULT_SCHEDULE) -> PipelineTiming:
    weights = (lambda x: weight_times_s(cost, slots, layers, recompute, x)) if schedule in SPLIT_SCHEDULES else None
    return PipelineTiming(micro_batch, lambda x: action_times_s(cost, slots, layers, recompute, x), granularity,
                          schedule, weights, tuple(bool(r) for r in recompute), lambda x: recv_times_s(cost, slots, x))
