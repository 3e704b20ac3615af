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


def host_overhead(path: str) -> str:
    """us of host CPU time per dispatched aten op (minimum over rounds), and each ratio to the empty mode's."""
    data = json.load(open(path))
    rows, ops = {}, {}
    for b in data["benchmarks"]:
        info = b["extra_info"]
        rows.setdefault(info["workload"], {})[info["config"]] = (b["stats"]["min"], info)
        ops[info["workload"]] = info["ops"]
    configs = ["eager", "empty_mode", "ample-first", "ample-later", "0.6-first", "0.6-later", "0.5-first",
               "0.5-later"]
    out = [f"Machine: {data['machine_info'].get('cpu', {}).get('brand_raw', '?')}, "
           f"{data['machine_info'].get('cpu', {}).get('count', '?')} cores; date {data['datetime']}; timer "
           f"{data['benchmarks'][0]['options'].get('timer', '?')}", "",
           "us of host time per aten op (ratio to the empty dispatch mode):", "",
           "| workload | ops | " + " | ".join(configs) + " |", "|---|---|" + "---|" * len(configs)]
    for w, r in rows.items():
        n = ops[w]
        empty = r["empty_mode"][0] / n
        cells = []
        for c in configs:
            if c not in r:
                cells.append("-")
                continue
            us = r[c][0] / n
            cells.append(f"{us * 1e6:.1f} ({us / empty:.1f}x)")
        out.append(f"| {w} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    kind, path = sys.argv[1], sys.argv[2]
    print({"step_time": step_time, "host_overhead": host_overhead}[kind](path))
