"""Host time of the later steps of the GPT example at its smallest budget, and how many of their ops followed the
first step's decisions (Note [Step replay]): `python bench/replay_smallest.py` (one thread; run it pinned to one
core, beside another engine's checkout with PYTHONPATH pointing at it, to compare the two)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402

import coop_arena  # noqa: E402
from test_exactness import smallest_budget  # noqa: E402
from training import train  # noqa: E402


def main(steps: int = 6) -> None:
    torch.set_num_threads(1)
    for policy in ("coop", "dtr"):
        nbytes = smallest_budget("gpt", policy)
        seen = []
        train("gpt", coop_arena.Budget(nbytes, device="cpu", policy=policy), steps=steps,
              check=lambda b: seen.append((b.stats.replayed_ops, b.stats.ops, time.process_time())))
        later = [seen[i][2] - seen[i - 1][2] for i in range(2, len(seen))]  # steps 3.. (step 2 learns layouts)
        print(f"{policy} budget {nbytes} B: ops followed / ops of steps 2-{steps}: "
              f"{[f'{r}/{n}' for r, n, _ in seen[1:]]}; process seconds per later step: median "
              f"{statistics.median(later):.4f}, min {min(later):.4f}")


if __name__ == "__main__":
    main()
