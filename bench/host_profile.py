"""Where a Budget's host time per op goes: a sampling profile (py-spy) of later blocks of one of
bench/test_host_overhead.py's workloads, summarized per function.

    pip install py-spy
    py-spy record -r 500 -f raw -o /tmp/gpt2.txt -- .venv/bin/python bench/host_profile.py run gpt2_layout ample 20
    .venv/bin/python bench/host_profile.py summary /tmp/gpt2.txt > bench/results/host_profile_gpt2_layout.md

`run` builds the workload, runs a few blocks of one Budget (ample, or a fraction of the plain peak) to settle
it, then runs later blocks for the given seconds inside `_timed`; `summary` keeps only the samples taken inside
`_timed` (so imports and the first blocks are not counted) and lists the functions with the largest share of
them, inclusive (the function and what it calls) and self (the function's own lines).
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _timed(run, budget, seconds: float) -> int:
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
        run(budget)
        n += 1
    return n


def run(name: str, ratio: str, seconds: float) -> None:
    import coop_arena
    from bench.test_host_overhead import _workload  # (sets one thread, as the benchmark runs)
    once, ops, peak = _workload(name)
    nbytes = (1 << 30) if ratio == "ample" else int(float(ratio) * peak)
    budget = coop_arena.Budget(nbytes, device="cpu")
    for _ in range(4):
        once(budget)
    n = _timed(once, budget, seconds)
    print(f"{name} at {ratio}: {n} later blocks of {ops} ops, {budget.stats.evictions} evictions each")


def summary(path: str, top: int = 40) -> str:
    inclusive, own, total = collections.Counter(), collections.Counter(), 0
    for line in open(path):
        stack, count = line.rstrip("\n").rsplit(" ", 1)
        frames = stack.split(";")
        if not any(f.startswith("_timed ") for f in frames):
            continue
        n = int(count)
        total += n
        own[_short(frames[-1])] += n
        for f in {_short(f) for f in frames}:
            inclusive[f] += n
    out = [f"Samples inside the timed loop: {total}", "", "| inclusive | function |", "|---:|---|"]
    out += [f"| {n / total * 100:.1f} % | `{f}` |" for f, n in inclusive.most_common(top)]
    out += ["", "| self | function |", "|---:|---|"]
    out += [f"| {n / total * 100:.1f} % | `{f}` |" for f, n in own.most_common(top)]
    return "\n".join(out)


def _short(frame: str) -> str:
    """`name (path/to/file.py:line)` without the line and with the path from site-packages or the project."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")").rsplit(":", 1)[0]
    for cut in ("site-packages/", "coop_arena/", "bench/"):
        if cut in where:
            where = where[where.index(cut) + (len(cut) if cut == "site-packages/" else 0):]
            break
    return f"{name} ({where})" if where else name


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    else:
        print(summary(sys.argv[2]))
