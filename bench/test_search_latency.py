"""Search latency per eviction event: `Memory.plan(nbytes)`, the pure victim search, for coop, dtr and dte.

Setup (deterministic, numpy RNG seeded per count): an arena exactly as large as `count + count // 20` storages
of mixed sizes (most 1-8 units of 512 bytes, some 9-64, a few 65-256), placed with cheap tensor partitioning,
the clock advanced between allocations, 1 in 20 of them freed again to leave holes, 1 % pinned and 1 %
unevictable, a random fifth touched at the end. That leaves exactly `count` resident storages. The request is
twice the largest free block (at least 32 units), so no free block serves it and every policy needs several
victims (asserted below, with the plan's purity).

What is timed is `memory.plan(request)`: reading the block columns (`Memory._columns`) plus the policy's search,
i.e. the search latency of one allocation that needs eviction. `apply` (the eviction itself) is not timed.

Run: `.venv/bin/python -m pytest bench/test_search_latency.py --benchmark-only
      --benchmark-json=bench/results/search_latency.json`; results and targets in bench/results/search_latency.md.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from coop_arena import Memory

U = 512
COUNTS = (1_000, 10_000)
POLICIES = ("coop", "dtr", "dte")
MIN_VICTIMS = 3


def _sizes(rng: np.random.Generator, n: int) -> np.ndarray:
    """Mixed sizes in units: 80 % small (1-8), 17 % medium (9-64), 3 % large (65-256)."""
    kind = rng.random(n)
    small = rng.integers(1, 9, n)
    medium = rng.integers(9, 65, n)
    large = rng.integers(65, 257, n)
    return np.where(kind < 0.80, small, np.where(kind < 0.97, medium, large))


@functools.cache
def prepared(policy: str, count: int) -> tuple[Memory, int]:
    """A Memory holding exactly `count` resident storages, and a request that needs several victims."""
    rng = np.random.default_rng(count)
    extra = count // 20                       # allocated, then freed: the holes
    n = count + extra
    units = _sizes(rng, n)
    # cost per byte spans both sides of the cheap/expensive threshold (cheap_density = 4 per byte)
    density = np.exp(rng.normal(np.log(4.0), 1.5, n))
    cost = units * U * density
    nbytes = units * U - rng.integers(0, 2, n) * rng.integers(1, U, n)   # some not a multiple of 512
    m = Memory(int(units.sum()) * U, policy=policy, trace_len=16)
    storages = []
    for i in range(n):
        storages.append(m.allocate(int(nbytes[i]), float(cost[i])))
        m.advance(float(rng.exponential(1.0)))
    assert m.table.free_bytes == 0
    order = rng.permutation(n)
    for i in order[:extra]:
        m.free(storages[i])
    for i in order[extra : extra + count // 100]:
        m.pin(storages[i])
    for i in order[extra + count // 100 : extra + 2 * (count // 100)]:
        m.make_unevictable(storages[i])
    for i in order[extra + 2 * (count // 100) :]:
        if rng.random() < 0.2:
            m.advance(float(rng.exponential(1.0)))
            m.touch(storages[i])
    assert len(m.resident()) == count
    m.check_invariants()
    request = max(2 * m.table.largest_free, 32 * U)
    return m, request


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("policy", POLICIES)
def test_search_latency(benchmark, policy, count):
    m, request = prepared(policy, count)
    assert not m.fits(request), "the request must need eviction"
    snap = m.snapshot()
    plan = m.plan(request)
    assert plan is not None and len(plan.victims) >= MIN_VICTIMS, f"{policy}: {plan}"
    benchmark.extra_info.update(victims=len(plan.victims), request_bytes=request, blocks=len(m.table),
                                resident=count)
    got = benchmark(m.plan, request)
    assert got == plan                                   # the search is pure: same plan, nothing changed
    assert m.snapshot() == snap
