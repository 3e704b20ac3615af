"""Step time of 2-rank DistributedDataParallel on the CPU (gloo), plain and under a Budget per rank.

    torchrun --standalone --nproc-per-node 2 bench/ddp.py [--steps 15] [--out bench/results/ddp.md]

Three runs side by side in one process per rank, their steps interleaved (one step of each in turn) so that
a change in the machine's load falls on all three alike: plain DDP, and DDP under a Budget of 100 % and 50 %
of the rank's plain peak (measured first by the same engine with a budget too large to evict). The model is
the demo's GPT (4 layers, d 128, 8 x 128 tokens per rank); dropout draws the same bits in every run. Rank 0
writes the medians, the ratios to plain, the evictions per step, and the command to `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import coop_arena
from coop_arena.examples import GPT

VOCAB, SEQ, BATCH = 256, 128, 8


class Run:
    def __init__(self, name: str, budget):
        torch.manual_seed(0)
        self.model = GPT(vocab=VOCAB, d=128, heads=4, layers=4, seq=SEQ)
        self.ddp = DDP(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3, momentum=0.9)
        self.name, self.budget, self.seconds, self.evictions = name, budget, [], []

    def step(self, x, y, seed: int) -> float:
        torch.manual_seed(seed)
        self.opt.zero_grad()
        dist.barrier()  # both ranks start the step together
        start = time.perf_counter()
        with self.budget if self.budget is not None else contextlib.nullcontext():
            logits = self.ddp(x)
            F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
        self.opt.step()
        return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15, help="timed steps per run (after 2 warm-up steps)")
    p.add_argument("--out", default="bench/results/ddp.md")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    data = [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(args.steps + 2)]

    probe = Run("probe", coop_arena.Budget(1 << 31, device="cpu"))
    probe.step(*data[0], seed=0)
    peak = probe.budget.stats.peak_bytes
    runs = [Run("plain DDP", None), Run("Budget 100 %", coop_arena.Budget(peak, device="cpu")),
            Run("Budget 50 %", coop_arena.Budget(peak // 2, device="cpu"))]
    for i, (x, y) in enumerate(data):
        for run in runs:
            seconds = run.step(x, y, seed=100 + i)
            if i >= 2:
                run.seconds.append(seconds)
                run.evictions.append(run.budget.stats.evictions if run.budget is not None else 0)
    states = [[p.detach() for p in run.model.parameters()] for run in runs]
    exact = all(torch.equal(a, b) for s in states[1:] for a, b in zip(states[0], s))
    dist.destroy_process_group()
    if rank != 0:
        return
    base = statistics.median(runs[0].seconds)
    lines = [
        "# 2-rank DDP step time on the CPU, plain and under a Budget per rank",
        "",
        f"Command: `torchrun --standalone --nproc-per-node {world} bench/ddp.py --steps {args.steps}` "
        f"({datetime.date.today()}, torch {torch.__version__}, {os.cpu_count()} CPUs, 1 thread per rank, "
        f"load average {os.getloadavg()[0]:.1f} at the end).",
        "",
        f"Model: the demo's GPT (4 layers, d 128, vocab {VOCAB}), {BATCH} x {SEQ} tokens per rank, SGD; plain peak "
        f"of a step on rank 0 measured by the same engine: {peak} bytes ({peak / 2**20:.2f} MiB). Median of "
        f"{args.steps} steps after 2 warm-up steps, the three runs' steps interleaved. Parameters after the "
        f"last step bitwise equal across the three runs: {exact}.",
        "",
        "| run | median step (ms) | vs plain DDP | evictions per step (rank 0) |",
        "|---|---|---|---|",
    ]
    for run in runs:
        med = statistics.median(run.seconds)
        lines.append(f"| {run.name} | {med * 1e3:.1f} | {med / base:.2f}x | {statistics.median(run.evictions):.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
