"""Compiled hot loops (numba, an optional dependency): the coop window search as one pass over the blocks.

Note [Compiled window search]
Rationale: the vectorized search (policy.coop_window_numpy) is a couple of dozen numpy calls, and on a small
  table each call costs a few microseconds whatever it does; one compiled pass costs about as much as one call.
Approach: `window` computes exactly what the numpy formulation computes, in the same floating-point order:
  c/s is zeroed at BLOCKED blocks (in place, as the numpy path does), its prefix sums are a running sum from
  the left (np.cumsum is one too), the best left end of each right end is found by a pointer that only moves
  right (the numpy path merges two sorted arrays; both give max{l : offsets[l] <= ends[r] - need}), and the
  first strict minimum over right ends is taken (np.argmin's first minimum). tests/test_search_paths.py checks
  that both paths return the same plans bit for bit.
Limitations: compiled on first use (`cache=True` keeps the machine code in __pycache__, so later processes only
  load it); without numba, or where it fails to import, the numpy path runs (policy.compiled_window).

Note [Compiling off the engine's stack]
Rationale: numba's type inference keeps the tracebacks of the typing errors it tries and recovers from, and a
  traceback holds every frame above it. Compiled lazily at the first call, on the engine's stack, they held the
  frames of the model's forward, with their tensors, for the rest of the process: an activation (an MLP's
  logits) stayed alive until its block exited, so a process whose cache was cold decided otherwise than one
  whose cache was warm (514 trace events against 513) and kept that step's tensors.
Approach: `load` compiles, or loads from the cache, every function for the argument types the engine passes
  (`SIGNATURES`), and policy.compiled_window runs it once per process in a helper thread, whose stack holds
  nothing of the program's. tests/test_search_paths.py checks that a cold cache and a warm one decide alike
  and that no block compiles anything more.
Limitations: a call with other argument types (a new caller) compiles lazily on the engine's stack again; the
  test above fails then, until its types are added to `SIGNATURES`.

Note [Compiled decision]
Rationale: the window search is one part of what an eviction event spends choosing. The prices it reads (c/s
  and the price of a copy per block, gathered from the per-slot columns) and the move plan's reruns (Note [Moving
  instead of evicting] in memory.py: a window on cheaper prices, then a destination for each block priced as a
  copy) were another few dozen numpy calls and Python loops per event, more than the window search itself.
Approach: `prices` gathers and divides in one pass, in numpy's order of operations (clock - last, + 1.0, then
  c / s and 2.0 * bytes / s), so every price has the same bits. `move_search` runs the move plan's loop as
  memory.py's Python version does: the window on the copy prices, the window's movable blocks largest first
  (then lowest index), each taking the best-fitting free hole outside the window (smallest, then lowest
  address) or else the range of the smallest evictable block outside it whose eviction costs less than its own
  (then the cheapest, then the lowest index), and a rerun with a block priced at its eviction when it finds
  neither. It returns the window and the moves; `move_total` lists what the plan evicts and sums the copies'
  prices, and the caller totals the evictions' prices with numpy, as before, so every sum keeps its order. `columns` brings the block table's address-ordered columns up to date (Note [Block
  table] in blocks.py) in one merge: the cached order less its dead ids, merged by offset with the ids born
  since. tests/test_search_paths.py checks both paths give the same plans, prices and columns.
"""

from __future__ import annotations

import numba
import numpy as np

FREE, EVICTABLE, BLOCKED = 0, 1, 2  # policy's kinds (not imported: this module must not import the package it serves)


@numba.njit(cache=True, nogil=True)
def window(offsets, sizes, kind, h, need):
    """(lo, r, cost) of the cheapest window of blocks lo..r covering `need` bytes with no BLOCKED block, the
    first such right end on ties and its shortest window; (-1, -1, inf) when none. `h` (c/s per block, 0 at
    FREE blocks) is zeroed at BLOCKED blocks in place."""
    n = sizes.shape[0]
    h0 = np.empty(n + 1)
    acc = 0.0
    h0[0] = acc
    for i in range(n):
        if kind[i] == BLOCKED:
            h[i] = 0.0
        acc += h[i]
        h0[i + 1] = acc
    best, best_lo, best_r = np.inf, -1, -1
    lo, last_blocked = 0, -1
    for r in range(n):
        if kind[r] == BLOCKED:
            last_blocked = r
        target = offsets[r] + sizes[r] - need
        if target < 0:
            continue
        while lo + 1 < n and offsets[lo + 1] <= target:
            lo += 1
        if lo <= last_blocked:
            continue
        cost = h0[r + 1] - h0[lo]
        if cost < best:
            best, best_lo, best_r = cost, lo, r
    return best_lo, best_r, best


@numba.njit(cache=True, nogil=True)
def prices(own, kind_rows, c_rows, last_rows, sizes, clock):
    """Per block in address order (row `own[i]` of the per-slot columns): its kind, c/s and 2 x bytes / s, with
    s = clock - last + 1.0 (Note [Compiled decision])."""
    n = own.shape[0]
    kind = np.empty(n, kind_rows.dtype)
    h = np.empty(n)
    move = np.empty(n)
    for i in range(n):
        o = own[i]
        s = clock - last_rows[o]
        s += 1.0
        kind[i] = kind_rows[o]
        h[i] = c_rows[o] / s
        move[i] = 2.0 * sizes[i] / s
    return kind, h, move


@numba.njit(cache=True, nogil=True)
def _take_hole(hole_off, hole_size, holes, nbytes):
    """Offset of `nbytes` from the low end of the best-fitting of the first `holes` holes, or -1."""
    best = -1
    for j in range(holes):
        if hole_size[j] >= nbytes and (best < 0 or hole_size[j] < hole_size[best]
                                       or (hole_size[j] == hole_size[best] and hole_off[j] < hole_off[best])):
            best = j
    if best < 0:
        return -1
    at = hole_off[best]
    hole_off[best] += nbytes
    hole_size[best] -= nbytes
    return at


@numba.njit(cache=True, nogil=True)
def move_search(offsets, sizes, owners, kind, h, move, need, plain_cost):
    """The move plan's search (Note [Compiled decision]): (lo, r, cost, moved, at, made, count, cand) with the
    moves in the first `count` entries (made: the block evicted to make the hole, or -1), or count = -1 when no
    window on the copy prices costs less than `plain_cost`; `cand`: the blocks priced as copies at the end."""
    n = sizes.shape[0]
    h2 = np.empty(n)
    cand = np.empty(n, np.bool_)
    for i in range(n):
        cand[i] = kind[i] == EVICTABLE and move[i] < h[i]
        h2[i] = move[i] if cand[i] else h[i]
    moved = np.empty(n, np.int64)
    at = np.empty(n, np.int64)
    made = np.empty(n, np.int64)
    hole_off = np.empty(n, np.int64)
    hole_size = np.empty(n, np.int64)
    spare = np.empty(n, np.bool_)
    while True:
        lo, r, cost = window(offsets, sizes, kind, h2, need)  # (it zeroes BLOCKED blocks, which h2 never prices)
        if r < 0 or cost >= plain_cost:
            return lo, r, cost, moved, at, made, -1, cand
        start, end = offsets[lo], offsets[r] + sizes[r]
        holes = 0
        for j in range(n):
            outside = offsets[j] + sizes[j] <= start or offsets[j] >= end
            spare[j] = outside and kind[j] == EVICTABLE
            if outside and owners[j] == 0:
                hole_off[holes] = offsets[j]
                hole_size[holes] = sizes[j]
                holes += 1
        movers = np.array([i for i in range(lo, r + 1) if kind[i] == EVICTABLE and cand[i]], np.int64)
        order = movers[np.argsort(-sizes[movers], kind="mergesort")]  # largest first, then lowest index
        count, stuck = 0, -1
        for i in order:
            hole = -1
            dest = _take_hole(hole_off, hole_size, holes, sizes[i])
            if dest < 0:  # make a hole: the smallest cheaper evictable block outside, then cheapest, then lowest
                for j in range(n):
                    if spare[j] and sizes[j] >= sizes[i] and h[j] + move[i] < h[i] and (
                            hole < 0 or sizes[j] < sizes[hole] or (sizes[j] == sizes[hole] and h[j] < h[hole])):
                        hole = j
                if hole < 0:
                    stuck = i
                    break
                spare[hole] = False
                hole_off[holes] = offsets[hole]
                hole_size[holes] = sizes[hole]
                holes += 1
                dest = _take_hole(hole_off, hole_size, holes, sizes[i])
            moved[count] = i
            at[count] = dest
            made[count] = hole
            count += 1
        if stuck < 0:
            return lo, r, cost, moved, at, made, count, cand
        cand[stuck] = False  # no destination: priced at its eviction, and the search runs again
        h2[stuck] = h[stuck]


@numba.njit(cache=True, nogil=True)
def move_total(kind, move, cand, lo, r, moved, made, count):
    """What a move plan evicts, in the order memory.py totals it (the window's evictable blocks not moved, in
    address order, then the blocks evicted to make holes), and the sum of its copy prices in the moves' order
    (left to right, as Python's sum)."""
    evict = []
    for i in range(lo, r + 1):
        if kind[i] == EVICTABLE and not cand[i]:
            evict.append(i)
    copies = 0.0
    for k in range(count):
        if made[k] >= 0:
            evict.append(made[k])
        copies += move[moved[k]]
    return np.array(evict, np.int64), copies


@numba.njit(cache=True, nogil=True)
def columns(order, alive, born, off, size, owner):
    """(order, offsets, sizes, owners) in address order: the ids of `order` (address-ordered) still `alive`,
    merged by offset with the ids `born` (in any order; offsets are distinct among live ids)."""
    born = born[np.argsort(off[born])]
    n = 0
    for b in order:
        if alive[b]:
            n += 1
    n += born.shape[0]
    out = np.empty(n, np.int64)
    i = j = 0
    for k in range(n):
        while i < order.shape[0] and not alive[order[i]]:
            i += 1
        if j < born.shape[0] and (i == order.shape[0] or off[born[j]] < off[order[i]]):
            out[k] = born[j]
            j += 1
        else:
            out[k] = order[i]
            i += 1
    offsets = np.empty(n, np.int64)
    sizes = np.empty(n, np.int64)
    owners = np.empty(n, np.int64)
    for k in range(n):
        b = out[k]
        offsets[k] = off[b]
        sizes[k] = size[b]
        owners[k] = owner[b]
    return out, offsets, sizes, owners


@numba.njit(cache=True, nogil=True)
def evictable(kind, lo, r):
    """The EVICTABLE blocks of lo..r, ascending: a window's victims."""
    out = np.empty(r + 1 - lo, np.int64)
    n = 0
    for i in range(lo, r + 1):
        if kind[i] == EVICTABLE:
            out[n] = i
            n += 1
    return out[:n]


def _array(dtype, readonly: bool = False):
    return numba.types.Array(dtype, 1, "C", readonly=readonly)


_I8, _I8R, _I1, _F8, _B = (_array(numba.int64), _array(numba.int64, True), _array(numba.int8),
                           _array(numba.float64), _array(numba.boolean))
SIGNATURES = (  # what the engine passes (the block table's columns are read-only views)
    (window, (_I8R, _I8R, _I1, _F8, numba.int64)),
    (prices, (_I8R, _I1, _F8, _F8, _I8R, numba.float64)),
    (move_search, (_I8R, _I8R, _I8R, _I1, _F8, _F8, numba.int64, numba.float64)),
    (move_total, (_I1, _F8, _B, numba.int64, numba.int64, _I8, _I8, numba.int64)),
    (columns, (_I8, _B, _I8, _I8, _I8, _I8)),
    (evictable, (_I1, numba.int64, numba.int64)),
)


def load() -> None:
    """Compile, or load from the cache, each function for the types in SIGNATURES (Note [Compiling off the
    engine's stack]: run it off the engine's stack)."""
    for fn, sig in SIGNATURES:
        fn.compile(sig)
