"""Record the decisions of one version of coop_arena and compare another version's with them.

For a change that must not change decisions (a faster table, search or cost model), this records on the code
before the change and compares on the code after it: every memory trace event (with ids, offsets and clock),
the memory stats of every block and `budget.stats` (search timings and the footprint's fields left out), and the
parameters after training. CPU runs keep the arena at the whole budget (`headroom=0`, where the version has a
learned headroom: Note [Headroom]), so that they compare the policy's decisions, not the arena's size. Workloads: the example models (mlp, cnn, gpt, lstm) trained 3
steps on cpu (tests/training.py) at 40 % of their plain peak, and `coop-arena plan`-style dry runs on meta
(batch 8) at 0.5 and 0.3 of the peak, under coop, dtr and dte. Dry runs stop at `max_overhead=30`, a
deterministic point, where a ratio thrashes.

    python bench/decisions.py record /tmp/before.pkl            # on the code before the change
    python bench/decisions.py compare /tmp/before.pkl           # on the code after it (records again)
    python bench/decisions.py compare /tmp/before.pkl --numpy-search   # ... with numba blocked

Two things in the runtime are not decisions and are kept out of the comparison:
- Automatic cycle collection runs when allocation counters pass a threshold, so *when* a dead intermediate is
  collected (and freed in the trace) depends on every allocation any code makes. It is off while recording;
  collected explicitly between runs, at the same points in both versions.
- The last dead storages of a block are freed in an order that differs from run to run of the same code (seen
  on the lstm dry runs). Traces that differ only in the order of their trailing run of `free` events are
  reported as the same, with the length of that run.
Exit status 1 when anything differs.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

MODELS = ("mlp", "cnn", "gpt", "lstm")
POLICIES = ("coop", "dtr", "dte")
TRACE = 10**8
MAX_OVERHEAD = 30.0
TIMING = ("search_seconds", "search_seconds_per_event", "search_seconds_max", "replayed_ops")  # (and not decisions)
# the footprint's fields (Note [Headroom]): with the arena fixed at the whole budget they say nothing of decisions
FOOTPRINT = ("cap", "headroom", "arena_bytes", "footprint_peak", "footprint_observed", "escaped_bytes")


def _fixed_arena() -> dict:
    """Budget arguments that keep the arena at the whole budget, where the version has a learned headroom."""
    import inspect
    import coop_arena
    return {"headroom": 0} if "headroom" in inspect.signature(coop_arena.Budget).parameters else {}


class Recorder:
    """Hooks Memory.reset to keep each block's trace and stats. (Op costs show in the trace's clock, which
    advances by each op's and each replay's cost; the cost model itself runs once per op configuration.)"""

    def __init__(self):
        import coop_arena.memory as memory
        self.blocks = []
        reset = memory.Memory.reset

        def keep_and_reset(m):
            if hasattr(m, "trace") and m.trace.events:
                self.blocks.append((list(m.trace.events), _untimed(m.stats.as_dict())))
            reset(m)

        memory.Memory.reset = keep_and_reset

    def take(self):
        gc.collect()
        out = (self.blocks, [])
        self.blocks = []
        return out


def _untimed(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in TIMING and k not in FOOTPRINT}


def record(models) -> dict:
    import torch
    torch.set_num_threads(1)
    import coop_arena
    from coop_arena import plan
    from training import state, train
    rec, out = Recorder(), {}
    for name in models:
        b = coop_arena.Budget(1 << 28, device="cpu", trace_len=TRACE, **_fixed_arena())
        train(name, b, steps=1)
        peak = b.stats.peak_bytes
        rec.take()
        for policy in POLICIES:
            t0 = time.time()
            b = coop_arena.Budget(int(0.4 * peak), device="cpu", policy=policy, trace_len=TRACE, **_fixed_arena())
            stats = []
            model = train(name, b, check=lambda bb: stats.append(_untimed(bb.stats.as_dict())))
            blocks, costs = rec.take()
            out["cpu", name, policy, 0.4] = dict(stats=stats, traces=blocks, costs=costs, params=state(model))
            print("cpu", name, policy, sum(len(e) for e, _ in blocks), "events", f"{time.time() - t0:.1f}s", flush=True)
        model, inputs = plan.load(name, 8)
        probe = coop_arena.Budget(1 << 50, device="meta", trace_len=TRACE)
        plan.step(model, inputs, probe)
        peak = probe.stats.peak_bytes
        rec.take()
        for ratio in (0.5, 0.3):
            for policy in POLICIES:
                t0 = time.time()
                b = coop_arena.Budget(max(int(ratio * peak), 512), device="meta", policy=policy, trace_len=TRACE,
                                      max_overhead=MAX_OVERHEAD)
                try:
                    plan.step(model, inputs, b)
                    stats = _untimed(b.stats.as_dict())
                except (coop_arena.OutOfBudget, coop_arena.Thrashing) as e:
                    stats = (type(e).__name__, str(e), _untimed(b.stats.as_dict()))
                blocks, costs = rec.take()
                out["meta", name, policy, ratio] = dict(stats=[stats], traces=blocks, costs=costs, peak=peak)
                print("meta", name, policy, ratio, sum(len(e) for e, _ in blocks), "events",
                      f"{time.time() - t0:.1f}s", flush=True)
    return out


def _settled(traces):
    """Each block's trace with its trailing run of `free` events sorted, and that run's length."""
    out = []
    for events, stats in traces:
        k = len(events)
        while k and events[k - 1].kind == "free":
            k -= 1
        out.append((events[:k] + sorted(events[k:]), stats, len(events) - k))
    return out


def compare(before: dict, after: dict) -> int:
    import torch
    bad = 0
    for key, x in before.items():
        y = after.get(key)
        if y is None:
            print("MISSING", key)
            bad += 1
            continue
        note = "same"
        for field in x:
            if field == "params":
                same = len(x[field]) == len(y[field]) and all(torch.equal(p, q) for p, q in zip(x[field], y[field]))
            else:
                same = x[field] == y[field]
            if not same and field == "traces":
                sx, sy = _settled(x[field]), _settled(y[field])
                same = [t[:2] for t in sx] == [t[:2] for t in sy]
                note = f"same up to the order of the trailing frees {[t[2] for t in sx]}" if same else note
            if not same:
                print("DIFFERS", key, field)
                bad += 1
        print(note, key, f"events={sum(len(e) for e, _ in x['traces'])} costs={len(x['costs'])}")
    print("configurations:", len(before), "differences:", bad)
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("command", choices=("record", "compare"))
    p.add_argument("baseline", help="the pickle to write (record) or to compare with (compare)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated example models")
    p.add_argument("--numpy-search", action="store_true", help="block numba: the numpy window search runs")
    p.add_argument("--save", help="compare: also write this run's recording here")
    args = p.parse_args(argv)
    gc.disable()
    if args.numpy_search:
        sys.modules["numba"] = None  # `import numba` now raises ImportError
    models = args.models.split(",")
    if args.command == "record":
        with open(args.baseline, "wb") as f:
            pickle.dump(record(models), f)
        return 0
    with open(args.baseline, "rb") as f:
        before = pickle.load(f)
    after = record(models)
    if args.save:
        with open(args.save, "wb") as f:
            pickle.dump(after, f)
    return 1 if compare({k: v for k, v in before.items() if k[1] in models}, after) else 0


if __name__ == "__main__":
    sys.exit(main())
