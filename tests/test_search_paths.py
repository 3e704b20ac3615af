"""The searches' fast paths make the decisions of their plain formulations, bit for bit.

- coop: the compiled window search (numba, where installed) and the numpy one return equal plans (victims,
  range, cost as the same float) and leave `h` equal, on random tables small and large, with many ties.
- dtr / dte: the sorted-scores-plus-heap loop (Note [DTR loop]) equals the original loop, kept here as
  `reference_dtr`: one argmin over all scores per victim and a walk over the free blocks to measure each run.
- Memory: the same random program run with the compiled search and with the numpy one gives the same trace.
- The rest of a decision (Note [Compiled decision] in compiled.py): the compiled prices have the bits of the
  numpy ones, and the compiled move plan picks the same window, moves and holes as the Python one.
"""

from __future__ import annotations

import logging
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_memory_properties import SETTINGS, U, Driver, as_tuple, columns, move_layouts, step_st

from coop_arena import Memory, OutOfBudget, policy
from coop_arena.policy import BLOCKED, EVICTABLE, FREE, EvictionPlan, coop_window, coop_window_numpy, plan_dtr

COMPILED = policy.compiled_window()
needs_numba = pytest.mark.skipif(COMPILED is None, reason="numba is not installed: only the numpy search exists")


@st.composite
def big_columns(draw):
    """Up to 600 blocks of 1-8 units; c log-normal with a share of exact ties, staleness varied, a few BLOCKED."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 600))
    sizes = rng.integers(1, 9, n) * U
    kind = rng.choice(np.array([FREE, EVICTABLE, BLOCKED], np.int8), n, p=[0.1, 0.85, 0.05])
    c = np.exp(rng.normal(8.0, 2.0, n))
    c[rng.random(n) < 0.3] = 1024.0                  # ties
    c[kind == FREE] = 0.0
    clock = float(rng.integers(1, 1000))
    last = np.floor(rng.random(n) * clock)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    need = int(rng.integers(1, max(2, int(sizes.sum()) // U // draw(st.sampled_from([1, 4, 20]))) + 1)) * U
    return offsets, sizes, kind, c, last, clock, need


def _h(kind, c, last, clock):
    h = policy.heuristic(c, last, clock)
    h[kind != EVICTABLE] = 0.0
    return h


def _both(cols):
    offsets, sizes, kind, c, last, clock, need = cols
    h1, h2 = _h(kind, c, last, clock), _h(kind, c, last, clock)
    lo, r, cost = COMPILED(offsets, sizes, kind, h1, need)
    fast = None if r < 0 else policy._window_plan(offsets, sizes, kind, lo, r, cost)
    plain = coop_window_numpy(offsets, sizes, kind, h2, need)
    assert as_tuple(fast) == as_tuple(plain)
    assert h1.tobytes() == h2.tobytes()  # the same in-place zeroing
    return plain


@needs_numba
@settings(max_examples=300, **SETTINGS)
@given(cols=columns(dyadic=False))
def test_compiled_equals_numpy_on_small_tables(cols):
    _both(cols)


@needs_numba
@settings(max_examples=200, **SETTINGS)
@given(cols=big_columns())
def test_compiled_equals_numpy_on_large_tables(cols):
    _both(cols)


@needs_numba
def test_the_dispatcher_takes_the_compiled_search_and_falls_back(monkeypatch):
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 9, 200) * U
    kind = np.where(rng.random(200) < 0.1, FREE, EVICTABLE).astype(np.int8)
    c = np.where(kind == FREE, 0.0, rng.random(200) * 1e4)
    offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    calls = []

    def spy(*args):
        calls.append(1)
        return COMPILED(*args)

    monkeypatch.setattr(policy, "_COMPILED", [spy])
    fast = coop_window(offsets, sizes, kind, c.copy(), 40 * U)
    monkeypatch.setattr(policy, "_COMPILED", [None])
    plain = coop_window(offsets, sizes, kind, c.copy(), 40 * U)
    assert calls == [1] and fast == plain and len(plain.victims) >= 2


def test_an_unusable_numba_falls_back_to_numpy(monkeypatch, caplog):
    """numba installed but failing on import (here: no cache directory it may write): the numpy search runs, and
    the reason is logged once."""
    broken = types.ModuleType("coop_arena.compiled")

    def __getattr__(name):
        raise RuntimeError("cannot cache function 'window': no locator available for file 'compiled.py'")

    broken.__getattr__ = __getattr__
    monkeypatch.setitem(sys.modules, "coop_arena.compiled", broken)
    monkeypatch.setattr(policy, "_COMPILED", [])
    with caplog.at_level(logging.WARNING, logger="coop_arena.policy"):
        assert policy.compiled_window() is None
    assert "numba unusable (cannot cache function" in caplog.text
    offsets, sizes = np.array([0, U, 3 * U]), np.array([U, 2 * U, U])
    plan = coop_window(offsets, sizes, np.array([EVICTABLE] * 3, np.int8), np.array([1.0, 0.5, 2.0]), 2 * U)
    assert plan == EvictionPlan((1,), U, 3 * U, 0.5, "coop")


# ------------------------------------------------------------------------------------------------- dtr / dte
def _run(freeish, i):
    lo = hi = i
    n = len(freeish)
    while lo > 0 and freeish[lo - 1]:
        lo -= 1
    while hi + 1 < n and freeish[hi + 1]:
        hi += 1
    return lo, hi


def reference_dtr(offsets, sizes, kind, c, last, clock, need, *, adjacent_free=False):
    """The original DTR / DTE loop: one argmin over every score per victim, runs measured by walking."""
    ev = np.nonzero(kind == EVICTABLE)[0]
    if ev.size == 0:
        return None
    n = len(sizes)
    freeish = kind == FREE
    stale = clock - last[ev] + 1.0
    m = sizes[ev].astype(np.float64)
    if adjacent_free:
        left_free = np.where((ev > 0) & freeish[np.maximum(ev - 1, 0)], sizes[np.maximum(ev - 1, 0)], 0)
        right_free = np.where((ev + 1 < n) & freeish[np.minimum(ev + 1, n - 1)], sizes[np.minimum(ev + 1, n - 1)], 0)
        m = m + left_free + right_free
    score = c[ev] / (m * stale)
    pos = {int(b): j for j, b in enumerate(ev)}
    chosen, total = [], 0.0
    while True:
        j = int(np.argmin(score))
        if not np.isfinite(score[j]):
            return None
        i = int(ev[j])
        total += float(score[j])
        score[j] = np.inf
        freeish[i] = True
        chosen.append(i)
        lo, hi = _run(freeish, i)
        if int(sizes[lo : hi + 1].sum()) >= need:
            return EvictionPlan(tuple(sorted(chosen)), int(offsets[lo]), int(offsets[hi] + sizes[hi]), total,
                                "dte" if adjacent_free else "dtr")
        if adjacent_free:
            for nb in (lo - 1, hi + 1):
                k = pos.get(nb)
                if k is not None and np.isfinite(score[k]):
                    side = 0
                    if nb > 0 and freeish[nb - 1]:
                        x, y = _run(freeish, nb - 1)
                        side += int(sizes[x : y + 1].sum())
                    if nb + 1 < n and freeish[nb + 1]:
                        x, y = _run(freeish, nb + 1)
                        side += int(sizes[x : y + 1].sum())
                    score[k] = c[nb] / ((sizes[nb] + side) * (clock - last[nb] + 1.0))


def _no_adjacent_free(cols):
    """Merge adjacent FREE blocks of drawn columns into one, as a real table keeps them."""
    offsets, sizes, kind, c, last, clock, need = cols
    keep = np.ones(len(sizes), bool)
    keep[1:] = ~((kind[1:] == FREE) & (kind[:-1] == FREE))
    starts = np.flatnonzero(keep)
    sizes = np.add.reduceat(sizes, starts)
    return (np.concatenate(([0], np.cumsum(sizes)[:-1])), sizes, kind[starts], c[starts], last[starts], clock, need)


@pytest.mark.parametrize("adjacent_free", [False, True])
@settings(max_examples=250, **SETTINGS)
@given(cols=st.one_of(columns(dyadic=False), columns(dyadic=True), big_columns()))
def test_dtr_loop_equals_the_original(cols, adjacent_free):
    cols = _no_adjacent_free(cols)
    got = plan_dtr(*cols, adjacent_free=adjacent_free)
    assert as_tuple(got) == as_tuple(reference_dtr(*cols, adjacent_free=adjacent_free))


# ------------------------------------------------------------------------------------------------- Memory
@needs_numba
def test_memory_decides_the_same_with_either_search():
    """Random programs (the property test's steps) on two Memory objects, one searching with the compiled window
    and one with numpy: the traces, layouts and counters agree; enough evictions happen for this to mean it."""
    evictions = []

    @settings(max_examples=25, **SETTINGS)
    @given(walk=st.lists(step_st, min_size=150, max_size=150), partition=st.booleans())
    def same(walk, partition):
        runs = []
        for path in (COMPILED, None):
            policy._COMPILED[:] = [path]
            try:
                d = Driver("coop", partition)
                for op, a, b in walk:
                    d.step(op, a, b)
                runs.append((list(d.m.trace.events), d.m.snapshot(), d.m.stats.as_dict()["evictions"]))
            finally:
                policy._COMPILED[:] = [COMPILED]
        assert runs[0] == runs[1]
        evictions.append(runs[0][2])

    same()
    assert sum(evictions) >= 500, evictions


# ------------------------------------------------------------------------------------- the rest of a decision
@needs_numba
@settings(max_examples=60, **SETTINGS)
@given(cols=big_columns())
def test_compiled_prices_have_the_bits_of_numpy(cols):
    from coop_arena import compiled
    offsets, sizes, kind, c, last, clock, _ = cols
    rng = np.random.default_rng(len(sizes))
    own = rng.permutation(len(sizes))  # the rows of the per-slot columns, in a block order of their own
    stale = clock - last[own]
    stale += 1.0
    want = (kind[own], c[own] / stale, 2.0 * sizes / stale)
    got = compiled.prices(own, kind, c, last, sizes, clock)
    assert all(g.tobytes() == w.tobytes() and g.dtype == w.dtype for g, w in zip(got, want))


def _move_case(blocks, need_units):
    m = Memory(sum(u for _, u, _ in blocks) * U, policy="coop", partition=False)
    holes = []
    for kind, units, cost in blocks:
        s = m.allocate(units * U, cost, pinned=kind == "pinned")
        if kind == "free":
            holes.append(s)
    for s in holes:
        m.free(s)
    copies = []
    m.mover = lambda src, dst, n: copies.append((src, dst, n))
    try:
        m.allocate(need_units * U, 1.0)
    except OutOfBudget:
        copies.append("out of budget")
    stats = {k: v for k, v in m.stats.as_dict().items() if not k.startswith("search_seconds")}  # (timings)
    return copies, m.snapshot(), [(e.kind, e.sid, e.offset) for e in m.trace.events], stats


@needs_numba
def test_the_compiled_move_plan_moves_as_the_python_one():
    """Layouts where a copy into a hole (or into the range of a cheaper block evicted for it) beats an
    eviction, with reruns when a block finds no destination: the same moves, layout, trace and stats."""
    moved = []

    @settings(max_examples=1000, **SETTINGS)
    @given(case=move_layouts())
    def same(case):
        runs = []
        for path in (COMPILED, None):
            policy._COMPILED[:] = [path]
            try:
                runs.append(_move_case(*case))
            finally:
                policy._COMPILED[:] = [COMPILED]
        assert runs[0] == runs[1]
        moved.append(runs[0][3]["relocations"])

    same()
    assert sum(1 for n in moved if n) >= 25, sum(1 for n in moved if n)  # enough cases moved a block for the comparison to mean it


# ------------------------------------------------------------------------------------------ compiling
_COLD_OR_WARM = """
import gc, json, sys, types
sys.path.insert(0, {tests!r})
gc.disable()  # (what numba's tracebacks hold then stays until a full collection: what a young one missed)
import torch
torch.set_num_threads(1)
import coop_arena
from coop_arena import compiled
from training import train
probe = coop_arena.Budget(1 << 28, device="cpu", headroom=0)
train("mlp", probe, steps=1)
budget = coop_arena.Budget(int(0.4 * probe.stats.peak_bytes), device="cpu", headroom=0)
held = []
exit_ = type(budget).__exit__
def outermost(f):
    while f.f_back is not None:
        f = f.f_back
    return f
def spy(self, *exc):  # frames of this thread's finished calls still alive at the block's exit
    stack, f = set(), sys._getframe()
    while f is not None:
        stack.add(id(f))
        f = f.f_back
    here = outermost(sys._getframe())
    held.extend(f"{{o.f_code.co_filename}}:{{o.f_code.co_name}}" for o in gc.get_objects()
                if isinstance(o, types.FrameType) and id(o) not in stack and outermost(o) is here
                and "numba" not in o.f_code.co_filename)
    return exit_(self, *exc)
type(budget).__exit__ = spy
train("mlp", budget, steps=1)
print(json.dumps(dict(trace=[repr(e) for e in budget.trace], evictions=budget.stats.evictions, held=held,
                      signatures={{fn.__name__: len(fn.signatures) for fn, _ in compiled.SIGNATURES}})))
"""


@needs_numba
def test_a_cold_compile_cache_decides_as_a_warm_one_and_holds_no_frames(tmp_path):
    """Numba's type inference keeps tracebacks, which hold every frame above them (Note [Compiling off the engine's
    stack] in compiled.py): compiled on the engine's stack, an MLP's logits stayed alive until the block's exit
    (unless a young collection found the cycle first) and the first eviction of a process with a cold cache
    decided otherwise than with a warm one. Two processes share an empty cache and collect no cycles: the first
    compiles, the second loads; both make the same decisions, no frame of the program outlives its call, and no
    block compiles anything beyond SIGNATURES."""
    import json
    import os
    import subprocess
    from pathlib import Path

    code = _COLD_OR_WARM.format(tests=str(Path(__file__).parent))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert any(tmp_path.joinpath("numba").rglob("*.nbc"))  # the first run compiled into the cache
    assert cold["evictions"] > 0 and cold["trace"] == warm["trace"]
    assert cold["held"] == [] and warm["held"] == []
    assert all(n == 1 for n in cold["signatures"].values()), cold["signatures"]
