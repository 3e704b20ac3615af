"""Relocation (Note [Relocation]): pinned or unevictable blocks that split the arena are copied out of the
window instead of failing the request. Exact moves on a hand-built layout, then a real training step."""

import contextlib

import pytest
import torch
import torch.nn as nn

import coop_arena
from coop_arena import OutOfBudget
from coop_arena.plan import step
from coop_arena.storage import State

from test_memory import U, build
from training import bitwise_equal


def layout(**kw):
    # a1 P1 b1 .1 Q1 c1 .1 with P and Q pinned: no run of 3 units is free of them. Moving a pinned unit costs
    # 2 x 512 (a copy), evicting a, b or c 5000: the cheapest 3-unit windows cover one pinned unit and one
    # evictable one; the first of them (lowest address) is P b .
    m, s = build([("a", 1, 5000.0), ("p", 1, 1.0, {"pinned": True}), ("b", 1, 5000.0), (".", 1, 0.0),
                  ("q", 1, 1.0, {"pinned": True}), ("c", 1, 5000.0), (".", 1, 0.0)], **kw)
    moves = []
    m.mover = lambda src, dst, n: moves.append((src // U, dst // U, n))
    return m, s, moves


def test_pinned_block_is_copied_out_of_the_window():
    m, s, moves = layout()
    assert m.plan(3 * U) is None  # no run of 3 units without a pinned block
    new = m.allocate(3 * U, 5.0)
    assert moves == [(1, 6, 512)]  # p goes to the hole outside the window p b .
    assert s["p"].offset == 6 * U and s["p"].state is State.RESIDENT and s["p"].pins == 1
    assert new.offset == 1 * U
    assert {n: v.state.value for n, v in s.items()} == {"a": "resident", "p": "resident", "b": "evicted",
                                                        "q": "resident", "c": "resident"}
    assert m.stats.relocations == 1 and m.stats.relocated_bytes == U and m.stats.evictions == 1
    assert [e.kind for e in m.trace.events][-3:] == ["evict", "move", "alloc"]
    m.check_invariants()


def test_no_destination_no_change():
    m, s, moves = layout()
    m.allocate(1 * U, 1.0, pinned=True)  # takes the hole at unit 3: the only hole left lies in every window
    m.pin(s["a"])
    m.pin(s["c"])  # and no evictable block outside a window could be evicted to make a destination
    before = m.snapshot()
    with pytest.raises(OutOfBudget):
        m.allocate(3 * U, 5.0)
    assert moves == [] and m.snapshot() == before  # Rule 7
    m.check_invariants()


def test_fixed_blocks_and_other_policies_never_move():
    m, s, moves = layout()
    m.fix(s["p"])
    m.allocate(3 * U, 5.0)
    assert moves == [(4, 6, 512)]  # p stays: the next window, b . Q, moves q instead
    assert s["p"].offset == 1 * U
    m.unfix(s["p"])
    with pytest.raises(ValueError, match="not fixed"):
        m.unfix(s["p"])
    for kw in ({"policy": "dtr"}, {"relocate": False}):
        m, s, moves = layout(**kw)
        with pytest.raises(OutOfBudget):
            m.allocate(3 * U, 5.0)
        assert moves == []
    with pytest.raises(ValueError, match="not pinned"):
        m.fix(s["a"])


class StackRNN(nn.Module):
    """A recurrence whose per-step states are stacked at the end: the stack pins many small inputs spread
    over the arena, which leaves no window without relocation."""

    def __init__(self, h=32):
        super().__init__()
        self.w, self.u = nn.Linear(h, h), nn.Linear(h, h)
        self.v, self.p = nn.Linear(h, 8 * h), nn.Linear(8 * h, h)

    def forward(self, x):
        h, hs = x.new_zeros(x.shape[1], x.shape[2]), []
        for t in range(x.shape[0]):
            h = self.p(torch.relu(self.v(torch.tanh(self.w(x[t]) + self.u(h)))))
            hs.append(h)
        return torch.stack(hs).sum(0)


def _train(budget, steps=2):
    torch.manual_seed(0)
    model = StackRNN()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(steps):
        x = torch.randn(48, 16, 32, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        if budget is None:
            model(x).pow(2).mean().backward()
        else:
            with budget:
                model(x).pow(2).mean().backward()
                budget.check_invariants()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_relocation_keeps_training_bitwise_exact():
    probe = coop_arena.Budget(1 << 26, device="cpu")
    _train(probe, steps=1)
    nbytes = int(0.5 * probe.stats.peak_bytes)
    with pytest.raises(OutOfBudget, match="aten.stack"):
        _train(coop_arena.Budget(nbytes, device="cpu", relocate=False), steps=1)
    budget = coop_arena.Budget(nbytes, device="cpu")
    params = _train(budget)
    st = budget.stats
    assert st.relocations > 0 and st.rematerializations > 0 and st.peak_bytes <= nbytes
    assert st.compute_overhead > 1.0
    assert bitwise_equal(_train(None), params)


def test_meta_dry_run_makes_the_same_moves():
    runs = {}
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        model = StackRNN().to(device)
        x = torch.empty(48, 16, 32, device=device).normal_() if device == "cpu" else torch.empty(48, 16, 32,
                                                                                               device="meta")
        probe = coop_arena.Budget(1 << 26, device=device)
        step(model, (x,), probe)
        b = coop_arena.Budget(int(0.5 * probe.stats.peak_bytes), device=device)
        step(model, (x,), b)
        st = b.stats
        runs[device] = (st.relocations, st.relocated_bytes, st.evictions, st.compute_overhead,
                        [(e.kind, e.sid, e.offset) for e in b.trace])
    assert runs["cpu"][0] > 0 and runs["cpu"] == runs["meta"]


def move_layout(between=(".", 1, 0.0), **kw):
    # e1 c1 Q1 .1 R1 d1 f1 with Q and R pinned; a 2-unit request. Evicting e and c costs 3001, d and f 9000.
    # Copying e (2 x 512 = 1024) to the hole outside its window and evicting c costs 1025.
    return build([("e", 1, 3000.0), ("c", 1, 1.0), ("q", 1, 1.0, {"pinned": True}), between,
                  ("r", 1, 1.0, {"pinned": True}), ("d", 1, 5000.0), ("f", 1, 4000.0)], **kw)


def test_expensive_block_is_moved_to_a_hole_instead_of_evicted():
    m, s = move_layout()
    moves = []
    m.mover = lambda src, dst, n: moves.append((src // U, dst // U, n // U))
    assert m.plan(2 * U).victims == (0, 1)  # the plain plan: evict e and c
    new = m.allocate(2 * U, 5.0)
    assert moves == [(0, 3, 1)] and new.offset == 0
    assert s["e"].state is State.RESIDENT and s["e"].offset == 3 * U and s["c"].state is State.EVICTED
    assert (m.stats.relocations, m.stats.evictions, m.stats.compactions) == (1, 1, 0)
    m.check_invariants()
    for kw in ({"policy": "dtr"}, {"relocate": False}):  # the baselines and the ablation evict
        m, s = move_layout(**kw)
        m.mover = lambda src, dst, n: pytest.fail("nothing may move")
        m.allocate(2 * U, 5.0)
        assert m.stats.relocations == 0 and m.stats.evictions >= 1


def slide_layout():
    # P2 .1 a1 Q2 b1 .1 with P and Q pinned: no 3-unit window avoids them, and relocation has no 2-unit hole
    # outside any window to move P or Q to.
    return build([("p", 2, 1.0, {"pinned": True}), (".", 1, 0.0), ("a", 1, 5000.0),
                  ("q", 2, 1.0, {"pinned": True}), ("b", 1, 1.0), (".", 1, 0.0)])


def test_compaction_slides_blocks_together_when_no_destination_exists():
    # The arena holds P, Q and the request once b (the cheaper) goes and a and Q slide down by one unit (Q over
    # its own old range).
    m, s = slide_layout()
    moves = []
    m.mover = lambda src, dst, n: moves.append((src // U, dst // U, n // U))
    assert m.plan(3 * U) is None and m._relocation_plan(3 * U, m._prices())[0] is None
    new = m.allocate(3 * U, 5.0)
    assert moves == [(3, 2, 1), (4, 3, 2)]
    assert (s["a"].offset, s["q"].offset, new.offset) == (2 * U, 3 * U, 5 * U)
    assert s["b"].state is State.EVICTED and s["a"].state is State.RESIDENT and s["q"].pins == 1
    st = m.stats
    assert (st.compactions, st.relocations, st.relocated_bytes, st.evictions, st.excess_bytes) == (1, 2, 3 * U, 1, 0)
    assert [e.kind for e in m.trace.events][-4:] == ["evict", "move", "move", "alloc"]
    m.check_invariants()


def test_compaction_respects_fixed_blocks_and_fails_cleanly():
    m, s = slide_layout()
    m.mover = lambda src, dst, n: pytest.fail("nothing may move")
    m.fix(s["q"])  # Q must keep its address: the segments around it hold 2 and 0 unpinned units, not 3
    before = m.snapshot()
    with pytest.raises(OutOfBudget):
        m.allocate(3 * U, 5.0)
    assert m.snapshot() == before and m.stats.compactions == 0  # Rule 7
    m.check_invariants()


class Attention(nn.Module):
    """Two residual self-attention layers: near the edge a backward op's pinned inputs split the arena so that
    neither the window search nor relocation can place its output, and only a compaction can."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.MultiheadAttention(64, 4, batch_first=True) for _ in range(2))

    def forward(self, x):
        for a in self.layers:
            x = x + a(x, x, x)[0]
        return x.square().mean()


def attention_grads(shape, budget=None):
    """The parameter gradients of one training step of `Attention` on an input of `shape` (under `budget`)."""
    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    with budget if budget is not None else contextlib.nullcontext():
        model(x).backward()
    return [p.grad for p in model.parameters()]


def test_compaction_keeps_training_bitwise_exact():
    """Every budget from 62 % of the peak down to the smallest that fits, for two input shapes: exact, with
    compactions and moves among them (which budgets need them depends on the policy's choices)."""
    train = attention_grads
    compacted, moved = 0, False
    for shape in ((8, 32, 64), (4, 64, 64)):
        probe = coop_arena.Budget(1 << 26, device="cpu")
        plain = train(shape, None)
        train(shape, probe)
        for percent in range(62, 40, -1):
            budget = coop_arena.Budget(probe.stats.peak_bytes * percent // 100, device="cpu")
            try:
                grads = train(shape, budget)
            except OutOfBudget:
                break
            st = budget.stats
            assert bitwise_equal(plain, grads) and st.peak_bytes <= st.budget
            if st.compactions:
                compacted += 1
                assert st.relocated_bytes > 0 and st.rematerializations > 0
            moved = moved or (st.relocations > 0 and not st.compactions)
    assert compacted >= 1, "some of the smallest budgets that fit should need a compaction"
    assert moved, "some budget should move blocks instead of evicting them"


def hole_layout(**kw):
    # move_layout with g (cost 10) in place of its free block: e1 c1 Q1 g1 R1 d1 f1, no free block. The plain
    # plan evicts e and c (3001). Copying e (2 x 512 = 1024) needs a destination outside its window: evicting g
    # makes one, for 1035 in all; d and f would cost more to evict than e itself.
    return move_layout(("g", 1, 10.0), **kw)


def test_a_cheap_block_outside_the_window_is_evicted_to_make_a_hole_for_an_expensive_one():
    m, s = hole_layout()
    moves = []
    m.mover = lambda src, dst, n: moves.append((src // U, dst // U, n // U))
    assert m.plan(2 * U).victims == (0, 1)  # the plain plan: evict e and c
    new = m.allocate(2 * U, 5.0)
    assert moves == [(0, 3, 1)] and new.offset == 0  # e takes g's range
    assert s["e"].state is State.RESIDENT and s["e"].offset == 3 * U
    assert {n: v.state.value for n, v in s.items() if n in "cgdf"} == {"c": "evicted", "g": "evicted",
                                                                      "d": "resident", "f": "resident"}
    assert (m.stats.relocations, m.stats.evictions) == (1, 2)
    assert [e.kind for e in m.trace.events][-4:] == ["evict", "evict", "move", "alloc"]
    m.check_invariants()


def test_no_hole_is_made_from_a_block_that_costs_more_than_the_one_it_would_take():
    m, s = hole_layout()
    m.pin(s["g"])  # the only cheap block outside the window: d and f cost more to evict than e
    m.mover = lambda src, dst, n: pytest.fail("nothing may move")
    m.allocate(2 * U, 5.0)
    assert s["e"].state is State.EVICTED and s["c"].state is State.EVICTED
    assert (m.stats.relocations, m.stats.evictions) == (0, 2)
    m.check_invariants()


def test_a_block_with_no_destination_is_priced_at_its_eviction_and_the_search_reruns():
    # a1 b1 .1 d1 e2, a 3-unit request; a copy costs 1024 a unit. The plain plan evicts a and b (4000). Priced as
    # copies, [a b .] is the cheapest window (2048), but a and b have no destination: the only free unit is
    # inside it, and no block outside costs less to evict than a copy saves. Evicting them there instead costs
    # what the plain plan does. Priced at their eviction, the search finds [d e]: d is copied to the free unit
    # and e evicted, 2524 in all.
    m, s = build([("a", 1, 2000.0), ("b", 1, 2000.0), (".", 1, 0.0), ("d", 1, 5000.0), ("e", 2, 1500.0)])
    moves = []
    m.mover = lambda src, dst, n: moves.append((src // U, dst // U, n // U))
    assert m.plan(3 * U).victims == (0, 1)
    new = m.allocate(3 * U, 5.0)
    assert moves == [(3, 2, 1)] and new.offset == 3 * U
    assert {n: v.state.value for n, v in s.items()} == {"a": "resident", "b": "resident", "d": "resident",
                                                        "e": "evicted"}
    assert (m.stats.relocations, m.stats.evictions) == (1, 1)
    m.check_invariants()
