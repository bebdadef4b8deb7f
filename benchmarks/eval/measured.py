"""Section 4: the CPU measurements other benchmarks wrote, copied with their provenance (not re-run).

``benchmarks/runtime_cpu.py`` and ``benchmarks/fidelity.py`` run the real runtime under
``--emulate`` on this machine; re-running them here would double the suite's time and share the
two cores with the planner timings. Their JSON is copied verbatim, with the command and machine
taken from the JSON or, where the JSON lacks them, from the markdown report written next to it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
import statistics
from pathlib import Path
from typing import Any

from eval.scenarios import REPO

SOURCES = (("runtime", "runtime_cpu", "benchmarks/runtime_cpu.py"), ("fidelity", "fidelity", "benchmarks/fidelity.py"))


def _from_markdown(md: Path, field: str) -> str | None:
    if not md.is_file():
        return None
    match = re.search(rf"^{field}:\s*(.+?)\s*$", md.read_text(), re.MULTILINE)
    return match.group(1).strip("` ") if match else None


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _json_text(value: Any) -> str | None:
    return None if value is None else json.dumps(value, sort_keys=True)


def read_source(bench_dir: Path, name: str, stem: str, script: str) -> dict[str, Any]:
    path = bench_dir / f"{stem}.json"
    shown = path.resolve().relative_to(REPO) if path.resolve().is_relative_to(REPO) else path
    out: dict[str, Any] = {"name": name, "script": script, "path": str(shown), "exists": path.is_file()}
    if not path.is_file():
        return out
    raw = path.read_bytes()
    data = json.loads(raw)
    meta = data if isinstance(data, dict) else {}
    md = bench_dir / f"{stem}.md"
    return {**out,
            "modified": dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "sha256": hashlib.sha256(raw).hexdigest()[:12],
            "report": str(Path(out["path"]).with_suffix(".md")) if md.is_file() else None,
            "command": _text(meta.get("command")) or _from_markdown(md, "Command"),
            "machine": _text(meta.get("machine")) or _from_markdown(md, "Machine") or _json_text(meta.get("machine")),
            "data": data}


def _records(data: Any) -> list[dict[str, Any]]:
    if isinstance(data, dict):
        data = data.get("rows", [])
    return [r for r in data if isinstance(r, dict)] if isinstance(data, list) else []


def derived(name: str, data: Any) -> list[str]:
    """Comparisons the source's own tables imply, computed here (and stored, so the docs can cite them)."""
    out = []
    plans = data.get("plans") if isinstance(data, dict) else None
    if name == "runtime" and isinstance(plans, dict) and "tokens_per_s" in plans.get("eth", {}):
        for other, rec in plans.items():
            if other != "eth" and rec.get("tokens_per_s"):
                ratio = plans["eth"]["tokens_per_s"] / rec["tokens_per_s"]
                verdict = "faster" if ratio > 1.0 else "slower"
                paced = "; paced emulation: confirms schedule and overheads, not the compute model" \
                    if data.get("emulation") == "paced" else ""
                out.append(f"measured eth / {other}: {ratio:.2f}x (eth {verdict} on this machine{paced})")
    rows = [r for r in _records(data) if {"measured_s", "simulated_s"} <= r.keys()]
    for mode in dict.fromkeys(r.get("mode", "unrecorded") for r in rows) if name == "fidelity" else ():
        in_mode = [r for r in rows if r.get("mode", "unrecorded") == mode]
        errors = [abs(r["simulated_s"] - r["measured_s"]) / r["measured_s"] for r in in_mode]
        out.append(f"{mode} emulation, simulated vs measured iteration time: median |error| "
                   f"{statistics.median(errors) * 100:.1f}%, worst {max(errors) * 100:.1f}% over {len(in_mode)} plans")
        for model in dict.fromkeys(r.get("model") for r in in_mode):
            sub = [r for r in in_mode if r.get("model") == model and "method" in r]
            if len(sub) > 1:
                sim = [r["method"] for r in sorted(sub, key=lambda r: r["simulated_s"])]
                real = [r["method"] for r in sorted(sub, key=lambda r: r["measured_s"])]
                same = "the same" if sim == real else "DIFFERENT"
                out.append(f"{mode} emulation, {model}: ranking by simulation {' < '.join(sim)}, by measurement "
                           f"{' < '.join(real)}: {same}")
    return out


def emulation_modes(data: Any) -> list[str]:
    """The ``--emulate`` modes a source's runs used: its ``emulation`` field, else its rows' ``mode``."""
    if isinstance(data, dict) and isinstance(data.get("emulation"), str):
        return [data["emulation"]]
    return list(dict.fromkeys(str(r["mode"]) for r in _records(data) if "mode" in r))


def collect(bench_dir: Path) -> dict[str, Any]:
    sources = [read_source(bench_dir, *s) for s in SOURCES]
    for src in sources:
        if src["exists"]:
            src["derived"] = derived(src["name"], src["data"])
            src["emulation_modes"] = emulation_modes(src["data"])
    return {"section": "measured", "sources": sources}
