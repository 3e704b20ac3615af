"""`make demo`: train a small GPT-style model on the CPU under half its plain footprint, once per policy, and
compare with plain PyTorch: memory, evictions, recomputations, overhead, and bitwise-equal parameters.

Plain PyTorch's footprint is measured with the profiler (coop_arena.footprint), as a user would measure it, and
each Budget's `footprint_peak` (its arena plus what its ops allocated outside it, Note [Headroom]) is reported
next to it. The first block of a Budget, which learns its headroom, may go over the budget: the warning that
says so (FootprintExceeded) is counted in the table's notes instead of printed.

Wall time is reported for the first step and for the later steps apart: the first step of a process pays
one-time costs (PyTorch's own warm-up, the engine's per-op caches, and for coop loading the compiled window
search, about a second with numba), which say nothing about the steady state a training loop runs in."""

from __future__ import annotations

import time
import warnings

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from .blocks import ALIGNMENT
from .budget import Budget
from .errors import CoopArenaError, FootprintExceeded
from .footprint import measure
from .evaluate import CONFIGS
from .examples import GPT
from .policy import POLICIES


def _fmt_bytes(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _make(seed=0):
    torch.manual_seed(seed)
    return GPT(vocab=256, d=128, heads=4, layers=4, seq=128)


def _batches(steps, batch=8, seq=128, vocab=256):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(steps)]


def train(budget: Budget | None, steps: int, desc: str):
    model = _make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = _batches(steps)
    times = []
    for i in tqdm(range(steps), desc=desc, leave=False, unit="step"):
        t0 = time.perf_counter()
        x, y = data[i]
        torch.manual_seed(100 + i)  # dropout draws the same bits in every run
        opt.zero_grad()
        if budget is None:
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
        else:
            with budget:
                loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return model, times, loss.detach().item()


def _ratio(times, plain, later: bool) -> str:
    """Wall time of the first step, or of the later steps together, against plain PyTorch's."""
    if not later:
        return f"{times[0] / plain[0]:.2f}x"
    return f"{sum(times[1:]) / sum(plain[1:]):.2f}x" if len(times) > 1 else "-"


def plain_footprint() -> int:
    """Plain PyTorch's footprint of a training step (the second: the first also makes the optimizer's state), model
    state (gradients, optimizer state) excluded, measured with the profiler."""
    model = _make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = 0
    for i, (x, y) in enumerate(_batches(2)):
        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()

        if i:
            out = measure(step, keep=lambda: [p.grad for p in model.parameters()]).excess
        else:
            step()
        opt.step()
    return out


def main(steps: int = 4, ratio: float = 0.5) -> int:
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)
    torch.set_num_threads(1)  # the same arithmetic in every run, and no spin-waiting on a shared machine
    peak = plain_footprint()
    nbytes = int(ratio * peak)
    ref, t_plain, loss = train(None, steps, "plain PyTorch")
    ref_state = [t.detach().clone() for t in ref.state_dict().values()]
    console.print(f"GPT-style model, {sum(p.numel() for p in ref.parameters()):,} parameters, batch 8 x 128 "
                  f"tokens, {steps} AdamW steps on the CPU; plain PyTorch's footprint {_fmt_bytes(peak)} (profiled, "
                  f"model state excluded); budget {_fmt_bytes(nbytes)} = {ratio:.0%} of it.")
    table = Table(title="coop_arena: one training run per policy under the same hard budget")
    for col in ("policy", "footprint", "budget", "arena", "evictions", "recomputations",
                "compute overhead", "wall time vs plain: first step", "later steps", "parameters identical"):
        table.add_column(col, justify="right")
    table.add_row("plain", _fmt_bytes(peak), "-", "-", "-", "-", "1.00x", "1.00x", "1.00x" if steps > 1 else "-", "reference")
    over, last_over = [], False
    ok = True
    failures = []
    for policy in POLICIES:
        budget = Budget(max(nbytes, ALIGNMENT), device="cpu", **CONFIGS[policy])  # the evaluation's baselines
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", FootprintExceeded)
                model, t, _ = train(budget, steps, f"policy {policy}")
            over += [policy for w in caught if issubclass(w.category, FootprintExceeded)]
        except CoopArenaError as e:  # a --ratio below what the step can run at: reported, like `plan` does
            ok = False
            failures.append(f"{policy} does not fit: {type(e).__name__}: {e}")
            table.add_row(policy, "-", _fmt_bytes(budget.nbytes), "-", "-", "-", "-", "-", "-",
                          f"no ({type(e).__name__})")
            continue
        same = all(torch.equal(a, b.detach()) for a, b in zip(ref_state, model.state_dict().values()))
        ok &= same
        st = budget.stats
        last_over |= st.footprint_peak > st.cap
        table.add_row(policy, _fmt_bytes(st.footprint_peak), _fmt_bytes(st.cap), _fmt_bytes(st.arena_bytes), str(st.evictions),
                      str(st.rematerializations), f"{st.compute_overhead:.2f}x", _ratio(t, t_plain, False), _ratio(t, t_plain, True),
                      "yes (bitwise)" if same else "NO")
    console.print(table)
    for line in failures:
        console.print(line, highlight=False)
    if over:
        console.print(f"The first step of {', '.join(dict.fromkeys(over))} went over the budget by its temporaries "
                      f"while the Budget learned the headroom it keeps for them outside the arena "
                      f"(FootprintExceeded); " + ("the last step went over it too." if last_over else
                                           "the last step stayed within it."), highlight=False)
    console.print("Footprint: the last step's arena plus the most bytes its ops held outside it; arena: the part of "
                  "the budget it was given. Counts and overhead are for the last step; compute overhead is analytic (FLOPs and bytes), "
                  "wall time includes the Python dispatch of every op; the first step also pays one-time loading "
                  "(for coop, the compiled window search), the later steps are the steady state.")
    return 0 if ok else 1
