"""How much of a Budget's host time goes to decisions: an upper bound on what replaying a recorded step could save.

Step replay (apply the first step's placements and evictions to later steps, skipping the search, the cost
model and the bookkeeping that serves decisions) can only remove time spent deciding. This profiles later
blocks of one Budget on the host-overhead workloads (bench/test_host_overhead.py) and sums the time spent
inside the decision modules (memory.py: placement, planning, touches, cost refresh; policy.py and compiled.py:
the window search; blocks.py: the block table; storage.py: records and recompute costs; cost.py: the cost
model). Some of that work (a record per output, the block table) would remain under replay, so the share is an
upper bound.

    PYTHONPATH=. .venv/bin/python bench/decision_share.py > bench/results/decision_share.md
"""

from __future__ import annotations

import cProfile
import datetime
import pstats

import torch

import coop_arena
from bench import test_host_overhead as host

DECISIONS = ("coop_arena/memory.py", "coop_arena/policy.py", "coop_arena/compiled.py", "coop_arena/blocks.py",
             "coop_arena/storage.py", "coop_arena/cost.py")


def share(name: str, ratio: str) -> tuple[float, float]:
    """(seconds of own time in all functions, share of it inside the decision modules) over 3 later blocks."""
    run, _, peak = host._workload(name)
    budget = coop_arena.Budget((1 << 30) if ratio == "ample" else int(float(ratio) * peak), device="cpu")
    run(budget)  # the first block: caches filled, as for every later step
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(3):
        run(budget)
    profile.disable()
    stats = pstats.Stats(profile).stats
    total = sum(v[2] for v in stats.values())
    decided = sum(v[2] for k, v in stats.items() if k[0].endswith(DECISIONS))
    return total, decided / total


def main() -> None:
    torch.set_num_threads(1)
    print("Command: `PYTHONPATH=. .venv/bin/python bench/decision_share.py > bench/results/decision_share.md`")
    print(f"\nDate {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}; cProfile, "
          "3 later blocks of one Budget per row (profiling roughly doubles the time; shares, not times, are the result)\n")
    print("| workload | budget | profiled s | share in decision modules |")
    print("|---|---|---|---|")
    for name in host.WORKLOADS:
        for ratio in ("ample", "0.6"):
            if name == "add_chain_2000" and ratio != "ample":
                continue  # as in the benchmark: a fraction of its peak is below one op's working set
            total, frac = share(name, ratio)
            print(f"| {name} | {ratio} | {total:.2f} | {frac:.1%} |")


if __name__ == "__main__":
    main()
