"""Smoke test of the evaluation suite: `benchmarks/evaluate.py --quick` into a temporary directory.

Checks what the suite promises: every output file exists, docs/evaluation.md is exactly the
template rendered from the JSON files, every number in it comes from those files, speedups and
headline numbers are recomputed consistently, and every loss of eth is stated in the text.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("throughput", "search", "ablation", "measured", "sensitivity", "summary")
# A number as the markdown prints it: not part of an identifier (gpt3-1.3b, A100, d2, tp4), with an
# optional x (speedup) or % suffix.
NUMBER = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(?:x|%)?(?!\w|\.\d)")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BASELINES = ("layer-balanced", "uniform", "layer-balanced-best-type", "uniform-best-type")  # eval/throughput.py

pytestmark = pytest.mark.slow


def _walk(obj: Any, numbers: list[float], strings: list[str]) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            strings.append(str(k))
            _walk(v, numbers, strings)
    elif isinstance(obj, list):
        for v in obj:
            _walk(v, numbers, strings)
    elif isinstance(obj, bool) or obj is None:
        return
    elif isinstance(obj, (int, float)):
        numbers.append(obj)
    else:
        strings.append(str(obj))


def allowed_numbers(results: dict[str, Any]) -> set[str]:
    """Every way the template may print a JSON value, plus digits that JSON strings carry verbatim."""
    numbers: list[float] = []
    strings: list[str] = []
    _walk(results, numbers, strings)
    allowed: set[str] = set()
    for v in numbers:
        if isinstance(v, int):
            allowed.add(str(abs(v)))
        for scale in (1.0, 100.0, 1e-3):
            a = abs(v * scale)
            if not math.isfinite(a):
                continue
            allowed.update(f"{a:.{p}f}" for p in range(5))
            allowed.add(f"{a:.4g}")
    for s in strings:
        allowed.update(m.group(1).replace(",", "") for m in NUMBER.finditer(s))
    return allowed


def foreign_numbers(markdown: str, allowed: set[str]) -> list[str]:
    return [m.group(1) for m in NUMBER.finditer(markdown) if m.group(1).replace(",", "") not in allowed]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    root = tmp_path_factory.mktemp("eval")
    measured = root / "measured"
    measured.mkdir()
    (measured / "runtime_cpu.json").write_text(json.dumps({
        "command": "python benchmarks/runtime_cpu.py --steps 3", "machine": "test machine",
        "plans": {"uniform": {"median_step_s": 2.5, "tokens_per_s": 400.0},
                  "eth": {"median_step_s": 2.0, "tokens_per_s": 500.0}}}))
    docs = root / "docs"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "evaluate.py"), "--quick", "--no-progress",
         "--docs-dir", str(docs), "--measured-dir", str(measured)],
        cwd=REPO, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {name: json.loads((docs / "benchmarks" / f"eval_{name}.json").read_text()) for name in SECTIONS}
    return docs, results, (docs / "evaluation.md").read_text()


def test_every_output_exists_with_provenance(run: tuple[Path, dict[str, Any], str]) -> None:
    docs, results, _ = run
    for name, data in results.items():
        assert data["section"] == name
        assert data["meta"]["command"].startswith("python benchmarks/evaluate.py --quick")
        assert "CPUs" in data["meta"]["machine"] and data["meta"]["quick"] is True
    figures = [c["figure"] for c in results["throughput"]["clusters"]]
    figures += list(results["throughput"]["figures"].values())
    figures += [results[s]["figure"] for s in ("search", "ablation", "sensitivity")]
    assert len(figures) == len(set(figures)) >= 7
    for fig in figures:
        data = (docs / fig).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000, fig


def test_markdown_is_the_template_rendered_from_the_json(run: tuple[Path, dict[str, Any], str]) -> None:
    _, results, markdown = run
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from eval.render import render
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert markdown == render(results)


def test_every_number_in_the_markdown_comes_from_the_json(run: tuple[Path, dict[str, Any], str]) -> None:
    _, results, markdown = run
    allowed = allowed_numbers(results)
    assert foreign_numbers(markdown, allowed) == []
    # the check can fail: a hand-typed number is caught
    assert foreign_numbers(markdown + "\n| speedup | 987654.321x |\n", allowed) == ["987654.321"]


def test_speedups_and_headline_are_consistent(run: tuple[Path, dict[str, Any], str]) -> None:
    _, results, _ = run
    th = results["throughput"]
    rows = th["rows"]
    assert rows and {r["samples_per_gpu"] for r in rows} == set(th["samples_per_gpu"])
    for row in rows:
        gpus = next(c["gpus"] for c in th["clusters"] if c["key"] == row["cluster"])
        assert row["global_batch"] == row["samples_per_gpu"] * gpus
        m = row["methods"]
        for mode in th["modes"]:
            for cond in (c["key"] for c in th["conditions"]):
                for pair in th["pairs"]:
                    a, b = pair.split(" / ")
                    value = row["speedup"][mode][cond][pair]
                    if b == "best-baseline":  # the fastest of the baselines that fit
                        fits = [x for x in BASELINES if m[x]["feasible"]]
                        b = max(fits, key=lambda x: m[x]["replay"][cond][mode]["tokens_per_s"], default=None)
                        if mode == "static" and cond == "nominal":
                            assert row["best_baseline"] == b
                    if b is not None and m[a]["feasible"] and m[b]["feasible"]:
                        assert value == pytest.approx(m[a]["replay"][cond][mode]["tokens_per_s"]
                                                      / m[b]["replay"][cond][mode]["tokens_per_s"])
                    else:
                        assert value is None
        for v in m.values():
            if not v["feasible"]:
                continue
            assert 0.0 < v["nominal"]["balance_efficiency"] <= 1.0 + 1e-9
            assert v["replay"]["nominal"]["static"]["tokens_per_s"] == pytest.approx(v["nominal"]["tokens_per_s"])
            for rep in v["replay"].values():
                for timing in rep.values():
                    assert timing["tokens_per_s"] == pytest.approx(row["global_batch"] * row["seq_len"]
                                                                   / timing["iteration_s"])
                if rep["rebalanced"]["applied"] == 0:  # nothing re-split: the same replay
                    assert rep["rebalanced"]["tokens_per_s"] == rep["static"]["tokens_per_s"]
    for p in [p for s in results["sensitivity"]["sweeps"].values() for p in s["points"]]:
        for baseline in ("layer-balanced", "uniform"):
            if p["methods"]["eth"]["feasible"] and p["methods"][baseline]["feasible"]:
                assert p["speedup"][baseline] == pytest.approx(p["methods"]["eth"]["tokens_per_s"]
                                                               / p["methods"][baseline]["tokens_per_s"])
    for case in results["ablation"]["rows"]:
        for variant in case["variants"].values():
            if variant["feasible"]:
                assert variant["relative"] == pytest.approx(variant["tokens_per_s"] / case["eth"]["tokens_per_s"])
    for cell in results["summary"]["matrix"]["grid"]:
        values = [r["speedup"][cell["mode"]][cell["condition"]][cell["pair"]] for r in rows
                  if cell["samples_per_gpu"] in (0, r["samples_per_gpu"])]
        values = [v for v in values if v is not None]
        assert cell["num_cases"] == len(values)
        if values:
            assert cell["geomean"] == pytest.approx(math.exp(sum(map(math.log, values)) / len(values)))
            assert cell["max"]["value"] == max(values) and cell["min"]["value"] == min(values)
            assert cell["num_slower"] == sum(1 for v in values if v < 1.0)


def test_every_loss_of_eth_is_stated(run: tuple[Path, dict[str, Any], str]) -> None:
    _, results, markdown = run
    th = results["throughput"]
    losses = 0
    for row in th["rows"]:
        section = markdown.split(f"#### {row['cluster_label']}\n", 1)[1].split("\n#### ", 1)[0]
        for baseline in ("layer-balanced", "uniform"):
            sp = row["speedup"]["static"]["nominal"][f"eth / {baseline}"]
            spg = row["samples_per_gpu"]
            stated = (f"**eth is slower than {baseline} at nominal speed on {row['model']} at "
                      f"{spg} sample{'' if spg == 1 else 's'}/GPU**")
            assert (stated in section) == (sp is not None and sp < 1.0), (row["cluster"], row["model"], baseline)
            losses += sp is not None and sp < 1.0
    assert ("**At nominal speeds eth is never simulated slower" in markdown) == (losses == 0)
    where = markdown.split("## Where eth does not win\n", 1)[1]
    tol = results["summary"]["matrix"]["tie_tolerance"]
    for row in th["rows"]:
        for cond in (c["key"] for c in th["conditions"] if c["which"] is not None):
            for baseline in ("layer-balanced", "uniform"):
                s = row["speedup"]["static"][cond][f"eth / {baseline}"]
                r = row["speedup"]["rebalanced"][cond][f"eth / {baseline}"]
                if s is not None and min(s, r) < 1.0 - tol:
                    assert f"| {row['condition_labels'][cond]} | {baseline} |" in where
    for sweep in results["sensitivity"]["sweeps"].values():
        for baseline, a in sweep["analysis"].items():
            assert ("eth stops helping" in markdown) or not a["no_gain_x"]


def test_measured_results_are_copied_with_provenance(run: tuple[Path, dict[str, Any], str]) -> None:
    _, results, markdown = run
    runtime, fidelity = results["measured"]["sources"]
    assert runtime["exists"] and runtime["command"] == "python benchmarks/runtime_cpu.py --steps 3"
    assert runtime["data"]["plans"]["eth"]["tokens_per_s"] == 500.0
    assert "measured eth / uniform: 1.25x (eth faster on this machine)" in runtime["derived"]
    assert not fidelity["exists"]
    assert "`python benchmarks/runtime_cpu.py --steps 3` on test machine" in markdown
    assert f"`{fidelity['path']}` does not exist in this checkout" in markdown and "measured" in fidelity["path"]


def test_render_only_reproduces_the_markdown_from_the_json(run: tuple[Path, dict[str, Any], str]) -> None:
    docs, _, markdown = run
    (docs / "evaluation.md").write_text("stale\n")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "evaluate.py"), "--render-only",
                           "--docs-dir", str(docs)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (docs / "evaluation.md").read_text() == markdown
