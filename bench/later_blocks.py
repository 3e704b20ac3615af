"""Host time per aten op of the later (replayed) blocks of the host-overhead workloads, at an ample budget and at
60 % and 50 % of the plain peak: the minimum over rounds of process time, as bench/test_host_overhead.py's
`later` columns, without the other columns (a quick before/after check of a change to the per-op path).

    taskset -c 0 python bench/later_blocks.py            # this checkout
    PYTHONPATH=/path/to/other taskset -c 1 python /path/to/other/bench/later_blocks.py   # beside it, at once

Run the two engines at the same time on different cores, then again with the cores swapped: these machines are
shared, and only runs side by side compare."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import coop_arena  # noqa: E402
from bench.test_host_overhead import _workload  # noqa: E402

WORKLOADS = ("mlp_200x8", "gpt2_layout", "resnet50_layout")
RATIOS = ("ample", "0.6", "0.5")


def main(rounds: int = 7) -> None:
    torch.set_num_threads(1)
    print(f"# coop_arena from {Path(coop_arena.__file__).parent}")
    for name in WORKLOADS:
        run, ops, peak = _workload(name)
        for ratio in RATIOS:
            budget = coop_arena.Budget((1 << 30) if ratio == "ample" else int(float(ratio) * peak), device="cpu")
            run(budget)  # the first block: recorded
            times = []
            for _ in range(rounds):
                t = time.process_time()
                run(budget)
                times.append(time.process_time() - t)
            st = budget.stats
            if st.replayed_ops != st.ops:
                raise SystemExit(f"{name} at {ratio}: {st.replayed_ops} of {st.ops} ops followed the recording")
            print(f"{name} {ratio} {min(times) / ops * 1e6:.1f} us/op (evictions {st.evictions})", flush=True)


if __name__ == "__main__":
    main()
