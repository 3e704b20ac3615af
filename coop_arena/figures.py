"""Figures of an evaluation, drawn from its results.json data only (matplotlib, no display needed):

- overhead.png: compute overhead against memory ratio, one panel per model, one line per configuration (the
  paper's main figure); the lower bound as a dotted vertical line.
- search_fragmentation.png: search latency per eviction event and fragmentation rate, bars per policy at a few
  ratios, for ResNet-50 and U-Net (or the first two models that ran when those are absent).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .evaluate import ran, run_at  # noqa: E402

STYLE = {"coop": dict(color="C3", lw=2.2, marker="o"), "dtr": dict(color="C0", marker="s"),
         "dte": dict(color="C2", marker="^"), "coop-no-partition": dict(color="C1", ls="--", marker="."),
         "coop-no-window": dict(color="C4", ls="--", marker="."), "coop-no-inplace": dict(color="C5", ls=":",
                                                                                       marker="."),
         "coop-no-relocation": dict(color="C7", ls="-.", marker=".")}


def overhead(results: dict, path: Path) -> Path:
    models = ran(results)
    n = max(len(models), 1)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    for ax, (name, m) in zip(axes.flat, models.items()):
        for config, data in m["runs"].items():
            pts = [(r["ratio"], r["compute_overhead"]) for r in data["runs"] if r["fits"]]
            if pts:
                ax.plot(*zip(*pts), label=config, ms=3.5, **STYLE.get(config, {}))
        ax.axvline(m["lower_bound_ratio"], color="grey", ls=":", lw=1)
        ax.set_title(f"{name} (batch {m['batch']})", fontsize=10)
        ax.set_xlim(1.02, 0.0)
        ax.set_xlabel("memory ratio")
        ax.set_ylabel("compute overhead")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.suptitle("Compute overhead vs memory ratio (dotted: lower bound)", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def search_fragmentation(results: dict, path: Path, models=("resnet50", "unet"), ratios=(0.8, 0.6, 0.4),
                         policies=("coop", "dtr", "dte")) -> Path:
    ok = ran(results)
    chosen = [m for m in models if m in ok] or list(ok)[:2]
    fig, axes = plt.subplots(2, max(len(chosen), 1), figsize=(5.2 * max(len(chosen), 1), 6.4), squeeze=False)
    metrics = (("search_seconds_per_event", 1e6, "search latency per eviction (µs)"),
               ("fragmentation", 1.0, "fragmentation rate"))
    for col, name in enumerate(chosen):
        present = [p for p in policies if p in ok[name]["runs"]]
        width = 0.8 / max(len(present), 1)
        for row, (key, scale, label) in enumerate(metrics):
            ax = axes[row][col]
            for k, p in enumerate(present):
                hits = [run_at(ok[name], p, ratio) for ratio in ratios]
                vals = [0.0 if r is None else r[key] * scale for r in hits]
                xs = [i + (k - (len(present) - 1) / 2) * width for i in range(len(ratios))]
                ax.bar(xs, vals, width, label=p, color=STYLE.get(p, {}).get("color"))
            ax.set_xticks(range(len(ratios)), [f"{r:g}" for r in ratios])
            ax.set_xlabel("memory ratio (no bar: does not fit, or no eviction)")
            ax.set_ylabel(label)
            ax.set_title(name, fontsize=10)
            ax.grid(axis="y", alpha=0.3)
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw(results: dict, out: Path) -> list[Path]:
    return [overhead(results, out / "overhead.png"), search_fragmentation(results, out / "search_fragmentation.png")]
