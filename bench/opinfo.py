"""PyTorch's OpInfo database under a Budget: each sample's forward and backward, bitwise against plain PyTorch.

    python -m bench.opinfo --out bench/results/opinfo.md          # the whole database (make opinfo)
    python -m bench.opinfo --ops addbmm,linalg.eig --samples 8    # some ops

Every op of `op_db` on the CPU in float32, its first samples (`--samples`), functional and in-place variants. A
case runs `loss = sum(<outputs> * c)` (c fixed) and the gradients of the sample's tensors; it runs twice plainly
(a kernel whose bits differ between identical calls is `nondeterministic`, not compared further), once under an
empty TorchDispatchMode, and under Budgets: `ample` (nothing evicted) and `tight` (the smallest of a few budgets
from the ample run's lower bound up to 1.25x its peak that runs: tensors are evicted and recomputed), with coop, and with dtr at
`tight` in the full sweep. The outcome of a case is the worst of its Budget runs:

  exact        outputs and gradients bitwise plain PyTorch's (sizes and values; a NaN equals itself)
  mode         they differ from plain PyTorch's but equal the empty dispatch mode's: PyTorch computes them
               otherwise under any dispatch mode (`prod`'s backward); not caused by the Budget
  refused      a typed coop_arena error (UnsupportedOp, OutOfBudget at every budget tried, ...), its message kept
  mismatch     other bits than plain PyTorch and than the empty mode: a defect
  error        another exception, where plain PyTorch runs: a defect
Cases plain PyTorch itself cannot run (`plain fails`) and nondeterministic kernels are counted, not compared.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import coop_arena
from coop_arena import CoopArenaError, OutOfBudget

AMPLE = 1 << 26
RANK = {"exact": 0, "mode": 1, "refused": 2, "mismatch": 3, "error": 4}


class _Empty(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def op_db():
    import os
    import sys
    stderr = sys.stderr
    with open(os.devnull, "w") as null:  # (the testing package prints its setup)
        sys.stderr = null
        try:
            from torch.testing._internal.common_methods_invocations import op_db as db
        finally:
            sys.stderr = stderr
    return db


def cases(ops=None, samples: int = 2, variants=("functional", "inplace")):
    """(name, variant, index, op, sample) of each case, in the database's order."""
    for op in op_db():
        name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if ops is not None and name not in ops and op.name not in ops:
            continue
        if torch.float32 not in op.supported_dtypes("cpu"):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sample_list = list(op.sample_inputs("cpu", torch.float32, requires_grad=op.supports_autograd))
        except Exception:  # (a sample generator that needs something this build lacks)
            continue
        for variant in variants:
            fn = op.op if variant == "functional" else op.inplace_variant
            if fn is None:
                continue
            for i, sample in enumerate(sample_list[:samples]):
                yield name, variant, i, fn, sample


def _copy(x):
    if isinstance(x, torch.Tensor):
        if x.layout is not torch.strided:
            return x.detach().clone()
        y = x.detach().clone()
        return y.requires_grad_(x.requires_grad) if y.is_leaf and (y.is_floating_point() or y.is_complex()) else y
    if isinstance(x, (list, tuple)):
        return type(x)(_copy(v) for v in x) if not hasattr(x, "_fields") else type(x)(*[_copy(v) for v in x])
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    return x


def _tensors(x) -> list:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _inputs(sample):
    """Fresh copies of the sample's arguments, made before the block (as a user's inputs are)."""
    return _copy(sample.input), _copy(sample.args), _copy(sample.kwargs)


def _step(fn, variant, inputs):
    """Outputs and gradients of one run of the case on `inputs` (_inputs), as plain tensors (detached copies)."""
    inp, args, kwargs = inputs
    leaves = [t for t in _tensors((inp, args, kwargs)) if t.requires_grad]
    torch.manual_seed(0)
    x = inp.clone() if variant == "inplace" and isinstance(inp, torch.Tensor) else inp
    out = fn(x, *args, **kwargs)
    outs = [o for o in _tensors(out) if o.layout is torch.strided]
    diff = [o for o in outs if o.requires_grad and o.numel()]
    grads = []
    if diff and leaves:
        loss = sum((torch.view_as_real(o.resolve_conj()) if o.is_complex() else o).mul(
            torch.linspace(-1.0, 1.0, o.numel() * (2 if o.is_complex() else 1)).reshape(
                (*o.shape, 2) if o.is_complex() else o.shape)).sum() for o in diff)
        grads = [g for g in torch.autograd.grad(loss, leaves, allow_unused=True) if g is not None]
    return [o.detach().clone() for o in outs] + [g.detach().clone() for g in grads]


def _ints(t):
    t = t.resolve_conj().resolve_neg()
    if t.is_complex():
        t = torch.view_as_real(t)
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(t.element_size())
    return t.view(dtype) if dtype is not None and t.dtype != torch.bool else t


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(_ints(x), _ints(y))
                                    for x, y in zip(a, b))


def _under(budget, fn, variant, sample):
    inputs = _inputs(sample)
    with budget:
        r = _step(fn, variant, inputs)
    return r


# Ops whose output is uninitialized memory: its bytes are whatever the memory held (not compared)
UNINITIALIZED = {"empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided", "empty_permuted"}


def run_case(fn, variant, sample, policies=("coop",), tight=True, name: str = "") -> tuple[str, str, int]:
    """(outcome, detail, evictions) of one case (see the module's docstring); `name`: the op's, in op_db."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plain = _step(fn, variant, _inputs(sample))
        except Exception as e:
            return "plain fails", f"{type(e).__name__}", 0
        try:
            again = _step(fn, variant, _inputs(sample))
        except Exception as e:
            return "plain fails", f"{type(e).__name__} (second call)", 0
        if name.split(".")[0] in UNINITIALIZED or not same(plain, again):
            return "nondeterministic", "plain PyTorch's bits differ between identical calls (or are uninitialized)", 0
        try:
            inputs = _inputs(sample)
            with _Empty():
                empty = _step(fn, variant, inputs)
        except Exception:
            empty = None
        worst, detail, evictions = "exact", "", 0
        runs = [("coop", "ample")] + [(p, "tight") for p in policies] if tight else [("coop", "ample")]
        lower = None
        for policy, kind in runs:
            outcome, why, got = "exact", "", None
            try:
                if kind == "ample":
                    budget = coop_arena.Budget(AMPLE, device="cpu", headroom=0, policy=policy)
                    got = _under(budget, fn, variant, sample)
                    lower, peak = budget.stats.lower_bound, budget.stats.peak_bytes
                else:
                    if lower is None or peak <= lower:
                        continue  # nothing can be evicted: the ample run said all there is
                    # (up to a bit above the ample run's peak: a configuration's first calls take other paths than
                    # later ones, Note [Shapes that change], so a later block may need more at once than it showed)
                    for nbytes in sorted({lower, (lower + peak) // 2, int(0.9 * peak), peak, int(1.25 * peak)}):
                        budget = coop_arena.Budget(max(nbytes, 256), device="cpu", headroom=0, policy=policy)
                        try:
                            got = _under(budget, fn, variant, sample)
                            evictions += budget.stats.evictions
                            break
                        except OutOfBudget as e:
                            why = f"OutOfBudget up to 1.25x its ample peak: {str(e)[:120]}"
                    if got is None:
                        outcome = "refused"
            except CoopArenaError as e:
                outcome, why = "refused", f"{type(e).__name__}: {str(e)[:200]}"
            except Exception as e:
                outcome, why = "error", f"{policy} {kind}: {type(e).__name__}: {str(e)[:200]}"
            if got is not None and not same(got, plain):
                outcome = "mode" if empty is not None and same(got, empty) else "mismatch"
                why = f"{policy} {kind}"
            if RANK[outcome] > RANK[worst]:
                worst, detail = outcome, why
        return worst, detail, evictions


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", default=None, help="comma-separated op names (default: the whole database)")
    ap.add_argument("--samples", type=int, default=2, help="samples per op and variant")
    ap.add_argument("--out", default=None, help="write the summary (markdown) here")
    a = ap.parse_args(argv)
    ops = set(a.ops.split(",")) if a.ops else None
    start = time.perf_counter()
    rows, counts = [], collections.Counter()
    try:
        from tqdm import tqdm
    except ImportError:  # (a plain loop)
        def tqdm(x, **_):
            return x
    for name, variant, i, fn, sample in tqdm(list(cases(ops, a.samples)), desc="opinfo", unit="case"):
        outcome, detail, evictions = run_case(fn, variant, sample, policies=("coop", "dtr"), name=name)
        counts[outcome] += 1
        rows.append((name, variant, i, outcome, detail, evictions))
    elapsed = time.perf_counter() - start
    lines = ["# PyTorch's OpInfo database under a Budget", "",
             f"`python -m bench.opinfo --samples {a.samples}" + (f" --ops {a.ops}" if a.ops else "") + "` "
             f"(CPU, float32, torch {torch.__version__}; {elapsed / 60:.1f} min). Outcomes as in bench/opinfo.py.",
             "", "| outcome | cases |", "|---|---:|"]
    lines += [f"| {k} | {counts[k]} |" for k in ("exact", "mode", "refused", "mismatch", "error",
                                                  "nondeterministic", "plain fails")]
    lines += ["", f"Cases with evictions under `tight`: {sum(1 for r in rows if r[5])}.", "",
              "## Every case that is not exact", "", "| op | variant | sample | outcome | detail |", "|---|---|---:|---|---|"]
    lines += [f"| {n} | {v} | {i} | {o} | {d.replace('|', '/')} |" for n, v, i, o, d, _ in rows
              if o not in ("exact", "plain fails")]
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 1 if counts["mismatch"] or counts["error"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
