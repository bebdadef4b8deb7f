"""Evaluation suite: throughput (1/4/16 samples per GPU, nominal and mis-estimated device speeds, without
and with online rebalancing), search time, ablations, CPU measurements and sensitivity of eth and
eth --robust vs the layer-balanced and uniform baselines, written to docs/evaluation.md from its own JSON.

    .venv/bin/python benchmarks/evaluate.py [--quick] [--budget-s 10] [--docs-dir docs]

Writes docs/benchmarks/eval_{throughput,search,ablation,measured,sensitivity,summary}.json, the
figures docs/figures/eval_*.png, and docs/evaluation.md rendered from those JSON files only.
The full run took 8 min 10 s on 2 shared cores (throughput about 5.5 min, search 2 min; the header of
docs/evaluation.md records each run's time per section); ``--quick`` (the CI smoke test) under a minute.
``--render-only`` redraws the docs from the JSON without running anything; with
``--measured-dir docs/benchmarks`` it first re-copies the runtime and fidelity benchmarks' JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from eval import ablation, figures, measured, search, sensitivity, throughput  # noqa: E402
from eval.common import Job, machine, timed, write_json  # noqa: E402
from eval.render import SECTIONS, render  # noqa: E402
from eval.scenarios import REPO  # noqa: E402
from eval.summary import summarize  # noqa: E402
from planner_scale import reference_loop_s  # noqa: E402

QUICK_BUDGET_S = 2.0
FULL_BUDGET_S = 10.0  # the exhaustive searches time out at any budget above 32 GPUs; 10 s bounds the run


def _run_jobs(sections: dict[str, list[Job]], show: bool) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in sections}
    columns = (TextColumn("{task.description:<40}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, disable=not show) as progress:
        task = progress.add_task("evaluation", total=sum(len(j) for j in sections.values()))
        for name, jobs in sections.items():
            for job in jobs:
                progress.update(task, description=job.label)
                wall_s, row = timed(job.run)
                rows[name].append({**row, "job_wall_s": wall_s})
                progress.advance(task)
    return rows


def load_results(docs: Path) -> dict[str, dict[str, Any]]:
    results = {name: json.loads((docs / "benchmarks" / f"eval_{name}.json").read_text()) for name in SECTIONS}
    zero = docs / "benchmarks" / "zero_eval.json"  # benchmarks/zero_eval.py: sharding on vs off, same cases
    if zero.is_file():
        results["zero"] = json.loads(zero.read_text())
    return results


def evaluate(*, quick: bool, budget_s: float, docs: Path, measured_dir: Path, command: str,
             show_progress: bool = True) -> dict[str, dict[str, Any]]:
    started, t0 = dt.datetime.now(dt.timezone.utc), time.perf_counter()
    meta = {"command": command, "machine": machine(), "started": started.strftime("%Y-%m-%d %H:%M UTC"),
            "quick": quick}
    loop_start_s = None if quick else reference_loop_s()  # this machine's speed: planning times read against it
    rows = _run_jobs({"throughput": throughput.jobs(quick), "search": search.jobs(quick, budget_s),
                      "ablation": ablation.jobs(quick), "sensitivity": sensitivity.jobs(quick)}, show_progress)
    results = {"throughput": throughput.finish(rows["throughput"], quick),
               "search": search.finish(rows["search"], budget_s, quick),
               "ablation": ablation.finish(rows["ablation"]),
               "measured": measured.collect(measured_dir),
               "sensitivity": sensitivity.finish(rows["sensitivity"])}
    results["summary"] = {"section": "summary", **summarize(results["throughput"], results["search"])}
    meta["duration_s"] = time.perf_counter() - t0
    meta["section_s"] = {name: sum(r["job_wall_s"] for r in section) for name, section in rows.items()}
    meta["load_average_end"] = os.getloadavg()[0]
    if loop_start_s is not None:
        meta["reference_loop_s"] = [loop_start_s, reference_loop_s()]
    for name, data in results.items():
        write_json(docs / "benchmarks" / f"eval_{name}.json", {"meta": meta, **data})
    return render_docs(docs)


def render_docs(docs: Path, *, resummarize: bool = False,
                measured_dir: Path | None = None) -> dict[str, dict[str, Any]]:
    """Figures and evaluation.md from the JSON files on disk (never from memory), so they always match.

    ``resummarize`` recomputes eval_summary.json from the section files first (it is derived from them);
    ``measured_dir`` re-copies the measured section from the runtime and fidelity benchmarks' JSON there
    (a copy, nothing is run), so a re-run of those benchmarks reaches the docs without the whole suite.
    """
    if measured_dir is not None:
        meta = load_results(docs)["measured"]["meta"]
        write_json(docs / "benchmarks" / "eval_measured.json", {"meta": meta, **measured.collect(measured_dir)})
    if resummarize:
        old = load_results(docs)
        summary = {"meta": old["summary"]["meta"], "section": "summary",
                   **summarize(old["throughput"], old["search"])}
        write_json(docs / "benchmarks" / "eval_summary.json", summary)
    written = load_results(docs)
    figures.draw_all(written, docs)
    out = docs / "evaluation.md"
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text(render(written))
    tmp.replace(out)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small subset of every section (smoke test)")
    parser.add_argument("--budget-s", type=float, default=None, help="time budget of each exhaustive search "
                        f"(default {FULL_BUDGET_S:g}, quick {QUICK_BUDGET_S:g})")
    parser.add_argument("--docs-dir", type=Path, default=REPO / "docs", help="where evaluation.md, benchmarks/ "
                        "and figures/ are written")
    parser.add_argument("--measured-dir", type=Path, default=None,
                        help="where runtime_cpu.json and fidelity.json are read from (default docs/benchmarks; "
                        "with --render-only, only if given)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--render-only", action="store_true",
                        help="recompute the summary, redraw the figures and evaluation.md from the existing "
                        "JSON (no runs); with --measured-dir, re-copy the measured section from there first")
    args = parser.parse_args()
    if args.render_only:
        render_docs(args.docs_dir, resummarize=True, measured_dir=args.measured_dir)
        print(f"rendered {args.docs_dir / 'evaluation.md'} from {args.docs_dir / 'benchmarks'}/eval_*.json")
        return
    budget_s = args.budget_s if args.budget_s is not None else (QUICK_BUDGET_S if args.quick else FULL_BUDGET_S)
    command = "python benchmarks/evaluate.py" + "".join(f" {a}" for a in sys.argv[1:])
    measured_dir = args.measured_dir or REPO / "docs" / "benchmarks"
    results = evaluate(quick=args.quick, budget_s=budget_s, docs=args.docs_dir, measured_dir=measured_dir,
                       command=command, show_progress=not args.no_progress)
    print(f"wrote {args.docs_dir / 'evaluation.md'} in {results['summary']['meta']['duration_s']:.0f} s")


if __name__ == "__main__":
    main()
