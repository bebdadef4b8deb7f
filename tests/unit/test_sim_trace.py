"""Trace JSON schema and round trip; the timeline PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _sim_fakes import FakeCost, make_plan

from ethpipe.sim import simulate
from ethpipe.sim.timeline import draw_timeline
from ethpipe.sim.trace import read_trace, trace_from_report, write_trace


def _two_pipeline_trace():  # noqa: ANN202
    plan = make_plan([([(0, 1), (1, 2)], [2, 1], "fast"), ([(0, 2)], [1, 1], "fast")])
    cost = FakeCost(p2p_time_s=0.25, grad_bytes_by_layers={(0, 1): 500, (1, 2): 500}, optimizer_time_s=0.1)
    report = simulate(plan, cost)
    return plan, report, trace_from_report(plan, report)


def test_trace_schema_is_chrome_trace_events(tmp_path: Path) -> None:
    plan, report, trace = _two_pipeline_trace()
    path = tmp_path / "t.json"
    write_trace(path, trace)
    data = json.loads(path.read_text())
    assert data["displayTimeUnit"] == "ms"
    spans = [e for e in data["traceEvents"] if e["ph"] == "X"]
    meta = [e for e in data["traceEvents"] if e["ph"] == "M"]
    assert len(spans) == len(report.events)
    assert {e["cat"] for e in spans} == {"compute", "p2p", "allreduce", "optimizer"}
    for e in spans:
        assert set(e) >= {"name", "ph", "ts", "dur", "pid", "tid", "cat", "args"}
        assert e["dur"] >= 0 and e["ts"] >= 0
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert names[(0, 1)] == "rank 1 (fast)" and names[(1, 2)] == "rank 2 (fast)"
    assert len(names) == 3  # one track per rank
    assert any(e["name"] == "recv F1" and e["tid"] == 1 and e["cat"] == "p2p" for e in spans)
    assert {e["args"]["name"] for e in meta if e["name"] == "process_name"} == {"pipeline 0", "pipeline 1"}
    b1 = next(e for e in spans if e["name"] == "B1" and e["tid"] == 0)
    own = next(ev for ev in report.events if ev.name == "B1" and ev.ranks == (0,))
    assert b1["ts"] == pytest.approx(own.start_s * 1e6) and b1["dur"] == pytest.approx(own.dur_s * 1e6)
    assert any(e["name"] == "allreduce block 1" and e["tid"] == 2 for e in spans)


def test_trace_round_trip(tmp_path: Path) -> None:
    _, report, trace = _two_pipeline_trace()
    path = tmp_path / "t.json"
    write_trace(path, trace)
    back = read_trace(path)
    assert back.process_names == trace.process_names and back.thread_names == trace.thread_names
    assert len(back.events) == len(trace.events)
    for a, b in zip(trace.events, back.events):
        assert (a.name, a.cat, a.pid, a.tid, a.args) == (b.name, b.cat, b.pid, b.tid, b.args)
        assert a.start_s == pytest.approx(b.start_s, abs=1e-9) and a.dur_s == pytest.approx(b.dur_s, abs=1e-9)
    assert back.other["iteration_time_s"] == report.iteration_time_s
    assert back.span_s == pytest.approx(report.iteration_time_s)


@pytest.mark.parametrize(("content", "message"), [
    ("{", "not valid JSON"),
    ('{"traceEvents": 3}', "must be a list"),
    ('{"traceEvents": [{"ph": "X", "name": "F0"}]}', "traceEvents[0] is malformed"),
])
def test_read_trace_rejects_bad_files(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_trace(path)
    with pytest.raises(ValueError, match="not found"):
        read_trace(tmp_path / "missing.json")


def test_timeline_png_is_written(tmp_path: Path) -> None:
    _, report, trace = _two_pipeline_trace()
    path = tmp_path / "timeline.png"
    draw_timeline(trace, path, title=f"iteration {report.iteration_time_s:.2f} s")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert not list(tmp_path.glob(".*.png"))  # no temporary left behind


def test_measured_style_trace_reads_and_draws(tmp_path: Path) -> None:
    """A runtime-written trace (one process, categories from names) loads and draws the same way."""
    from ethpipe.sim.trace import trace_from_dict

    data = {"traceEvents": [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "rank 0 (cpu)"}},
        {"name": "F0", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 1000, "cat": "F"},
        {"name": "B0", "ph": "X", "pid": 0, "tid": 0, "ts": 1500, "dur": 2000, "cat": "B"},
        {"name": "allreduce block 0", "ph": "X", "pid": 0, "tid": 0, "ts": 3500, "dur": 500, "cat": "allreduce"},
    ]}
    trace = trace_from_dict(data)
    assert [e.name for e in trace.events] == ["F0", "B0", "allreduce block 0"]
    assert trace.span_s == pytest.approx(4e-3) and trace.thread_names == {(0, 0): "rank 0 (cpu)"}
    draw_timeline(trace, tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 5_000


def test_weight_gradient_passes_have_their_own_colour_and_legend_entry() -> None:
    """zb-h1's W passes drew as backward with no legend entry."""
    from ethpipe.sim.timeline import _COLOURS, _kind
    from ethpipe.sim.trace import TraceEvent

    kinds = {name: _kind(TraceEvent(name, "compute", 0, 0, 0.0, 1.0)) for name in ("F3", "B3", "W3", "W3.1")}
    assert kinds == {"F3": "forward", "B3": "backward", "W3": "weight grad (W)", "W3.1": "weight grad (W)"}
    assert _COLOURS["weight grad (W)"] not in (_COLOURS["backward"], _COLOURS["forward"])
