"""Figures drawn from plain data only (matplotlib, no display needed). Of an evaluation, from its results.json:

- overhead.png: compute overhead against memory ratio, one panel per model, one line per configuration (the
  paper's main figure); the lower bound as a dotted vertical line.
- search_fragmentation.png: search latency per eviction event and fragmentation rate, bars per policy at a few
  ratios, for ResNet-50 and U-Net (or the first two models that ran when those are absent).

Of one step, from its memory snapshot (snapshot.py): `occupancy`, the arena's used bytes over the step's memory
events, with evictions, recomputations and moves marked (`coop-arena plan --plot`).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .evaluate import ran, run_at  # noqa: E402
from .snapshot import timeline  # noqa: E402

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


_MARKS = (("evict", "evicted", "C3", "v", 14), ("restore", "recomputed", "C2", "^", 14),
          ("move", "moved (relocation, compaction)", "C1", "d", 14), ("oom", "out of budget", "k", "X", 60))


def occupancy(snapshot: dict, path, title: str = "") -> Path:
    """The arena's used bytes after each memory event of `snapshot` (memory_snapshot's format), its capacity as a
    dashed line, and a mark at each eviction, recomputation (restore), move and out-of-budget event."""
    points = timeline(snapshot)
    capacity = sum(seg["total_size"] for seg in snapshot["segments"])
    unit, scale = next(((u, s) for u, s in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
                        if max(capacity, 1) >= s), ("bytes", 1))
    fig, ax = plt.subplots(figsize=(10, 4.2))
    used = [u / scale for _, u in points]
    ax.step(range(len(used)), used, where="post", color="C0", lw=1.2, label="used")
    ax.axhline(capacity / scale, color="grey", ls="--", lw=1, label="arena")
    counts = []
    for kind, label, color, marker, size in _MARKS:
        at = [i for i, (k, _) in enumerate(points) if k == kind]
        if kind == "move":  # a free at the old address, then an alloc at the new one: marked once, at the alloc
            at = [i for i in at if i == 0 or used[i] > used[i - 1]]
        if at:
            ax.scatter(at, [used[i] for i in at], s=size, color=color, marker=marker, zorder=3,
                       label=f"{label} ({len(at)})")
        counts.append(f"{len(at)} {label.split(' ')[0]}")
    ax.set_xlabel("memory event")
    ax.set_ylabel(f"arena bytes in use ({unit})")
    ax.set_ylim(0, capacity / scale * 1.08 if capacity else None)
    ax.set_title(f"{title or 'Arena occupancy'}: {', '.join(counts)}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
