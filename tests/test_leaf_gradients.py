"""A leaf's gradient is computed outside the arena (Note [Gradients of leaves] in coop_arena/dispatch.py): the
largest weight gradient of a step no longer sets its lower bound."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import coop_arena

HEAD_IN, HEAD_OUT = 512, 1024  # the classifier's weight: 2 MiB, its gradient as large


def vgg_like():
    """Twelve small conv layers (the first with a BatchNorm, for its buffers), then a large Linear classifier
    head, as VGG's: the head's weight gradient is much larger than any activation of a batch of 2."""
    torch.manual_seed(0)
    convs = [m for _ in range(11) for m in (nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())]
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), *convs, nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(HEAD_IN, HEAD_OUT), nn.ReLU(), nn.Linear(HEAD_OUT, 10))


def train(budget, steps=3):
    model = vgg_like()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(2, 3, 16, 16, generator=g), torch.randint(0, 10, (2,), generator=g)
        with budget if budget is not None else torch.enable_grad():
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return model


def test_a_classifier_heads_weight_gradient_does_not_set_the_lower_bound():
    head = HEAD_IN * HEAD_OUT * 4
    plain = train(None)
    probe = coop_arena.Budget(1 << 26, device="cpu")
    train(probe)
    peak, lower_bound = probe.stats.peak_bytes, probe.stats.lower_bound
    # with the gradient in the arena the bound was above its size (and half the peak did not fit)
    assert lower_bound < head // 8, (lower_bound, head)
    assert peak < head // 2  # nor is the gradient in the peak

    budget = coop_arena.Budget(peak // 2, device="cpu")
    model = train(budget)
    st = budget.stats
    assert st.evictions > 0 and st.rematerializations > 0, st
    assert st.peak_bytes <= st.budget and st.lower_bound < head // 8
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain.parameters()))
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), plain.buffers()))
    assert len(list(model.buffers())) == 3  # the BatchNorm's running mean, variance and count


def test_a_weight_with_two_gradients_in_one_backward_gets_their_sum():
    """A weight read by two branches of the loss receives two gradients, which autograd sums before accumulating:
    neither becomes `.grad` as it is (Note [Gradients of leaves]: a leaf that sums several gradients). Whichever
    of them are made outside the arena, every step is bitwise what plain PyTorch computes, with the budget ample
    and at 0.6 of the peak (at half of it the largest op does not fit), and the gradient is a plain tensor."""
    def run(budget):
        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(64, 64) / 8)
        opt = torch.optim.SGD([w], lr=0.01)
        grads = []
        for i in range(3):
            x = torch.randn(64, 64, generator=torch.Generator().manual_seed(i))
            with budget if budget is not None else torch.enable_grad():
                h = x
                for _ in range(4):
                    h = torch.tanh(h @ w)
                (h.sum() + (x @ w.t()).square().mean()).backward()
            grads.append(w.grad.clone())
            opt.step()
            opt.zero_grad()
        return [w.detach().clone(), *grads]

    plain = run(None)
    probe = coop_arena.Budget(1 << 26, device="cpu")
    assert all(type(t) is torch.Tensor and torch.equal(a, t) for a, t in zip(plain, run(probe)))
    budget = coop_arena.Budget(int(0.6 * probe.stats.peak_bytes), device="cpu")
    assert all(type(t) is torch.Tensor and torch.equal(a, t) for a, t in zip(plain, run(budget)))
    assert budget.stats.evictions > 0 and budget.stats.rematerializations > 0


BACKWARDS = {  # how a step starts its backward from the two branches' outputs a and b
    "loss.backward()": lambda a, b: ((a - b).square().sum() + 0.1 * a.sum()).backward(),
    "loss.backward(gradient)": lambda a, b: ((a - b).square().sum() + 0.1 * a.sum()).backward(torch.ones(())),
    "autograd.backward(two roots)": lambda a, b: torch.autograd.backward(
        [(a - b).square().sum(), a], [torch.ones(()), torch.full_like(a, 0.1)]),
}


@pytest.mark.parametrize("backward", list(BACKWARDS))
def test_an_encoder_shared_by_two_branches_of_the_loss_fits_its_budget_by_the_profiler(backward):
    """A siamese encoder: both branches of the loss read every weight, and neither branch lies below the other in
    the autograd graph, so a walk down from the node that first meets a weight does not find its second use. The
    uses are counted from the roots the backward runs from (Note [Gradients of leaves]), whether its gradient is
    implicit, given, or given for several outputs: the two gradients of each weight, summed before they
    accumulate, are temporaries of the step and go in the arena, counted. Made outside the arena instead, they
    were not counted: the step's footprint was 1.4x its budget here (1.6-1.8x on a wider encoder)."""
    import warnings

    from coop_arena import footprint

    def run(budget, steps=4):
        torch.manual_seed(0)
        enc = nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64))
        opt = torch.optim.SGD(enc.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        x1, x2 = torch.randn(256, 128, generator=g), torch.randn(256, 128, generator=g)
        fps = []

        def step():
            with budget if budget is not None else torch.enable_grad():
                BACKWARDS[backward](enc(x1), enc(x2))  # (nothing of the step held at its exit)

        for i in range(steps):
            opt.zero_grad()
            if i == 0 or (budget is not None and budget._observe):  # (the Budget observes its first blocks itself)
                step()
            else:
                fps.append(footprint.measure(step, keep=lambda: [p.grad for p in enc.parameters()]).excess)
            opt.step()
        return list(enc.parameters()), fps

    plain, fps = run(None, steps=6)
    nbytes = int(0.9 * max(fps))
    budget = coop_arena.Budget(nbytes, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", coop_arena.FootprintExceeded)  # the first block's
        params, fps = run(budget, steps=6)
    st = budget.stats
    assert fps and all(st.arena_bytes + fp <= 1.02 * nbytes for fp in fps), (nbytes, st.arena_bytes, fps)
    assert st.evictions > 0 and st.rematerializations > 0, st
    assert all(type(p.grad) is torch.Tensor for p in params)
    assert all(torch.equal(p, q) for p, q in zip(params, plain))
