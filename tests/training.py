"""One training harness for plain PyTorch and for a Budget, so the two runs differ only in the Budget."""

from __future__ import annotations

import contextlib

import torch

from coop_arena.examples import MODELS, batch, loss_fn


def build(name: str, device="cpu"):
    torch.manual_seed(0)
    return MODELS[name]().to(device)


def train(name: str, budget=None, steps: int = 3, device="cpu", check=None, inside=None):
    """Train `steps` SGD-with-momentum steps; returns the model. `inside(budget)` runs at the end of each
    block, `check(budget)` after it."""
    model = build(name, device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for i in range(steps):
        x, y = batch(name, i, device)
        torch.manual_seed(100 + i)  # dropout draws the same bits in both runs
        opt.zero_grad()
        with budget if budget is not None else contextlib.nullcontext():
            loss = loss_fn(name, model(x), y)
            loss.backward()
            if inside is not None:
                inside(budget)
        if check is not None:
            check(budget)
        opt.step()
    return model


def state(model) -> list[torch.Tensor]:
    """Parameters and buffers (BatchNorm running statistics included)."""
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def bitwise_equal(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))
