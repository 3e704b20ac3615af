"""One training step of the 100-layer chain (bench/chain.py) at half its plain peak, per policy, dry run on meta:
wall time of the step, and in extra_info its compute overhead divided by the optimal checkpointing schedule's
for the same budget (the target is <= 1.25). A step stops with Thrashing past `chain.MAX_OVERHEAD`; it is then
recorded as such, with the overhead it had reached.

Run: `.venv/bin/python -m pytest -q bench/test_chain.py --benchmark-only --benchmark-json=bench/results/chain_step.json`
(one round per policy: a thrashing step takes many seconds). The whole sweep is `python -m bench.chain`.
"""

from __future__ import annotations

import pytest
import torch

import coop_arena
from bench import chain
from coop_arena.errors import Thrashing
from coop_arena.evaluate import CONFIGS
from coop_arena.plan import step

N_LAYERS, RATIO = 100, 0.5


@pytest.mark.parametrize("policy", chain.POLICIES)
def test_chain_step(benchmark, policy):
    torch.set_num_threads(1)
    p = chain.measure(N_LAYERS)
    nbytes = int(RATIO * p.plain_peak)
    optimal = chain.optimal_overhead(N_LAYERS, nbytes)
    assert optimal is not None and optimal > 1.0
    model, inputs = chain.build(N_LAYERS)
    runs = []

    def one_step():
        budget = coop_arena.Budget(nbytes, device="meta", max_overhead=chain.MAX_OVERHEAD, **CONFIGS[policy])
        try:
            step(model, inputs, budget)
            runs.append(("fits", budget.stats))
        except Thrashing:
            runs.append((f"thrashes (> {chain.MAX_OVERHEAD:g}x)", budget.stats))

    benchmark.group = f"chain {N_LAYERS} layers, ratio {RATIO}"
    benchmark.pedantic(one_step, rounds=1, iterations=1)
    outcome, st = runs[-1]
    benchmark.extra_info.update(
        n_layers=N_LAYERS, ratio=RATIO, budget=nbytes, policy=policy, outcome=outcome,
        compute_overhead=st.compute_overhead, optimal_overhead=optimal,
        overhead_vs_optimal=st.compute_overhead / optimal, evictions=st.evictions,
        rematerializations=st.rematerializations)
    assert st.evictions > 0
