"""Memory: small hand-built layouts with exact victims, byte counts and telemetry.

Layouts are written in units of U = 512 bytes (the alignment). `build` places storages left to right with
`partition=False`, so a layout reads like the arena: "a1 b1 .2 c1" is a (1 unit), b (1 unit), a free block of 2
units, c (1 unit). Every storage is allocated at clock 0 unless a test advances the clock.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from coop_arena import Memory, OutOfBudget
from coop_arena.storage import State, recompute_cost
from coop_arena.telemetry import Event

U = 512
POLICIES = ("coop", "dtr", "dte")


def build(spec, policy="coop", budget=None, **kw):
    """spec: (name, units, cost) or (name, units, cost, allocate-kwargs); name "." is a hole (placed, then freed).
    Returns the Memory and a dict name -> Storage (holes left out)."""
    units = sum(e[1] for e in spec)
    m = Memory((budget or units) * U, policy=policy, partition=kw.pop("partition", False), **kw)
    named, holes, off = {}, [], 0
    for name, n, cost, *opts in spec:
        s = m.allocate(n * U, cost, **(opts[0] if opts else {}))
        assert s.offset == off, f"{name} placed at {s.offset}, layout wants {off}"
        off += n * U
        if name == ".":
            holes.append(s)
        else:
            named[name] = s
    for h in holes:
        m.free(h)
    m.check_invariants()
    return m, named


def layout(m, named) -> str:
    """The arena as "a1 b2 .1": names with sizes in units, "." for free blocks, "#sid" for unnamed storages."""
    by_sid = {s.sid: n for n, s in named.items()}
    out = []
    for b in m.snapshot():
        sid = b["sid"]
        out.append(("." if sid is None else by_sid.get(sid, f"#{sid}")) + str(b["size"] // U))
    return " ".join(out)


def names(named, sids) -> list[str]:
    by_sid = {s.sid: n for n, s in named.items()}
    return [by_sid[i] for i in sids]


def frozen(m):
    """Everything a failed call must leave as it was."""
    return m.snapshot(), m.stats.as_dict(), m.clock, m.used_bytes, [(s.sid, s.state, s.pins) for s in m.resident()]


# ----------------------------------------------------------------------------------------------- the Coop case
# Eight 1-unit storages; a and c are the cheapest but not adjacent, e and f are a little dearer and adjacent.
SCATTERED = [("a", 1, 1.0), ("b", 1, 100.0), ("c", 1, 1.0), ("d", 1, 100.0),
             ("e", 1, 5.0), ("f", 1, 5.0), ("g", 1, 100.0), ("h", 1, 100.0)]


def test_two_scattered_cheap_storages_do_not_serve_the_request():
    m, s = build(SCATTERED)
    assert s["a"].nbytes + s["c"].nbytes == 2 * U
    m.evict(s["a"])
    m.evict(s["c"])
    assert layout(m, s) == ".1 b1 .1 d1 e1 f1 g1 h1"
    assert m.table.free_bytes == 2 * U and not m.fits(2 * U)  # two free units, no two-unit block
    m.check_invariants()


def test_coop_evicts_one_contiguous_run():
    m, s = build(SCATTERED, "coop")
    plan = m.plan(2 * U)
    assert (plan.victims, plan.start, plan.end, plan.cost) == ((4, 5), 4 * U, 6 * U, 10.0)
    n = m.allocate(2 * U, 50.0)
    m.check_invariants()
    assert names(s, m.trace.evictions()) == ["e", "f"]
    assert n.offset == 4 * U
    assert layout(m, s) == f"a1 b1 c1 d1 #{n.sid}2 g1 h1"
    st = m.stats
    # minimal: there were no free bytes, so exactly the requested bytes had to go
    assert (st.eviction_events, st.evictions, st.evicted_bytes, st.excess_bytes) == (1, 2, 2 * U, 0)
    assert s["e"].state is State.EVICTED and s["a"].state is State.RESIDENT


@pytest.mark.parametrize("policy", ["dtr", "dte"])
def test_dtr_and_dte_evict_the_scattered_ones_first(policy):
    m, s = build(SCATTERED, policy)
    plan = m.plan(2 * U)
    assert (plan.victims, plan.start, plan.end) == ((0, 2, 4, 5), 4 * U, 6 * U)
    n = m.allocate(2 * U, 50.0)
    m.check_invariants()
    assert names(s, m.trace.evictions()) == ["a", "c", "e", "f"]
    assert n.offset == 4 * U
    assert layout(m, s) == f".1 b1 .1 d1 #{n.sid}2 g1 h1"
    st = m.stats
    assert (st.eviction_events, st.evictions, st.evicted_bytes, st.excess_bytes) == (1, 4, 4 * U, 2 * U)


def test_coop_evicts_fewer_bytes_than_dtr_on_the_same_layout():
    got = {}
    for policy in POLICIES:
        m, _ = build(SCATTERED, policy)
        m.allocate(2 * U, 50.0)
        got[policy] = (m.stats.evicted_bytes, m.stats.excess_bytes)
    assert got == {"coop": (2 * U, 0), "dtr": (4 * U, 2 * U), "dte": (4 * U, 2 * U)}


# --------------------------------------------------------------------------------------------------- staleness
def test_staleness_moves_the_window():
    m, s = build([(n, 1, 10.0) for n in "abcdefgh"], "coop")
    m.advance(9.0)                      # every storage now has staleness 10: c/s = 1
    m.touch(s["b"])
    m.touch(s["c"])                     # staleness 1: c/s = 10
    assert m.plan(2 * U).victims == (3, 4)      # d,e: the first pair with neither b nor c (cost 2)
    m.touch(s["d"])
    assert m.plan(2 * U).victims == (4, 5)      # e,f
    m.advance(10.0)                     # clock 19: a, g, h have staleness 20 (c/s = 0.5), b..d 11 (0.91)
    m.touch(s["e"])
    m.touch(s["f"])                     # staleness 1 (c/s = 10)
    p = m.plan(2 * U)
    assert p.victims == (6, 7) and math.isclose(p.cost, 1.0)
    m.check_invariants()


def test_staleness_orders_dtr():
    m, s = build([(n, 1, 10.0) for n in "abcd"] + [("x", 1, 1000.0)], "dtr")
    m.advance(4.0)
    for n in "abc":
        m.touch(s[n])
    # d is the stalest (c/(m s) = 10/(512 * 5)) and alone serves one unit
    assert m.plan(U).victims == (3,)
    # for two units: d first, then a, b, c tie at staleness 1 and the lowest address goes first; d is not
    # next to a or b, so dtr keeps going until a and b form a run (d stays in the plan: address-oblivious)
    p = m.plan(2 * U)
    assert (p.victims, p.start, p.end) == ((0, 1, 3), 0, 2 * U)
    m.check_invariants()


# ---------------------------------------------------------------------------- pinned and unevictable storages
BLOCKED = [("a", 1, 1.0), ("P", 1, 1.0, {"pinned": True}), ("b", 1, 1.0), ("X", 1, 1.0, {"evictable": False}),
           ("c", 1, 100.0), ("d", 1, 100.0)]


@pytest.mark.parametrize("policy,victims", [("coop", ["c", "d"]), ("dtr", ["a", "b", "c", "d"]),
                                             ("dte", ["a", "b", "c", "d"])])
def test_pinned_and_unevictable_end_a_window(policy, victims):
    m, s = build(BLOCKED, policy)
    assert [b["state"] for b in m.snapshot()] == ["resident", "pinned", "resident", "unevictable",
                                                  "resident", "resident"]
    assert m.unevictable_bytes == 2 * U and m.largest_window() == 2 * U
    n = m.allocate(2 * U, 1.0)
    m.check_invariants()
    assert names(s, m.trace.evictions()) == victims
    assert n.offset == 4 * U
    assert s["P"].state is State.RESIDENT and s["X"].state is State.RESIDENT


def test_pin_and_unpin_open_and_close_windows():
    m, s = build([("a", 1, 1.0), ("b", 1, 1.0), ("c", 1, 50.0), ("d", 1, 50.0)], "coop")
    assert m.plan(2 * U).victims == (0, 1)
    m.pin(s["a"])
    m.pin(s["a"])                       # pins count
    assert m.plan(2 * U).victims == (1, 2)
    m.unpin(s["a"])
    assert m.plan(2 * U).victims == (1, 2)      # still pinned once
    assert m.snapshot()[0]["state"] == "pinned"
    m.unpin(s["a"])
    assert m.plan(2 * U).victims == (0, 1)
    m.make_unevictable(s["b"])
    assert m.plan(2 * U).victims == (2, 3)
    assert m.snapshot()[1]["state"] == "unevictable"
    m.check_invariants()


def test_a_pinned_restore_is_pinned():
    m, s = build([("a", 1, 1.0), ("b", 1, 2.0), ("c", 1, 3.0)], "coop")
    m.evict(s["a"])
    assert m.restore(s["a"], pinned=True) == 0
    assert s["a"].pins == 1
    m.allocate(U, 1.0)                  # must not take a: b is the cheapest evictable
    assert m.trace.evictions() == [s["a"].sid, s["b"].sid]
    m.check_invariants()


# ------------------------------------------------------------------------------------ cheap tensor partitioning
def test_expensive_low_cheap_high():
    m = Memory(8 * U, cheap_density=4.0)           # expensive: cost >= 4 * nbytes
    e1 = m.allocate(U, 4.0 * U)                     # exactly at the threshold: expensive
    c1 = m.allocate(U, 4.0 * U - 1)                 # just below: cheap
    e2 = m.allocate(2 * U, 1e9)
    c2 = m.allocate(U, 0.0)
    m.check_invariants()
    assert (e1.expensive, c1.expensive, e2.expensive, c2.expensive) == (True, False, True, False)
    assert [e1.offset, e2.offset, c2.offset, c1.offset] == [0, U, 6 * U, 7 * U]
    assert [(b["offset"], b["sid"], b.get("expensive")) for b in m.snapshot()] == [
        (0, e1.sid, True), (U, e2.sid, True), (3 * U, None, None), (6 * U, c2.sid, False), (7 * U, c1.sid, False)]


def test_cheap_goes_to_the_high_edge_of_a_hole():
    m = Memory(8 * U)
    a = m.allocate(U, 1e9)
    hole = m.allocate(3 * U, 1e9)
    m.allocate(U, 1e9)
    m.free(hole)                                    # free: [U, 4U) and [5U, 8U); best fit is the first
    c = m.allocate(U, 1.0)
    e = m.allocate(U, 1e9)
    assert (a.offset, c.offset, e.offset) == (0, 3 * U, U)
    m.check_invariants()


def test_partition_off_places_everything_low():
    m = Memory(8 * U, partition=False)
    offs = [m.allocate(U, cost).offset for cost in (1e9, 1.0, 1e9, 0.0)]
    assert offs == [0, U, 2 * U, 3 * U]


def test_partitioning_gathers_cheap_storages_into_one_window():
    got = {}
    for partition in (True, False):
        m = Memory(8 * U, partition=partition)
        for cost in (1e9, 1.0, 1e9, 1.0, 1e9, 1.0, 1e9, 1.0):   # interleaved expensive / cheap
            m.allocate(U, cost)
        m.allocate(4 * U, 1.0)
        got[partition] = sorted(m.trace.evictions())
    assert got[True] == [1, 3, 5, 7]     # the four cheap ones, gathered at the top of the arena
    assert got[False] == [0, 1, 2, 3]    # every four-unit run holds two expensive ones


# --------------------------------------------------------------------------------------- dte: adjacent free bytes
HOLEY = [("x", 1, 3.0), (".", 1, 0.0), ("y", 1, 3.0), ("z", 1, 2.0), ("w", 1, 2.0), ("v", 1, 100.0)]


@pytest.mark.parametrize("policy,victims,offset,evicted", [
    ("dtr", ["z", "w"], 3 * U, 2 * U),  # z and w are cheapest per byte; the hole is ignored
    ("dte", ["x"], 0, U),               # x counts the free unit beside it: 3 / 2 units beats 2 / 1 unit
    ("coop", ["x"], 0, U),
])
def test_dte_counts_adjacent_free_bytes(policy, victims, offset, evicted):
    m, s = build(HOLEY, policy)
    assert layout(m, s) == "x1 .1 y1 z1 w1 v1"
    n = m.allocate(2 * U, 1.0)
    m.check_invariants()
    assert names(s, m.trace.evictions()) == victims
    assert n.offset == offset
    assert (m.stats.evicted_bytes, m.stats.excess_bytes) == (evicted, 0)
    assert m.stats.fragmentation == pytest.approx(1 / 6)


# ------------------------------------------------------------------------------------------- recompute cost
NEIGHBOURS = [("p", 1, 5.0), ("A", 1, 100.0), ("q", 1, 1.0), ("r", 1, 1.0), ("B", 1, 100.0),
              ("s", 1, 2.0), ("t", 1, 2.0), ("C", 1, 100.0)]


def _c_column(m, s):
    """The c the policy reads for a resident storage (internal column), after bringing it up to date."""
    m._refresh_costs()
    return float(m._c[s.slot + 1])


@pytest.mark.parametrize("policy,before,after", [
    ("coop", ["q", "r"], ["s", "t"]),
    ("dtr", ["q", "r"], ["r", "s", "t"]),
])
def test_evicted_input_makes_a_storage_costlier(policy, before, after):
    m = Memory(8 * U, policy=policy, partition=False)
    s = {}
    for name, n, cost in NEIGHBOURS:               # q reads p; p is far from q in the arena
        s[name] = m.allocate(n * U, cost, inputs=[s["p"]] if name == "q" else ())
    assert layout(m, s) == "p1 A1 q1 r1 B1 s1 t1 C1"
    assert recompute_cost(s["q"]) == 1.0
    plan = m.plan(2 * U)
    assert names(s, [m.snapshot()[i]["sid"] for i in plan.victims]) == before
    m.evict(s["p"])                                # recomputing q would now need p first
    assert recompute_cost(s["q"]) == _c_column(m, s["q"]) == 1.0 + 5.0
    plan = m.plan(2 * U)
    assert names(s, [m.snapshot()[i]["sid"] for i in plan.victims]) == after
    m.allocate(2 * U, 1.0)
    assert names(s, m.trace.evictions()) == ["p"] + after
    m.check_invariants()


def test_recompute_cost_counts_each_evicted_ancestor_once():
    m = Memory(8 * U, partition=False)
    a = m.allocate(U, 1.0)
    b = m.allocate(U, 2.0, inputs=[a])
    c = m.allocate(U, 4.0, inputs=[b])
    d = m.allocate(U, 8.0, inputs=[c])
    e = m.allocate(U, 16.0, inputs=[a, c])         # reads two storages
    m.evict(a)
    assert _c_column(m, b) == recompute_cost(b) == 2 + 1
    assert _c_column(m, e) == 16 + 1
    assert _c_column(m, d) == 8                    # its input c is resident: a replay of d stops there
    m.evict(c)
    assert _c_column(m, b) == 2 + 1                # descendants do not count (Note [Recompute cost])
    assert _c_column(m, d) == 8 + 4
    assert _c_column(m, e) == 16 + 1 + 4
    m.evict(b)                                      # c's replay now needs b, and b's needs a
    assert _c_column(m, d) == 8 + 4 + 2 + 1
    assert _c_column(m, e) == 16 + 4 + 2 + 1        # a reached twice (directly and through c), counted once
    m.restore(b)
    assert _c_column(m, b) == 2 + 1
    assert _c_column(m, d) == 8 + 4
    m.restore(a)
    assert _c_column(m, b) == 2
    assert _c_column(m, e) == 16 + 4
    m.free(c)                                       # a freed storage is no longer recomputed by anyone
    m.check_invariants()
    m.evict(b)
    m.evict(d)
    m.check_invariants()


def test_a_write_adds_its_cost_and_inputs():
    m = Memory(8 * U, partition=False)
    a = m.allocate(U, 1.0)
    w = m.allocate(U, 3.0)
    b = m.allocate(U, 2.0, inputs=[a])
    m.add_write(b, 5.0, [w, b])                     # b += w: a replay of b runs its producer, then the write
    assert b.cost == 7.0 and [x.sid for x in b.inputs] == [a.sid, w.sid]
    m.evict(w)
    assert _c_column(m, b) == 7 + 3
    with pytest.raises(ValueError, match="only a resident storage can be written"):
        m.add_write(w, 1.0)
    m.check_invariants()


# ------------------------------------------------------------------------------------------------ OutOfBudget
@pytest.mark.parametrize("policy", POLICIES)
def test_out_of_budget_reports_and_changes_nothing(policy):
    m, s = build(BLOCKED, policy)
    m.advance(3.0)
    before = frozen(m)
    next_sid = m._next_sid
    with pytest.raises(OutOfBudget) as info:
        m.allocate(3 * U, 1.0, op="aten.mm.default")
    err = info.value
    assert (err.requested, err.budget, err.pinned, err.unevictable, err.largest_window, err.op) == (
        3 * U, 6 * U, U, U, 2 * U, "aten.mm.default")
    msg = str(err)
    assert "aten.mm.default" in msg and "1.50 KiB (1536 bytes)" in msg
    assert "Raise the budget" in msg and "512 bytes more" in msg and "smaller batch" in msg
    assert frozen(m) == before
    assert m._next_sid == next_sid
    assert m.trace.events[-1] == Event("out_of_budget", next_sid, -1, 3 * U, 3.0)
    m.check_invariants()
    m.allocate(2 * U, 1.0)                          # and the memory still works
    m.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_out_of_budget_on_restore_leaves_the_storage_evicted(policy):
    m, s = build([("a", 2, 1.0), ("b", 2, 1.0, {"pinned": True})], policy)
    m.evict(s["a"])
    m.allocate(U, 1.0, pinned=True)
    m.allocate(U, 1.0, evictable=False)
    before = frozen(m)
    with pytest.raises(OutOfBudget) as info:
        m.restore(s["a"])
    e = info.value
    assert (e.requested, e.pinned, e.unevictable, e.largest_window, e.restore) == (2 * U, 3 * U, U, 0, True)
    assert s["a"].state is State.EVICTED and s["a"].offset == -1
    assert frozen(m) == before
    m.check_invariants()


def test_out_of_budget_larger_than_the_arena():
    m, s = build([("a", 2, 1.0), ("b", 2, 1.0)])
    before = frozen(m)
    with pytest.raises(OutOfBudget) as info:
        m.allocate(5 * U, 1.0)
    assert (info.value.requested, info.value.budget, info.value.unevictable, info.value.largest_window) == (
        5 * U, 4 * U, 0, 4 * U)
    assert frozen(m) == before
    assert m.allocate(4 * U, 1.0).offset == 0       # everything may go for a request that fits the arena
    assert sorted(m.trace.evictions()) == [s["a"].sid, s["b"].sid]


# -------------------------------------------------------------------------------------------------- telemetry
def test_stats_and_trace_over_several_events():
    m, s = build(HOLEY, "dte")                     # x1 .1 y1 z1 w1 v1, all at clock 0
    m.advance(2.0)
    n1 = m.allocate(2 * U, 1.0)                    # event 1: 1 of 6 units free; x (with the free unit) serves it
    m.advance(1.0)
    n2 = m.allocate(U + 1, 2.0)                    # event 2: nothing free; n1 (c 1, 2 units, staleness 2) is
    s["n1"], s["n2"] = n1, n2                      #   the least c/(m s): 1/(1024 * 2)
    m.restore(s["x"])                              # event 3: z and w tie at 2/(512 * 4); z is lower
    m.check_invariants()
    assert layout(m, s) == "n22 y1 x1 w1 v1"
    st = m.stats
    assert (st.allocations, st.restores, st.eviction_events, st.evictions) == (8, 1, 3, 3)
    assert names(s, m.trace.evictions()) == ["x", "n1", "z"]
    assert (st.evicted_bytes, st.excess_bytes) == (4 * U, 0)
    assert st.fragmentation == pytest.approx((1 / 6 + 0 + 0) / 3)
    assert st.evicted_bytes == sum(m.table.round_up(e.nbytes) for e in m.trace.events if e.kind == "evict")
    assert 0 < st.search_seconds_max <= st.search_seconds
    assert st.search_seconds_per_event == pytest.approx(st.search_seconds / 3)
    assert st.peak_bytes == 6 * U
    assert n2.nbytes == U + 1 and m.snapshot()[0] == {"offset": 0, "size": 2 * U, "state": "resident",
                                                      "sid": n2.sid, "nbytes": U + 1, "cost": 2.0,
                                                      "expensive": False}
    d = st.as_dict()
    assert d["fragmentation"] == st.fragmentation and d["budget"] == 6 * U and d["eviction_events"] == 3


def test_trace_events_read_like_a_log():
    m = Memory(4 * U, partition=False)
    a = m.allocate(2 * U, 1.0)
    m.advance(1.5)
    b = m.allocate(U, 2.0)
    c = m.allocate(U - 7, 3.0)
    m.advance(0.5)
    d = m.allocate(2 * U, 4.0)                     # evicts a: 1/3 against b, c: 2/1.5 + 3/1.5
    m.free(b)
    m.restore(a)                                   # b's free unit and c (3/1.5) beat d and b's unit (4/1)
    assert list(m.trace.events) == [
        Event("alloc", a.sid, 0, 2 * U, 0.0),
        Event("alloc", b.sid, 2 * U, U, 1.5),
        Event("alloc", c.sid, 3 * U, U - 7, 1.5),
        Event("evict", a.sid, -1, 2 * U, 2.0),
        Event("alloc", d.sid, 0, 2 * U, 2.0),
        Event("free", b.sid, -1, U, 2.0),
        Event("evict", c.sid, -1, U - 7, 2.0),
        Event("restore", a.sid, 2 * U, 2 * U, 2.0),
    ]
    assert m.stats.peak_bytes == 4 * U and m.used_bytes == 4 * U
    m.check_invariants()


def test_trace_is_bounded():
    m = Memory(64 * U, trace_len=3)
    ss = [m.allocate(U, 1.0) for _ in range(5)]
    assert [e.sid for e in m.trace.events] == [2, 3, 4]
    m.free(ss[0])
    assert [(e.kind, e.sid) for e in m.trace.events] == [("alloc", 3), ("alloc", 4), ("free", 0)]


def test_no_eviction_no_event():
    m = Memory(8 * U)
    for _ in range(8):
        m.allocate(U, 1.0)
    assert m.stats.eviction_events == 0 and m.stats.fragmentation == 0.0 and m.stats.search_seconds_per_event == 0.0
    assert m.stats.peak_bytes == 8 * U


def test_reset_forgets_everything():
    m, s = build(SCATTERED)
    m.allocate(2 * U, 1.0)
    m.reset()
    assert m.snapshot() == [{"offset": 0, "size": 8 * U, "state": "free", "sid": None}]
    assert m.stats.as_dict() == Memory(8 * U).stats.as_dict() and list(m.trace.events) == [] and m.clock == 0.0
    m.check_invariants()


# ------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,exc", [
    ({"nbytes": 0}, ValueError), ({"nbytes": -U}, ValueError), ({"nbytes": 4096.0}, TypeError),
    ({"nbytes": True}, TypeError), ({"nbytes": "4096"}, TypeError), ({"nbytes": 100}, ValueError),
    ({"policy": "lru"}, ValueError), ({"policy": None}, ValueError),
    ({"partition": 1}, TypeError), ({"cheap_density": -1.0}, ValueError),
    ({"cheap_density": math.inf}, ValueError), ({"alignment": 384}, ValueError),
])
def test_bad_constructor_arguments(kwargs, exc):
    args = {"nbytes": 8 * U} | kwargs
    with pytest.raises(exc):
        Memory(args.pop("nbytes"), **args)


def test_budget_accepts_numpy_ints():
    assert Memory(np.int64(8 * U)).budget == 8 * U


def _other_memory_storage():
    return Memory(4 * U).allocate(U, 1.0)


BAD_CALLS = [
    # (name, call on (m, named), exception, message fragment)
    ("zero size", lambda m, s: m.allocate(0, 1.0), ValueError, "positive"),
    ("negative size", lambda m, s: m.allocate(-U, 1.0), ValueError, "positive"),
    ("float size", lambda m, s: m.allocate(512.0, 1.0), TypeError, "int"),
    ("bool size", lambda m, s: m.allocate(True, 1.0), TypeError, "int"),
    ("negative cost", lambda m, s: m.allocate(U, -1.0), ValueError, ">= 0"),
    ("nan cost", lambda m, s: m.allocate(U, math.nan), ValueError, ">= 0"),
    ("inf cost", lambda m, s: m.allocate(U, math.inf), ValueError, ">= 0"),
    ("bool cost", lambda m, s: m.allocate(U, True), TypeError, "number"),
    ("str cost", lambda m, s: m.allocate(U, "1"), TypeError, "number"),
    ("bad input", lambda m, s: m.allocate(U, 1.0, inputs=[1]), TypeError, "Storage"),
    ("negative advance", lambda m, s: m.advance(-1.0), ValueError, ">= 0"),
    ("nan advance", lambda m, s: m.advance(math.nan), ValueError, ">= 0"),
    ("bool advance", lambda m, s: m.advance(True), TypeError, "number"),
    ("free twice", lambda m, s: m.free(s["gone"]), ValueError, "already freed"),
    ("free pinned", lambda m, s: m.free(s["P"]), ValueError, "pinned"),
    ("unpin unpinned", lambda m, s: m.unpin(s["a"]), ValueError, "not pinned"),
    ("unpin evicted", lambda m, s: m.unpin(s["ev"]), ValueError, "not pinned"),
    ("pin evicted", lambda m, s: m.pin(s["ev"]), ValueError, "evicted"),
    ("pin freed", lambda m, s: m.pin(s["gone"]), ValueError, "freed"),
    ("evict evicted", lambda m, s: m.evict(s["ev"]), ValueError, "evicted"),
    ("evict freed", lambda m, s: m.evict(s["gone"]), ValueError, "freed"),
    ("evict pinned", lambda m, s: m.evict(s["P"]), ValueError, "pinned"),
    ("restore resident", lambda m, s: m.restore(s["a"]), ValueError, "resident"),
    ("restore freed", lambda m, s: m.restore(s["gone"]), ValueError, "freed"),
    ("evict a non-storage", lambda m, s: m.evict("a"), TypeError, "Storage"),
    ("touch a non-storage", lambda m, s: m.touch(None), TypeError, "Storage"),
    ("evict another memory's", lambda m, s: m.evict(_other_memory_storage()), ValueError, "belong"),
    ("touch another memory's", lambda m, s: m.touch(_other_memory_storage()), ValueError, "belong"),
]


@pytest.mark.parametrize("call,exc,match", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_raise_and_change_nothing(call, exc, match):
    m, s = build([("a", 1, 1.0), ("P", 1, 1.0, {"pinned": True}), ("ev", 1, 1.0), ("gone", 1, 1.0),
                  (".", 4, 1.0)])
    m.evict(s["ev"])
    m.free(s["gone"])
    m.advance(1.0)
    before = frozen(m)
    events = list(m.trace.events)
    with pytest.raises(exc, match=match):
        call(m, s)
    assert frozen(m) == before
    assert list(m.trace.events) == events
    assert (s["ev"].state, s["gone"].state, s["P"].pins) == (State.EVICTED, State.FREED, 1)
    m.check_invariants()


def test_zero_cost_is_allowed():
    # a storage that costs nothing to recompute is the best victim there is
    m, s = build([("a", 1, 0.0), ("b", 1, 1.0)])
    assert m.plan(U).victims == (0,)
