"""Random walks through Memory, checked against a plain model after every step.

A step is (op, a, b): `op` names the call, the integers pick its arguments (which storage, what size, what cost)
from what exists at that moment, so every drawn sequence is a valid program and hypothesis can shrink it. After
each step: `check_invariants()`, every storage's state and pin count equal the model's, the bytes held equal
the model's resident bytes. An allocation or restore may evict only resident, unpinned, evictable storages; it
raises OutOfBudget exactly when no free block fits and no run of evictable and free blocks covers the request,
and then it leaves `snapshot()` and `stats.as_dict()` as they were. Calls that must fail (pinning an evicted
storage, freeing twice, ...) are part of the walk too and must change nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coop_arena import Memory, OutOfBudget
from coop_arena.policy import BLOCKED, EVICTABLE, FREE, plan_coop
from coop_arena.storage import State

U = 512
ARENA_UNITS = 24
COSTS = (0.0, 0.5, 1.0, 2.0, 5.0, 40.0, 1e4)
TICKS = (0.0, 0.5, 1.0, 3.0)
# op names repeated to weight them: allocation and restore drive eviction, pins stay rare
OPS = ("alloc",) * 5 + ("restore",) * 3 + ("free",) * 2 + ("evict",) * 2 + ("pin", "unpin", "unpin", "touch",
                                                                             "advance")

STEPS_PER_EXAMPLE = 200
EXAMPLES_PER_POLICY = 55           # 55 x 200 = 11,000 steps per policy
STEPS_RUN: dict[str, int] = {}

step_st = st.tuples(st.sampled_from(OPS), st.integers(0, 1 << 16), st.integers(0, 1 << 16))
walk_st = st.lists(step_st, min_size=STEPS_PER_EXAMPLE, max_size=STEPS_PER_EXAMPLE)
SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Driver:
    """Runs steps on one Memory and keeps the model: sid -> state and pins."""

    def __init__(self, policy: str, partition: bool):
        self.m = Memory(ARENA_UNITS * U, policy=policy, partition=partition, trace_len=1 << 20)
        self.all: list = []                  # every storage ever allocated, in sid order
        self.state: dict[int, State] = {}    # the model
        self.pins: dict[int, int] = {}

    # ---------------------------------------------------------------------------------------------- helpers
    def _with(self, state: State, pinned: bool | None = None) -> list:
        return [s for s in self.all if self.state[s.sid] is state
                and (pinned is None or (self.pins[s.sid] > 0) == pinned)]

    def _frozen(self):
        return self.m.snapshot(), self.m.stats.as_dict(), self.m.clock

    def _must_fail(self, call, exc=ValueError):
        before = self._frozen()
        with pytest.raises(exc):
            call()
        assert self._frozen() == before

    def _place(self, call, need: int, s=None):
        """An allocation (s is None) or a restore of s: check evictions against the model, or OutOfBudget."""
        m = self.m
        fits, window = m.fits(need), m.largest_window()
        planned = None
        if not fits:
            plan = m.plan(need)
            assert (plan is None) == (window < need)
            if plan is not None:
                planned = [m.snapshot()[i]["sid"] for i in plan.victims]
            if m.policy == "coop":
                cols = m._columns()
                assert as_tuple(plan) == reference_coop(*cols, m.clock, need)
        before, n_events = self._frozen(), len(m.trace.events)
        events_before = m.stats.eviction_events
        try:
            out = call()
        except OutOfBudget as e:
            assert not fits and window < need, f"OutOfBudget for {need} bytes with a {window}-byte window"
            assert (e.requested, e.largest_window, e.pinned + e.unevictable) == (
                s.nbytes if s else e.requested, window, m.unevictable_bytes)
            assert e.restore == (s is not None)
            assert e.budget == m.budget
            assert self._frozen() == before
            assert [ev.kind for ev in list(m.trace.events)[n_events:]] == ["out_of_budget"]
            return None
        assert fits or window >= need, f"placed {need} bytes though the largest window was {window}"
        new = list(m.trace.events)[n_events:]
        victims = [ev.sid for ev in new if ev.kind == "evict"]
        assert m.stats.eviction_events == events_before + (0 if fits else 1)
        assert bool(victims) == (not fits)
        assert victims == (planned or []), "the pure plan and what was evicted differ"
        assert m.stats.evicted_bytes - before[1]["evicted_bytes"] == sum(m.table.round_up(self.all[v].nbytes)
                                                                         for v in victims)
        for v in victims:
            assert self.state[v] is State.RESIDENT and self.pins[v] == 0 and self.all[v].evictable, (
                f"evicted storage {v}: model says {self.state[v]}, pins {self.pins[v]}")
            self.state[v] = State.EVICTED
        return out

    # ------------------------------------------------------------------------------------------------ steps
    def step(self, op: str, a: int, b: int) -> None:
        m = self.m
        if op == "alloc":
            units = 1 + a % 6
            nbytes = units * U - (b % 3) * 100
            live = [s for s in self.all if self.state[s.sid] is not State.FREED]
            inputs = [live[(b >> k) % len(live)] for k in range(b % 3)] if live else []
            evictable, pinned = a % 11 != 0, a % 13 == 0
            s = self._place(lambda: m.allocate(nbytes, COSTS[b % len(COSTS)], evictable=evictable,
                                               inputs=list(dict.fromkeys(inputs)), pinned=pinned), units * U)
            if s is not None:
                assert s.sid == len(self.all) and s.state is State.RESIDENT
                self.all.append(s)
                self.state[s.sid], self.pins[s.sid] = State.RESIDENT, int(pinned)
        elif op == "restore":
            ev = self._with(State.EVICTED)
            if not ev:
                res = self._with(State.RESIDENT)
                if res:
                    self._must_fail(lambda: m.restore(res[a % len(res)]))
                return
            s = ev[a % len(ev)]
            pinned = b % 7 == 0
            if self._place(lambda: m.restore(s, pinned=pinned), m.table.round_up(s.nbytes), s) is not None:
                self.state[s.sid], self.pins[s.sid] = State.RESIDENT, int(pinned)
        elif op == "free":
            freed = self._with(State.FREED)
            if freed and b % 10 == 0:
                self._must_fail(lambda: m.free(freed[a % len(freed)]))
                return
            live = [s for s in self.all if self.state[s.sid] is not State.FREED]
            if not live:
                return
            s = live[a % len(live)]
            if self.pins[s.sid]:
                self._must_fail(lambda: m.free(s))
            else:
                m.free(s)
                self.state[s.sid] = State.FREED
        elif op == "evict":
            res = self._with(State.RESIDENT)
            if b % 10 == 0 and self._with(State.EVICTED):
                ev = self._with(State.EVICTED)
                self._must_fail(lambda: m.evict(ev[a % len(ev)]))
                return
            if not res:
                return
            s = res[a % len(res)]
            if self.pins[s.sid]:
                self._must_fail(lambda: m.evict(s))
            else:
                m.evict(s)
                self.state[s.sid] = State.EVICTED
        elif op == "pin":
            res = self._with(State.RESIDENT)
            if b % 5 == 0 and self._with(State.EVICTED):
                ev = self._with(State.EVICTED)
                self._must_fail(lambda: m.pin(ev[a % len(ev)]))
            elif res:
                s = res[a % len(res)]
                m.pin(s)
                self.pins[s.sid] += 1
        elif op == "unpin":
            pinned = self._with(State.RESIDENT, pinned=True)
            if pinned:
                s = pinned[a % len(pinned)]
                m.unpin(s)
                self.pins[s.sid] -= 1
            else:
                loose = [s for s in self.all if self.pins[s.sid] == 0]
                if loose:
                    self._must_fail(lambda: m.unpin(loose[a % len(loose)]))
        elif op == "touch":
            live = [s for s in self.all if self.state[s.sid] is not State.FREED]
            if live:
                s = live[a % len(live)]
                m.touch(s)
                assert s.last_access == m.clock
        elif op == "advance":
            m.advance(TICKS[a % len(TICKS)])
        else:
            raise AssertionError(op)

    def check(self) -> None:
        m = self.m
        m.check_invariants()
        held = 0
        for s in self.all:
            assert s.state is self.state[s.sid], f"storage {s.sid} is {s.state}, the model says {self.state[s.sid]}"
            assert s.pins == self.pins[s.sid], f"storage {s.sid} has {s.pins} pins, the model says {self.pins[s.sid]}"
            if s.state is State.RESIDENT:
                held += m.table.round_up(s.nbytes)
            else:
                assert s.pins == 0 and s.offset == -1
        assert m.used_bytes == held
        assert sorted(x.sid for x in m.resident()) == [s.sid for s in self.all if self.state[s.sid] is State.RESIDENT]
        pinned_blocks = {b["sid"] for b in m.snapshot() if b["state"] == "pinned"}
        assert pinned_blocks == {sid for sid, p in self.pins.items() if p > 0}


@pytest.mark.parametrize("policy", ["coop", "dtr", "dte"])
def test_random_walks_keep_the_invariants(policy):
    @settings(max_examples=EXAMPLES_PER_POLICY, **SETTINGS)
    @given(walk=walk_st, partition=st.booleans())
    def walk_once(walk, partition):
        d = Driver(policy, partition)
        for op, a, b in walk:
            d.step(op, a, b)
            d.check()
        STEPS_RUN[policy] = STEPS_RUN.get(policy, 0) + len(walk)

    STEPS_RUN[policy] = 0
    walk_once()
    assert STEPS_RUN[policy] >= 10_000, f"only {STEPS_RUN[policy]} steps ran for {policy}"


@pytest.mark.parametrize("policy", ["coop", "dtr", "dte"])
@settings(max_examples=15, **SETTINGS)
@given(walk=st.lists(step_st, min_size=120, max_size=120), partition=st.booleans())
def test_same_calls_same_decisions(policy, walk, partition):
    """Rule 8: two fresh Memory objects fed the same calls make the same decisions."""
    d1, d2 = Driver(policy, partition), Driver(policy, partition)
    for op, a, b in walk:
        d1.step(op, a, b)
        d2.step(op, a, b)
        assert d1.m.snapshot() == d2.m.snapshot()
    assert list(d1.m.trace.events) == list(d2.m.trace.events)
    assert d1.m.trace.evictions() == d2.m.trace.evictions()
    timing = ("search_seconds", "search_seconds_max", "search_seconds_per_event")
    s1, s2 = d1.m.stats.as_dict(), d2.m.stats.as_dict()
    assert {k: v for k, v in s1.items() if k not in timing} == {k: v for k, v in s2.items() if k not in timing}


# ---------------------------------------------------------------------------------------- the coop window search
def as_tuple(plan):
    return None if plan is None else (plan.victims, plan.start, plan.end, plan.cost, plan.policy)


def reference_coop(offsets, sizes, kind, c, last, clock, need):
    """The plain formulation of the coop search (one binary search per right end), kept here as the reference
    that the vectorized `plan_coop` must match bit for bit (Note [Coop window search])."""
    h = np.where(kind == EVICTABLE, c / (clock - last + 1.0), 0.0)
    p0 = np.concatenate(([0], np.cumsum(sizes)))
    h0 = np.concatenate(([0.0], np.cumsum(h)))
    b0 = np.concatenate(([0], np.cumsum(kind == BLOCKED)))
    left = np.searchsorted(p0, p0[1:] - need, side="right") - 1
    ok = left >= 0
    lc = np.where(ok, left, 0)
    ok &= b0[1:] - b0[lc] == 0
    if not ok.any():
        return None
    cost = np.where(ok, h0[1:] - h0[lc], np.inf)
    r = int(np.argmin(cost))
    lo = int(lc[r])
    victims = tuple(int(i) for i in np.nonzero(kind[lo : r + 1] == EVICTABLE)[0] + lo)
    return (victims, int(offsets[lo]), int(offsets[r] + sizes[r]), float(cost[r]), "coop")


@st.composite
def columns(draw, dyadic: bool):
    """Block columns as a policy sees them. With `dyadic`, every c/s is a multiple of 1/4 below 64, so sums are
    exact and a brute force can check optimality; otherwise arbitrary floats with many ties."""
    n = draw(st.integers(1, 40))
    units = draw(st.lists(st.integers(1, 6), min_size=n, max_size=n))
    kinds = draw(st.lists(st.sampled_from([FREE, EVICTABLE, EVICTABLE, EVICTABLE, BLOCKED]), min_size=n, max_size=n))
    if dyadic:
        c = [draw(st.integers(0, 255)) / 4 for _ in range(n)]
        last = [0.0] * n
        clock = 0.0
    else:
        c = draw(st.lists(st.sampled_from([0.0, 0.1, 1.0, 2.0, 3.0, 1e-3, 7.5]), min_size=n, max_size=n))
        last = draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=n, max_size=n))
        clock = draw(st.sampled_from([2.0, 3.0, 10.0]))
    sizes = np.array(units, np.int64) * U
    kind = np.array(kinds, np.int8)
    c = np.where(kind == FREE, 0.0, np.array(c))
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    need = draw(st.integers(1, 14)) * U
    return offsets, sizes, kind, c, np.array(last), clock, need


@settings(max_examples=400, **SETTINGS)
@given(cols=columns(dyadic=False))
def test_coop_search_equals_the_plain_formulation(cols):
    assert as_tuple(plan_coop(*cols)) == reference_coop(*cols)


@settings(max_examples=300, **SETTINGS)
@given(cols=columns(dyadic=True))
def test_coop_window_is_the_cheapest_covering_run(cols):
    offsets, sizes, kind, c, last, clock, need = cols
    n = len(sizes)
    h = np.where(kind == EVICTABLE, c, 0.0)          # staleness 1 everywhere
    windows = [(sum(h[lo : r + 1]), r, lo) for r in range(n) for lo in range(r + 1)
               if sizes[lo : r + 1].sum() >= need and not (kind[lo : r + 1] == BLOCKED).any()]
    plan = plan_coop(*cols)
    if not windows:
        assert plan is None
        return
    best = min(w[0] for w in windows)
    assert plan is not None and plan.cost == best
    lo, r = int(np.searchsorted(offsets, plan.start)), int(np.searchsorted(offsets, plan.end - 1, side="right")) - 1
    assert sizes[lo : r + 1].sum() >= need and not (kind[lo : r + 1] == BLOCKED).any()
    assert plan.victims == tuple(i for i in range(lo, r + 1) if kind[i] == EVICTABLE)
    # ties: the first right end that reaches the minimum, with its shortest covering window
    r_best = min(r_ for cost, r_, _ in windows if cost == best)
    assert (lo, r) == (max(lo_ for _, r_, lo_ in windows if r_ == r_best), r_best)


# ------------------------------------------------------------------------------ move plans (Note [Moving instead
# of evicting] in memory.py): random layouts, one request, against the plain window's price
COPY = 2 * U  # the price of copying one unit at staleness 1 (2 x bytes / s)


@st.composite
def move_layouts(draw):
    """(blocks as (kind, units, cost), request in units): no clock advance, so every staleness is 1 and a block's
    eviction price is its cost."""
    blocks = draw(st.lists(st.tuples(st.sampled_from(("free", "evictable", "evictable", "evictable", "pinned")),
                                     st.integers(1, 3), st.sampled_from((1.0, 300.0, 800.0, 1500.0, 3000.0, 8000.0))),
                           min_size=3, max_size=10))
    return blocks, draw(st.integers(1, 5))


@settings(max_examples=400, **SETTINGS)
@given(case=move_layouts())
def test_a_move_plan_never_costs_more_than_the_plain_window(case):
    blocks, need_units = case
    m = Memory(sum(u for _, u, _ in blocks) * U, policy="coop", partition=False)
    made, holes = [], []
    for kind, units, cost in blocks:
        s = m.allocate(units * U, cost, pinned=kind == "pinned")
        (holes if kind == "free" else made).append((s, kind, cost))
    for s, _, _ in holes:
        m.free(s)
    copies = []
    m.mover = lambda src, dst, n: copies.append((src, dst, n))
    plain = m.plan(need_units * U)
    before = {s.sid: (s.offset, s.state) for s, _, _ in made}
    try:
        new = m.allocate(need_units * U, 1.0)
    except OutOfBudget:
        assert plain is None
        assert {s.sid: (s.offset, s.state) for s, _, _ in made} == before and not copies
        return
    m.check_invariants()
    evicted = [(s, kind, cost) for s, kind, cost in made if s.state is State.EVICTED]
    moved = {s.sid: (kind, cost) for s, kind, cost in made if s.state is State.RESIDENT and s.offset != before[s.sid][0]}
    assert all(kind == "evictable" for _, kind, _ in evicted), "only evictable storages are evicted"
    assert len(copies) == len(moved) == m.stats.relocations
    if plain is not None and not m.stats.compactions:
        # the plain window could serve the request: anything else must be cheaper, copies at their price
        price = sum(cost for _, _, cost in evicted) + sum(n // U * COPY for _, _, n in copies)
        assert price <= plain.cost, (price, plain)
        assert all(kind == "evictable" for kind, _ in moved.values()), "with a window, only evictable blocks move"
    occupied = [(s.offset, s.offset + m.table.round_up(s.nbytes)) for s, _, _ in made if s.state is State.RESIDENT]
    assert all(hi <= new.offset or lo >= new.offset + need_units * U for lo, hi in occupied)


def test_the_random_layouts_take_move_plans_and_rerun_their_search(monkeypatch):
    """The property above is not vacuous: its layouts take move plans, and some searches rerun because a block
    priced as a copy found no destination."""
    from coop_arena import memory as memory_module
    seen = {"stuck": 0, "placed": 0, "taken": 0}
    copies, move_plan = memory_module.Memory._copies, memory_module.Memory._move_plan

    def count_copies(self, *args, **kw):
        moves, stuck = copies(self, *args, **kw)
        seen["stuck" if stuck is not None else "placed"] += 1
        return moves, stuck

    def count_plans(self, *args, **kw):
        plan = move_plan(self, *args, **kw)
        seen["taken"] += plan is not None
        return plan
    monkeypatch.setattr(memory_module.Memory, "_copies", count_copies)
    monkeypatch.setattr(memory_module.Memory, "_move_plan", count_plans)
    test_a_move_plan_never_costs_more_than_the_plain_window()
    assert seen["taken"] >= 10 and seen["stuck"] >= 10, seen  # 400 layouts: about 27 and 72
