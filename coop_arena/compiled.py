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
"""

from __future__ import annotations

import numba
import numpy as np

BLOCKED = 2  # policy.BLOCKED (not imported: this module must not import the package it serves)


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
