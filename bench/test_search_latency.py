"""Search latency per eviction event: `Memory.plan(nbytes)`, the pure victim search, for coop, dtr and dte.

Setup (deterministic, numpy RNG seeded per count): an arena exactly as large as `count + count // 20` storages
of mixed sizes (most 1-8 units of 512 bytes, some 9-64, a few 65-256), placed with cheap tensor partitioning,
the clock advanced between allocations, 1 in 20 of them freed again to leave holes, 1 % pinned and 1 %
unevictable, a random fifth touched at the end. That leaves exactly `count` resident storages. The request is
twice the largest free block (at least 32 units), so no free block serves it and every policy needs several
victims (asserted below, with the plan's purity).

What is timed is `memory.plan(request)`: reading the block columns (`Memory._columns`) plus the policy's search,
i.e. the search latency of one allocation that needs eviction. `apply` (the eviction itself) is not timed.
coop runs twice, with the compiled window search (`path=compiled`, numba) and with the numpy one
(`path=numpy`); the two must return the same plan.

`test_search_latency_after_a_mutation` times the same search when the block table changed since its columns
were last read (as in a real step, where blocks are placed and released between two evictions): before each
round, untimed, one block is released and placed again at the same offset, so the table is the same but its
address-ordered columns must be brought up to date (Note [Block table]).

Run: `.venv/bin/python -m pytest bench/test_search_latency.py --benchmark-only
      --benchmark-json=bench/results/search_latency.json`; results and targets in bench/results/search_latency.md.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from coop_arena import Memory
from coop_arena import policy as _policy

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


PATHS = [("coop", "compiled"), ("coop", "numpy"), ("dtr", "-"), ("dte", "-")]


@pytest.fixture
def search_path(request):
    """Selects the coop window search for one benchmark: "compiled" (skipped without numba) or "numpy"."""
    path = request.param
    compiled = _policy.compiled_window()
    if path == "compiled" and compiled is None:
        pytest.skip("numba is not installed")
    _policy._COMPILED[:] = [None] if path == "numpy" else [compiled]
    yield path
    _policy._COMPILED[:] = [compiled]


def _checked(policy, count):
    m, request = prepared(policy, count)
    assert not m.fits(request), "the request must need eviction"
    plan = m.plan(request)
    assert plan is not None and len(plan.victims) >= MIN_VICTIMS, f"{policy}: {plan}"
    return m, request, plan


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("policy,search_path", PATHS, indirect=["search_path"])
def test_search_latency(benchmark, policy, search_path, count):
    m, request, plan = _checked(policy, count)
    snap = m.snapshot()
    benchmark.extra_info.update(victims=len(plan.victims), request_bytes=request, blocks=len(m.table),
                                resident=count)
    got = benchmark(m.plan, request)
    assert got == plan                                   # the search is pure: same plan, nothing changed
    assert m.snapshot() == snap


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("policy,search_path", PATHS, indirect=["search_path"])
def test_search_latency_after_a_mutation(benchmark, policy, search_path, count):
    m, request, plan = _checked(policy, count)
    snap = m.snapshot()
    table = m.table
    b = snap[len(snap) // 2 + next(i for i, b in enumerate(snap[len(snap) // 2 :]) if b["sid"] is not None)]
    owner = int(table.owners[table.index_of(b["offset"])])

    def mutate():
        table.release(b["offset"])
        table.place_at(b["offset"], b["size"], owner)

    benchmark.extra_info.update(victims=len(plan.victims), blocks=len(table), resident=count)
    got = benchmark.pedantic(m.plan, args=(request,), setup=mutate, rounds=400 if policy == "coop" else 20,
                             warmup_rounds=1)
    assert got == plan
    assert m.snapshot() == snap


# ------------------------------------------------------------------------------------------- whole decisions
CHAIN_LAYERS = {"2.4k": 400, "10k": 1_650}  # Linear(64) + Tanh layers: about 2,400 and 10,000 storages


@functools.cache
def _chain(layers: int):
    """A dry run (meta) of a Linear(64)+Tanh chain: the step, and its peak with ample memory."""
    import torch
    import coop_arena
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
    model, x = torch.nn.Sequential(*mods).to("meta"), torch.empty(64, 64, device="meta")

    def step(budget):
        with budget:
            model(x).sum().backward()
        for p in model.parameters():
            p.grad = None
    probe = coop_arena.Budget(1 << 40, device="meta")
    step(probe)
    return step, probe.stats.peak_bytes, probe.stats.ops


@pytest.mark.parametrize("size", list(CHAIN_LAYERS))
@pytest.mark.parametrize("policy,search_path", PATHS, indirect=["search_path"])
def test_decision_time_per_event(benchmark, policy, search_path, size, monkeypatch):
    """Everything a placement that needs room spends choosing (cost refresh, prices, window search, move,
    relocation and compaction plans: `stats.search_seconds`), per eviction event, on the chain's dry run at 40 %
    of its peak. The median over the events of the last round is the figure (extra_info)."""
    import coop_arena
    from coop_arena.memory import Memory
    step, peak, ops = _chain(CHAIN_LAYERS[size])
    times = []
    apply = Memory._apply

    def timed(self, plan, need, search_seconds, *args, **kwargs):  # read the time the decision took
        times.append(search_seconds)
        return apply(self, plan, need, search_seconds, *args, **kwargs)
    monkeypatch.setattr(Memory, "_apply", timed)
    budgets = []

    def setup():
        times.clear()
        budgets.append(coop_arena.Budget(int(0.4 * peak), device="meta", policy=policy, replay=False))
        return (budgets[-1],), {}
    benchmark.pedantic(step, setup=setup, rounds=3, warmup_rounds=1)
    st = budgets[-1].stats
    assert st.eviction_events == len(times) > 0
    times.sort()
    benchmark.extra_info.update(ops=ops, events=len(times), median_us=times[len(times) // 2] * 1e6,
                                p90_us=times[int(len(times) * 0.9)] * 1e6, mean_us=st.search_seconds_per_event * 1e6,
                                relocations=st.relocations)
