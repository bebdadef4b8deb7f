"""The replay of ``cost/schedule_time.py`` with transfers that take time: senders wait (``cost/rendezvous.py``).

Node n of a stage's list (an action after its batch's waits, a deferred send's wait, the flush) goes on at
``max(E(n-1) + w, E(producer) + in, posted(consumer) + out)`` and lasts its compute after that: ``w`` is the
longest transfer of its batch (a deferred send's, or a receive posted before a run of Ws, less the W compute
since it was posted), so the node lasts
``D = base + w - in_own`` (``base``: receive + compute, what the caller prices) and ends at
``max(E(n-1), E(producer) + in - w, posted(consumer) + out - w) + D``. A free send (0 s) is not waited for,
nor a free receive of a later action of its unit, which waits at that action (``cost/rendezvous.py``).

The consumers' posts make the critical path change direction between two neighbours once or twice per
micro-batch (zb-h1's deferred sends, the warm-up and the drain), where the free replay's sweeps settle one
change each; so here every node is evaluated once instead, level by level in a topological order of the graph
(nodes numbered by level, so that a level is a slice): a few numpy operations per level for all the variants
at once.
"""

from __future__ import annotations

import functools
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from ethpipe.cost.periodic_graph import Flat, Pattern, base_count, extend, find_pattern, periodic_family
from ethpipe.cost.rendezvous import stage_nodes
from ethpipe.schedule import Action, output_dest, pipeline_schedule, split_microbatches

_F, _B_WHOLE, _B_INPUT, _W, _NO_COMPUTE = range(5)  # a node's compute (a wait node: none)
_ACT, _GRAD, _NO_TRANSFER = range(3)  # which transfer a receive or send is
# What a node waits for: its own input; that input when an earlier batch received it (a free transfer is waited
# at the action); another receive of its batch; a send of its batch (the consumer's post; a consumer that posts
# at the start only makes the send last); a receive a deferred batch posted before a run of Ws (waited after it).
_OWN, _EAGER, _OTHER, _SEND, _SEND_AT_START, _EARLY = range(6)
Key = tuple[np.ndarray, np.ndarray, np.ndarray]  # (table, row, micro-batch) per node or term


class _Graph(NamedTuple):
    """A pipeline's nodes (N of them, stage after stage) and what they wait for ("terms")."""

    compute: Key  # per node
    own: Key  # per node: its action's receive
    term_node: np.ndarray  # per term: the waiting node
    term_kind: np.ndarray
    term_key: Key  # the transfer
    term_posted: np.ndarray  # sends and early receives: the first node after they were posted (the gap's start),
    # else the node
    need_at: np.ndarray  # per term: its (slot, node) in the table of each batch's transfers
    arrive: np.ndarray  # the terms that can arrive (all but _SEND_AT_START)
    # Level order: the nodes renumbered level by level (a level is a slice; index N: none, whose end is 0).
    order: np.ndarray  # per position: its node
    arrive_at: np.ndarray  # per arriving term: its (slot, position) in the arrivals table (slot 0: the node before)
    slots: tuple[int, int]  # (transfer slots, arrival slots)
    levels: tuple[tuple[int, int, np.ndarray], ...]  # per level: its positions, and the positions waited for
    flush: np.ndarray  # per stage: its last node's position


@lru_cache(maxsize=256)  # a few MB at most: the estimate's and finish times' shapes, not the balancer's
def _graph(schedule: str, depth: int, m: int, unsplit: tuple[bool, ...], num_chunks: int = 1) -> _Graph:
    """The nodes of a pipeline's lists (``cost/rendezvous.py``) and what each waits for, as index arrays.

    A finalist's zb-h1 pipeline at 4 samples per GPU has 30 stages and 350 micro-batches (40k nodes), and the
    planner prices several counts of one shape: the flat arrays of a long 1F1B or zb-h1 pipeline are extended
    from a few short ones (``cost/periodic_graph.py``, identical to ``_flat``'s), then levelled here."""
    pattern = _pattern(schedule, depth, unsplit) if (
        periodic_family(schedule, num_chunks) and m >= base_count(depth) + EXTEND_FROM) else None
    return _finish(extend(pattern, m) if pattern is not None else _flat(schedule, depth, m, unsplit, num_chunks))


# Counts past ``periodic_graph.base_count`` from which a graph is extended rather than built: the pattern costs the
# builds of three counts from the base, so a shape priced at one short count alone is cheaper built.
EXTEND_FROM = 8


@lru_cache(maxsize=64)
def _pattern(schedule: str, depth: int, unsplit: tuple[bool, ...]) -> Pattern | None:
    return find_pattern(functools.partial(_flat, schedule, depth, unsplit=unsplit), depth)


def _flat(schedule: str, depth: int, m: int, unsplit: tuple[bool, ...], num_chunks: int = 1) -> Flat:
    """The graph's nodes and terms as built from the lists, one node at a time (``Flat``)."""
    lists = pipeline_schedule(depth, m, schedule, unsplit, num_chunks)
    stages = stage_nodes(lists, num_chunks)
    first = np.cumsum([0] + [len(nodes) for nodes in stages]).tolist()
    compute: list[int] = []  # per node: (code, row, micro-batch), flat
    own: list[int] = []  # per node: the transfer of its action's receive, flat
    t_node: list[int] = []  # per term (what a node waits for): the waiting node, its kind, the node waited for
    t_kind: list[int] = []  # (or -1), the transfer (flat, 3 per term) and where the gap since its post starts
    t_wait: list[int] = []
    t_key: list[int] = []
    t_posted: list[int] = []
    no_transfer = (_NO_TRANSFER, 0, 0)
    for s, (acts, nodes) in enumerate(zip(lists, stages)):
        split = split_microbatches(acts)
        codes = [(_F if a.kind == "F" else _W if a.kind == "W" else _B_INPUT if a.microbatch in split else _B_WHOLE,
                  a.chunk * depth + s, a.microbatch) for a in acts]
        received = [_received(a, s, depth) for a in acts]
        base = first[s]
        for n, node in enumerate(nodes):
            g = base + n
            k = node.action
            if k < 0:
                compute += (_NO_COMPUTE, 0, 0)
                own_key = no_transfer
            else:
                compute += codes[k]
                own_key = received[k] if node.src is not None else no_transfer
            own += own_key
            early = node.posted < n - 1  # posted before the Ws: like a deferred send, less the Ws' compute since
            in_batch = False
            for r in node.recvs:
                if r.action == k:
                    kind, in_batch = _OWN, True
                else:
                    kind = _EARLY if early else _OTHER
                t_node.append(g)
                t_kind.append(kind)
                t_wait.append(first[r.src] + r.node)
                t_key += received[r.action]
                t_posted.append(base + node.posted + 1 if early else g)
            if node.src is not None and not in_batch:
                t_node.append(g)
                t_kind.append(_EAGER)
                t_wait.append(first[node.src[0]] + node.src[1])
                t_key += own_key
                t_posted.append(g)
            for send in node.sends:
                waited = first[send.dst] + send.post if send.post >= 0 else -1
                t_node.append(g)
                t_kind.append(_SEND if waited >= 0 else _SEND_AT_START)
                t_wait.append(waited)
                t_key += _sent(acts[send.action], s, depth, num_chunks)
                t_posted.append(base + send.posted + 1)
    terms = np.column_stack([np.array(t_node, dtype=np.int64), np.array(t_kind, dtype=np.int64),
                             np.array(t_wait, dtype=np.int64), np.array(t_key, dtype=np.int64).reshape(-1, 3),
                             np.array(t_posted, dtype=np.int64)]) if t_node else np.zeros((0, 7), dtype=np.int64)
    nodes = np.concatenate([np.array(compute, dtype=np.int64).reshape(-1, 3),
                            np.array(own, dtype=np.int64).reshape(-1, 3)], axis=1)
    return Flat(np.array(first, dtype=np.int64), nodes, terms)


def _finish(flat: Flat) -> _Graph:
    """The levelled graph of ``flat``'s nodes and terms."""
    total = int(flat.first[-1])
    node, kinds, waits = flat.terms[:, 0], flat.terms[:, 1], flat.terms[:, 2]
    starts = flat.first[:-1]
    level = _levels(total, starts, node, waits)
    order = np.argsort(level, kind="stable")  # by level, then node
    at = np.empty(total + 1, dtype=int)
    at[order] = np.arange(total)
    at[total] = total
    need_slot = _slots(node)
    arrive = np.flatnonzero(kinds != _SEND_AT_START)
    arrive_slot = _slots(node[arrive]) + 1
    slots = (int(need_slot.max(initial=0)) + 1, int(arrive_slot.max(initial=0)) + 1)
    before = at[np.arange(total) - 1]  # the node before in its stage (index N: none)
    before[starts] = total
    sources = np.full((slots[1], total), total)
    sources[0] = before[order]
    sources[arrive_slot, at[node[arrive]]] = at[waits[arrive]]
    bounds = np.concatenate([[0], np.cumsum(np.bincount(level, minlength=1))]).tolist()
    return _Graph(_columns(flat.nodes[:, :3]), _columns(flat.nodes[:, 3:]), node, kinds, _columns(flat.terms[:, 3:6]),
                  flat.terms[:, 6].copy(), need_slot * total + node, arrive, order,
                  arrive_slot * total + at[node[arrive]], slots,
                  tuple((lo, hi, sources[:, lo:hi]) for lo, hi in zip(bounds, bounds[1:])),
                  at[flat.first[1:] - 1])


def _levels(total: int, starts: np.ndarray, node: np.ndarray, waits: np.ndarray) -> np.ndarray:
    """Each node's level: one more than the highest of what it waits for, the node before it in its stage
    included (Kahn's order over the waits; the graph is acyclic: the runtime's batches cannot wait in a cycle,
    ``comm.replay``)."""
    chained = np.ones(total, dtype=bool)
    chained[starts] = False
    edges = waits >= 0
    src = np.concatenate([np.flatnonzero(chained) - 1, waits[edges]]).tolist()
    dst = np.concatenate([np.flatnonzero(chained), node[edges]])
    waiting = np.bincount(dst, minlength=total).tolist()
    users: list[list[int]] = [[] for _ in range(total)]
    for u, g in zip(src, dst.tolist()):
        users[u].append(g)
    level = [0] * total
    ready = [g for g in range(total) if waiting[g] == 0]
    for g in ready:  # the list grows as nodes become ready: a breadth-first Kahn order
        up = level[g] + 1
        for user in users[g]:
            if level[user] < up:
                level[user] = up
            waiting[user] -= 1
            if not waiting[user]:
                ready.append(user)
    assert len(ready) == total, "the nodes wait in a cycle: schedule and rendezvous disagree"
    return np.array(level, dtype=int)


def _slots(nodes: np.ndarray) -> np.ndarray:
    """Per entry of a non-decreasing array: how many earlier entries share its node (its slot in a (slot, node)
    table)."""
    return np.arange(nodes.size) - np.searchsorted(nodes, nodes, side="left")


def _columns(triples: np.ndarray) -> Key:
    """(table, row, micro-batch) triples, shape (n, 3), as three index arrays."""
    return tuple(np.ascontiguousarray(c) for c in triples.T)  # type: ignore[return-value]


def _received(a: Action, s: int, depth: int) -> tuple[int, int, int]:
    """The transfer an action on stage ``s`` receives: its row's activation (F) or gradient (B)."""
    return (_ACT if a.kind == "F" else _GRAD), a.chunk * depth + s, a.microbatch


def _sent(a: Action, s: int, depth: int, num_chunks: int) -> tuple[int, int, int]:
    """The transfer an action sends: the receiving row's activation (F) or gradient (B)."""
    dst, dc = output_dest(a.kind, s, a.chunk, depth, num_chunks)
    return (_ACT if a.kind == "F" else _GRAD), dc * depth + dst, a.microbatch


def rendezvous_finish_s(schedule: str, table: np.ndarray, transfers: np.ndarray, unsplit: tuple[bool, ...],
                        num_chunks: int) -> np.ndarray:
    """Each stage's flush, shape ``(..., depth)``. ``table[..., code, row, j]``: F, whole B, input-only B, W
    and no compute's seconds (receives included); ``transfers[..., kind, row, j]``: activation, gradient and no
    receive's seconds (``replay_finish_s``)."""
    rows, m = table.shape[-2:]
    graph = _graph(schedule, rows // num_chunks, m, unsplit, num_chunks)
    lead = np.broadcast_shapes(table.shape[:-3], transfers.shape[:-3])
    total = graph.order.size
    base = np.broadcast_to(table[..., graph.compute[0], graph.compute[1], graph.compute[2]], lead + (total,))
    value = np.broadcast_to(transfers[..., graph.term_key[0], graph.term_key[1], graph.term_key[2]],
                            lead + graph.term_kind.shape)
    padded = np.concatenate([np.zeros(lead + (1,)), base.cumsum(-1)], axis=-1)
    gap = padded[..., graph.term_node] - padded[..., graph.term_posted]  # a deferred send's W since it was posted
    need = np.where(graph.term_kind >= _SEND, value - gap, np.where(graph.term_kind == _EAGER, 0.0, value))
    batch = np.zeros(lead + (graph.slots[0] * total,))
    batch[..., graph.need_at] = need
    w = np.maximum(batch.reshape(lead + graph.slots[:1] + (total,)).max(-2), 0.0)  # done transfers: no wait
    durations = (base + (w - transfers[..., graph.own[0], graph.own[1], graph.own[2]]))[..., graph.order]
    got = value[..., graph.arrive]
    offset = got - w[..., graph.term_node[graph.arrive]]
    free = np.isin(graph.term_kind[graph.arrive], (_OTHER, _SEND, _EARLY)) & (got <= 0.0)  # not waited (or not here)
    arrivals = np.full(lead + (graph.slots[1] * total,), -np.inf)
    arrivals[..., :total] = 0.0  # slot 0: the node before (none: index N, whose end is 0)
    arrivals[..., graph.arrive_at] = np.where(free, -np.inf, offset)
    arrivals = arrivals.reshape(lead + graph.slots[1:] + (total,))
    ends = np.zeros(lead + (total + 1,))
    for lo, hi, waited in graph.levels:
        ends[..., lo:hi] = (ends[..., waited] + arrivals[..., lo:hi]).max(-2) + durations[..., lo:hi]
    return ends[..., graph.flush]
