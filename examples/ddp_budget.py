"""Data-parallel training with a memory budget per rank: DistributedDataParallel, unchanged, on CPU ranks (gloo).

    torchrun --standalone --nproc-per-node 2 examples/ddp_budget.py                 # half of each rank's peak
    torchrun --standalone --nproc-per-node 2 examples/ddp_budget.py --fraction 0.3
    torchrun --standalone --nproc-per-node 2 examples/ddp_budget.py --starve-rank 1 # rank 1 runs out of budget

Each rank measures its own plain peak (one step under a Budget too large to evict, same engine), then trains
under `fraction` of it. A rank whose step fails (OutOfBudget, or a collective whose peer has left) destroys
its process group, so that the peers' pending collectives fail at once rather than at the group's timeout,
and re-raises: torchrun then stops every rank and reports the failure.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import coop_arena
from coop_arena.examples import GPT


def step(ddp, budget, x, y):
    with budget:
        logits = ddp(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
    return loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fraction", type=float, default=0.5, help="budget per rank, as a fraction of its plain peak")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--policy", default="coop", choices=["coop", "dtr", "dte"])
    p.add_argument("--starve-rank", type=int, default=None, help="give this rank a budget of 1 KiB (shows the teardown)")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # bounds a wait on a hung rank
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = GPT(layers=6)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    data = [(torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g))
            for _ in range(args.steps + 1)]

    probe = coop_arena.Budget(1 << 30, device="cpu", policy=args.policy)
    step(ddp, probe, *data[0])  # the plain peak of this rank's step, measured by the same engine
    opt.zero_grad()
    nbytes = 1024 if rank == args.starve_rank else int(args.fraction * probe.stats.peak_bytes)
    budget = coop_arena.Budget(nbytes, device="cpu", policy=args.policy)

    for i in range(args.steps):
        opt.zero_grad()
        try:
            loss = step(ddp, budget, *data[i + 1])
        except Exception as e:
            print(f"rank {rank}: step {i} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            dist.destroy_process_group()  # peers waiting on this rank in a collective fail now
            raise
        opt.step()
        s = budget.stats
        print(f"rank {rank} step {i}: loss {loss:.4f}, budget {s.budget} bytes ({args.fraction:.0%} of "
              f"{probe.stats.peak_bytes}), peak {s.peak_bytes}, {s.evictions} evictions, "
              f"{s.rematerializations} rematerializations, overhead {s.compute_overhead:.2f}x", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
