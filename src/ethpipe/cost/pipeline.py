"""Closed-form 1F1B timing of one pipeline: when each stage's last backward (and its last sends) ends.

A 1F1B iteration is a DAG of actions (``ethpipe.schedule``): ``F(i, j)`` after ``F(i-1, j)``,
``B(i, j)`` after ``B(i+1, j)``, and each stage runs its action list in order; an action's
weight is its receive plus its compute (receives occupy the receiver, as in the runtime) and, given the
receive times, a sender waits for its sends (``cost/rendezvous.py``): after the action before it an
action weighs ``compute + max(in, out)``, after its producer ``compute + in`` (the former in the steady
state, where the producer is also the previous action's consumer's previous action), and a stage's last
send ends its flush. The simulator computes the longest path exactly in O(depth x micro-batches) events;
here it is bounded from below by the longest of a family of paths, each O(1) from prefix sums:

* micro-batch 0 reaches anchor stage ``a`` and ``a``'s first backward ends at ``E_a`` (exact with
  free sends: the warm-up is a forward-only flow shop, then ``B(a, 0)`` waits for ``B(a+1, 0)``);
* ``a`` runs its actions up to ``B(a, j)``; the last of them may instead wait for micro-batch
  ``j``'s round trip below ``a`` (when the cooldown's backwards do not hide it);
* micro-batch ``j``'s gradient climbs to stage ``k``, which runs the rest of its actions.

With a bottleneck at the back this is the textbook ``S + (m-1) M``; with one at the front the
cooldown hides the round trip (which ``S + (m-1) M`` overcharges); with a smaller last
micro-batch the path may leave the anchor with the last full one (``j = m-2``). Checked
against the simulator (tests/unit/test_pipeline_time.py, tests/unit/test_rendezvous.py): exact on equal
stages, slow links or not, a few percent low at worst on strongly unequal ones (the paths leave out a warm-up
send's and a drain send's wait for its consumer's post).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np


def _excl_cumsum(x: np.ndarray, axis: int = 0) -> np.ndarray:
    """sum_{i<a} x_i along ``axis``."""
    return x.cumsum(axis) - x


def _excl_suffix(x: np.ndarray, axis: int = 0) -> np.ndarray:
    """sum_{i>a} x_i along ``axis`` (method calls: the planner prices thousands of small pipelines)."""
    return x.sum(axis, keepdims=True) - x.cumsum(axis)


def _warmup(fwd: np.ndarray, bwd: np.ndarray, warm: np.ndarray | None = None, chain_b: np.ndarray | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """Ends of the warm-up forwards ``F(a, j <= w_a)`` and of each first backward ``B(a, 0)``: exact with free
    sends (``warm``, ``chain_b`` None), else a lower bound (a warm-up forward's send may also wait for its
    consumer to post the receive). ``warm[a, j]``: what ``F(a, j - 1)``'s send adds to ``F(a, j)`` after it;
    ``chain_b``: each ``B(a, 0)`` after the forward before it."""
    depth, m = fwd.shape
    end_f = np.zeros((depth, m))
    k = min(depth, m)
    if (fwd[:, :k] == fwd[:, :1]).all() and (warm is None or (warm[:, 1:k] == warm[:, 1:2]).all()):
        # identical jobs: C(a, j) = sum_{i<=a} F_i + j max_{i<=a} F'_i (F': after the previous one)
        after = fwd[:, 0] if warm is None or k < 2 else fwd[:, 0] + warm[:, 1]
        end_f[:, :k] = fwd[:, 0].cumsum()[:, None] + np.arange(k)[None, :] * np.maximum.accumulate(after)[:, None]
        return end_f, _first_backward(end_f, bwd, chain_b)
    upstream = np.zeros(m)
    for a in range(depth):
        n = min(depth - 1 - a, m - 1) + 1
        s = (fwd[a, :n] if warm is None else fwd[a, :n] + warm[a, :n]).cumsum()
        # x_j = max(x_{j-1} + f_j + warm_j, u_j + f_j)
        end_f[a, :n] = np.maximum.accumulate(upstream[:n] - (s - fwd[a, :n])) + s
        upstream = end_f[a]
    return end_f, _first_backward(end_f, bwd, chain_b)


def _first_backward(end_f: np.ndarray, bwd: np.ndarray, chain_b: np.ndarray | None) -> np.ndarray:
    depth, m = end_f.shape
    rows = np.arange(depth)
    last_warmup = end_f[rows, np.minimum(depth - 1 - rows, m - 1)].tolist()  # as floats: a plain loop follows
    first_bwd = bwd[:, 0].tolist()
    first_b = [0.0] * depth
    below = 0.0
    if chain_b is None:
        for a in range(depth - 1, -1, -1):
            below = max(below, last_warmup[a]) + first_bwd[a]
            first_b[a] = below
        return np.array(first_b)
    after = chain_b[:, 0].tolist()  # B(a, 0) after its last warm-up forward (and that one's send)
    for a in range(depth - 1, -1, -1):
        below = max(below + first_bwd[a], last_warmup[a] + after[a])
        first_b[a] = below
    return np.array(first_b)


_LAYOUT_KEPT_UP_TO = 1 << 14  # depth x micro-batches: ~0.3 MB of index arrays at most per kept shape


def _layout_of(depth: int, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``_layout``, kept only for shapes small enough that 256 of them stay small."""
    return _layout(depth, m) if depth * m <= _LAYOUT_KEPT_UP_TO else _layout.__wrapped__(depth, m)


@lru_cache(maxsize=256)
def _layout(depth: int, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``stage_finish_s``'s index arrays for a (depth, m) pipeline, kept per shape (the planner times thousands
    of pipelines of a few shapes): forwards before ``B(a, 0)``, where ``cf_ahead`` and ``cb`` at ``F(a, j)`` are
    read in the flattened (depth, m + 1) prefix sums, and which forwards run after ``B(a, 0)``."""
    a = np.arange(depth)[:, None]
    j = np.arange(m)[None, :]
    w = depth - 1 - a
    k0 = a * (m + 1) + np.minimum(w, m - 1) + 1  # where cf holds the forwards before B(a, 0)
    ahead = (a * (m + 1) + np.minimum(j + w + 1, m)).ravel()
    at_fj = (a * (m + 1) + np.clip(j - w, 1, m)).ravel()
    steady = j >= w + 1
    for x in (k0, ahead, at_fj, steady):
        x.setflags(write=False)
    return k0, ahead, at_fj, steady


@lru_cache(maxsize=256)
def _sends(depth: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Where ``stage_finish_s`` reads, in ``concat(act.ravel(), grad.ravel(), [0])``, the send waited before
    each action, (3, depth, m): before F, before B, and before F as in the warm-up (for every j); and which
    actions' producer is also the previous action's consumer's previous action (the steady state)."""
    a = np.arange(depth)[:, None]
    j = np.arange(m)[None, :]
    w = depth - 1 - a
    none = 2 * depth * m

    def act(i: np.ndarray, jj: np.ndarray) -> np.ndarray:  # stage i's send of activation jj: stage i+1 receives it
        return np.where(i < depth - 1, (i + 1) * m + jj, none)

    def grad(i: np.ndarray, jj: np.ndarray) -> np.ndarray:  # stage i's send of gradient jj: stage i-1 receives it
        return np.where(i > 0, depth * m + (i - 1) * m + jj, none)

    out_f = np.where(j == 0, none, np.where(j <= w, act(a, j - 1), grad(a, j - w - 1)))
    out_b = np.where(j + w <= m - 1, act(a, j + w), np.where(j >= 1, grad(a, j - 1), act(a, m - 1)))
    warm = np.where(j == 0, none, act(a, j - 1))
    sent = np.stack([out_f, out_b, warm])
    matched = np.stack([np.broadcast_to(j > w, (depth, m)), np.broadcast_to(j + w <= m - 1, (depth, m))])
    for x in (sent, matched):
        x.setflags(write=False)
    return sent, matched


def _send_weights(fwd: np.ndarray, bwd: np.ndarray, recv: tuple[np.ndarray, np.ndarray]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(F, B) after the action before them, (F, B) after their producer, and a warm-up forward's send's extra.

    An action starts once its batch is done: its receive ``in`` and the previous action's send ``out``, which
    also waits for its consumer to post the receive (after the consumer's previous action). After the action
    before it, it weighs ``compute + max(in, out)``; after its producer ``compute + in``, except in the steady
    state, where the consumer's previous action IS the producer and the weight is the former either way."""
    depth, m = fwd.shape
    sent, matched = _sends(depth, m) if depth * m <= _LAYOUT_KEPT_UP_TO else _sends.__wrapped__(depth, m)
    flat = np.concatenate([np.asarray(recv[0], dtype=float).ravel(), np.asarray(recv[1], dtype=float).ravel(), [0.0]])
    extra = flat.take(sent)  # less each one's own receive, at least 0
    extra[:2] -= flat[:-1].reshape(2, depth, m)
    extra[2] -= flat[:depth * m].reshape(depth, m)
    np.maximum(extra, 0.0, out=extra)
    steady = extra[:2] * matched
    return fwd + extra[0], bwd + extra[1], fwd + steady[0], bwd + steady[1], extra[2]


def stage_finish_s(fwd: np.ndarray, bwd: np.ndarray, recv: tuple[np.ndarray, np.ndarray] | None = None
                   ) -> np.ndarray:
    """Each stage's flush: its last backward and, with ``recv``, its last send done. ``fwd[i, j]``/``bwd[i, j]``:
    stage i's receive + compute on micro-batch j; ``recv``: (activation, gradient) seconds of those receives
    (the part of ``fwd``/``bwd`` they are; stage i's sends are stage i+1's activation and stage i-1's gradient
    receives), so that senders wait for their sends (``cost/rendezvous.py``); None: free sends."""
    fwd, bwd = np.asarray(fwd, dtype=float), np.asarray(bwd, dtype=float)
    depth, m = fwd.shape
    k0, ahead, at_fj, steady = _layout_of(depth, m)
    chain_f, chain_b, warm, first_chain = fwd, bwd, None, None  # weights after the action before
    if recv is not None:
        chain_f, chain_b, fwd, bwd, warm = _send_weights(fwd, bwd, recv)  # fwd, bwd: after the producer
        first_chain = chain_b
    cf = np.zeros((depth, m + 1))  # cf[i, j] = sum_{j'<j}
    chain_f.cumsum(1, out=cf[:, 1:])
    cb = np.zeros((depth, m + 1))
    chain_b.cumsum(1, out=cb[:, 1:])
    end_f, first_b = _warmup(fwd, bwd, warm, first_chain)
    e = first_b[:, None]
    cf_k0 = cf.take(k0)  # (depth, 1): broadcast below, the same values as a full gather
    cb_next, cb_first = cb[:, 1:], cb[:, 1:2]  # cb[a, j + 1] for every j; cb[a, 1]
    cf_ahead = cf.take(ahead).reshape(depth, m)  # forwards up to F(a, j + w): issued before B(a, j)
    after_b0 = (cf_ahead - cf_k0) + (cb_next - cb_first)
    to_fj = np.where(steady, e + (cf[:, 1:] - cf_k0) + (cb.take(at_fj).reshape(depth, m) - cb_first),
                     end_f)  # end of F(a, j); ``steady``: F(a, j) runs after B(a, 0)
    v = np.maximum(e + after_b0, to_fj + _excl_suffix(fwd + bwd) + bwd)  # end of B(a, j)
    rest = (cb[:, -1:] - cb_next) + (cf[:, -1:] - cf_ahead)  # after B(k, j)
    pb = _excl_cumsum(bwd)
    up = np.maximum.accumulate((v + pb)[::-1], axis=0)[::-1] - pb + rest
    g = to_fj + _excl_suffix(fwd)
    down = np.maximum.accumulate(g[:-1], axis=0) + bwd[::-1].cumsum(0)[::-1][1:] + rest[1:]  # stages 1..
    ends = up  # the last action's end by the paths through B(a, j)
    np.maximum(up[1:], down, out=ends[1:])
    last = ends.max(1)
    if recv is None or depth == 1:
        return last
    # B(a, m - 1)'s send to stage a - 1, posted there after the action before its B(a - 1, m - 1)
    before = ends[:-1, :-1].max(1) - chain_b[:-1, -1] if m > 1 else end_f[:-1, 0]
    out = np.asarray(recv[1], dtype=float)[:-1, -1]
    last[1:] = np.where(out > 0.0, np.maximum(last[1:], before) + out, last[1:])
    return last


def _waits(both, entry, exit_):
    return np.where(both, entry + exit_, np.maximum(entry, exit_))


def equal_sizes_makespans(f_full: np.ndarray, b_full: np.ndarray, f_last: np.ndarray, b_last: np.ndarray,
                          m: np.ndarray) -> np.ndarray:
    """Fast bound for ``m - 1`` full micro-batches then one last one (``m >= 2``), for the balancer.

    Same paths as ``stage_finish_s`` with free sends (a lower bound with them too), the entry priced by
    micro-batch 0's plain round trip and exits by the last two micro-batches. ``f_full``/``b_full``:
    (depth,); ``f_last``/``b_last``: (R, depth) for R last sizes; ``m``: (M,). Returns (R, M).
    """
    depth = f_full.shape[-1]
    w = depth - 1 - np.arange(depth)
    mm = np.asarray(m, dtype=float)[None, :, None]
    fl, bl = f_last[:, None, :], b_last[:, None, :]
    t = f_full + b_full
    k = np.minimum(w, mm - 1)
    entry = np.maximum(_excl_suffix(t, -1) - np.where(k == mm - 1, (mm - 2) * f_full + fl, k * f_full), 0.0)
    etop = _excl_cumsum(f_full, -1)
    exit_last = np.maximum(_excl_suffix(fl + bl, -1) - k * b_full, 0.0)
    last = etop + (mm - 1) * t + fl + bl + _waits(mm >= w + 2, entry, exit_last) + _excl_cumsum(bl, -1)
    # leave the anchor with the last full micro-batch, then stage 0 runs the last one
    tail_f = np.where(w >= 1, fl, 0.0)
    k2 = np.minimum(w, np.maximum(mm - 2, 0))
    exit_full = np.maximum(_excl_suffix(t, -1) - (tail_f + k2 * b_full), 0.0)
    stage0 = b_last[:, None, :1] + (f_last[:, None, :1] if depth == 1 else 0.0)
    full = (etop + (mm - 1) * t + tail_f + _waits(mm >= w + 3, entry, exit_full) + _excl_cumsum(b_full, -1)
            + stage0)
    return np.maximum(np.max(last, axis=-1), np.max(full, axis=-1))


def steady_lines(f_full: np.ndarray, b_full: np.ndarray, f_last: np.ndarray, b_last: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """For ``m >= depth + 2`` ``equal_sizes_makespans`` is ``max_a (c[r, a] + m * slope[a])``: (c, slope)."""
    depth = f_full.shape[-1]
    w = depth - 1 - np.arange(depth)
    t = f_full + b_full
    entry = np.maximum(_excl_suffix(t, -1) - w * f_full, 0.0)
    etop = _excl_cumsum(f_full, -1)
    exit_last = np.maximum(_excl_suffix(f_last + b_last, -1) - w * b_full, 0.0)
    c_last = etop - t + f_last + b_last + entry + exit_last + _excl_cumsum(b_last, -1)
    tail_f = np.where(w >= 1, f_last, 0.0)
    exit_full = np.maximum(_excl_suffix(t, -1) - (tail_f + w * b_full), 0.0)
    stage0 = b_last[:, :1] + (f_last[:, :1] if depth == 1 else 0.0)
    c_full = etop - t + tail_f + entry + exit_full + _excl_cumsum(b_full, -1) + stage0
    return np.concatenate([c_last, c_full], axis=-1), np.concatenate([t, t])


def lines_that_can_lead(c: np.ndarray, slope: np.ndarray, m_lo: float, m_hi: float) -> np.ndarray:
    """Indices of the lines ``c[r, a] + m * slope[a]`` that may be the largest for some row r and some m in
    [m_lo, m_hi] (m_lo >= 0), as computed in floats: a line is left out only where, in every row, another line is
    above it by far more than the two evaluations' rounding at both ends of the range (the difference of two lines
    is linear in m, so it is smallest at an end). The max over the lines kept is then bit for bit the max over all:
    the largest computed value is never a line left out. At 30 stages 1F1B's 60 steady lines leave one to three,
    and T(n)'s tables reach the batch (16k samples at 4 per GPU) 20-60x faster."""
    ends = np.array([m_lo, m_hi], dtype=float)[:, None, None]
    values = c[None, :, :] + ends * slope[None, None, :]  # (end, row, line)
    gap = values[:, :, :, None] - values[:, :, None, :]  # (end, row, above, below)
    size = np.abs(c)[:, :, None] + np.abs(c)[:, None, :] + m_hi * (np.abs(slope)[:, None] + np.abs(slope)[None, :])
    above = gap.min(axis=0) > 1e-12 * size  # rounding: ~2.2e-16 of the same sum
    return np.flatnonzero(~above.any(axis=1).all(axis=0))
