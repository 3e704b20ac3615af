"""CPU step time of real models: plain PyTorch, a Budget with ample memory (the dispatch overhead) and a
Budget at 50 % of the plain peak, per policy, side by side in one run. Targets: ample <= 1.10x plain,
50 % <= 1.35x plain. `python bench/report.py step_time` turns the JSON into bench/results/step_time.md."""

from __future__ import annotations

import functools

import pytest
import torch

import coop_arena
from coop_arena.examples import CNN, GPT

torch.set_num_threads(1)

MODELS = {
    "gpt": (lambda: GPT(vocab=512, d=256, heads=4, layers=2, seq=128),
            lambda: torch.randint(0, 512, (8, 128), generator=torch.Generator().manual_seed(0))),
    "cnn": (lambda: CNN(c=32, blocks=2),
            lambda: torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(0))),
}


def _step(model, x, budget):
    model.zero_grad(set_to_none=True)
    if budget is None:
        model(x).float().square().mean().backward()
    else:
        with budget:
            model(x).float().square().mean().backward()


@functools.cache
def _peak(name) -> int:
    make, data = MODELS[name]
    torch.manual_seed(0)
    probe = coop_arena.Budget(1 << 31, device="cpu")
    _step(make(), data(), probe)
    return probe.stats.peak_bytes


CONFIGS = [("plain", None, None), ("ample", "coop", None)] + [("half", p, 0.5) for p in ("coop", "dtr", "dte")]


@pytest.mark.parametrize("config,policy,ratio", CONFIGS, ids=[f"{c}-{p}" for c, p, _ in CONFIGS])
@pytest.mark.parametrize("name", list(MODELS))
def test_step_time(benchmark, name, config, policy, ratio):
    make, data = MODELS[name]
    torch.manual_seed(0)
    model, x = make(), data()
    budget = None
    if config == "ample":
        budget = coop_arena.Budget(1 << 31, device="cpu", policy=policy)
    elif config == "half":
        budget = coop_arena.Budget(int(ratio * _peak(name)), device="cpu", policy=policy)
    benchmark.group = name
    benchmark.extra_info.update(model=name, config=config, policy=policy, peak=_peak(name))
    benchmark.pedantic(_step, args=(model, x, budget), rounds=5, warmup_rounds=1, iterations=1)
    if budget is not None:
        st = budget.stats
        benchmark.extra_info.update(evictions=st.evictions, rematerializations=st.rematerializations,
                                    compute_overhead=st.compute_overhead, budget=st.budget)
        if config == "half":
            assert st.evictions > 0
