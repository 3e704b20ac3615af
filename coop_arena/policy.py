"""Eviction policies: pure functions from the block columns to a frozen plan (plan first, commit second).

Each policy sees the blocks in address order as columns: `sizes` (bytes), `kind` (FREE, EVICTABLE, BLOCKED:
pinned or unevictable), `c` (recompute cost including the evicted neighbourhood), `last` (logical clock of the
last use) and the current `clock`. Staleness is s = clock - last + 1. Nothing here mutates; `Memory.apply` is
the only place a plan takes effect.

- coop: the sliding window. Among all runs of consecutive blocks with no BLOCKED block whose bytes cover the
  request, take the one with the least total c/s (free blocks count zero). For each right end the best left end
  is the shortest covering one (costs are >= 0), found for all right ends at once with prefix sums and one
  merge of two sorted arrays (Note [Coop window search]): a handful of vectorized passes, or one compiled
  pass where numba is installed.
- dtr: evict the evictable storage with the least c/(m*s), anywhere, one at a time, until the free run that the
  last victim joined covers the request (address-oblivious: earlier victims elsewhere stay evicted).
- dte: dtr with m counting the free bytes adjacent on both sides of the storage as well (MegEngine's variant).
  Scores of the storages bordering a grown free run are updated after each victim.
Ties break towards lower addresses, so plans are deterministic (Rule 8).

The window is the cheapest plan under its own measure (a dtr plan's last free run is a window too, and its other
victims only add c/s), so coop cannot lose to dtr request by request; where it loses over a step (ResNet-152 at
0.35 and 0.3 of its peak), dtr's scattered victims free bytes that later requests take without a search. Taking
dtr's plan whenever its c/s per byte it frees is below the window's was measured and not adopted: Inception V3 at
0.3/0.2 1.174x/1.411x -> 1.161x/1.365x, but ResNet-152 at 0.35 1.155x -> 1.186x, DenseNet-121 at 0.5/0.2
1.135x/1.239x -> 1.154x/1.317x, GPT-2 at 0.5 1.120x -> 1.128x. Scoring each right end's shortest window by
its c/s times (need / its bytes)^a, so that a window freeing more than the request counts what it frees beyond it,
was measured too and not adopted: a = 1 ResNet-152 at 0.35/0.3/0.1 1.155x/1.182x/1.452x -> 1.149x/1.174x/1.614x
(dtr 1.129x/1.147x/1.633x), a = 0.5 1.157x/1.186x/1.577x.
Where the loss at ResNet-152 0.35 comes from (one dry run each): coop replays 71 convolution outputs (11.1 % of
the step's cost) and 114 batch-norm outputs (4.2 %), dtr 49 (7.3 %) and 117 (5.5 %); coop's 184 plans evict 187
storages, none reading another victim of the same plan, so the window does not lose by evicting a producer beside
its consumer. Coop evicts more, smaller storages for about the same bytes (187 of 171 MiB on average against
dtr's 164 of 198 MiB), and more of them are convolution outputs; which single decisions cause that is not measured.

Note [Staleness, not the recorded next use]
Staleness is a guess at how soon a storage is needed again. A training loop repeats one step, so a later block
could know instead: the first block records which op reads which storage (storages named by the op that created
them and their order in it), and a later block replaces s by the distance to the next read in the first block's
program cost (for a storage read by nothing later but the rebuilding of an evicted storage, that one's next read;
read by nothing: infinite, price 0). Measured as a monkeypatch on coop, second block against the first:
- better: the 100-layer chain at 0.2 1.649x -> 1.360x (1.06x its optimum), U-Net 0.45/0.35 1.337x/1.417x ->
  1.164x/1.254x, ResNet-152 0.1 1.877x -> 1.402x, DenseNet-121 0.125/0.5 1.731x/1.135x -> 1.349x/1.121x, BiLSTM
  0.5/0.3 1.404x/1.653x -> 1.344x/1.508x, Inception V3 0.3 1.185x -> 1.158x, GPT-2 0.5 1.135x -> 1.122x;
- worse: Swin-T 0.25/0.2 1.153x/1.360x -> 1.258x/1.513x, and at 0.15 the second block raised OutOfBudget
  where the first fit; ResNet-50 0.2 1.357x -> 1.680x; BERT-Large 0.1 1.428x -> 1.684x.
Variants moved the losses elsewhere: the distance in ops instead of cost (Swin-T 0.2 1.216x, but Inception V3
0.2 1.738x); the geometric mean of staleness and that distance (Inception V3 0.3 1.474x, BERT-Large 0.1
1.756x); counting resident dependents' reads too was worse everywhere (Swin-T 0.2 3.28x). A later step that
fails where the first fitted would end a training run, so staleness stays.
Damping staleness instead (coop's c/s^a, copies priced alike), measured on 16 points (2026-12-06): a = 0.5
lowers U-Net 0.3/0.25 1.491x/3.982x -> 1.281x/1.584x, Inception V3 0.2 1.411x -> 1.303x, ResNet-152 0.3 1.182x ->
1.159x, DenseNet-121 0.5 1.135x -> 1.118x, BERT-Large 0.1 1.399x -> 1.338x, but raises ResNet-50 0.2 1.316x ->
1.521x (and 0.1625 no longer fits), Swin-T 0.1625 1.376x -> 4.321x, ResNet-152 0.1 1.452x -> 1.536x; a = 0.75 and
0.9 move other edges the same way (U-Net 0.25 stops fitting at 0.75; ResNet-50 0.1625 at 0.9). s stays whole.
"""

from __future__ import annotations

import heapq
import logging
import sys
import threading
from dataclasses import dataclass

import numpy as np

FREE, EVICTABLE, BLOCKED = 0, 1, 2
POLICIES = ("coop", "dtr", "dte")


@dataclass(frozen=True, slots=True)
class EvictionPlan:
    victims: tuple[int, ...]  # block indices to evict, ascending
    start: int                # the free range the request will be placed in: [start, end)
    end: int
    cost: float               # the policy's score of the plan (sum of c/s for coop, sum of picked scores for dtr/dte)
    policy: str


def heuristic(c: np.ndarray, last: np.ndarray, clock: float) -> np.ndarray:
    d = clock - last
    d += 1.0
    return np.divide(c, d, out=d)  # c / (clock - last + 1.0), one temporary


def plan_coop(offsets, sizes, kind, c, last, clock: float, need: int) -> EvictionPlan | None:
    h = heuristic(c, last, clock)
    h[kind != EVICTABLE] = 0.0
    return coop_window(offsets, sizes, kind, h, need)


# Note [Coop window search]
# Rationale: the search runs once per allocation that needs eviction, over every block of the arena, so its
#   constant factor is the latency the user sees; at 1,000 blocks each numpy call costs about a microsecond
#   whatever it does, so the number of calls matters as much as the work.
# Approach: blocks tile the arena, so the prefix sums of the sizes are the offsets themselves. The best window
#   ending at block r starts at left[r] = max{l : offsets[l] <= ends[r] - need} and costs h0[r+1] - h0[left[r]]
#   with h0 the prefix sums of c/s.
#   - Right ends with ends[r] < need cannot cover: one scalar search cuts them off (r0).
#   - offsets and the targets ends[r] - need are both sorted, so left[] is a merge, not n binary searches: a
#     stable sort of the two concatenated runs (timsort merges two runs in linear time) puts each target right
#     after the offsets <= it; its position minus the targets before it, minus one, is left[r].
#   - A window is valid when no BLOCKED block lies in [left[r], r], i.e. left[r] > the last BLOCKED index <= r
#     (a running maximum over the few BLOCKED indices).
#   - Where numba is installed the same computation runs as one compiled pass (Note [Compiled window search]
#     in compiled.py); `coop_window` takes it, `coop_window_numpy` is the fallback, and both give the same plans.
# Decisions are those of the plain formulation (same c/s values, same prefix sums and subtraction, first minimum
# on ties); tests/test_memory_properties.py compares the two bit for bit.
def coop_window(offsets, sizes, kind, h, need: int) -> EvictionPlan | None:
    """The coop plan from c/s per block `h`, which must be 0 at FREE blocks (it is zeroed at BLOCKED ones here,
    in place): the compiled search where numba is installed, else the numpy one."""
    window = compiled_window()
    if window is None:
        return coop_window_numpy(offsets, sizes, kind, h, need)
    lo, r, cost = window(offsets, sizes, kind, h, need)
    return None if r < 0 else _window_plan(offsets, sizes, kind, lo, r, cost)


def coop_window_numpy(offsets, sizes, kind, h, need: int) -> EvictionPlan | None:
    """`coop_window` as vectorized numpy passes. ndarray methods rather than np.* wrappers: at 1,000 blocks the
    dispatch is a visible cost."""
    n = len(sizes)
    ends = offsets + sizes
    r0 = int(ends.searchsorted(need))                   # the first right end that can cover
    if r0 == n:
        return None
    target = ends[r0:] - need                           # >= 0, so left >= 0
    merged = np.concatenate((offsets, target)).argsort(kind="stable")
    left = (merged >= n).nonzero()[0]                   # positions of the targets in the merged order
    left -= np.arange(1, n - r0 + 1)                    # ... minus the targets before them, minus one
    blocked = (kind == BLOCKED).nonzero()[0]
    h[blocked] = 0.0
    h0 = np.empty(n + 1)
    h0[0] = 0.0
    h.cumsum(out=h0[1:])
    cost = h0[r0 + 1 :] - h0.take(left)
    if blocked.size:
        last_blocked = np.empty(n, np.int64)
        last_blocked.fill(-1)
        last_blocked[blocked] = blocked
        np.maximum.accumulate(last_blocked, out=last_blocked)
        cost[left <= last_blocked[r0:]] = np.inf        # a BLOCKED block inside: not a window
    j = int(cost.argmin())
    if cost[j] == np.inf:
        return None
    return _window_plan(offsets, sizes, kind, int(left[j]), j + r0, cost[j])


def _window_plan(offsets, sizes, kind, lo: int, r: int, cost) -> EvictionPlan:
    compiled = compiled_decision()
    if compiled is not None:
        victims = compiled.evictable(kind, lo, r)
    else:
        victims = np.flatnonzero(kind[lo : r + 1] == EVICTABLE) + lo
    victims = tuple(victims.tolist())
    return EvictionPlan(victims, int(offsets[lo]), int(offsets[r] + sizes[r]), float(cost), "coop")


_COMPILED = []  # [the compiled window search, or None where numba is missing], filled on first use


def compiled_window():
    """The compiled window search (compiled.window), or None where numba is not installed. Imported on the first
    search, not with the package: importing numba takes a noticeable fraction of a second. Imported and compiled
    in a helper thread (Note [Compiling off the engine's stack] in compiled.py)."""
    if not _COMPILED:
        found = []

        def import_and_compile():
            try:
                from .compiled import load, window
                load()
            except ImportError:  # numba is not installed
                window = None
            except Exception as e:  # numba is there but cannot serve (for example no writable cache directory)
                logging.getLogger(__name__).warning("coop window search: numba unusable (%s), using numpy", e)
                window = None
            found.append(window)

        helper = threading.Thread(target=import_and_compile, name="coop_arena compile")
        helper.start()
        helper.join()
        _COMPILED.append(found[0] if found else None)
    return _COMPILED[0]


def compiled_decision():
    """The compiled module (compiled.py: the prices and the move plan's search, Note [Compiled decision]) while
    the compiled window search is in use, else None: either every part of a decision is compiled or none."""
    return None if compiled_window() is None else sys.modules.get("coop_arena.compiled")


class _Runs:
    """Maximal runs of free blocks as blocks join them (DTR's victims): O(1) per join. A run is stored at its
    two ends only; a block never joins next to a run's interior, so ends are all that is ever asked."""

    __slots__ = ("sizes", "free", "joined", "end_of", "start_of", "bytes_at")

    def __init__(self, sizes, kind):
        self.sizes = sizes
        self.free = kind == FREE          # free from the start (single-block runs until something joins)
        self.joined: set[int] = set()
        self.end_of: dict[int, int] = {}   # run start -> run end, for runs that grew
        self.start_of: dict[int, int] = {}  # run end -> run start
        self.bytes_at: dict[int, int] = {}  # run start -> its bytes

    def freeish(self, i: int) -> bool:
        return i in self.joined or self.free.item(i)

    def ending_at(self, e: int) -> tuple[int, int]:
        """(start, bytes) of the run ending at block e."""
        s = self.start_of.get(e, e)
        return s, self.bytes_at.get(s) or self.sizes.item(s)

    def starting_at(self, s: int) -> tuple[int, int]:
        """(end, bytes) of the run starting at block s."""
        return self.end_of.get(s, s), self.bytes_at.get(s) or self.sizes.item(s)

    def join(self, i: int) -> tuple[int, int, int]:
        """Block i becomes free: (start, end, bytes) of the run it is now part of."""
        lo = hi = i
        total = self.sizes.item(i)
        if i > 0 and self.freeish(i - 1):
            lo, b = self.ending_at(i - 1)
            total += b
        if i + 1 < len(self.sizes) and self.freeish(i + 1):
            hi, b = self.starting_at(i + 1)
            total += b
        self.joined.add(i)
        self.end_of[lo], self.start_of[hi], self.bytes_at[lo] = hi, lo, total
        return lo, hi, total

    def beside(self, i: int) -> int:
        """Bytes of the free runs just below and just above block i (not free itself)."""
        side = 0
        if i > 0 and self.freeish(i - 1):
            side += self.ending_at(i - 1)[1]
        if i + 1 < len(self.sizes) and self.freeish(i + 1):
            side += self.starting_at(i + 1)[1]
        return side


def plan_dtr(offsets, sizes, kind, c, last, clock: float, need: int, *, adjacent_free: bool = False) -> EvictionPlan | None:
    """Note [DTR loop]: each step takes the evictable storage with the least score (first in address order on
    ties, as np.argmin would) until the run of free blocks the last victim joined covers the request. Scores
    are sorted once; dte's updated scores (the storages bordering a grown run) go to a heap, and each step takes
    the smaller of the two heads, skipping entries that are chosen or out of date."""
    ev = np.nonzero(kind == EVICTABLE)[0]
    if ev.size == 0:
        return None
    n = len(sizes)
    stale = clock - last[ev] + 1.0
    m = sizes[ev].astype(np.float64)
    if adjacent_free:
        freeish = kind == FREE
        left_free = np.where((ev > 0) & freeish[np.maximum(ev - 1, 0)], sizes[np.maximum(ev - 1, 0)], 0)
        right_free = np.where((ev + 1 < n) & freeish[np.minimum(ev + 1, n - 1)], sizes[np.minimum(ev + 1, n - 1)], 0)
        m = m + left_free + right_free
        pos = np.full(n, -1, np.int64)  # block index -> index in ev
        pos[ev] = np.arange(ev.size)
    score_np = c[ev] / (m * stale)
    score = score_np.tolist()
    ranked = score_np.argsort(kind="stable").tolist()  # (score, index) order: np.argmin's choice, step by step
    blocks = ev.tolist()
    chosen = [False] * len(blocks)
    updated = [False] * len(blocks)  # its score in `ranked` is out of date; the heap has the current one
    heap: list[tuple[float, int]] = []
    runs = _Runs(sizes, kind)
    picked, total, at = [], 0.0, 0
    while True:
        while at < len(ranked) and (chosen[ranked[at]] or updated[ranked[at]]):
            at += 1
        while heap and (chosen[heap[0][1]] or heap[0][0] != score[heap[0][1]]):
            heapq.heappop(heap)
        if heap and (at == len(ranked) or heap[0] < (score[ranked[at]], ranked[at])):
            j = heapq.heappop(heap)[1]
        elif at < len(ranked):
            j = ranked[at]
        else:
            return None  # everything evictable is chosen and still nothing fits
        i = blocks[j]
        total += score[j]
        chosen[j] = True
        picked.append(i)
        lo, hi, run_bytes = runs.join(i)
        if run_bytes >= need:
            return EvictionPlan(tuple(sorted(picked)), int(offsets[lo]), int(offsets[hi] + sizes[hi]), total,
                                "dte" if adjacent_free else "dtr")
        if adjacent_free:
            for nb in (lo - 1, hi + 1):
                k = pos.item(nb) if 0 <= nb < n else -1
                if k >= 0 and not chosen[k]:
                    score[k] = c.item(nb) / ((sizes.item(nb) + runs.beside(nb)) * (clock - last.item(nb) + 1.0))
                    updated[k] = True
                    heapq.heappush(heap, (score[k], k))


def plan(policy: str, offsets, sizes, kind, c, last, clock: float, need: int) -> EvictionPlan | None:
    if policy == "coop":
        return plan_coop(offsets, sizes, kind, c, last, clock, need)
    if policy == "dtr":
        return plan_dtr(offsets, sizes, kind, c, last, clock, need)
    if policy == "dte":
        return plan_dtr(offsets, sizes, kind, c, last, clock, need, adjacent_free=True)
    raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")


def largest_window(sizes, kind) -> int:
    """Bytes of the largest run of blocks with no BLOCKED block: the most one request could ever get."""
    blocked = kind == BLOCKED
    if blocked.all():
        return 0
    seg = np.cumsum(blocked)
    return int(np.bincount(seg[~blocked], weights=sizes[~blocked]).max())
