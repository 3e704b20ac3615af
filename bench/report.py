"""Turn a pytest-benchmark JSON file into a markdown table with ratios measured in the same run.

    python bench/report.py step_time bench/results/step_time.json > bench/results/step_time.md
"""

from __future__ import annotations

import json
import sys


STEP_TIME_HEAD = """# Step time on the CPU: plain PyTorch against a Budget

Command (one run, all rows side by side; raw numbers in step_time.json; `make bench` runs both):

```
.venv/bin/python -m pytest -q bench/test_step_time.py --benchmark-only --benchmark-json=bench/results/step_time.json
.venv/bin/python bench/report.py step_time bench/results/step_time.json > bench/results/step_time.md
```

Models: GPT-style (vocab 512, d 256, 4 heads, 2 layers, batch 8 x 128) and CNN (32 channels, 5 residual blocks,
batch 16 x 3 x 32 x 32); one forward and backward per step, 1 intra-op thread, median of 5 rounds. No GPU was
available: CPU only. Run to run on a shared 2-core machine the ratios move by a few hundredths.
"""

STEP_TIME_TARGETS = {"ample": 1.10, "half": 1.35}  # the targets: x plain PyTorch's step


def step_time(path: str) -> str:
    """The whole of bench/results/step_time.md: how it was made, the table, and the targets met or missed."""
    data = json.load(open(path))
    rows = {}
    for b in data["benchmarks"]:
        info = b["extra_info"]
        rows.setdefault(info["model"], []).append((info, b["stats"]["median"]))
    out = [STEP_TIME_HEAD,
           f"Machine: {data['machine_info'].get('cpu', {}).get('brand_raw', '?')}, "
           f"{data['machine_info'].get('cpu', {}).get('count', '?')} cores; date {data['datetime']}", "",
           "| model | run | policy | median step (s) | vs plain | evictions | recomputations | compute overhead |",
           "|---|---|---|---|---|---|---|---|"]
    ratios = {config: [] for config in STEP_TIME_TARGETS}
    for model, runs in rows.items():
        plain = next(t for info, t in runs if info["config"] == "plain")
        for info, t in runs:
            if "compute_overhead" not in info:
                out.append(f"| {model} | {info['config']} | - | {t:.4f} | 1.00x | - | - | - |")
                continue
            out.append(f"| {model} | {info['config']} | {info.get('policy') or '-'} | {t:.4f} | {t / plain:.2f}x | "
                       f"{info.get('evictions', '-')} | {info.get('rematerializations', '-')} | "
                       f"{info['compute_overhead']:.2f}x |")
            if info["config"] in ratios:
                ratios[info["config"]].append((t / plain, f"{model} {info.get('policy')}"))
    out += ["", "## Targets", "", "| target | measured | met? |", "|---|---|---|"]
    names = {"ample": "ample budget", "half": "50 % budget"}
    for config, bound in STEP_TIME_TARGETS.items():
        got = ratios[config]
        if got:
            worst = max(got)
            out.append(f"| {names[config]} <= {bound:.2f}x plain | {', '.join(f'{n} {r:.2f}x' for r, n in got)} | "
                       f"{'yes' if worst[0] <= bound else 'no'} |")
    out += ["", "The ample-budget ratio is the Python dispatch of every op (unwrap, place, run into the arena, wrap, "
            "record); it shrinks as ops get larger. At 50 % the compute overhead column is the recomputation's "
            "share (analytic); the rest of the gap is dispatch and the bookkeeping of evictions."]
    return "\n".join(out)


def host_overhead(*paths: str) -> str:
    """us of host CPU time per dispatched aten op and each ratio to the empty mode's: one table with the minimum
    over rounds, one with the mean (the minimum skips the rounds in which Python's cycle collector ran). Given
    several runs' JSON files, a cell is the minimum over all their rounds, or the mean of their means."""
    runs = [json.load(open(path)) for path in paths]
    data = runs[0]
    seen = {b["extra_info"]["config"] for b in data["benchmarks"]}
    configs = [c for c in ("eager", "empty_mode", "wrap_only", "ample-first", "ample-later", "ample-search", "0.6-first",
                           "0.6-later", "0.6-search", "0.5-first", "0.5-later", "0.5-search") if c in seen]
    out = [f"Machine: {data['machine_info'].get('cpu', {}).get('brand_raw', '?')}, "
           f"{data['machine_info'].get('cpu', {}).get('count', '?')} cores; "
           f"date{'s' if len(runs) > 1 else ''} {', '.join(r['datetime'] for r in runs)}; timer "
           f"{data['benchmarks'][0]['options'].get('timer', '?')}"]
    for stat, title in (("min", "minimum over rounds"), ("mean", "mean over rounds")):
        rows, ops = {}, {}
        for run in runs:
            for b in run["benchmarks"]:
                info = b["extra_info"]
                rows.setdefault(info["workload"], {}).setdefault(info["config"], []).append(b["stats"][stat])
                ops[info["workload"]] = info["ops"]
        pick = min if stat == "min" else (lambda v: sum(v) / len(v))
        out += ["", f"us of host time per aten op, {title}{' of ' + str(len(runs)) + ' runs' if len(runs) > 1 else ''} "
                    f"(ratio to the empty dispatch mode):", "",
                "| workload | ops | " + " | ".join(configs) + " | ample-later / eager |",
                "|---|---|" + "---|" * (len(configs) + 1)]
        for w, values in rows.items():
            n, r = ops[w], {c: pick(v) for c, v in values.items()}
            empty = r["empty_mode"] / n
            cells = [f"{r[c] / n * 1e6:.1f} ({r[c] / n / empty:.1f}x)" if c in r else "-" for c in configs]
            plain = f"{r['ample-later'] / r['eager']:.1f}x" if "ample-later" in r and "eager" in r else "-"
            out.append(f"| {w} | {n} | " + " | ".join(cells) + f" | {plain} |")
    return "\n".join(out)


if __name__ == "__main__":
    kind, paths = sys.argv[1], sys.argv[2:]
    print({"step_time": step_time, "host_overhead": host_overhead}[kind](*paths))
