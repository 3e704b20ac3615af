"""Step replay (Note [Step replay] in coop_arena/replay.py): a later block of a Budget follows the decisions of the
block before it while it runs the same step, and falls back to the normal path at the first difference. Either
way, the trace, the stats and the trained parameters are exactly those of `replay=False`. The arena is the
whole budget (`headroom=0`) so that every block after the first runs in the same arena (a learned headroom
restarts replay each time it resizes the arena: Note [Headroom])."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

import coop_arena
from training import bitwise_equal, state, train

UNTIMED = lambda st: {k: v for k, v in st.as_dict().items()  # noqa: E731
                      if not k.startswith("search_seconds") and k != "replayed_ops"}


def _blocks(name, fraction, policy, replay, steps=3, nbytes=None):
    """Train `name` under a Budget at `fraction` of its peak (or of `nbytes`): (per block: trace, stats), the
    model."""
    peak = coop_arena.Budget(1 << 28, device="cpu", headroom=0)
    train(name, peak, steps=2)  # (and the process's plan caches learn every configuration of the step first)
    nbytes = int(fraction * (peak.stats.peak_bytes if nbytes is None else nbytes))
    budget = coop_arena.Budget(nbytes, device="cpu", policy=policy, replay=replay, trace_len=10**7, headroom=0)
    blocks = []

    def inside(b):
        b.check_invariants()

    model = train(name, budget, steps=steps, inside=inside,
                  check=lambda b: blocks.append((b.trace, b.stats)))
    return blocks, model


@pytest.mark.parametrize("policy", ["coop", "dtr"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "lstm"])
def test_replayed_steps_make_the_decisions_of_the_normal_path(name, policy):
    replayed, model = _blocks(name, 0.4, policy, replay=True)
    normal, reference = _blocks(name, 0.4, policy, replay=False)
    assert bitwise_equal(state(model), state(reference))
    assert bitwise_equal(state(model), state(train(name)))
    for (trace, st), (trace0, st0) in zip(replayed, normal):
        assert trace == trace0
        assert UNTIMED(st) == UNTIMED(st0)
        assert st.evictions > 0 and st.rematerializations > 0
        assert st0.replayed_ops == 0
    first, *later = [st for _, st in replayed]
    assert first.replayed_ops == 0  # nothing to follow yet
    assert all(st.replayed_ops == st.ops for st in later), [(st.replayed_ops, st.ops) for st in later]
    assert all(st.search_seconds == 0.0 for st in later)  # every eviction took the recorded plan: no search


class Branchy(nn.Module):
    """An MLP whose middle layers run only when `wide` is set (a branch taken on a Python condition)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.head = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)])
        self.middle = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
        self.tail = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(6)])
        self.wide = True

    def forward(self, x):
        x = self.head(x)
        if self.wide:
            x = self.middle(x)
        return self.tail(x).square().sum()


def _train_branchy(budget, plan):
    """Steps of (batch size, wide) from `plan`; (traces, stats) per block and the parameters."""
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    blocks = []
    for i, (batch, wide) in enumerate(plan):
        model.wide = wide
        x = torch.randn(batch, 32, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        with budget if budget is not None else contextlib.nullcontext():
            model(x).backward()
            if budget is not None:
                budget.check_invariants()
        if budget is not None:
            blocks.append((budget.trace, budget.stats))
        opt.step()
    return blocks, state(model)


# a repeated step, then a branch not taken midway, then the same step again, then another batch size
PLAN = [(16, True), (16, True), (16, False), (16, False), (16, True), (12, True), (12, True)]


def test_a_step_that_changes_midway_falls_back_to_the_normal_path():
    _, plain = _train_branchy(None, PLAN)
    probe = coop_arena.Budget(1 << 26, device="cpu", headroom=0)
    _train_branchy(probe, PLAN[:1])
    nbytes = int(0.4 * probe.stats.peak_bytes)
    _train_branchy(coop_arena.Budget(nbytes, device="cpu", replay=False, headroom=0), PLAN)  # the process's plan caches learn
    runs = {}  # every configuration first (new shapes go through temporaries once: Note [Shapes that change])
    for replay in (True, False):
        runs[replay] = _train_branchy(coop_arena.Budget(nbytes, device="cpu", replay=replay, trace_len=10**7, headroom=0), PLAN)
    (replayed, params), (normal, params0) = runs[True], runs[False]
    assert bitwise_equal(params, plain) and bitwise_equal(params0, plain)
    for (trace, st), (trace0, st0) in zip(replayed, normal):
        assert trace == trace0 and UNTIMED(st) == UNTIMED(st0)
        assert st.evictions > 0
    got = [(st.replayed_ops, st.ops) for _, st in replayed]
    assert got[0][0] == 0
    assert got[1][0] == got[1][1]                       # the same step again: followed to its end
    assert 0 < got[2][0] < got[2][1]                    # the head ran as before, then the branch was not taken
    assert got[3][0] == got[3][1]                       # the step without the branch, repeated
    assert 0 < got[4][0] < got[4][1]                    # the branch again, after the head
    assert got[5][0] < got[5][1]                        # another batch size: its first placement differs
    assert got[6][0] == got[6][1]


def test_a_failed_block_leaves_the_last_good_recording_to_follow():
    probe = coop_arena.Budget(1 << 26, device="cpu", headroom=0)
    _train_branchy(probe, PLAN[:1])
    budget = coop_arena.Budget(int(0.4 * probe.stats.peak_bytes), device="cpu", trace_len=10**7, headroom=0)
    model = Branchy()
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    with budget:
        model(x).backward()
    first = budget.trace
    model.zero_grad()  # (a step that accumulates into existing gradients runs other ops)
    with pytest.raises(RuntimeError, match="stop here"):
        with budget:
            model.head(x).sum().backward()
            raise RuntimeError("stop here")
    model.zero_grad()
    with budget:
        model(x).backward()
    assert budget.stats.replayed_ops == budget.stats.ops > 0
    assert budget.trace == first


def test_a_dry_run_repeated_on_meta_is_replayed():
    model = Branchy().to("meta")
    x = torch.empty(64, 32, device="meta")
    probe = coop_arena.Budget(1 << 30, device="meta", headroom=0)
    with probe:
        model(x).backward()
    budget = coop_arena.Budget(int(0.3 * probe.stats.peak_bytes), device="meta", headroom=0)
    stats = []
    for _ in range(3):
        with budget:
            model(x).backward()
        stats.append(budget.stats)
    assert stats[0].evictions > 0 and stats[0].replayed_ops == 0
    assert all(UNTIMED(s) == UNTIMED(stats[0]) and s.replayed_ops == s.ops for s in stats[1:])


def _failing_placements(name, policy):
    """(fraction, nbytes, per block: trace, stats, the model) at the largest fraction of `name`'s smallest budget
    under `policy` (found to 4 % of the peak), going down by 1 %, at which some restores find no plan and the step
    still runs: the OutOfBudget is caught by the restore's fallback and the step goes on."""
    from test_exactness import smallest_budget
    nbytes = smallest_budget(name, policy)
    for fraction in (1.0, 0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.93, 0.92):
        try:
            blocks, model = _blocks(name, fraction, policy, replay=True, nbytes=nbytes)
        except coop_arena.OutOfBudget:
            continue
        if any(e[0] == "out_of_budget" for e in blocks[0][0]):
            return fraction, nbytes, blocks, model
    pytest.fail(f"no budget from 1.0 to 0.92 of {name}'s smallest under {policy} ({nbytes} bytes) has a restore "
                f"that finds no plan in a step that runs")


@pytest.mark.parametrize("policy,name", [("coop", "gpt"), ("dtr", "cnn")])
def test_placements_that_found_no_plan_are_replayed_too(policy, name):
    """Near its smallest budget a model's restores sometimes find no plan: the OutOfBudget is caught by the
    restore's fallback and the step goes on. The recording holds those failures as well, so the later steps follow
    it to their end (before, they stopped following at the first such placement: 175 of 250 ops for coop on the
    GPT example)."""
    fraction, nbytes, replayed, model = _failing_placements(name, policy)
    normal, reference = _blocks(name, fraction, policy, replay=False, nbytes=nbytes)
    assert bitwise_equal(state(model), state(reference))
    for (trace, st), (trace0, st0) in zip(replayed, normal):
        assert trace == trace0 and UNTIMED(st) == UNTIMED(st0)
        assert any(e[0] == "out_of_budget" for e in trace)  # failed placements the fallback went on from
    first, *later = [st for _, st in replayed]
    assert first.replayed_ops == 0
    assert all(st.replayed_ops == st.ops for st in later), [(st.replayed_ops, st.ops) for st in later]


def test_replay_must_be_a_bool():
    with pytest.raises(ValueError, match="replay must be True or False"):
        coop_arena.Budget(1 << 20, device="cpu", replay="yes", headroom=0)


def _deaths_block(memory, follow, dead):
    """A block on a bare Memory: a, b, c placed (c by evicting a), then the deaths of `dead` (names) handled, and b
    dropped when the recording says so. Returns whether b's drop was taken from the recording, and its recording."""
    memory.reset()
    memory.start_replay(follow)
    a = memory.allocate(4096, 1.0)
    b = memory.allocate(4096, 1.0, inputs=[a])
    memory.allocate(4096, 1.0, inputs=[b])  # (does not fit: a is evicted)
    assert memory.stats.evictions == 1
    memory.note_deaths([{"a": a, "b": b}[n] for n in dead])
    followed = memory.recorded_outcome(b) == "drop"
    memory.drop(b)
    return followed, memory.take_recording()


def test_drops_follow_the_recording_only_after_the_same_deaths():
    """A dead storage's drop is taken from the recording without deciding it again (lifetime.keeps_dead) only while
    the deaths handled so far are those of the recorded block: which storages a wrapper still uses is what that
    decision reads."""
    from coop_arena.memory import Memory
    memory = Memory(8192, partition=False)
    followed, recording = _deaths_block(memory, None, ["b"])
    assert not followed  # nothing to follow yet
    assert _deaths_block(memory, recording, ["b"]) == (True, recording)
    assert memory.stats.evictions == 1 and memory.used_bytes == 4096
    followed, _ = _deaths_block(memory, recording, ["a", "b"])  # a's wrapper died too: the recording differs
    assert not followed and not memory.following
