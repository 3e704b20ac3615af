"""Restoring an op's evicted inputs when they do not fit back all at once (Rule 9's fallback, Note [Restore
plans] in remat.py): the inputs come back one at a time, each by its own plan or, where that plan's pins do not
fit either, pinning only what each replay reads while it runs."""

from __future__ import annotations

import pytest

import coop_arena
from coop_arena import OutOfBudget
from coop_arena import remat as remat_module

from test_relocation import attention_grads
from training import bitwise_equal

pytestmark = pytest.mark.filterwarnings("ignore:this step is thrashing")  # these budgets are at the edge

SHAPE = (8, 16, 64)  # two attention layers whose backward ops read two evicted projections of one size


def _train(budget):
    return attention_grads(SHAPE, budget)


@pytest.fixture(scope="module")
def plain_and_peak():
    probe = coop_arena.Budget(1 << 26, device="cpu")
    _train(probe)
    return _train(None), probe.stats.peak_bytes


@pytest.fixture
def narrow_calls(monkeypatch):
    calls = []
    original = remat_module.Remat._rebuild_narrow

    def spy(self, s, op, **kw):
        calls.append(s.sid)
        return original(self, s, op, **kw)
    monkeypatch.setattr(remat_module.Remat, "_rebuild_narrow", spy)
    return calls


# (policy, percents of the peak): each fits only through the fallback (the joint plans fail at all of them)
CASES = [("coop", range(57, 52, -1)), ("dtr", range(62, 57, -1))]


@pytest.mark.parametrize("policy,percents", CASES, ids=[c[0] for c in CASES])
def test_inputs_restored_in_turn_keep_training_bitwise_exact(plain_and_peak, narrow_calls, policy, percents):
    plain, peak = plain_and_peak
    for percent in percents:
        budget = coop_arena.Budget(peak * percent // 100, device="cpu", policy=policy)
        grads = _train(budget)
        st = budget.stats
        assert bitwise_equal(plain, grads), f"{policy} at {percent} %"
        assert st.restores_in_turn >= 1 and st.rematerializations > 0 and st.peak_bytes <= st.budget
    assert narrow_calls, "some input should have needed the narrow rebuild (its own plan's pins did not fit)"


@pytest.mark.parametrize("policy,percents", CASES, ids=[c[0] for c in CASES])
def test_without_the_fallback_the_same_budgets_fail(plain_and_peak, monkeypatch, policy, percents):
    """The fallback is what makes these budgets fit: with it disabled each fails as before, OutOfBudget from a
    restore, and the Budget stays usable (a larger one then fits)."""
    _, peak = plain_and_peak

    def refuse(self, targets, op, *, plans):
        raise OutOfBudget(1, 1, 0, 0, op)
    monkeypatch.setattr(remat_module.Remat, "_acquire_in_turn", refuse)
    for percent in percents:
        budget = coop_arena.Budget(peak * percent // 100, device="cpu", policy=policy)
        with pytest.raises(OutOfBudget):
            _train(budget)
    monkeypatch.undo()
    budget = coop_arena.Budget(peak * percents[0] // 100, device="cpu", policy=policy)
    _train(budget)
    assert budget.stats.restores_in_turn >= 1
