"""`coop-arena evaluate`: the Coop paper's evaluation, as dry runs of one training step on the `meta` device
(the same engine and analytic cost model as a real run; no data, no GPU).

For every model: one run with no eviction gives the plain peak and the lower bound; then, for every policy
configuration, the memory ratio (budget / plain peak) goes down from 1.0 in steps of `step` until the step no
longer fits, and the edge between the last ratio that fit and the first that did not is bisected `refine` times.
Feasibility is taken as monotone in the budget: below the first failure nothing more is run. A run fails when
it raises OutOfBudget, or Thrashing once its recomputation passes MAX_OVERHEAD (DTR's notion of thrashing: the
step would finish, at a cost nobody would pay, and after a long time).

Configurations (all in one engine; only the named switch differs):
- coop: sliding window, cheap tensor partitioning, recomputable in-place.
- dtr, dte: the baselines' eviction rules, address-oblivious placement (no partitioning).
- coop-no-partition, coop-no-inplace, coop-no-relocation: Coop without one of its parts (copy-on-write in
  place of recomputable in-place; no copying of pinned blocks out of a window, Note [Relocation]);
  coop-no-window: Coop's placement and in-place handling with DTR's one-victim-at-a-time choice.

With `jobs > 1` the models are swept in that many worker processes (the longest first); every number but the
search latency (wall time) is the same as with one.

Measures are those of DESIGN.md section 3, read from `Budget.stats`. Results go to `results.json` (plain data,
the input of the table and of the figures), `summary.md` and two PNG figures.
"""

from __future__ import annotations

import datetime
import json
import math
import multiprocessing
import platform
import queue
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from .blocks import ALIGNMENT
from .budget import Budget
from .errors import CoopArenaError
from .plan import load, step
from .suite import SUITE, available, default_batch

CONFIGS: dict[str, dict] = {
    "coop": dict(policy="coop"),
    "dtr": dict(policy="dtr", partition=False),
    "dte": dict(policy="dte", partition=False),
    "coop-no-partition": dict(policy="coop", partition=False),
    "coop-no-window": dict(policy="dtr"),
    "coop-no-inplace": dict(policy="coop", recomputable_inplace=False),
    "coop-no-relocation": dict(policy="coop", relocate=False),
}
BASELINES = ("dtr", "dte")
QUICK_MODELS = ("resnet50", "unet")
MAX_OVERHEAD = 10.0     # a run whose recomputation passes this (Thrashing) counts as not fitting


@dataclass
class Sweep:
    step: float = 0.05      # coarse ratio step from 1.0 down
    refine: int = 2         # bisections of the edge after the first failure
    configs: tuple[str, ...] = tuple(CONFIGS)

    def __post_init__(self):
        if not 0 < self.step <= 0.5:
            raise ValueError(f"step must be in (0, 0.5], got {self.step}")
        if self.refine < 0:
            raise ValueError(f"refine must be >= 0, got {self.refine}")
        unknown = [c for c in self.configs if c not in CONFIGS]
        if unknown:
            raise ValueError(f"unknown configurations {unknown}; accepted: {', '.join(CONFIGS)}")

    def grid(self) -> list[float]:
        n = int(round(1.0 / self.step))
        return [round(1.0 - i * self.step, 6) for i in range(n)]  # 1.0 ... step (0 is never feasible)


QUICK = Sweep(step=0.1, refine=0)


def run_once(model, inputs, nbytes: int, config: str) -> dict:
    """One dry-run step under `nbytes` with a configuration: the stats, or why it did not fit."""
    budget = Budget(max(nbytes, ALIGNMENT), device="meta", max_overhead=MAX_OVERHEAD, **CONFIGS[config])
    t0 = time.perf_counter()
    try:
        step(model, inputs, budget)
    except CoopArenaError as e:
        return {"fits": False, "error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - t0}
    st = budget.stats
    return {"fits": True, "compute_overhead": st.compute_overhead, "evictions": st.evictions,
            "eviction_events": st.eviction_events, "rematerializations": st.rematerializations,
            "search_seconds": st.search_seconds, "search_seconds_per_event": st.search_seconds_per_event,
            "fragmentation": st.fragmentation, "peak_bytes": st.peak_bytes, "relocated_bytes": st.relocated_bytes,
            "compactions": st.compactions, "restores_in_turn": st.restores_in_turn,
            "exit_rematerializations": st.exit_rematerializations,
            "exit_overhead": st.exit_overhead,
            "seconds": time.perf_counter() - t0}


def sweep_model(name: str, batch: int | None, sweep: Sweep, progress: tqdm | None = None) -> dict:
    """Every configuration's runs for one model (a suite name, an example name or module:function)."""
    why = available(name) if name in SUITE else None
    if why:
        return {"model": name, "error": why}
    batch = default_batch(name, batch)
    try:
        model, inputs = load(name, batch)
        probe = Budget(1 << 50, device="meta")
        step(model, inputs, probe)
    except Exception as e:  # a model the engine cannot run is reported, the sweep goes on
        return {"model": name, "batch": batch, "error": f"{type(e).__name__}: {e}"}
    peak, lower = probe.stats.peak_bytes, probe.stats.lower_bound
    result = {"model": name, "batch": batch, "kind": SUITE[name].kind if name in SUITE else "example",
              "plain_peak": peak, "lower_bound": lower, "lower_bound_ratio": lower / peak, "ops": probe.stats.ops,
              "compute_cost": probe.stats.compute_cost, "runs": {}}
    for config in sweep.configs:
        runs, good, bad = [], None, None

        def attempt(ratio):
            r = run_once(model, inputs, int(ratio * peak), config)
            runs.append({"ratio": ratio, "budget": int(ratio * peak), **r})
            if progress is not None:
                progress.set_postfix_str(f"{name} {config} {ratio:.3f}", refresh=False)
            return r["fits"]

        grid = sweep.grid()
        for i, ratio in enumerate(grid):
            if progress is not None:
                progress.update(1)
            if attempt(ratio):
                good = ratio
            else:
                bad = ratio
                if progress is not None:
                    progress.update(len(grid) - i - 1)
                break
        if good is not None and bad is not None:
            for _ in range(sweep.refine):
                mid = round((good + bad) / 2, 6)
                if attempt(mid):
                    good = mid
                else:
                    bad = mid
        runs.sort(key=lambda r: -r["ratio"])
        result["runs"][config] = {"smallest_ratio": good, "first_failure": bad, "runs": runs}
    return result


class _QueueProgress:
    """tqdm's update / set_postfix_str, sent from a worker process to the parent's bar."""

    def __init__(self, q):
        self.q = q

    def update(self, n: int) -> None:
        self.q.put(("update", n))

    def set_postfix_str(self, text: str, refresh: bool = False) -> None:
        self.q.put(("postfix", text))


def _sweep_in_worker(args):
    name, batch, sweep, q = args
    torch.set_num_threads(1)
    return name, sweep_model(name, batch, sweep, _QueueProgress(q))


_ORDER = {"rnn": 0, "transformer": 1, "cnn": 2}


def _sweep_parallel(models, batch, sweep, jobs, progress) -> dict:
    longest_first = sorted(models, key=lambda n: _ORDER.get(SUITE[n].kind, 3) if n in SUITE else 3)
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds torch's thread pools
    with ctx.Manager() as manager, ctx.Pool(min(jobs, len(models))) as pool:
        q = manager.Queue()
        pending = pool.map_async(_sweep_in_worker, [(n, batch, sweep, q) for n in longest_first], chunksize=1)
        while True:
            try:
                kind, value = q.get(timeout=0.2)
            except queue.Empty:
                if pending.ready():
                    break
                continue
            if kind == "update":
                progress.update(value)
            else:
                progress.set_postfix_str(value, refresh=False)
        done = dict(pending.get())
    return {n: done[n] for n in models}


def evaluate(models, sweep: Sweep, batch: int | None = None, out: Path | None = None,
             console: Console | None = None, command: str = "", jobs: int = 1) -> dict:
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive int, got {jobs!r}")
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=220)
    torch.set_num_threads(1)
    results = {"command": command, "date": datetime.date.today().isoformat(), "torch": torch.__version__,
               "python": platform.python_version(), "jobs": jobs,
               "sweep": {"step": sweep.step, "refine": sweep.refine, "max_overhead": MAX_OVERHEAD,
                         "configs": list(sweep.configs)}, "models": {}}
    t0 = time.perf_counter()
    total = len(models) * len(sweep.configs) * len(sweep.grid())
    with tqdm(total=total, desc="evaluate", unit="run", dynamic_ncols=True) as progress:
        if jobs > 1 and len(models) > 1:
            results["models"] = _sweep_parallel(models, batch, sweep, jobs, progress)
        else:
            for name in models:
                results["models"][name] = sweep_model(name, batch, sweep, progress)
    results["seconds"] = time.perf_counter() - t0
    results["targets"] = check_targets(results)
    console.print(summary_table(results))
    for line in results["targets"]:
        console.print(f"[{'green' if line['met'] else 'red'}]{'met ' if line['met'] else 'MISSED'}[/] {line['target']}: "
                      f"{line['detail']}")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        (out / "summary.md").write_text(summary_markdown(results))
        from . import figures
        written = figures.draw(results, out)
        console.print(f"wrote {out / 'results.json'}, {out / 'summary.md'}, " + ", ".join(str(p) for p in written))
    return results


# ------------------------------------------------------------------------------------------------ reading results
def run_at(model: dict, config: str, ratio: float) -> dict | None:
    """The run at exactly `ratio` (None when not run or not feasible there)."""
    for r in model["runs"][config]["runs"]:
        if math.isclose(r["ratio"], ratio, abs_tol=1e-9):
            return r if r["fits"] else None
    return None


def overhead_at(model: dict, config: str, ratio: float) -> float | None:
    """Compute overhead at exactly `ratio` (None when not run or not feasible there)."""
    r = run_at(model, config, ratio)
    return None if r is None else r["compute_overhead"]


def at_exit(run: dict) -> str:
    """How much of a run's overhead is replays at block exit (copying out the output the step still holds), as a
    note for a target's detail; empty when none is (or results from before it was recorded)."""
    share = run.get("exit_overhead", 0.0)
    return f" ({share:.3f} of it at exit)" if share > 0 else ""


def ran(results: dict) -> dict:
    """The models whose sweep ran (not those reported with an error)."""
    return {n: m for n, m in results["models"].items() if "error" not in m}


TOLERANCE = 1.02   # coop's overhead may exceed the best baseline's by 2 % (relative)
CLIFF = 1.5        # overhead at ratio r at most this times the overhead at r + step


def check_targets(results: dict) -> list[dict]:
    """The targets of the evaluation, each met or missed, with the numbers that decide it."""
    models = ran(results)
    configs = results["sweep"]["configs"]
    step = results["sweep"].get("step", 0.05)
    out = []
    if "coop" not in configs or not models:
        return out
    baselines = [b for b in BASELINES if b in configs]

    def fits(m, c, ratio):
        """Overhead at `ratio`; None when it does not fit; 'unknown' when not run but between ratios that fit."""
        o = overhead_at(m, c, ratio)
        if o is not None:
            return o
        smallest = m["runs"][c]["smallest_ratio"]
        ran_there = any(math.isclose(r["ratio"], ratio, abs_tol=1e-9) for r in m["runs"][c]["runs"])
        return "unknown" if not ran_there and smallest is not None and smallest <= ratio else None

    worse = []
    for n, m in models.items():
        ratios = sorted({r["ratio"] for b in baselines for r in m["runs"][b]["runs"] if r["fits"]}, reverse=True)
        for ratio in ratios:
            best = min((o for b in baselines if isinstance(o := overhead_at(m, b, ratio), float)), default=None)
            oc = fits(m, "coop", ratio)
            if best is None or oc == "unknown":
                continue
            if oc is None:
                worse.append(f"{n}@{ratio:g}: coop does not fit, best baseline {best:.3f}x")
            elif oc > best * TOLERANCE:
                worse.append(f"{n}@{ratio:g}: coop {oc:.3f}x{at_exit(run_at(m, 'coop', ratio))} > {best:.3f}x")
    out.append({"target": f"coop's overhead <= min(dtr, dte) + {TOLERANCE - 1:.0%} at every ratio where a baseline "
                          f"fits", "met": not worse, "detail": "; ".join(worse) or "no ratio where coop is worse"})
    cliffs = []
    for n, m in models.items():
        fitting = [r for r in m["runs"]["coop"]["runs"] if r["fits"]]
        for r in fitting:
            # the partner is the fitting ratio nearest r + step from below: r + step itself on the grid, and for
            # a point the refinement added, which has none there, the closest one above it within the step
            above = [u for u in fitting if r["ratio"] < u["ratio"] <= r["ratio"] + step + 1e-9]
            if not above:
                continue
            up = max(above, key=lambda u: u["ratio"])
            if r["compute_overhead"] > CLIFF * up["compute_overhead"]:
                at = (f"+{step:g}" if abs(up["ratio"] - r["ratio"] - step) < 1e-9 else f"{up['ratio']:g}")
                cliffs.append(f"{n}@{r['ratio']:g}: {r['compute_overhead']:.3f}x{at_exit(r)} vs "
                              f"{up['compute_overhead']:.3f}x at {at}")
    out.append({"target": f"no cliff: coop's overhead at r <= {CLIFF:g}x its overhead at r + {step:g} (or at the measured ratio "
                          f"nearest below that)", "met": not cliffs,
                "detail": "; ".join(cliffs) or "none"})
    if "dte" in configs:
        behind = [f"{n}: coop {m['runs']['coop']['smallest_ratio']} vs dte {m['runs']['dte']['smallest_ratio']}"
                  for n, m in models.items() if m["runs"]["dte"]["smallest_ratio"] is not None and (
                      m["runs"]["coop"]["smallest_ratio"] is None
                      or m["runs"]["coop"]["smallest_ratio"] > m["runs"]["dte"]["smallest_ratio"] + 1e-9)]
        out.append({"target": "coop's smallest feasible ratio <= dte's on every model", "met": not behind,
                    "detail": "; ".join(behind) or "all"})
    far = []
    for n, m in models.items():
        c = m["runs"]["coop"]["smallest_ratio"]
        if c is None or c > 2 * m["lower_bound_ratio"]:
            far.append(f"{n}: {c if c is None else round(c, 4)} vs lower bound {m['lower_bound_ratio']:.3f}")
    out.append({"target": "coop's smallest feasible ratio within 2x of the lower bound on every model",
                "met": not far, "detail": "; ".join(far) if far else "all within"})
    miss = []
    for n, m in models.items():
        if m["kind"] in ("cnn", "transformer"):
            o = overhead_at(m, "coop", 0.5)
            if o is None or o > 1.10:
                miss.append(f"{n}: {'does not fit' if o is None else f'{o:.3f}x'}")
    out.append({"target": "coop's overhead at ratio 0.5 <= 1.10x on every CNN and transformer", "met": not miss,
                "detail": "; ".join(miss) if miss else "all within"})
    if "coop-no-partition" in configs:
        lose = []
        for n, m in models.items():
            c, p = m["runs"]["coop"]["smallest_ratio"], m["runs"]["coop-no-partition"]["smallest_ratio"]
            if p is not None and (c is None or c > p + 1e-9):
                lose.append(f"{n}: smallest {c} vs {p} without")
            for r in m["runs"]["coop-no-partition"]["runs"]:
                oc = fits(m, "coop", r["ratio"])
                if r["fits"] and isinstance(oc, float) and oc > r["compute_overhead"] * TOLERANCE:
                    lose.append(f"{n}@{r['ratio']:g}: {oc:.3f}x vs {r['compute_overhead']:.3f}x without")
        out.append({"target": f"partitioning at least as good as none (smallest ratio; overhead within "
                              f"{TOLERANCE - 1:.0%}) on every model", "met": not lose, "detail": "; ".join(lose) or "all"})
    return out


def _rows(results: dict):
    configs = results["sweep"]["configs"]
    shown = [c for c in ("coop", "dtr", "dte") if c in configs]
    header = (["model", "batch", "plain peak", "lower bound"] + [f"smallest {c}" for c in configs]
              + [f"{c} @0.5" for c in shown] + [f"{c} @0.3" for c in shown])
    rows = []
    for n, m in results["models"].items():
        if "error" in m:
            rows.append([n, str(m.get("batch", "-")), "error: " + m["error"].splitlines()[0][:80]]
                        + [""] * (len(header) - 3))
            continue
        row = [n, str(m["batch"]), f"{m['plain_peak'] / 2**30:.2f} GiB", f"{m['lower_bound_ratio']:.3f}"]
        for c in configs:
            s = m["runs"][c]["smallest_ratio"]
            row.append("-" if s is None else f"{s:.3f}")
        for ratio in (0.5, 0.3):
            for c in shown:
                o = overhead_at(m, c, ratio)
                row.append("-" if o is None else f"{o:.3f}x")
        rows.append(row)
    return header, rows


def summary_table(results: dict) -> Table:
    header, rows = _rows(results)
    table = Table(title="Smallest feasible memory ratio per configuration; compute overhead at ratios 0.5 and 0.3 "
                        "('-': does not fit)")
    for h in header:
        table.add_column(h, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def summary_markdown(results: dict) -> str:
    header, rows = _rows(results)
    lines = [f"Command: `{results['command']}` ({results['date']}, torch {results['torch']}, "
             f"{results['seconds'] / 60:.1f} min)", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "Ratios are budget / plain peak; lower bound is (largest single-op working set + unevictable "
                  "bytes) / plain peak; '-' means the step does not fit.", "", "Targets:", ""]
    lines += [f"- {'met' if t['met'] else '**missed**'}: {t['target']} ({t['detail']})" for t in results["targets"]]
    return "\n".join(lines) + "\n"
