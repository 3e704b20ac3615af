"""Compute overhead against the arena's size, in fine steps, for one of bench/peer_models.py's models: where the
policies have cliffs (a slightly larger arena that recomputes much more).

    python -m bench.arena_sweep resnet --headroom-mib 48 --out bench/results/arena_sweep_resnet.md

Each point is a dry run on `meta` (the decisions a CPU run makes, Rule 8) of two training steps under
`Budget(int(r * P), headroom=<headroom>)`, where P is the model's eager footprint as `make peers` measured it
(bench/results/peers.json) and the headroom is fixed at what the learned one is on the CPU (48 MiB for the ResNet),
so the arena is `r * P - headroom`, as in `make peers`. The second step's statistics are reported.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import coop_arena  # noqa: E402
from coop_arena.plan import to_meta  # noqa: E402

from bench.peer_models import MODELS  # noqa: E402

RATIOS = (0.42, 0.44, 0.45, 0.46, 0.47, 0.48, 0.49, 0.50, 0.51, 0.52, 0.54, 0.56, 0.60)
POLICIES = ("coop", "dtr", "dte")


def sweep(name: str, headroom: int, ratios=RATIOS, policies=POLICIES) -> list[dict]:
    model, (x, y), loss_fn = MODELS[name]()
    model = to_meta(copy.deepcopy(model))
    x, y = x.to("meta"), y.to("meta")
    peers = json.loads((Path(__file__).resolve().parent / "results" / "peers.json").read_text())
    P = peers["models"][name]["eager_footprint_bytes"]
    rows = []
    for policy in policies:
        for r in ratios:
            budget = coop_arena.Budget(int(r * P), device="meta", headroom=headroom, policy=policy)
            row = {"policy": policy, "ratio": r, "arena": int(r * P) - headroom}
            try:
                for _ in range(2):
                    model.zero_grad(set_to_none=True)
                    with budget:
                        loss_fn(model(x), y).backward()
                st = budget.stats
                row.update(fits=True, overhead=st.compute_overhead, rematerializations=st.rematerializations,
                           evictions=st.evictions)
            except coop_arena.OutOfBudget:
                row.update(fits=False)
            rows.append(row)
    return rows


def render(name: str, headroom: int, rows: list[dict], seconds: float) -> str:
    out = [f"# Compute overhead against the arena's size: {name}", "",
           f"Command: `python -m bench.arena_sweep {name} --headroom-mib {headroom >> 20}` "
           f"({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {seconds:.0f} s). Dry runs on meta, the "
           f"second of two steps; ratio r = budget / eager's footprint P (bench/results/peers.json), arena = "
           f"r * P - {headroom >> 20} MiB headroom. Cells: compute overhead (rematerializations); '-': OutOfBudget.",
           "", "| ratio | arena MiB | " + " | ".join(POLICIES) + " |", "|---:|---:|" + "---:|" * len(POLICIES)]
    for r in sorted({row["ratio"] for row in rows}):
        cells = []
        for p in POLICIES:
            row = next((x for x in rows if x["ratio"] == r and x["policy"] == p), None)
            cells.append("-" if row is None or not row["fits"]
                         else f"{row['overhead']:.2f}x ({row['rematerializations']})")
        arena = next(x["arena"] for x in rows if x["ratio"] == r)
        out.append(f"| {r:.2f} | {arena / 2**20:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("--headroom-mib", type=int, default=0, help="fixed headroom (MiB), as the CPU learns it")
    ap.add_argument("--out", type=Path, help="write the markdown table here (else print it)")
    args = ap.parse_args(argv)
    t0 = time.time()
    rows = sweep(args.model, args.headroom_mib << 20)
    text = render(args.model, args.headroom_mib << 20, rows, time.time() - t0)
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
