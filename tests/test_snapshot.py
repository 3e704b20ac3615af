"""Memory snapshots: each memory event of a Budget's trace names the op the runtime was running (Event.op)."""

import warnings
from collections import Counter

import pytest
import torch

import coop_arena
from coop_arena.examples import MODELS, batch, loss_fn


def _step(budget, inside=None):
    """One training step of a small MLP under `budget` (a tight one thrashes: the warning says so)."""
    torch.manual_seed(0)
    model = MODELS["mlp"](width=64, depth=8)
    x, y = batch("mlp", 0)
    with budget, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="this step is thrashing", category=RuntimeWarning)
        loss = loss_fn("mlp", model(x), y)
        loss.backward()
        if inside is not None:
            inside(budget)
    return loss


@pytest.fixture(scope="module")
def tight():
    """A Budget of a third of the step's plain peak, after one block: it evicts and recomputes."""
    plain = coop_arena.Budget(1 << 20, device="cpu", headroom=0)
    _step(plain)
    budget = coop_arena.Budget(plain.stats.peak_bytes // 3, device="cpu", headroom=0)
    _step(budget)
    return budget


def test_events_name_the_op_they_were_for(tight):
    ops = Counter(e.op for e in tight.trace)
    assert None not in ops and ops["aten.addmm.default"] > 0 and ops["block exit"] > 0
    ops = [e.op for e in tight.trace]
    exit_from = ops.index("block exit")  # the exit's own events (deaths at the end, copies out) come last
    assert set(ops[exit_from:]) == {"block exit"}


def test_an_optimizer_step_in_the_block_is_the_cause_of_what_it_settles():
    torch.manual_seed(0)
    model = MODELS["mlp"](width=64, depth=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch("mlp", 0)
    budget = coop_arena.Budget(56 << 10, device="cpu", headroom=0)
    with budget, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="this step is thrashing", category=RuntimeWarning)
        out = model(x)  # held across the step, as a training loop holds its outputs for metrics
        loss_fn("mlp", out, y).backward()
        optimizer.step()  # settles what was computed from the parameters it overwrites: frees what none can reach
    assert Counter(e.kind for e in budget.trace if e.op == "SGD.step")["free"] > 0
