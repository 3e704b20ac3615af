"""How much of a Budget's host time goes to decisions: what replaying a recorded step could save.

Step replay (apply the first step's placements and evictions to later steps, skipping the search, the cost
model and the bookkeeping that serves decisions) can only remove time spent deciding. This profiles later
blocks of one Budget on the host-overhead workloads (bench/test_host_overhead.py) and sums the time spent
inside the decision modules (memory.py: placement, planning, touches, cost refresh; policy.py and compiled.py:
the window search; blocks.py: the block table; storage.py: records and recompute costs; cost.py: the cost
model). Some of that work (a record per output, the block table) would remain under replay, so the share is an
upper bound. A second column counts only the calls a replay would skip: the search for a plan when nothing fits
(Memory._plan, _move_plan, _relocation_plan, _compaction_plan, with the cost refresh they run), the best-fit
lookup, the marking of stale costs and the cost of each new record. A third, measured without a profiler, is the
eviction search's own clock (`stats.search_seconds`) against the wall time of the same blocks.

    PYTHONPATH=. .venv/bin/python bench/decision_share.py > bench/results/decision_share.md
"""

from __future__ import annotations

import cProfile
import datetime
import pstats
import time

import torch

import coop_arena
from bench import test_host_overhead as host

DECISIONS = ("coop_arena/memory.py", "coop_arena/policy.py", "coop_arena/compiled.py", "coop_arena/blocks.py",
             "coop_arena/storage.py", "coop_arena/cost.py")


# What a replay would skip: (function, the callers it is counted under, or None for all of its calls). Each is
# counted once, by its cumulative time; recompute_cost only where a new record is placed (the cost refresh
# inside _plan calls it too, and is counted there).
SKIPPED = (("_plan", None), ("_move_plan", None), ("_relocation_plan", None), ("_compaction_plan", None),
           ("best_fit", None), ("_mark_dependents", None), ("recompute_cost", "_place"))


def share(name: str, ratio: str) -> tuple[float, float, float, float]:
    """(seconds of own time in all functions, share of it inside the decision modules, share in the calls a
    replay would skip, eviction search's share of the wall time without a profiler) over 3 later blocks."""
    run, _, peak = host._workload(name)
    budget = coop_arena.Budget((1 << 30) if ratio == "ample" else int(float(ratio) * peak), device="cpu")
    run(budget)  # the first block: caches filled, as for every later step
    wall = search = 0.0
    for _ in range(3):
        start = time.perf_counter()
        run(budget)
        wall += time.perf_counter() - start
        search += budget.stats.search_seconds
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3):
        run(budget)
    profile.disable()
    stats = pstats.Stats(profile).stats
    total = sum(v[2] for v in stats.values())
    decided = sum(v[2] for k, v in stats.items() if k[0].endswith(DECISIONS))
    skipped = 0.0
    for (path, _, func), (_, _, _, cumulative, callers) in stats.items():
        for name_, caller in SKIPPED:
            if func == name_ and path.endswith(DECISIONS):
                skipped += cumulative if caller is None else sum(
                    v[3] for k, v in callers.items() if k[2] == caller)
    return total, decided / total, skipped / total, search / wall


def main() -> None:
    torch.set_num_threads(1)
    print("Command: `PYTHONPATH=. .venv/bin/python bench/decision_share.py > bench/results/decision_share.md`")
    print(f"\nDate {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; cProfile, "
          "3 later blocks of one Budget per row (profiling roughly doubles the time; shares, not times, are the result)\n")
    print("| workload | budget | profiled s | share in decision modules | share in what a replay skips | "
          "eviction search / wall time |")
    print("|---|---|---|---|---|---|")
    for name in host.WORKLOADS:
        for ratio in ("ample", "0.6", "0.5"):
            if name == "add_chain_2000" and ratio != "ample":
                continue  # as in the benchmark: a fraction of its peak is below one op's working set
            total, frac, skipped, search = share(name, ratio)
            print(f"| {name} | {ratio} | {total:.2f} | {frac:.1%} | {skipped:.1%} | {search:.1%} |")


if __name__ == "__main__":
    main()
