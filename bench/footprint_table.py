"""Profiled footprint of a step under Budgets at 1.0 and 0.5 of plain PyTorch's, per model (Note [Measured
footprint] in coop_arena/footprint.py).

    python -m bench.footprint_table --out bench/results/footprint_after.json

Models: the four example models (coop_arena.examples, tests' sizes) and bench/peer_models.py's GPT and ResNet.
Each trains 4 steps (SGD, lr 0.01) from the same weights; steps 3 and 4 run under `footprint.measure` (the
parameters' gradients left out as model state) and the footprint is the largest of them: the bytes the step
allocated, plus the arena for a Budget (allocated when the Budget was made, before the profile). P is plain
PyTorch's, measured the same way; the Budgets are `Budget(int(r * P), device="cpu")` with their defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import warnings

import torch

import coop_arena
from coop_arena import footprint
from coop_arena.examples import MODELS, batch, loss_fn

from . import peer_models

RATIOS = (1.0, 0.5)


def models():
    for name in ("mlp", "cnn", "gpt", "lstm"):
        torch.manual_seed(0)
        yield name, MODELS[name](), (lambda i, name=name: batch(name, i)), (lambda o, y, n=name: loss_fn(n, o, y))
    for name in ("gpt", "resnet"):
        model, data, lf = getattr(peer_models, name)()
        yield f"peer {name}", model, (lambda i, data=data: data), lf


def measured(model, data, lf, budget, steps=4) -> int:
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = 0
    for i in range(steps):
        x, y = data(i)
        opt.zero_grad()

        def step():
            with budget if budget is not None else contextlib.nullcontext():
                lf(model(x), y).backward()

        if i >= 2:
            fp = footprint.measure(step, keep=lambda: [p.grad for p in model.parameters()])
            out = max(out, fp.excess + (budget.arena.nbytes if budget is not None else 0))
        else:
            step()
        opt.step()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    rows = {}
    for name, model, data, lf in models():
        plain = measured(model, data, lf, None)
        row = {"plain": plain}
        for r in RATIOS:
            try:
                row[str(r)] = measured(model, data, lf, coop_arena.Budget(int(r * plain), device="cpu"))
            except coop_arena.OutOfBudget as e:
                row[str(r)] = f"OutOfBudget: {str(e).splitlines()[0][:120]}"
        rows[name] = row
        print(name, row, flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(version=coop_arena.__file__, torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
