"""A long 1F1B or zb-h1 pipeline's rendezvous graph, extended from short ones of the same shape.

The planner prices many micro-batch counts m of one pipeline shape (the estimate's re-splits: 226 and 227, 347
and 348), and the graph of ``cost/rendezvous_replay.py`` is built node by node in Python: 0.3-0.4 s for a
30-stage, 350-micro-batch zb-h1 pipeline, a quarter of planning time on the slowest planner_random cases.

Under 1F1B and zb-h1 a stage's list is a warm-up, a steady state of one step per micro-batch (F j, then the B
and, under zb-h1, the W that many steps behind) and a drain. A node (``cost/rendezvous.py``) waits for nodes of
its neighbours a step or two away, so past the warm-up the lists of m + 1 micro-batches are those of m with one
more step in every stage. In the flat arrays (``Flat``), every number of a stage's head (before the step of
``F j0``), of its steady steps and of its tail is then an affine function of m and of the step: micro-batch
indices, transfers and node indices alike. ``find_pattern`` reads those functions off the graphs of three short
counts built node by node, and keeps them only if they reproduce the third one exactly (else the graph is always
built node by node); ``extend`` writes the graph of any longer count from them in a few numpy operations. The
tests check the extended arrays against the node-by-node ones for every depth, count and recompute pattern they
sweep (tests/unit/test_rendezvous.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

PERIODIC_SCHEDULES = ("1f1b", "zb-h1")  # one step per micro-batch (interleaved steps a group of them)
STEADY_STEPS = 3  # the steps read off the shortest count: enough to see that a step's values are affine
_F_CODE = 0  # a node's compute code for a forward (``rendezvous_replay._F``)


class Flat(NamedTuple):
    """A pipeline's graph before levelling: nodes stage after stage, and what each node waits for ("terms",
    ordered by their waiting node)."""

    first: np.ndarray  # (depth + 1,): each stage's first node, then the node count
    nodes: np.ndarray  # (nodes, 6): compute (code, row, micro-batch), its own receive (kind, row, micro-batch)
    terms: np.ndarray  # (terms, 7): waiting node, kind, node waited for (-1: none), transfer (kind, row,
    # micro-batch), the first node after it was posted


class _Affine(NamedTuple):
    """Rows whose values at count ``base + k`` (and step p of the steady state) are
    ``at_base + k * per_count (+ p * per_step)``."""

    at_base: np.ndarray
    per_count: np.ndarray
    per_step: np.ndarray | None = None  # steady steps only: shapes (rows per step, fields)


class _StagePattern(NamedTuple):
    head_nodes: _Affine
    step_nodes: _Affine
    tail_nodes: _Affine
    head_terms: _Affine  # terms in stage-local form (``_local_terms``)
    step_terms: _Affine
    tail_terms: _Affine


class Pattern(NamedTuple):
    """The affine functions of one pipeline shape's graph, valid from ``base_count`` micro-batches on."""

    base_count: int
    stages: tuple[_StagePattern, ...]


def periodic_family(schedule: str, num_chunks: int) -> bool:
    """Whether graphs of this schedule are extended from short ones (one step per micro-batch)."""
    return schedule in PERIODIC_SCHEDULES and num_chunks == 1


def base_count(depth: int) -> int:
    """The shortest count the pattern is read from: the steady steps read (from ``F (depth + 1)``) have a step
    of steady state on either side of them in every stage, and the drain a few steps after them."""
    return depth + STEADY_STEPS + 6


def find_pattern(build: Callable[[int], Flat], depth: int) -> Pattern | None:
    """The pattern of the graphs ``build(m)`` (node by node) of a depth-``depth`` pipeline: read off the counts
    ``base_count(depth)`` and one more, kept only if it writes the count after them exactly as ``build`` does;
    None where it does not (the graph is then built node by node at every count)."""
    m0 = base_count(depth)
    short, longer = build(m0), build(m0 + 1)
    stages = []
    for s in range(depth):
        found = _stage_pattern(short, longer, s, depth + 1)
        if found is None:
            return None
        stages.append(found)
    pattern = Pattern(m0, tuple(stages))
    check = build(m0 + 2)
    written = extend(pattern, m0 + 2)
    same = all(np.array_equal(a, b) for a, b in zip(written, check))
    return pattern if same else None


def extend(pattern: Pattern, m: int) -> Flat:
    """The graph of ``m`` >= ``pattern.base_count`` micro-batches."""
    k = m - pattern.base_count
    assert k >= 0, "a pattern writes its base count and longer ones"
    nodes, terms = [], []
    for sp in pattern.stages:
        nodes.append(np.concatenate([_at(sp.head_nodes, k), _steps_at(sp.step_nodes, k), _at(sp.tail_nodes, k)]))
        terms.append(np.concatenate([_at(sp.head_terms, k), _steps_at(sp.step_terms, k), _at(sp.tail_terms, k)]))
    first = np.concatenate([[0], np.cumsum([len(n) for n in nodes])]).astype(np.int64)
    return Flat(first, np.concatenate(nodes), _global_terms(terms, first))


def _at(rows: _Affine, k: int) -> np.ndarray:
    return rows.at_base + k * rows.per_count


def _steps_at(rows: _Affine, k: int) -> np.ndarray:
    """The steady steps at count base + k: ``STEADY_STEPS + k`` of them, stacked."""
    assert rows.per_step is not None
    steps = np.arange(STEADY_STEPS + k, dtype=np.int64)[:, None, None]
    return (rows.at_base + k * rows.per_count + steps * rows.per_step).reshape(-1, rows.at_base.shape[-1])


def _stage_pattern(short: Flat, longer: Flat, s: int, j0: int) -> _StagePattern | None:
    """Stage ``s``'s affine functions from the graphs of two consecutive counts (None: they are not affine)."""
    parts = []
    for flat, num_steps in ((short, STEADY_STEPS), (longer, STEADY_STEPS + 1)):
        lo, hi = int(flat.first[s]), int(flat.first[s + 1])
        nodes = flat.nodes[lo:hi]
        starts = [np.flatnonzero((nodes[:, 0] == _F_CODE) & (nodes[:, 1] == s) & (nodes[:, 2] == j))
                  for j in range(j0, j0 + num_steps + 1)]
        if any(len(x) != 1 for x in starts):
            return None
        bounds = np.array([int(x[0]) for x in starts])
        width = np.diff(bounds)
        if width[0] < 1 or np.any(width != width[0]):
            return None
        terms = _local_terms(flat, s)
        at = np.searchsorted(terms[:, 0], bounds)  # each step's first term (terms are ordered by node)
        term_width = np.diff(at)
        if np.any(term_width != term_width[0]):
            return None
        parts.append((nodes[:bounds[0]], nodes[bounds[0]:bounds[-1]].reshape(num_steps, width[0], 6),
                      nodes[bounds[-1]:], terms[:at[0]], terms[at[0]:at[-1]].reshape(num_steps, term_width[0], 8),
                      terms[at[-1]:]))
    (h0, b0, t0, hx0, bx0, tx0), (h1, b1, t1, hx1, bx1, tx1) = parts
    if h0.shape != h1.shape or t0.shape != t1.shape or hx0.shape != hx1.shape or tx0.shape != tx1.shape or (
            b0.shape[1:] != b1.shape[1:] or bx0.shape[1:] != bx1.shape[1:]):
        return None
    node_steps, term_steps = _steady(b0, b1), _steady(bx0, bx1)
    if node_steps is None or term_steps is None:
        return None
    return _StagePattern(_Affine(h0, h1 - h0), node_steps, _Affine(t0, t1 - t0),
                         _Affine(hx0, hx1 - hx0), term_steps, _Affine(tx0, tx1 - tx0))


def _steady(short: np.ndarray, longer: np.ndarray) -> _Affine | None:
    """The steady steps' function from their rows at two counts, shapes (steps, rows, fields); None where a
    step is not the one before it plus a constant, or the counts do not differ by one."""
    per_step = short[1] - short[0]
    for steps in (short, longer):
        expect = steps[0] + np.arange(len(steps), dtype=np.int64)[:, None, None] * per_step
        if not np.array_equal(steps, expect):
            return None
    return _Affine(short[0], longer[0] - short[0], per_step)


def _local_terms(flat: Flat, s: int) -> np.ndarray:
    """Stage ``s``'s terms with node indices local to their stage: (node, kind, stage waited for (-1: none),
    its node, transfer kind, row, micro-batch, posted)."""
    lo, hi = np.searchsorted(flat.terms[:, 0], [flat.first[s], flat.first[s + 1]])
    t = flat.terms[lo:hi]
    waited = t[:, 2]
    stage = np.where(waited >= 0, np.searchsorted(flat.first, waited, side="right") - 1, -1)
    local = np.where(waited >= 0, waited - flat.first[np.maximum(stage, 0)], -1)
    base = flat.first[s]
    return np.column_stack([t[:, 0] - base, t[:, 1], stage, local, t[:, 3:6], t[:, 6] - base]).astype(np.int64)


def _global_terms(per_stage: list[np.ndarray], first: np.ndarray) -> np.ndarray:
    """``_local_terms``' inverse over every stage."""
    rows = []
    for s, t in enumerate(per_stage):
        stage, local = t[:, 2], t[:, 3]
        waited = np.where(stage >= 0, first[np.maximum(stage, 0)] + local, -1)
        rows.append(np.column_stack([t[:, 0] + first[s], t[:, 1], waited, t[:, 4:7], t[:, 7] + first[s]]))
    return np.concatenate(rows).astype(np.int64) if rows else np.zeros((0, 7), dtype=np.int64)
