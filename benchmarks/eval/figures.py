"""PNG figures, drawn from the section results only (so they always match the JSON)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


COLORS = {"eth": "#1b7837", "eth-robust": "#7fbf7b", "eth-1f1b": "#d9f0d3", "layer-balanced": "#762a83",
          "uniform": "#999999", "layer-balanced-best-type": "#c2a5cf", "uniform-best-type": "#d9d9d9"}


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def throughput(section: dict[str, Any], docs: Path) -> None:
    """One grouped bar chart per cluster: each method's simulated tokens/s at nominal speeds per model and
    samples per GPU, as a share of the physical limit (so models of different sizes share one axis)."""
    methods = section["methods"]
    for cluster in section["clusters"]:
        rows = [r for r in section["rows"] if r["cluster"] == cluster["key"]]
        fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * len(rows) + 2), 4))
        width = 0.8 / len(methods)
        for i, method in enumerate(methods):
            xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(rows))]
            ys = [r["methods"][method]["nominal"]["balance_efficiency"] if r["methods"][method]["feasible"] else 0.0
                  for r in rows]
            ax.bar(xs, ys, width, label=method, color=COLORS[method])
        for j, r in enumerate(rows):
            if not any(v["feasible"] for v in r["methods"].values()):
                ax.text(j, 0.05, "does not fit", ha="center", fontsize=7, rotation=90)
        ax.set_xticks(range(len(rows)), [f"{r['model']}\n{r['samples_per_gpu']}/GPU" for r in rows], fontsize=6)
        ax.set_ylim(0, 1.15)
        ax.axhline(1.0, color="black", lw=0.8, ls=":")
        ax.set_ylabel("balance efficiency (limit / simulated time)")
        ax.set_title(f"{cluster['label']}, nominal speeds", fontsize=9)
        ax.legend(fontsize=7, ncol=len(methods), loc="upper right")
        _save(fig, docs / cluster["figure"])


def _label(cond: dict[str, Any]) -> str:
    return "nominal speeds" if cond["which"] is None else f"{cond['which']} type at {cond['speed']:g}x"


def speedups(section: dict[str, Any], docs: Path) -> None:
    """eth's speedup over each baseline per case, by samples per GPU and condition, static (hollow) and
    rebalanced (filled), with the geometric mean of each group as a bar."""
    pairs = [p for p in ("eth / best-baseline", "eth / layer-balanced", "eth / uniform") if p in section["pairs"]]
    conds, spgs, rows = section["conditions"], section["samples_per_gpu"], section["rows"]
    fig, axes = plt.subplots(len(pairs), len(conds), figsize=(4 * len(conds), 3.2 * len(pairs)), squeeze=False)
    for i, pair in enumerate(pairs):
        for j, cond in enumerate(conds):
            ax = axes[i][j]
            for k, spg in enumerate(spgs):
                for mode, dx, face in (("static", -0.15, "none"), ("rebalanced", 0.15, COLORS["eth"])):
                    vals = [r["speedup"][mode][cond["key"]][pair] for r in rows if r["samples_per_gpu"] == spg]
                    vals = [v for v in vals if v is not None]
                    if not vals:
                        continue
                    xs = [k + dx + 0.08 * ((n % 5) - 2) / 2 for n in range(len(vals))]
                    ax.scatter(xs, vals, s=12, facecolors=face, edgecolors=COLORS["eth"], lw=0.8,
                               label=("without rebalancing" if mode == "static" else "with rebalancing")
                               if k == 0 else None)
                    geo = math.exp(sum(math.log(v) for v in vals) / len(vals))
                    ax.plot([k + dx - 0.1, k + dx + 0.1], [geo, geo], color="black", lw=1.5)
            ax.axhline(1.0, color="black", lw=0.8, ls=":")
            ax.set_yscale("log")
            ax.set_xticks(range(len(spgs)), [f"{s}/GPU" for s in spgs])
            ax.set_title(f"{pair}, {_label(cond)}", fontsize=8)
            if j == 0:
                ax.set_ylabel("simulated speedup (bar: geo-mean)")
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    _save(fig, docs / section["figures"]["speedups"])


def rebalance(section: dict[str, Any], docs: Path) -> None:
    """Tokens/s with over without online rebalancing, per method and condition, one dot per case."""
    conds, methods, rows = section["conditions"], section["methods"], section["rows"]
    fig, axes = plt.subplots(1, len(conds), figsize=(4 * len(conds), 3.4), squeeze=False, sharey=True)
    for j, cond in enumerate(conds):
        ax = axes[0][j]
        for i, method in enumerate(methods):
            vals = [r["methods"][method]["replay"][cond["key"]]["rebalanced"]["tokens_per_s"]
                    / r["methods"][method]["replay"][cond["key"]]["static"]["tokens_per_s"]
                    for r in rows if r["methods"][method]["feasible"]]
            xs = [i + 0.3 * (((n * 7) % 11) / 10 - 0.5) for n in range(len(vals))]
            ax.scatter(xs, vals, s=10, color=COLORS[method])
        ax.axhline(1.0, color="black", lw=0.8, ls=":")
        ax.set_yscale("log")
        ax.set_xticks(range(len(methods)), methods, fontsize=7, rotation=20)
        ax.set_title(_label(cond), fontsize=8)
        if j == 0:
            ax.set_ylabel("tokens/s with / without rebalancing")
    _save(fig, docs / section["figures"]["rebalance"])


def search_time(section: dict[str, Any], docs: Path) -> None:
    rows = section["scale"]
    gpus = [r["gpus"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    series = (("eth", [r["eth"]["planning_s"] for r in rows], [False] * len(rows), COLORS["eth"]),
              ("layer-balanced (exhaustive)", [r["layer_balanced"]["planning_s"] for r in rows],
               [r["layer_balanced"]["timed_out"] for r in rows], COLORS["layer-balanced"]),
              ("eth space (exhaustive)", [r["exhaustive_eth"]["planning_s"] for r in rows],
               [r["exhaustive_eth"]["timed_out"] for r in rows], "#d95f02"))
    for label, ys, capped, color in series:
        ax.plot(gpus, ys, marker="o", label=label, color=color)
        hit = [(g, y) for g, y, c in zip(gpus, ys, capped) if c]
        if hit:
            ax.scatter(*zip(*hit), marker="x", s=80, color="red", zorder=3)
    ax.axhline(section["budget_s"], color="red", lw=0.8, ls="--", label="time budget (x = timed out)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.set_yscale("log")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("planning time (s)")
    ax.legend(fontsize=8)
    _save(fig, docs / section["figure"])


def ablation(section: dict[str, Any], docs: Path) -> None:
    names = section["variant_names"]
    rows = section["rows"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / max(len(names), 1)
    lowest = 1.0
    for i, name in enumerate(names):
        ys = [r["variants"].get(name, {}).get("relative") or 0.0 for r in rows]
        lowest = min([lowest] + [y for y in ys if y > 0])
        ax.bar([j + (i - (len(names) - 1) / 2) * width for j in range(len(rows))], ys, width, label=name)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylim(max(0.0, lowest - 0.1), None)
    ax.set_xticks(range(len(rows)), [f"{r['cluster']}\n{r['model']}" for r in rows], fontsize=7)
    ax.set_ylabel("tokens/s relative to full eth (0 = not run)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    _save(fig, docs / section["figure"])


def sensitivity(section: dict[str, Any], docs: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, sweep, xlabel in ((axes[0], "speed_ratio", "speed ratio fast / slow GPU"),
                              (axes[1], "nic_gbit_s", "inter-node NIC (Gbit/s per node)")):
        points = section["sweeps"][sweep]["points"]
        xs = [p["x"] for p in points]
        for baseline in ("layer-balanced", "uniform"):
            ys = [p["speedup"][baseline] if p["speedup"][baseline] is not None else float("nan") for p in points]
            ax.plot(xs, ys, marker="o", label=f"eth / {baseline}", color=COLORS[baseline])
        ax.axhline(1.0, color="black", lw=0.8)
        if sweep == "nic_gbit_s":
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("speedup (simulated)")
        ax.legend(fontsize=8)
    _save(fig, docs / section["figure"])


def draw_all(results: dict[str, dict[str, Any]], docs: Path) -> None:
    throughput(results["throughput"], docs)
    speedups(results["throughput"], docs)
    rebalance(results["throughput"], docs)
    search_time(results["search"], docs)
    ablation(results["ablation"], docs)
    sensitivity(results["sensitivity"], docs)
