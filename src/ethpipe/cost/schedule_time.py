"""Pipeline time of any schedule (``ethpipe.schedule``) by an exact, vectorised replay of its action lists.

A pipeline iteration is a DAG: each stage runs its actions in order, ``F(s, j)`` also waits for
``F(s-1, j)`` and ``B(s, j)`` for ``B(s+1, j)``; an action's weight is its receive plus its compute (as
in the runtime and the simulator). Where transfers take time their senders wait for them too
(``cost/rendezvous.py``), which ``cost/rendezvous_replay.py`` prices on that graph; with free transfers,
here: with ``D`` a stage's action durations and ``dep`` the time each
action's input arrives, its actions end at ``E = C + cummax(dep - C_excl)`` (``C``: the prefix sums of
``D``). Starting from no waiting at all and re-evaluating every stage, up and down, until nothing moves
gives the longest path exactly: each sweep settles one more change of direction of the critical path,
and a step's critical path changes direction a few times, not once per action. Each sweep is a few
numpy operations per stage, over all the variants being priced at once (the data balancer's smaller
last micro-batches).

``cost/pipeline.py`` prices 1F1B in closed form; this replay prices the split-backward schedules
(zb-h1) and the interleaved one (rows per virtual stage; the ring's wrap-around is one more dependency), for
which ``PipelineTiming`` tabulates ``T(n)`` up to ``2 depth + 2`` micro-batches (every count in one
replay, ``replay_counts_s``: one count at a time was a sixth of planning time at 1024-4096 GPUs) and extends
it by the bottleneck stage's per-micro-batch work (the steady state's growth rate; checked against the
simulator in tests/unit/test_schedule_time.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import numpy as np

from ethpipe.cost.rendezvous_replay import rendezvous_finish_s
from ethpipe.schedule import input_source, pipeline_schedule, split_microbatches

_F, _B_WHOLE, _B_INPUT, _W, _PAD = range(5)  # _PAD: no action (``replay_counts_s``)


@lru_cache(maxsize=4096)
def _structure(schedule: str, depth: int, m: int, unsplit: tuple[bool, ...], num_chunks: int = 1
               ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, tuple[tuple[int, np.ndarray, np.ndarray], ...]], ...]:
    """Per stage: (duration code, virtual-stage row, micro-batch, and per neighbour it waits for: (stage,
    mask of the actions that wait for it, index of the action in its list each waits for))."""
    lists = pipeline_schedule(depth, m, schedule, unsplit, num_chunks)
    where = [{(a.kind, a.microbatch, a.chunk): k for k, a in enumerate(acts)} for acts in lists]
    out = []
    for s, acts in enumerate(lists):
        split = split_microbatches(acts)
        codes, rows, mbs, srcs, deps = [], [], [], [], []
        for a in acts:
            j = a.microbatch
            codes.append(_F if a.kind == "F" else _W if a.kind == "W" else _B_INPUT if j in split else _B_WHOLE)
            rows.append(a.chunk * depth + s)
            mbs.append(j)
            src, sc = input_source(a.kind, s, a.chunk, depth, num_chunks)
            srcs.append(src)
            deps.append(where[src][(a.kind, j, sc)] if src >= 0 else -1)
        src_arr, dep_arr = np.array(srcs), np.array(deps)
        waits = tuple((int(src), src_arr == src, dep_arr[src_arr == src]) for src in sorted(set(srcs)) if src >= 0)
        out.append((np.array(codes), np.array(rows), np.array(mbs), waits))
    return tuple(out)


def replay_finish_s(schedule: str, fwd: np.ndarray, bwd: np.ndarray, moved: np.ndarray | None = None,
                    unsplit: tuple[bool, ...] = (), num_chunks: int = 1,
                    recv: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Each stage's flush: its last action and its last sends done (its gradients are final), shape
    ``(..., depth)``.

    ``fwd[..., v, j]`` / ``bwd[..., v, j]``: receive + forward / receive + whole backward of virtual stage v
    (chunk c of stage s is ``c * depth + s``; without chunks, stage s) on micro-batch j; ``moved`` (split
    schedules): the part of ``bwd`` its W takes over (``CostModel.weight_grad_s``); ``unsplit[s]``: stage s
    never splits (it recomputes); ``recv``: (activation, gradient) seconds of those receives (the part of
    ``fwd`` / ``bwd`` they are; row v's sends are row v + 1's activation and row v - 1's gradient receives),
    so that senders wait for their transfers; None or all 0: free transfers (no sender waits). Leading axes are
    independent variants priced together.
    """
    fwd, bwd = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
    moved = np.zeros_like(fwd) if moved is None else np.asarray(moved, dtype=float)
    rows_total, m = fwd.shape[-2:]
    depth = rows_total // num_chunks
    if recv is not None and (np.any(recv[0]) or np.any(recv[1])):
        act, grad = (np.asarray(x, dtype=float) for x in recv)
        table = np.stack([fwd, bwd, bwd - moved, moved, np.zeros_like(fwd)], axis=-3)
        shape = np.broadcast_shapes(act.shape, grad.shape)
        transfers = np.stack([np.broadcast_to(act, shape), np.broadcast_to(grad, shape), np.zeros(shape)], axis=-3)
        return rendezvous_finish_s(schedule, table, transfers, tuple(unsplit), num_chunks)
    table = np.stack([fwd, bwd, bwd - moved, moved], axis=-3)  # (..., 4, depth * chunks, m)
    structure = _structure(schedule, depth, m, tuple(unsplit), num_chunks)
    durations = [table[..., codes, rows, mbs] for codes, rows, mbs, _ in structure]

    def arrivals(s: int, ends: list[np.ndarray]) -> np.ndarray:
        arrive = np.zeros(durations[s].shape)
        for src, mask, deps in structure[s][3]:
            arrive[..., mask] = ends[src][..., deps]
        return arrive
    ends = _settle(durations, [tuple(src for src, _, _ in structure[s][3]) for s in range(depth)], arrivals)
    return np.stack([e[..., -1] for e in ends], axis=-1)


def _settle(durations: list[np.ndarray], sources: list[tuple[int, ...]],
            arrivals: Callable[[int, list[np.ndarray]], np.ndarray]) -> list[np.ndarray]:
    """Each stage's action ends (module docstring): from no waiting at all (a lower bound), stages re-evaluated up
    and down until nothing moves. ``sources[s]``: the stages stage s waits for; ``arrivals(s, ends)``: when each
    of its actions' inputs arrive, given the others' ends."""
    depth = len(durations)
    prefix = [np.cumsum(d, axis=-1) for d in durations]
    ends = [c.copy() for c in prefix]
    order = list(range(depth)) + list(range(depth - 2, 0, -1))
    # A stage's ends are a function of its neighbours' alone: re-evaluated only when one of them moved since.
    version = [0] * depth
    seen: list[tuple[int, ...] | None] = [None] * depth
    while True:
        moved_any = False
        for s in order + [0] if depth > 1 else [0]:
            now = tuple(version[src] for src in sources[s])
            if seen[s] == now:
                continue
            seen[s] = now
            c = prefix[s]
            new = c + np.maximum.accumulate(np.maximum(arrivals(s, ends) - (c - durations[s]), 0.0), axis=-1)
            if not np.array_equal(new, ends[s]):
                ends[s] = new
                version[s] += 1
                moved_any = True
        if not moved_any:
            return ends


Waits = tuple[tuple[int, np.ndarray, np.ndarray], ...]


@lru_cache(maxsize=64)  # 2-6 MB each at 30-40 stages; one per (depth, recomputing stages)
def _counts_structure(schedule: str, depth: int, num_counts: int, unsplit: tuple[bool, ...]
                      ) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, Waits], ...]:
    """``_structure`` of every micro-batch count m = 1..num_counts at once: per stage, (code, row, column) as
    (count, action) arrays (column 1: the count's last micro-batch, 0: a full one; past a count's own actions, a
    no-compute pad) and per neighbour it waits for, (flat index of the waiting actions, flat index of the actions
    they wait for) in the (count, action) layout."""
    per_count = [_structure.__wrapped__(schedule, depth, m, unsplit) for m in range(1, num_counts + 1)]
    widths = [max(len(st[s][0]) for st in per_count) for s in range(depth)]
    out = []
    for s, width in enumerate(widths):
        codes = np.full((num_counts, width), _PAD, dtype=np.int8)
        rows = np.zeros((num_counts, width), dtype=np.int32)
        cols = np.zeros((num_counts, width), dtype=np.int8)
        waits: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
        for m, st in enumerate(per_count):
            code, row, mb, deps = st[s]
            codes[m, :code.size], rows[m, :code.size], cols[m, :code.size] = code, row, mb == m
            for src, mask, dep in deps:
                at, of = waits.setdefault(src, ([], []))
                at.append(m * width + np.flatnonzero(mask))
                of.append(m * widths[src] + dep)
        out.append((codes, rows, cols, tuple((src, np.concatenate(at).astype(np.int32),
                                              np.concatenate(of).astype(np.int32))
                                             for src, (at, of) in sorted(waits.items()))))
    return tuple(out)


def replay_counts_s(schedule: str, full: tuple[np.ndarray, ...], last: tuple[np.ndarray, ...], num_counts: int,
                    unsplit: tuple[bool, ...] = ()) -> np.ndarray:
    """The pipeline's flush (max over stages; free transfers, no chunks) with m = 1..``num_counts`` micro-batches,
    m - 1 full ones and a last one of each variant, shape ``(variants, num_counts)``: what ``replay_finish_s``
    gives count by count, in one replay. ``full``: (fwd, bwd, moved) of a full micro-batch, each ``(depth,)``;
    ``last``: the same of each variant's last micro-batch, each ``(variants, depth)``.

    Bit for bit the per-count replays: the counts are independent rows of every array, a pad after a count's
    actions neither computes nor waits (so its stage's end stays its last action's), and a count whose stages
    have settled is re-evaluated to the values it holds (a stage's ends are a function of its neighbours')."""
    fwd, bwd, moved = (np.stack(np.broadcast_arrays(np.asarray(f, dtype=float), np.asarray(x, dtype=float)), axis=-1)
                       for f, x in zip(full, last))  # (variants, depth, full or last)
    table = np.stack([fwd, bwd, bwd - moved, moved, np.zeros_like(fwd)], axis=1)  # (var, code, depth, column)
    depth = fwd.shape[-2]
    structure = _counts_structure(schedule, depth, num_counts, tuple(unsplit))
    durations = [table[:, codes, rows, cols] for codes, rows, cols, _ in structure]  # (var, count, action)
    lead = fwd.shape[0]

    def arrivals(s: int, ends: list[np.ndarray]) -> np.ndarray:
        arrive = np.zeros(durations[s].shape)
        flat = arrive.reshape(lead, -1)
        for src, at, of in structure[s][3]:
            flat[:, at] = ends[src].reshape(lead, -1)[:, of]
        return arrive
    ends = _settle(durations, [tuple(src for src, _, _ in structure[s][3]) for s in range(depth)], arrivals)
    return np.stack([e[..., -1] for e in ends], axis=-1).max(axis=-1)


def stage_finish_of(schedule: str, fwd: np.ndarray, bwd: np.ndarray, moved: np.ndarray | None = None,
                    unsplit: tuple[bool, ...] = (), num_chunks: int = 1,
                    recv: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Each stage's flush (gradients final, last sends done) under ``schedule``: 1F1B's closed form
    (``cost/pipeline.py``), else the replay (arguments as ``replay_finish_s``). The pipeline's flush is the max
    over stages."""
    if schedule == "1f1b":
        from ethpipe.cost.pipeline import stage_finish_s

        return stage_finish_s(fwd, bwd, recv)
    return replay_finish_s(schedule, fwd, bwd, moved, unsplit, num_chunks, recv)
