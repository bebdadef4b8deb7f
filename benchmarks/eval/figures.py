"""PNG figures, drawn from the section results only (so they always match the JSON)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from eval.common import METHODS  # noqa: E402

COLORS = {"eth": "#1b7837", "layer-balanced": "#762a83", "uniform": "#999999"}


def _save(fig: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def throughput(section: dict[str, Any], docs: Path) -> None:
    """One grouped bar chart per cluster: simulated tokens/s per model and method, as a share of the
    physical limit (so models of different sizes share one linear axis), with eth's speedups on top."""
    for cluster in section["clusters"]:
        rows = [r for r in section["rows"] if r["cluster"] == cluster["key"]]
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(METHODS)
        for i, method in enumerate(METHODS):
            xs = [j + (i - 1) * width for j in range(len(rows))]
            ys = [r["methods"][method]["tokens_per_s"] / r["ideal_tokens_per_s"] if r["methods"][method]["feasible"]
                  else 0.0 for r in rows]
            ax.bar(xs, ys, width, label=method, color=COLORS[method])
        for j, r in enumerate(rows):
            if r["methods"]["eth"]["feasible"]:
                text = "\n".join(f"{v:.2f}x" for v in r["speedup"].values() if v is not None)
                ax.text(j - width, r["methods"]["eth"]["balance_efficiency"] + 0.02, text, ha="center", fontsize=7)
            else:
                ax.text(j, 0.05, "does not fit", ha="center", fontsize=8, rotation=90)
        ax.set_xticks(range(len(rows)), [r["model"] for r in rows])
        ax.set_ylim(0, 1.25)
        ax.axhline(1.0, color="black", lw=0.8, ls=":")
        ax.set_ylabel("simulated tokens/s / physical limit")
        ax.set_title(f"{cluster['label']} (labels: eth / layer-balanced, eth / uniform)", fontsize=9)
        ax.legend(fontsize=8, ncol=3, loc="upper right")
        _save(fig, docs / cluster["figure"])


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
    search_time(results["search"], docs)
    ablation(results["ablation"], docs)
    sensitivity(results["sensitivity"], docs)
