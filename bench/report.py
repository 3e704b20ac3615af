"""Turn a pytest-benchmark JSON file into a markdown table with ratios measured in the same run.

    python bench/report.py step_time bench/results/step_time.json > bench/results/step_time.md
"""

from __future__ import annotations

import json
import sys


def step_time(path: str) -> str:
    data = json.load(open(path))
    rows = {}
    for b in data["benchmarks"]:
        info = b["extra_info"]
        rows.setdefault(info["model"], []).append((info, b["stats"]["median"]))
    out = [f"Machine: {data['machine_info'].get('cpu', {}).get('brand_raw', '?')}, "
           f"{data['machine_info'].get('cpu', {}).get('count', '?')} cores; date {data['datetime']}", "",
           "| model | run | policy | median step (s) | vs plain | evictions | recomputations | compute overhead |",
           "|---|---|---|---|---|---|---|---|"]
    for model, runs in rows.items():
        plain = next(t for info, t in runs if info["config"] == "plain")
        for info, t in runs:
            out.append(f"| {model} | {info['config']} | {info.get('policy') or '-'} | {t:.4f} | {t / plain:.2f}x | "
                       f"{info.get('evictions', '-')} | {info.get('rematerializations', '-')} | "
                       f"{info['compute_overhead']:.2f}x |" if "compute_overhead" in info else
                       f"| {model} | {info['config']} | - | {t:.4f} | 1.00x | - | - | - |")
    return "\n".join(out)


if __name__ == "__main__":
    kind, path = sys.argv[1], sys.argv[2]
    print({"step_time": step_time}[kind](path))
