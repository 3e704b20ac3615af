"""Eviction policies: pure functions from the block columns to a frozen plan (plan first, commit second).

Each policy sees the blocks in address order as columns: `sizes` (bytes), `kind` (FREE, EVICTABLE, BLOCKED:
pinned or unevictable), `c` (recompute cost including the evicted neighbourhood), `last` (logical clock of the
last use) and the current `clock`. Staleness is s = clock - last + 1. Nothing here mutates; `Memory.apply` is
the only place a plan takes effect.

- coop: the sliding window. Among all runs of consecutive blocks with no BLOCKED block whose bytes cover the
  request, take the one with the least total c/s (free blocks count zero). For each right end the best left end
  is the shortest covering one (costs are >= 0), found for all right ends at once with prefix sums and one
  merge of two sorted arrays (Note [Coop window search]): a handful of vectorized passes.
- dtr: evict the evictable storage with the least c/(m*s), anywhere, one at a time, until the free run that the
  last victim joined covers the request (address-oblivious: earlier victims elsewhere stay evicted).
- dte: dtr with m counting the free bytes adjacent on both sides of the storage as well (MegEngine's variant).
  Scores of the storages bordering a grown free run are updated after each victim.
Ties break towards lower addresses, so plans are deterministic (Rule 8).
"""

from __future__ import annotations

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
# Decisions are those of the plain formulation (same c/s values, same prefix sums and subtraction, first minimum
# on ties); tests/test_memory_properties.py compares the two bit for bit.
def coop_window(offsets, sizes, kind, h, need: int) -> EvictionPlan | None:
    """The coop plan from c/s per block `h`, which must be 0 at FREE blocks (it is zeroed at BLOCKED ones here,
    in place). ndarray methods rather than np.* wrappers: at 1,000 blocks the dispatch is a visible cost."""
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
    r, lo = j + r0, int(left[j])
    victims = tuple(i for i, k in enumerate(kind[lo : r + 1].tolist(), lo) if k == EVICTABLE)
    return EvictionPlan(victims, int(offsets[lo]), int(ends[r]), float(cost[j]), "coop")


def _run(freeish: np.ndarray, i: int) -> tuple[int, int]:
    lo = hi = i
    n = len(freeish)
    while lo > 0 and freeish[lo - 1]:
        lo -= 1
    while hi + 1 < n and freeish[hi + 1]:
        hi += 1
    return lo, hi


def plan_dtr(offsets, sizes, kind, c, last, clock: float, need: int, *, adjacent_free: bool = False) -> EvictionPlan | None:
    ev = np.nonzero(kind == EVICTABLE)[0]
    if ev.size == 0:
        return None
    n = len(sizes)
    freeish = kind == FREE
    stale = clock - last[ev] + 1.0
    m = sizes[ev].astype(np.float64)
    if adjacent_free:
        left_free = np.where((ev > 0) & freeish[np.maximum(ev - 1, 0)], sizes[np.maximum(ev - 1, 0)], 0)
        right_free = np.where((ev + 1 < n) & freeish[np.minimum(ev + 1, n - 1)], sizes[np.minimum(ev + 1, n - 1)], 0)
        m = m + left_free + right_free
    score = c[ev] / (m * stale)
    pos = {int(b): j for j, b in enumerate(ev)}
    chosen, total = [], 0.0
    while True:
        j = int(np.argmin(score))
        if not np.isfinite(score[j]):
            return None  # everything evictable is chosen and still nothing fits
        i = int(ev[j])
        total += float(score[j])
        score[j] = np.inf
        freeish[i] = True
        chosen.append(i)
        lo, hi = _run(freeish, i)
        run_bytes = int(sizes[lo : hi + 1].sum())
        if run_bytes >= need:
            return EvictionPlan(tuple(sorted(chosen)), int(offsets[lo]), int(offsets[hi] + sizes[hi]), total,
                                "dte" if adjacent_free else "dtr")
        if adjacent_free:
            for nb in (lo - 1, hi + 1):
                k = pos.get(nb)
                if k is not None and np.isfinite(score[k]):
                    side = 0
                    if nb > 0 and freeish[nb - 1]:
                        x, y = _run(freeish, nb - 1)
                        side += int(sizes[x : y + 1].sum())
                    if nb + 1 < n and freeish[nb + 1]:
                        x, y = _run(freeish, nb + 1)
                        side += int(sizes[x : y + 1].sum())
                    score[k] = c[nb] / ((sizes[nb] + side) * (clock - last[nb] + 1.0))


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
