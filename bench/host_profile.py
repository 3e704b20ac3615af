"""Where a Budget's host time per op goes: a sampling profile (py-spy) of later blocks of one of
bench/test_host_overhead.py's workloads, summarized per function.

    pip install py-spy
    py-spy record -r 500 -f raw -o /tmp/gpt2.txt -- .venv/bin/python bench/host_profile.py run gpt2_layout ample 20
    .venv/bin/python bench/host_profile.py summary /tmp/gpt2.txt > bench/results/host_profile_gpt2_layout.md

`run` builds the workload, runs a few blocks of one Budget (ample, or a fraction of the plain peak) to settle
it, then runs later blocks for the given seconds inside `_timed`; `summary` keeps only the samples taken inside
`_timed` (so imports and the first blocks are not counted) and lists the functions with the largest share of
them, inclusive (the function and what it calls) and self (the function's own lines).

    pip install line_profiler
    .venv/bin/python bench/host_profile.py lines gpt2_layout ample 3 > bench/results/host_lines_gpt2_layout.txt

`lines` times every line of the per-op path's main functions (LINES) over that many later blocks, with their hit
counts: where the time of one op goes, line by line (deterministic, but line timing slows the path about 2x,
so read the shares, not the absolute times).
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


def _settled(name: str, ratio: str):
    """(one block of the workload, its ops, a Budget at `ratio` settled by four blocks)."""
    import coop_arena
    from bench.test_host_overhead import _workload  # (sets one thread, as the benchmark runs)
    once, ops, peak = _workload(name)
    nbytes = (1 << 30) if ratio == "ample" else int(float(ratio) * peak)
    budget = coop_arena.Budget(nbytes, device="cpu")
    for _ in range(4):
        once(budget)
    return once, ops, budget


def run(name: str, ratio: str, seconds: float) -> None:
    once, ops, budget = _settled(name, ratio)
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


# (module, qualified name) of the functions `lines` times: the per-op path, from the dispatch mode to the wrappers
LINES = [("budget", "_Mode._dispatch"), ("dispatch", "Dispatch.run"), ("dispatch", "Dispatch._run_functional"),
         ("dispatch", "Dispatch._run_direct"), ("dispatch", "Dispatch._bind"), ("dispatch", "Dispatch._run_view"),
         ("dispatch", "Dispatch._wrap_alias"), ("dispatch", "Dispatch._placed"), ("dispatch", "Dispatch.owners"),
         ("dispatch", "Dispatch.arena_arg"), ("memory", "Memory.allocate"), ("memory", "Memory._place"),
         ("memory", "Memory.note_op"), ("lifetime", "Lifetime.wrap"), ("lifetime", "Lifetime.drain"),
         ("recipe", "Recipe.make"), ("remat", "Remat.acquire"), ("remat", "Remat.release")]


def lines(name: str, ratio: str, blocks: int) -> None:
    import importlib

    from line_profiler import LineProfiler

    once, ops, budget = _settled(name, ratio)
    profiler = LineProfiler()
    for module, qualname in LINES:
        obj = importlib.import_module(f"coop_arena.{module}")
        for part in qualname.split("."):
            obj = getattr(obj, part)
        profiler.add_function(obj)
    profiler.enable_by_count()
    for _ in range(blocks):
        once(budget)
    profiler.disable_by_count()
    print(f"{name} at {ratio}: {blocks} later blocks of {ops} ops each, {budget.stats.evictions} evictions each")
    profiler.print_stats(output_unit=1e-6, stripzeros=True)


if __name__ == "__main__":
    if sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    elif sys.argv[1] == "lines":
        lines(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        print(summary(sys.argv[2]))
