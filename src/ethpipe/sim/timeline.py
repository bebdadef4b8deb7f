"""Gantt-chart PNG of a trace (simulated or measured): one row per rank, pipelines grouped.

Rows have a light background so idle gaps (pipeline bubbles, waiting for gradient sync)
stand out as uncoloured stretches between coloured work. Works from a ``Trace`` so the same
picture can be drawn for a prediction and for a real run.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.transforms import blended_transform_factory

from ethpipe.atomic import atomic_path
from ethpipe.schedule import is_action_name
from ethpipe.errors import UserError
from ethpipe.sim.trace import Trace, TraceEvent

_COLOURS = {
    "forward": "#4C78A8",
    "backward": "#F58518",
    "weight grad (W)": "#FFBF79",  # zb-h1's deferred weight-gradient passes
    "p2p": "#B279A2",
    "allreduce": "#E45756",
    "optimizer": "#54A24B",
    "allgather": "#72B7B2",
    "other": "#9D9D9D",
}
_LABEL_LIMIT = 400  # write micro-batch numbers into bars only when there are few
_ROW_LABEL_LIMIT = 64  # name every row only when there are few
_EDGE_LIMIT = 5000  # white separators between bars only when they can be seen


def _boxes(spans: list[tuple[float, float, float]], half_height: float, colour: str, edge_width: float) -> PolyCollection:
    """All (x, width, y) rectangles of one colour as a single collection (fast for 100k bars)."""
    verts = [((x, y - half_height), (x + w, y - half_height), (x + w, y + half_height), (x, y + half_height))
             for x, w, y in spans]
    return PolyCollection(verts, facecolors=colour, edgecolors="white", linewidths=edge_width)


def _kind(event: TraceEvent) -> str:
    """Colour class by name first (``F3``/``B3``/``W3``/``recv F3``/``allreduce block 2``), then category,
    so traces from the runtime (which may categorise differently) draw the same way; a split backward's
    W draws in its own lighter colour."""
    head = event.name.split(" ")[0]
    if is_action_name(head):
        return {"F": "forward", "W": "weight grad (W)"}.get(head[0], "backward")
    if head in ("recv", "send") or event.cat == "p2p":
        return "p2p"
    if head.startswith("allreduce") or event.cat == "allreduce":
        return "allreduce"
    if head.startswith("allgather") or event.cat == "allgather":
        return "allgather"
    if head.startswith("optim") or event.cat == "optimizer":
        return "optimizer"
    return "other"


def draw_timeline(trace: Trace, path: str | Path, title: str | None = None) -> None:
    """Write the Gantt PNG atomically (a bare Figure: no pyplot state, no display needed)."""

    work = list(trace.events)
    if not work:
        raise UserError("trace has no compute events to draw: was it written by `ethpipe simulate` or `train --trace`?")
    origin = min(e.start_s for e in work)
    end_ms = (max(e.end_s for e in work) - origin) * 1e3
    rows = sorted({(e.pid, e.tid) for e in work})
    y_of: dict[tuple[int, int], float] = {}
    y, prev_pid = 0.0, rows[0][0]
    for row in rows:
        if row[0] != prev_pid:
            y += 0.6  # a gap between pipelines
            prev_pid = row[0]
        y_of[row] = y
        y += 1.0
    height_in = min(max(2.5, 0.32 * y + 1.8), 40.0)
    fig = Figure(figsize=(14, height_in))
    ax = fig.subplots()
    spans_by_kind: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for e in work:
        spans_by_kind[_kind(e)].append(((e.start_s - origin) * 1e3, e.dur_s * 1e3, y_of[(e.pid, e.tid)]))
    background = [(0.0, end_ms, y_row) for y_row in y_of.values()]
    ax.add_collection(_boxes(background, 0.42, "#F2F2F2", 0.0))
    edge_width = 0.3 if len(work) <= _EDGE_LIMIT else 0.0
    for kind, spans in spans_by_kind.items():
        ax.add_collection(_boxes(spans, 0.4, _COLOURS[kind], edge_width))
    if len(work) <= _LABEL_LIMIT:
        for e in work:
            if _kind(e) in ("forward", "backward", "weight grad (W)"):
                x = (e.start_s - origin + e.dur_s / 2) * 1e3
                ax.text(x, y_of[(e.pid, e.tid)], e.name[1:], ha="center", va="center", fontsize=6, color="white")
    ax.set_ylim(y - 0.4, -0.6)
    ax.set_xlim(0.0, end_ms * 1.01)
    ax.set_xlabel("time (ms)")
    if len(rows) <= _ROW_LABEL_LIMIT:
        ax.set_yticks([y_of[r] for r in rows])
        ax.set_yticklabels([trace.thread_names.get(r, f"rank {r[1]}") for r in rows], fontsize=7)
    else:
        pids = sorted({r[0] for r in rows})
        firsts = [min(y_of[r] for r in rows if r[0] == p) for p in pids]
        ax.set_yticks(firsts)
        ax.set_yticklabels([trace.process_names.get(p, f"pipeline {p}") for p in pids], fontsize=6)
    if len(rows) <= _ROW_LABEL_LIMIT:
        side = blended_transform_factory(ax.transAxes, ax.transData)
        for pid in sorted({r[0] for r in rows}):
            ys = [y_of[r] for r in rows if r[0] == pid]
            ax.text(1.004, (min(ys) + max(ys)) / 2, trace.process_names.get(pid, f"pipeline {pid}"), transform=side,
                    rotation=270, va="center", ha="left", fontsize=8, color="#444444")
    legend = [Patch(facecolor=c, label=k) for k, c in _COLOURS.items() if k in spans_by_kind and k != "other"]
    legend.append(Patch(facecolor="#F2F2F2", edgecolor="#CCCCCC", label="idle (bubble / waiting)"))
    ax.legend(handles=legend, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(legend), fontsize=8,
              frameon=False)
    ax.set_title(title or f"iteration {end_ms:.2f} ms", fontsize=10, pad=22)
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.5)
    ax.set_axisbelow(True)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
