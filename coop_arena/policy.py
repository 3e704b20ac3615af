"""Eviction policies: pure functions from the block columns to a frozen plan (plan first, commit second).

Each policy sees the blocks in address order as columns: `sizes` (bytes), `kind` (FREE, EVICTABLE, BLOCKED:
pinned or unevictable), `c` (recompute cost including the evicted neighbourhood), `last` (logical clock of the
last use) and the current `clock`. Staleness is s = clock - last + 1. Nothing here mutates; `Memory.apply` is
the only place a plan takes effect.

- coop: the sliding window. Among all runs of consecutive blocks with no BLOCKED block whose bytes cover the
  request, take the one with the least total c/s (free blocks count zero). For each right end the best left end
  is the shortest covering one (costs are >= 0), found for all right ends at once with prefix sums and a
  binary search over them: one vectorized pass.
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
    return c / (clock - last + 1.0)


def plan_coop(offsets, sizes, kind, c, last, clock: float, need: int) -> EvictionPlan | None:
    h = np.where(kind == EVICTABLE, heuristic(c, last, clock), 0.0)
    p0 = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=p0[1:])
    h0 = np.zeros(len(sizes) + 1)
    np.cumsum(h, out=h0[1:])
    b0 = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(kind == BLOCKED, out=b0[1:])
    target = p0[1:] - need                                   # window [l, r] covers iff p0[l] <= p0[r+1] - need
    left = np.searchsorted(p0, target, side="right") - 1     # the largest such l, -1 if none
    ok = left >= 0
    lc = np.where(ok, left, 0)
    ok &= b0[1:] - b0[lc] == 0                               # no pinned or unevictable block inside
    if not ok.any():
        return None
    cost = np.where(ok, h0[1:] - h0[lc], np.inf)
    r = int(np.argmin(cost))
    lo = int(lc[r])
    victims = tuple(int(i) for i in np.nonzero(kind[lo : r + 1] == EVICTABLE)[0] + lo)
    return EvictionPlan(victims, int(offsets[lo]), int(offsets[r] + sizes[r]), float(cost[r]), "coop")


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
