"""The linear-chain benchmark and its exact optimum: every run reports its recompute overhead divided by the
overhead of the best checkpointing schedule for the same budget, computed by a dynamic program over the chain.

Workload: `nn.Sequential` of N x (`Linear(64, 64)`, `Tanh`), input (16, 64), one training step
(`coop_arena.plan.step`: forward, `.float().sum().backward()`), dry runs on `meta`.

    python -m bench.chain            # the sweep: N = 400 and 100, ratios 0.5, 0.3, 0.2, policies coop, dtr, dte
    bench.chain.optimal_overhead(100, nbytes)   # the optimum for one budget

Note [Chain model]
Rationale: "overhead within 1.25x of the optimal schedule" needs the optimum under the engine's own accounting,
  not a textbook one. So nothing here is a constant: `measure` runs one step with ample memory and records every
  event as the engine saw it (the storages each op read and produced, their aligned sizes and analytic costs from
  coop_arena/cost.py, the gradient reads of the post-accumulate-grad hooks if any, what was still alive at
  exit), and the model below is derived from that record.
Approach (the engine's accounting, runtime.py and memory.py):
  - Memory is counted in alignment units (512-byte blocks); a storage occupies its rounded-up size from the op
    that places it until it is evicted or freed. Parameters and the input are outside the arena (Rule 1).
  - An op needs its arena inputs and its outputs resident at once. A parameter's gradient is not in the arena:
    the op that produces it computes it outside (Note [Gradients of leaves] in coop_arena/dispatch.py), so the
    weight-gradient mm of a layer reads its input activation and the output gradient and places nothing, and
    no hook reads anything. Evicting a storage costs nothing; rebuilding it replays its recipe (same cost as the
    op) with the recipe's inputs resident.
  - Storages the user code still holds when the block ends (here the output of the last layer, the `out` of
    `plan.step`) must be resident at exit: `finish()` replays them, and that replay counts as recompute.
  - The chain: forward storages v_1..v_2N (addmm outputs h_i, tanh outputs a_i), each op reading only the one
    before. Nodes are the forward storages read after the forward (a_1..a_N); everything else is "fixed": the
    loss, the gradient seed, activation gradients.
  The schedules optimized over ("checkpointing schedules"): the program's ops run once, in order; forward
  storages may be evicted at any time and rebuilt from their recipes; fixed storages live from their op to
  their last read. Within that class `optimal_recompute` is exact, given the structure `chain_of` checks (it
  raises NotAChain otherwise):
  - Intermediates (h_i) are never worth keeping: each is read by no one but the next op of its stage and is no
    smaller than the node that ends the stage, which can always serve in its place.
  - Reads of nodes come in non-increasing order (a_N, a_{N-1}, ..., a_1), apart from the exit's read of a_N.
    That is the structure of revolve / Rotor: a segment (s, i] with a_s resident is served by computing
    forward to some a_j, keeping it, serving (j, i] recursively with a_j held, then (s, j].
  - A node's reads form "units" (reads with no op between them). Between two units the node may go and be
    rebuilt, which pays when the ops between need more memory than the reads (a_i is read by the weight-gradient
    mm of layer i + 1 and again by tanh_backward of layer i, with the bias-gradient sum between; on this chain
    keeping a_i across costs nothing, so the two are one unit). Each unit is a step of the recursion of its own.
  - The moment of a rebuild is part of the schedule. The engine restores lazily, just before the op that reads
    the node, but that is not always the best moment: the weight-gradient mm of layer i + 1 that first reads
    a_i runs after the mm that made the gradient of a_i, so just before it the backward holds two activation
    gradients, and just before that mm only one. Rebuilding a_i then (from a_{i-1} or a checkpoint: a forward
    step of h_i and a_i) needs 8 blocks less at the price of holding a_i across that mm; with the weight
    gradient in the arena the read itself needed more than either, and the lazy moment was the best. So each
    unit carries its "moments": for every event from just after the previous read (of node i + 1, or of node i
    for a later unit) to the read, the memory the backward holds then (`window`) and the memory of the events
    from then to the read with the node resident (`hold`), those no other moment beats in both. The DP picks
    one moment per rebuild and takes it for the whole recursion of that rebuild (the checkpoints it makes on
    the way are made then too, and held, in the shifted memory, from then on). `chain_of` checks that splitting
    one rebuild over two moments never beats doing all of it at one: holding the node from the earlier moment
    a to the later b (at most the events' memory plus the node) must need no more than rebuilding the node at b
    would (what the backward holds at b plus the forward step into the node), wherever the earlier moment holds
    no more than the later. A moment before the previous read is not considered: the node read there (or the
    node itself, kept) is resident then.
  - The exit: a_N is produced at exit from the highest node h still resident then, which the schedule holds
    from its last read to the end (h = N: a_N kept; none: rebuilt from the input). The replay needs what the
    backward holds at exit, h and the peak of the forward from h to N (`exit_need`). The DP carries "the holder
    is in this segment, of size sigma, with that exit need" as part of its state, and applies the exit need to
    the final budget, which keeps it exact.
  - The recursion only looks at per-node classes (sizes, costs, memory thresholds), so segments with the same
    sequence of classes share one memo entry; the interior layers of the chain are all alike, which is what makes
    N = 400 take seconds (about N^2 vector operations over the budgets).
  tests/test_chain_optimum.py checks the DP against an exhaustive search over checkpointing schedules of the
  recorded events (every forward storage may be kept, rebuilds at any moment) at every budget on 1 to 4 layers
  and at six budgets on 5 (all budgets on 5 and 6 layers agreed when run by hand). The moments matter: the
  smallest budget of 3 layers is 24 blocks, where rebuilding only at the reads needs 32 (on 2 layers, 24
  against 25).
Limitations (what the optimum is a bound of, and what it is not):
  - Placement is ignored: any set of blocks whose sizes fit the usable arena is taken to fit. The engine needs a
    contiguous free range per request, so fragmentation can only make it worse: in that respect the optimum is
    a lower bound, achievable with perfect placement.
  - Schedules that evict a gradient (or the loss, or the gradient seed) and rebuild it are outside the class.
    The runtime rebuilds such a storage only when it is read again, and by then the storages it was computed
    from have usually left the arena (a storage goes as soon as its last wrapper dies), so the rebuild replays
    the backward from the gradient seed down to that layer. An exhaustive search that allows this the way the
    runtime does it (rebuilt when read or as an input of such a rebuild, gone once its wrapper died;
    tests/test_chain_optimum.py, gradients=True, 2 layers in the tests and 3 by hand) finds the same least cost
    at every budget where a checkpointing schedule fits, and fits no budget below the DP's smallest one (with
    the weight gradients in the arena it fitted down to 48 blocks where the DP needed 56). That is evidence,
    not a proof, that for the runtime as it is the optimum is a lower bound wherever it is finite (placement
    aside). If dead storages stayed resident (issue 8 asks to keep dead ancestors of evicted storages), a
    gradient could be rebuilt by one op before its inputs go; with the weight gradients in the arena the same
    search, with storages kept past their wrappers, found on 2 layers between 57 and 64 blocks a schedule that
    replayed one mm (32,768) where the optimum replayed one layer's forward (41,216), so the optimum would then
    not be a bound near the peak (not run again since the weight gradients left the arena).
"""

from __future__ import annotations

import argparse
import bisect
import datetime
import functools
import json
import math
import multiprocessing
import os
import platform
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import torch
from torch import nn

import coop_arena
from coop_arena.errors import OutOfBudget, Thrashing
from coop_arena.evaluate import CONFIGS
from coop_arena.plan import step
from coop_arena.runtime import Runtime

WIDTH, BATCH = 64, 16
N_LAYERS = (400, 100)
RATIOS = (0.5, 0.3, 0.2)
POLICIES = ("coop", "dtr", "dte")
MAX_OVERHEAD = 20.0     # a run stops with Thrashing past this ("thrashes (> 20x)")
SECONDS = 30.0          # and is stopped after this much wall-clock time ("stopped at 30 s")
RESULTS = Path(__file__).parent / "results"


def build(n_layers: int):
    """(model, inputs) of the chain on meta."""
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be a positive int, got {n_layers!r}")
    with torch.device("meta"):  # nothing is materialized
        layers = [m for _ in range(n_layers) for m in (nn.Linear(WIDTH, WIDTH), nn.Tanh())]
        return nn.Sequential(*layers), (torch.empty(BATCH, WIDTH),)


# ================================================================================================ measurement
class NotAChain(ValueError):
    """The recorded step lacks a structure the DP relies on (Note [Chain model]); the message says which."""


@dataclass(frozen=True)
class Event:
    """One thing the step did that needs storages resident: an op, a hook's read of a gradient, or the exit."""

    reads: tuple[int, ...]   # storages (sids) it needs resident
    outs: tuple[int, ...]    # storages it places
    cost: float              # analytic cost the engine charged (0 for views, hooks and the exit)
    kind: str                # "op", "hook" or "exit"


@dataclass(frozen=True)
class Program:
    """A step as the engine ran it with ample memory."""

    events: tuple[Event, ...]
    forward_events: int          # events[:forward_events] are the model's forward
    drops: dict                  # sid -> number of events recorded when the runtime let it go (its wrapper died)
    units: dict                  # sid -> aligned size in alignment units
    recipe: dict                 # sid -> storages its producer read
    cost: dict                   # sid -> cost of its producer (what a replay charges)
    alignment: int
    plain_peak: int              # Budget.stats.peak_bytes of the run
    compute_cost: float          # Budget.stats.compute_cost of the run

    @property
    def forward(self) -> tuple[int, ...]:
        return tuple(s for e in self.events[:self.forward_events] for s in e.outs)


def record(model, inputs) -> Program:
    """Run one step under an ample Budget on meta and record its events (see Note [Chain model])."""
    budget = coop_arena.Budget(1 << 40, device="meta")
    mem = budget.memory
    events: list[Event] = []
    units, recipe, cost, dropped = {}, {}, {}, {}
    op = None  # the op in progress: [reads, outs, cost]
    orig = {k: getattr(mem, k) for k in ("allocate", "free", "evict", "touch", "advance")}

    def allocate(nbytes, c, **kw):
        if op is None:
            raise NotAChain("a storage was placed outside an op; the recording does not know this step")
        s = orig["allocate"](nbytes, c, **kw)
        units[s.sid] = mem.table.round_up(nbytes) // mem.table.alignment
        recipe[s.sid] = tuple(i.sid for i in kw.get("inputs", ()))
        cost[s.sid] = c
        op[1].append(s.sid)
        return s

    def touch(s):
        op[0].append(s.sid)
        orig["touch"](s)

    def advance(c):
        op[2] += c
        orig["advance"](c)

    def drop(kind):
        def f(s):
            dropped.setdefault(s.sid, len(events))
            orig[kind](s)
        return f

    def run(rt, func, args, kwargs):
        nonlocal op
        outer, op = op, [[], [], 0.0]  # a composite op runs its parts as nested ops: each is an event of its own
        try:
            return original_run(rt, func, args, kwargs)
        finally:
            if op[0] or op[1]:
                events.append(Event(tuple(dict.fromkeys(op[0])), tuple(op[1]), op[2], "op"))
            op = outer

    def grad_read(p):
        if isinstance(p.grad, coop_arena.Tensor):
            events.append(Event((p.grad._cell.storage.sid,), (), 0.0, "hook"))

    original_run = Runtime.run
    forward_end = []
    handles = [model.register_forward_hook(lambda *_: forward_end.append(len(events)))]
    handles += [p.register_post_accumulate_grad_hook(grad_read) for p in model.parameters()]
    mem.allocate, mem.touch, mem.advance, mem.free, mem.evict = allocate, touch, advance, drop("free"), drop("evict")
    try:
        with mock.patch.object(Runtime, "run", run):
            step(model, inputs, budget)
    finally:
        for h in handles:
            h.remove()
        for k in orig:
            delattr(mem, k)
    alive = tuple(s for s in units if s not in dropped)  # still held by user code at exit: finish() copies them
    events.append(Event(alive, (), 0.0, "exit"))
    st = budget.stats
    return Program(tuple(events), forward_end[0], dropped, units, recipe, cost, mem.table.alignment, st.peak_bytes,
                   st.compute_cost)


@functools.cache
def measure(n_layers: int) -> Program:
    return record(*build(n_layers))


# ============================================================================================ chain parameters
@dataclass(frozen=True)
class Unit:
    """A run of reads of one node that it stays resident for (between two units it may go and come back)."""

    need: int    # memory of the events from its first read to the next unit (the node counted up to its last read)
    keep: int    # memory of the events after its last read, up to the next unit, with the node kept (0: last unit)
    moments: tuple  # the moments worth rebuilding the node at for this unit, as (window, hold) pairs: the memory
                    # the backward holds then, and the memory of the events from then up to the unit's first read
                    # with the node resident (0: rebuilt just before that read)


@dataclass(frozen=True)
class Chain:
    """Per node i = 1..n (index 0 is the input, outside the arena), in alignment units and cost units."""

    size: tuple          # aligned size of node i
    fwd: tuple           # cost of the ops from node i-1 to node i
    peak_kept: tuple     # memory those ops need beyond node i-1, which stays resident anyway
    peak_dropped: tuple  # memory they need counting node i-1, a transient dropped after its last read
    units: tuple         # the reads of node i after the forward, as Units in program order
    tail: tuple          # memory from its last read to the end of its phase with node i held (the exit's holder)
    exit_need: tuple     # memory the exit needs with node i its holder (index 0: no holder, node n from the input)
    exit_reads_top: bool  # the exit needs node n (the user still holds it)
    compute_cost: float

    @property
    def n(self) -> int:
        return len(self.size) - 1

    def node_class(self, i: int) -> tuple:
        return (self.size[i], self.fwd[i], self.peak_kept[i], self.peak_dropped[i], self.units[i], self.tail[i],
                self.exit_need[i])


def chain_of(p: Program) -> Chain:
    """The chain's per-node numbers from a recorded step; NotAChain if its structure is not the DP's."""
    ev = p.events
    nf = p.forward_events
    z = p.units
    forward = list(p.forward)
    fwd_set = set(forward)
    prev = None
    for k, e in enumerate(ev[:nf]):  # each op reads only the storage placed last (views place nothing)
        if len(e.outs) > 1 or set(e.reads) - ({prev} if prev is not None else set()):
            raise NotAChain(f"forward op {k} reads {e.reads} and places {e.outs}: not a chain")
        prev = e.outs[0] if e.outs else prev
    later_reads = {s for e in ev[nf:] for s in e.reads if s in fwd_set}
    nodes = [s for s in forward if s in later_reads]
    if not nodes or nodes[-1] != forward[-1]:
        raise NotAChain("the last forward storage is not read after the forward")
    index = {s: i for i, s in enumerate(nodes, 1)}
    n = len(nodes)
    size, fwd, kept, dropped = [0], [0.0], [0], [0]
    pos = -1
    for i, node in enumerate(nodes, 1):
        stage = forward[pos + 1:forward.index(node) + 1]
        pos = forward.index(node)
        for s in stage[:-1]:
            if z[s] < z[node]:
                raise NotAChain(f"intermediate storage {s} ({z[s]} units) is smaller than node {node} ({z[node]})")
        pairs = [z[a] + z[b] for a, b in zip(stage, stage[1:])]
        size.append(z[node])
        fwd.append(sum(p.cost[s] for s in stage))
        kept.append(max([z[stage[0]]] + pairs))
        dropped.append(max([size[i - 1] + z[stage[0]]] + pairs))
    # the events after the forward: memory of fixed storages during each (live) and just before it (before)
    exit_e = len(ev) - 1
    created, last = {}, {}
    for e in range(nf, len(ev)):
        for s in ev[e].outs:
            created[s] = last[s] = e
        for s in ev[e].reads:
            if s not in fwd_set:
                last[s] = max(last.get(s, e), e)
    live, before = np.zeros(len(ev) + 1, np.int64), np.zeros(len(ev) + 1, np.int64)
    for s, c in created.items():
        live[c] += z[s]
        live[last[s] + 1] -= z[s]
        before[c + 1] += z[s]
        before[last[s] + 1] -= z[s]
    live, before = np.cumsum(live), np.cumsum(before)
    exit_nodes = {s for s in ev[exit_e].reads if s in fwd_set}
    if exit_nodes - {nodes[-1]}:
        raise NotAChain(f"the exit needs forward storages {sorted(exit_nodes)} other than the last node")
    reads: dict[int, list] = {}  # node -> the events that read it, in order
    for e in range(nf, exit_e):
        d = [index[s] for s in ev[e].reads if s in fwd_set]
        if len(d) > 1:
            raise NotAChain(f"event {e} reads several nodes {d}")
        if d:
            if reads and d[0] > min(reads):
                raise NotAChain(f"event {e} reads node {d[0]} after node {min(reads)}: not in reverse order")
            reads.setdefault(d[0], []).append(e)
    if len(reads) < n:
        raise NotAChain(f"nodes {sorted(set(range(1, n + 1)) - set(reads))} are read only at exit")
    start = {i: (reads[i][0] if i < n else nf) for i in range(1, n + 1)}

    def rebuild_moments(i: int, t: int, first: int) -> tuple:
        """(window, hold) of every moment from just after the previous read (of node i + 1 for the first unit, of
        node i for a later one) to just before `first` at which the rebuild of node i could happen, those no
        other moment beats in both. A rebuild split over two moments (the checkpoints of the recursion at the
        earlier, the rest later) is never better when holding the node from the earlier moment to the later
        needs no more than the later one's rebuild would: `chain_of` checks that, NotAChain otherwise."""
        since = reads[i][reads[i].index(first) - 1] if t else (reads[i + 1][-1] if i < n else first - 1)
        cands = [(int(before[e]), int(max(live[e:first])) + size[i] if e < first else 0, e)
                 for e in range(since + 1, first + 1)]
        for wa, _, a in cands:  # a split rebuild, begun at a and ended at b, against all of it at a
            for wb, _, b in cands:
                if a < b and wa <= wb and int(max(live[a:b])) + size[i] > wb + kept[i]:
                    raise NotAChain(f"rebuilding node {i} partly before event {a} and partly before {b} could "
                                    f"be cheaper than at either")
        best = []
        for w, h, _ in sorted(cands):
            if not best or h < best[-1][1]:
                best.append((w, h))
        return tuple(best)
    units, tail = [()], [0]
    for i in range(1, n + 1):
        end = start[i - 1] if i > 1 else exit_e  # the phase of node i: events start[i] .. end - 1
        groups = [[reads[i][0]]]  # reads with no event in between belong together
        for e in reads[i][1:]:
            if e == groups[-1][-1] + 1:
                groups[-1].append(e)
            else:
                groups.append([e])
        firsts = [start[i]] + [g[0] for g in groups[1:]] + [end]
        u, keep_prev = [], 0
        for t, g in enumerate(groups):
            span = range(firsts[t], firsts[t + 1])
            need = int(max(live[e] + (size[i] if e <= g[-1] else 0) for e in span))
            keep = int(max(live[g[-1] + 1:firsts[t + 1]], default=0)) + size[i] if t + 1 < len(groups) else 0
            moments = ((0, 0),) if (i == n and t == 0) else rebuild_moments(i, t, g[0])
            if u and keep_prev <= max(u[-1].need, need):  # keeping the node across costs no memory: one unit
                u[-1] = Unit(max(u[-1].need, keep_prev, need), keep, u[-1].moments)
            else:
                u.append(Unit(need, keep, moments))
            keep_prev = keep
        units.append(tuple(u))
        tail.append(int(max(live[reads[i][-1]:end])) + size[i])
    # the exit replays node n from its holder h (resident, nothing else of the chain is), the intermediate nodes
    # going as soon as the next one is made: the peak of the forward from h to n
    exit_need = [int(live[exit_e]) + size[h] + max([kept[h + 1]] + list(dropped[h + 2:]) if h < n else [0])
                 for h in range(n + 1)]
    return Chain(tuple(size), tuple(fwd), tuple(kept), tuple(dropped), tuple(units), tuple(tail),
                 tuple(exit_need), bool(exit_nodes), p.compute_cost)


# ======================================================================================================== DP
class Solver:
    """Least recompute cost of a step for every budget of 0..`units` alignment units (Note [Chain model]).

    Seg(s, i, t)[sigma, m]: node s resident (held outside m), about to rebuild node i for its read unit t,
      nothing of (s, i] resident; the least cost of every forward computation needed to serve units t.. of node
      i and all units of nodes i-1 down to s+1 with m units. sigma = 0: the exit's holder is not in (s, i];
      sigma = k >= 1: it is, of (size, exit need) `sigmas[k - 1]`, and its exit cost counts relative to s (minus
      the forward cost from s to it).
    Held(s, j, t)[sigma, m]: the same with node j resident (in m), about to serve its unit t.
    Seg(s, i, t) = min over the unit's rebuild moments o (window, hold) of Seg_o(s, i, t), and Seg_o(s, i, t) =
    min over j in (s, i] of the forward s -> j, with window + its peak within m, then
      j = i: Held(s, i, t), with hold within m (node i resident from the moment to its read);
      j < i: Seg_o(j, i, t) with m - size[j], then Held(s, j, 0) (with m - sigma when the holder was in (j, i]).
      The recursion of one rebuild keeps its moment: its checkpoints are made then too (Note [Chain model]).
    Held(s, j, t) = the unit's memory, then
      a later unit: keep node j (the memory between) and Held(s, j, t + 1), or drop it and Seg(s, j, t + 1);
      the last unit: Seg(s, j - 1, 0), or, node j being the holder (resident to the end: `tail`),
        Seg(s, j - 1, 0) with m - size[j].
    The least recompute cost is min over sigma of Seg(0, n, 0)[sigma], each at budgets within which the exit's
    replay from its holder fits (`exit_need`; sigma = 0: from the input): forward work counted relative to node 0
    plus the exit's replay from the holder (or from the input) comes to the program's forward plus every rebuild.
    """

    def __init__(self, chain: Chain, units: int):
        self.c = chain
        self.m = units + 1
        n = chain.n
        # the exit's holder by (size, memory the exit needs with it)
        self.sigmas = sorted({(chain.size[h], chain.exit_need[h]) for h in range(1, n + 1)}) \
            if chain.exit_reads_top else []
        self.prefix = np.concatenate([[0.0], np.cumsum(chain.fwd[1:])])
        classes, runs = {}, []  # runs of equal node classes: (first node, last node, class id)
        for i in range(1, n + 1):
            k = classes.setdefault(chain.node_class(i), len(classes))
            if runs and runs[-1][2] == k:
                runs[-1][1] = i
            else:
                runs.append([i, i, k])
        self._run_starts = [r[0] for r in runs]
        self._runs = runs
        self._keys: dict = {}
        self.seg: dict = {}      # (key, t) -> Seg over all rebuild moments
        self.seg_at: dict = {}   # (key, t, o) -> Seg with node i rebuilt at its unit's moment o
        self.held: dict = {}
        self.curve = self._solve()

    def key(self, s: int, i: int) -> int:
        """An id shared by all segments (s, i] with the same sequence of node classes."""
        parts = []
        r = bisect.bisect_right(self._run_starts, s + 1) - 1
        while r < len(self._runs) and self._runs[r][0] <= i:
            a, b, k = self._runs[r]
            parts.append((k, min(b, i) - max(a, s + 1) + 1))
            r += 1
        return self._keys.setdefault(tuple(parts), len(self._keys))

    def _shift(self, v: np.ndarray, units: int) -> np.ndarray:
        out = np.full_like(v, np.inf)
        if units < self.m:
            out[..., units:] = v[..., :self.m - units]
        return out

    def _empty(self) -> np.ndarray:
        """No unit left: free, unless a holder was still to be placed."""
        v = np.zeros((1 + len(self.sigmas), self.m))
        v[1:] = np.inf
        return v

    def _held(self, s: int, j: int, t: int) -> np.ndarray:
        k = (self.key(s, j), t)
        v = self.held.get(k)
        if v is not None:
            return v
        c = self.c
        u = c.units[j][t]
        if t + 1 < len(c.units[j]):
            v = self._held(s, j, t + 1).copy()
            v[:, :u.keep] = np.inf
            v = np.minimum(v, self.seg[(k[0], t + 1)])
        else:
            below = self.seg[(self.key(s, j - 1), 0)] if j - 1 > s else self._empty()
            v = below.copy()
            for q, (sigma, _) in enumerate(self.sigmas, 1):
                if (c.size[j], c.exit_need[j]) == self.sigmas[q - 1]:  # node j is the holder
                    w = self._shift(below[0], sigma) - (self.prefix[j] - self.prefix[s])
                    w[:c.tail[j]] = np.inf
                    v[q] = np.minimum(v[q], w)
        v[:, :u.need] = np.inf
        self.held[k] = v
        return v

    def _seg(self, s: int, i: int, t: int, o: int) -> np.ndarray:
        c = self.c
        window, hold = c.units[i][t].moments[o]
        best = np.full((1 + len(self.sigmas), self.m), np.inf)
        peak = 0
        for j in range(s + 1, i + 1):
            forward = self.prefix[j] - self.prefix[s]
            peak = max(peak, c.peak_kept[j] if j == s + 1 else c.peak_dropped[j])
            need = window + peak
            if need >= self.m:
                break  # the peak only grows with j
            if j < i:
                x = self._shift(self.seg_at[(self.key(j, i), t, o)], c.size[j])
                h = self._held(s, j, 0)
                cand = forward + x[0] + h
                for q, (sigma, _) in enumerate(self.sigmas, 1):  # the holder in (j, i]: Held(s, j) has sigma less
                    cand[q] = np.minimum(cand[q], x[q] + self._shift(h[0], sigma))
            else:
                cand = forward + self._held(s, i, t)
                cand[:, :hold] = np.inf  # node i resident from the rebuild to its read
            cand[:, :need] = np.inf
            np.minimum(best, cand, out=best)
        return best

    def _solve(self) -> np.ndarray:
        n = self.c.n
        for length in range(1, n + 1):
            for s in range(0, n - length + 1):
                i = s + length
                k = self.key(s, i)
                for t in reversed(range(len(self.c.units[i]))):
                    if (k, t) not in self.seg:
                        for o in range(len(self.c.units[i][t].moments)):
                            self.seg_at[(k, t, o)] = v = self._seg(s, i, t, o)
                            self.seg[(k, t)] = np.minimum(self.seg.get((k, t), v), v)
        top = self.seg[(self.key(0, n), 0)].copy()
        if not self.c.exit_reads_top:
            return top[0] - self.prefix[n]
        for q, need in enumerate([self.c.exit_need[0]] + [x for _, x in self.sigmas]):
            top[q, :need] = np.inf  # the exit's replay from its holder (from the input for q = 0)
        return top.min(axis=0)


_SOLVERS: dict[int, Solver] = {}


def curve(n_layers: int, units: int) -> np.ndarray:
    """Least recompute cost for every budget of 0..`units` alignment units (inf where nothing fits)."""
    s = _SOLVERS.get(n_layers)
    if s is None or s.m <= units:
        s = _SOLVERS[n_layers] = Solver(chain_of(measure(n_layers)), units)
    return s.curve[:units + 1]


def optimal_recompute(n_layers: int, nbytes: int) -> float | None:
    """Least recompute cost (engine cost units) of one step of the n-layer chain under `nbytes`; None when no
    checkpointing schedule fits."""
    p = measure(n_layers)
    # the plain run is a schedule without recompute that fits its own peak: no budget above it costs more
    units = min(nbytes, p.plain_peak) // p.alignment
    v = float(curve(n_layers, units)[units])
    return None if math.isinf(v) else v


def optimal_overhead(n_layers: int, nbytes: int) -> float | None:
    """compute_overhead of the optimal schedule: (compute + least recompute) / compute; None when nothing fits."""
    r = optimal_recompute(n_layers, nbytes)
    return None if r is None else 1.0 + r / measure(n_layers).compute_cost


def smallest_budget(n_layers: int) -> int:
    """The smallest budget (bytes, a multiple of the alignment) at which some checkpointing schedule fits."""
    p = measure(n_layers)
    s = _SOLVERS.get(n_layers)
    v = s.curve if s is not None and np.isfinite(s.curve).any() else curve(n_layers, p.plain_peak // p.alignment)
    return int(np.argmax(np.isfinite(v))) * p.alignment


# ===================================================================================================== runs
def _child(conn, n_layers, nbytes, config, max_overhead, seconds):
    torch.set_num_threads(1)
    model, inputs = build(n_layers)
    budget = coop_arena.Budget(nbytes, device="meta", max_overhead=max_overhead, **CONFIGS[config])
    t0 = time.perf_counter()
    lock = threading.Lock()
    done = []

    def report(outcome, error=None):
        if done:
            return
        done.append(outcome)
        st = budget.stats
        if st is None:
            conn.send({"outcome": outcome, "error": error, "seconds": time.perf_counter() - t0})
            return
        conn.send({"outcome": outcome, "error": error, "seconds": time.perf_counter() - t0,
                   "compute_overhead": st.compute_overhead, "evictions": st.evictions,
                   "rematerializations": st.rematerializations, "peak_bytes": st.peak_bytes,
                   "exit_overhead": st.exit_overhead})

    def watchdog():
        time.sleep(seconds)
        with lock:
            if not done:
                report("stopped")
                conn.close()
                os._exit(0)

    threading.Thread(target=watchdog, daemon=True).start()
    outcome, error = "fits", None
    try:
        step(model, inputs, budget)
    except Thrashing as e:
        outcome, error = "thrashes", str(e)
    except OutOfBudget as e:
        outcome, error = "out of budget", str(e)
    with lock:
        report(outcome, error)
        conn.close()


def run(n_layers: int, nbytes: int, config: str, *, max_overhead: float = MAX_OVERHEAD,
        seconds: float = SECONDS) -> dict:
    """One dry-run step in a fresh process, stopped by Thrashing past `max_overhead` or after `seconds` (the
    stats at that moment are reported with outcome "stopped")."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds torch's thread pools
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(child, n_layers, nbytes, config, max_overhead, seconds))
    p.start()
    child.close()
    try:
        if parent.poll(seconds + 60):
            try:
                return parent.recv()
            except EOFError:
                pass
        return {"outcome": "error", "error": f"the run's process ended without an answer (exit code {p.exitcode})",
                "seconds": seconds}
    finally:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def sweep(n_layers=N_LAYERS, ratios=RATIOS, policies=POLICIES, *, max_overhead=MAX_OVERHEAD, seconds=SECONDS,
          jobs: int = 2, command: str = "") -> dict:
    """Every (chain, ratio, policy) run with its optimum, as plain data (the input of `markdown`)."""
    out = {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                      f"torch {torch.__version__}",
           "workload": {"layers": "N x (Linear(64, 64), Tanh)", "batch": BATCH, "width": WIDTH, "device": "meta"},
           "max_overhead": max_overhead, "seconds_limit": seconds, "jobs": jobs,
           "load_average_before": os.getloadavg()[0], "chains": []}
    jobs_list = []
    for n in n_layers:
        p = measure(n)
        t0 = time.perf_counter()
        curve(n, int(max(ratios) * p.plain_peak) // p.alignment)
        dp_seconds = time.perf_counter() - t0
        smallest = smallest_budget(n)
        chain = {"n_layers": n, "plain_peak": p.plain_peak, "compute_cost": p.compute_cost,
                 "optimal_smallest_budget": smallest, "optimal_smallest_ratio": smallest / p.plain_peak,
                 "dp_seconds": dp_seconds, "runs": []}
        out["chains"].append(chain)
        for ratio in ratios:
            nbytes = int(ratio * p.plain_peak)
            opt = optimal_overhead(n, nbytes)
            for policy in policies:
                row = {"ratio": ratio, "budget": nbytes, "policy": policy, "optimal_overhead": opt}
                chain["runs"].append(row)
                jobs_list.append((row, n, nbytes, policy))
    with ThreadPoolExecutor(jobs) as pool:
        for row, result in zip([j[0] for j in jobs_list],
                               pool.map(lambda j: run(j[1], j[2], j[3], max_overhead=max_overhead, seconds=seconds),
                                        jobs_list)):
            row.update(result)
            if row.get("compute_overhead") and row["optimal_overhead"]:
                row["vs_optimal"] = row["compute_overhead"] / row["optimal_overhead"]
    out["load_average_after"] = os.getloadavg()[0]
    return out


def _fmt_result(r: dict, max_overhead: float, seconds: float) -> tuple[str, str, str]:
    """(outcome, overhead, overhead / optimal) as table cells."""
    o, v = r.get("compute_overhead"), r.get("vs_optimal")
    if r["outcome"] == "fits":
        return "fits", f"{o:.3f}x", f"{v:.2f}" if v else "-"
    if r["outcome"] == "thrashes":
        ratio = max_overhead / r["optimal_overhead"]
        return f"thrashes (> {max_overhead:g}x)", f"> {max_overhead:g}x", f"> {ratio:.1f}"
    if r["outcome"] == "stopped" and o is not None:
        return f"stopped at {seconds:g} s", f">= {o:.2f}x so far", f">= {v:.2f}" if v else "-"
    return r["outcome"], "-", "-"


def markdown(res: dict) -> str:
    mo, sec = res["max_overhead"], res["seconds_limit"]
    lines = ["# Linear chain: recompute overhead against the optimal checkpointing schedule", "",
             f"Command: `{res['command']}`", "",
             f"- Date: {res['date']}; machine: {res['machine']}.",
             f"- Workload: {res['workload']['layers']}, batch {res['workload']['batch']}, one step (forward, "
             f"`.float().sum().backward()`), dry run on meta. Ratio = budget / plain peak "
             f"(`Budget(1 << 40, device='meta')`'s `peak_bytes`).",
             f"- Overhead = `budget.stats.compute_overhead`; of it at exit = the replays at block exit that copy "
             f"out the output the step still holds (`exit_recompute_cost / compute_cost`, part of the overhead). "
             f"Optimal = the least overhead of a checkpointing schedule "
             f"under the engine's own accounting for the same budget (exact DP, `bench/chain.py`, Note [Chain "
             f"model]). Each run is stopped by `max_overhead={mo:g}` (Thrashing) or after {sec:g} s of wall clock "
             f"(then the overhead reached so far is shown). {res['jobs']} runs at a time, each in its own process; "
             f"load average {res['load_average_before']:.1f} before the sweep and {res['load_average_after']:.1f} "
             f"after on this shared machine, so the wall-clock cut-offs and seconds depend on it, the other "
             f"numbers do not.", ""]
    for ch in res["chains"]:
        lines += [f"## {ch['n_layers']} layers", "",
                  f"Plain peak {ch['plain_peak']:,} bytes; compute cost {ch['compute_cost']:,.0f}; smallest budget "
                  f"at which the optimal schedule fits: {ch['optimal_smallest_budget']:,} bytes (ratio "
                  f"{ch['optimal_smallest_ratio']:.3f}); DP time {ch['dp_seconds']:.1f} s.", "",
                  "| ratio | budget (bytes) | optimal overhead | policy | result | overhead | overhead / optimal | "
                  "of it at exit | evictions | rematerializations | seconds |",
                  "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in ch["runs"]:
            outcome, o, v = _fmt_result(r, mo, sec)
            opt = f"{r['optimal_overhead']:.4f}x" if r["optimal_overhead"] else "does not fit"
            count = lambda k: f"{r[k]:,}" if r.get(k) is not None else "-"  # noqa: E731
            exit_ = f"{r['exit_overhead']:.3f}" if r.get("exit_overhead") is not None else "-"
            lines.append(f"| {r['ratio']:g} | {r['budget']:,} | {opt} | {r['policy']} | {outcome} | {o} | {v} | "
                         f"{exit_} | {count('evictions')} | {count('rematerializations')} | {r.get('seconds', 0):.1f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.chain", description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=list(N_LAYERS))
    ap.add_argument("--ratios", type=float, nargs="+", default=list(RATIOS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(CONFIGS))
    ap.add_argument("--max-overhead", type=float, default=MAX_OVERHEAD)
    ap.add_argument("--seconds", type=float, default=SECONDS, help="wall-clock limit per run")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time, each in its own process")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.layers) or not all(0 < r <= 1 for r in args.ratios) or args.jobs < 1:
        ap.error("--layers must be positive, --ratios in (0, 1], --jobs positive")
    command = "python -m bench.chain " + " ".join(sys.argv[1:] if argv is None else argv)
    res = sweep(args.layers, args.ratios, args.policies, max_overhead=args.max_overhead, seconds=args.seconds,
                jobs=args.jobs, command=command.strip())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "chain.json").write_text(json.dumps(res, indent=1) + "\n")
    (args.out / "chain.md").write_text(markdown(res) + "\n")
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
