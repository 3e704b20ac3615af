"""BlockTable: table-driven traces of place / release fed to one generic overlap checker.

Each case is a list of steps and the table it must leave. After every step the checker compares the table with
an independent model (owner -> range), and `check_invariants()` runs.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coop_arena.blocks import FREE, BlockTable
from coop_arena.errors import InternalError

K = 512  # one alignment unit


def check_layout(t: BlockTable, live: dict[int, tuple[int, int]]) -> None:
    """The generic checker: `live` maps owner code -> (offset, size) of every range handed out and not released.
    Ranges must be aligned, inside [0, usable), pairwise disjoint, and be exactly the table's owned blocks; the
    free blocks must be exactly the rest."""
    t.check_invariants()
    spans = sorted((off, off + size, owner) for owner, (off, size) in live.items())
    for off, end, owner in spans:
        assert 0 <= off < end <= t.usable, f"owner {owner}: [{off}, {end}) outside [0, {t.usable})"
        assert off % t.alignment == 0 and end % t.alignment == 0, f"owner {owner}: [{off}, {end}) not aligned"
    for (o1, e1, w1), (o2, e2, w2) in zip(spans, spans[1:]):
        assert e1 <= o2, f"owners {w1} [{o1}, {e1}) and {w2} [{o2}, {e2}) overlap"
    owned = [(b["offset"], b["offset"] + b["size"], b["owner"] + 1) for b in t.snapshot() if b["owner"] is not None]
    assert owned == spans
    assert t.used_bytes == sum(e - o for o, e, _ in spans)
    assert t.free_bytes == t.usable - t.used_bytes
    # free blocks are the gaps between the live ranges, maximal (merged)
    gaps, cur = [], 0
    for off, end, _ in spans:
        if off > cur:
            gaps.append((cur, off - cur))
        cur = end
    if cur < t.usable:
        gaps.append((cur, t.usable - cur))
    assert [(b["offset"], b["size"]) for b in t.snapshot() if b["owner"] is None] == gaps
    assert t.largest_free == max((g[1] for g in gaps), default=0)


def run(t: BlockTable, steps) -> dict[int, tuple[int, int]]:
    """Steps: ("place", free_offset, nbytes, owner, high, expected_at) or ("release", offset, expected_merged)."""
    live: dict[int, tuple[int, int]] = {}
    for step in steps:
        if step[0] == "place":
            _, free_off, nbytes, owner, high, want = step
            at = t.place(free_off, nbytes, owner, high)
            assert at == want, f"{step}: placed at {at}"
            live[owner] = (at, t.round_up(nbytes))
        else:
            _, off, want = step
            merged = t.release(off)
            assert merged == want, f"{step}: merged block starts at {merged}"
            (owner,) = [w for w, (o, _) in live.items() if o == off]
            del live[owner]
        check_layout(t, live)
    return live


# (name, arena bytes, steps, expected (offset, size, owner) blocks at the end)
CASES = [
    ("low edge", 8 * K, [("place", 0, K, 1, False, 0)],
     [(0, K, 0), (K, 7 * K, None)]),
    ("high edge", 8 * K, [("place", 0, K, 1, True, 7 * K)],
     [(0, 7 * K, None), (7 * K, K, 0)]),
    ("exact fit takes the whole block", 2 * K, [("place", 0, 2 * K, 1, True, 0)],
     [(0, 2 * K, 0)]),
    ("low and high fill towards the middle", 8 * K,
     [("place", 0, K, 1, False, 0), ("place", K, 2 * K, 2, True, 6 * K), ("place", K, K, 3, False, K),
      ("place", 2 * K, K, 4, True, 5 * K)],
     [(0, K, 0), (K, K, 2), (2 * K, 3 * K, None), (5 * K, K, 3), (6 * K, 2 * K, 1)]),
    ("rounding up to the alignment", 8 * K,
     [("place", 0, 1, 1, False, 0), ("place", K, K + 1, 2, False, K)],
     [(0, K, 0), (K, 2 * K, 1), (3 * K, 5 * K, None)]),
    ("release with no free neighbour", 3 * K,
     [("place", 0, K, 1, False, 0), ("place", K, K, 2, False, K), ("place", 2 * K, K, 3, False, 2 * K),
      ("release", K, K)],
     [(0, K, 0), (K, K, None), (2 * K, K, 2)]),
    ("release merges with the right neighbour", 4 * K,
     [("place", 0, K, 1, False, 0), ("place", K, K, 2, False, K), ("release", K, K)],
     [(0, K, 0), (K, 3 * K, None)]),
    ("release merges with the left neighbour", 4 * K,
     [("place", 0, K, 1, True, 3 * K), ("place", 0, K, 2, True, 2 * K), ("release", 2 * K, 0)],
     [(0, 3 * K, None), (3 * K, K, 0)]),
    ("release merges on both sides", 5 * K,
     [("place", 0, K, 1, False, 0), ("place", K, K, 2, False, K), ("place", 2 * K, K, 3, False, 2 * K),
      ("place", 3 * K, K, 4, False, 3 * K), ("release", K, K), ("release", 3 * K, 3 * K), ("release", 2 * K, K)],
     [(0, K, 0), (K, 4 * K, None)]),
    ("release everything gives one block back", 4 * K,
     [("place", 0, K, 1, False, 0), ("place", K, K, 2, True, 3 * K), ("place", K, K, 3, False, K),
      ("release", 0, 0), ("release", 3 * K, 2 * K), ("release", K, 0)],
     [(0, 4 * K, None)]),
    ("the tail below one unit is never used", 4 * K + 100,
     [("place", 0, K, 1, True, 3 * K)],
     [(0, 3 * K, None), (3 * K, K, 0)]),
]


@pytest.mark.parametrize("name,nbytes,steps,final", CASES, ids=[c[0] for c in CASES])
def test_place_release_trace(name, nbytes, steps, final):
    t = BlockTable(nbytes)
    check_layout(t, {})
    run(t, steps)
    assert [(b["offset"], b["size"], b["owner"]) for b in t.snapshot()] == final


def test_columns_grow_past_their_capacity():
    t = BlockTable(300 * K)
    live = run(t, [("place", i * K, K, i + 1, False, i * K) for i in range(200)])
    assert len(t) == 201
    # release every other one: 100 isolated free blocks, then the rest, which merges everything
    for i in range(0, 200, 2):
        t.release(i * K)
        del live[i + 1]
        check_layout(t, live)
    assert len(t._free) == 101
    for i in range(1, 200, 2):
        assert t.release(i * K) == 0
        del live[i + 1]
    check_layout(t, live)
    assert t.snapshot() == [{"offset": 0, "size": 300 * K, "owner": None}]


def _layout(units):
    """Build a table from a list of units: positive = free block of that size, negative = owned block."""
    total = sum(abs(u) for u in units)
    t = BlockTable(total * K)
    # place every block at the low edge of the remaining free tail, then release the ones meant free
    off = 0
    for owner, u in enumerate(units, start=1):
        t.place(off, abs(u) * K, owner, False)
        off += abs(u) * K
    off = 0
    for u in units:
        if u > 0:
            t.release(off)
        off += abs(u) * K
    t.check_invariants()
    return t


BEST_FIT = [
    # (layout in units, request bytes, expected offset or None)
    ([4, -1, 2, -1, 3], 2 * K, 5 * K),        # the smallest fitting block, not the first
    ([4, -1, 2, -1, 3], 3 * K, 8 * K),
    ([4, -1, 2, -1, 3], 4 * K, 0),
    ([4, -1, 2, -1, 3], 5 * K, None),          # 9 units free in all, but no single block holds 5
    ([2, -1, 2, -1, 2], K, 0),                 # ties: lowest address
    ([3, -1, 2, -1, 2], 2 * K, 4 * K),
    ([-1, 1, -1, 2], 1, K),                    # rounding: 1 byte needs one unit
    ([-1, 1, -1, 2], K + 1, 3 * K),            # K + 1 bytes need two units
    ([-1, -1], K, None),                       # nothing free
]


@pytest.mark.parametrize("units,nbytes,want", BEST_FIT)
def test_best_fit(units, nbytes, want):
    t = _layout(units)
    assert t.best_fit(nbytes) == want
    free = [(b["offset"], b["size"]) for b in t.snapshot() if b["owner"] is None]
    fitting = [(size, off) for off, size in free if size >= t.round_up(nbytes)]
    assert want == (min(fitting)[1] if fitting else None)  # the same answer from a brute-force scan


@pytest.mark.parametrize("nbytes,alignment,want", [
    (0, 512, 512), (1, 512, 512), (511, 512, 512), (512, 512, 512), (513, 512, 1024), (4096, 512, 4096),
    (1, 1, 1), (3, 2, 4), (100, 64, 128), (1 << 20, 4096, 1 << 20), ((1 << 20) + 1, 4096, (1 << 20) + 4096),
])
def test_round_up(nbytes, alignment, want):
    assert BlockTable(1 << 22, alignment).round_up(nbytes) == want


@pytest.mark.parametrize("nbytes,alignment,usable", [(4096, 512, 4096), (5000, 512, 4608), (512, 512, 512),
                                                     (1023, 512, 512), (100, 64, 64), (7, 1, 7)])
def test_usable_size(nbytes, alignment, usable):
    t = BlockTable(nbytes, alignment)
    assert t.usable == usable
    assert t.snapshot() == [{"offset": 0, "size": usable, "owner": None}]
    assert t.free_bytes == t.largest_free == usable and t.used_bytes == 0
    t.check_invariants()


def test_snapshot_and_columns_agree():
    t = BlockTable(8 * K)
    t.place(0, K, 5, False)
    t.place(K, 2 * K, 9, True)
    snap = t.snapshot()
    assert snap == [{"offset": 0, "size": K, "owner": 4},
                    {"offset": K, "size": 5 * K, "owner": None},
                    {"offset": 6 * K, "size": 2 * K, "owner": 8}]
    assert t.offsets.tolist() == [0, K, 6 * K]
    assert t.sizes.tolist() == [K, 5 * K, 2 * K]
    assert t.owners.tolist() == [5, FREE, 9]
    assert [t.block(i) for i in range(len(t))] == [(0, K, 5), (K, 5 * K, FREE), (6 * K, 2 * K, 9)]
    assert [t.index_of(b["offset"]) for b in snap] == [0, 1, 2]
    # the snapshot is plain data, not a view of the columns
    assert all(type(v) in (int, type(None)) for b in snap for v in b.values())
    t.place(K, K, 7, False)
    assert snap[1] == {"offset": K, "size": 5 * K, "owner": None}


@pytest.mark.parametrize("nbytes,alignment", [
    (256, 512),          # smaller than one block
    (0, 512),
    (-4096, 512),
    (4096, 384),         # not a power of two
    (4096, 0),
    (4096, -512),
    (4096.0, 512),       # not an int
    (4096, 512.0),
    (True, 1),
    (4096, True),
    ("4096", 512),
    (np.float64(4096), 512),
])
def test_bad_construction(nbytes, alignment):
    with pytest.raises(ValueError):
        BlockTable(nbytes, alignment)


def test_caller_bugs_are_internal_errors_and_change_nothing():
    t = BlockTable(4 * K)
    t.place(0, K, 1, False)
    before = t.snapshot()
    for bad in (lambda: t.place(0, K, 2, False),        # the block at 0 is not free
                lambda: t.place(K, 4 * K, 2, False),    # does not fit
                lambda: t.place(K + 1, K, 2, False),    # no block starts there
                lambda: t.place(K, K, 0, False),        # owner code 0 means free
                lambda: t.release(K),                   # already free
                lambda: t.release(3 * K)):              # inside a block
        with pytest.raises(InternalError, match="please report"):
            bad()
        assert t.snapshot() == before
        t.check_invariants()


@pytest.mark.parametrize("corrupt,message", [
    (lambda t: t._size.__setitem__(1, t._size[1] - K), "gap or overlap"),
    (lambda t: t._owner.__setitem__(2, FREE), "adjacent"),
    (lambda t: t._free.append((K, 123 * K)), "free list"),
    (lambda t: setattr(t, "used_bytes", t.used_bytes + 1), "used_bytes"),
    (lambda t: t._owner.__setitem__(2, 1), "owns two blocks"),
    (lambda t: t._off.__setitem__(0, K), "first block starts"),
])
def test_check_invariants_names_what_disagrees(corrupt, message):
    t = BlockTable(8 * K)
    t.place(0, K, 1, False)
    t.place(K, K, 2, False)
    t.place(2 * K, K, 3, False)
    t.check_invariants()
    corrupt(t)
    with pytest.raises(InternalError, match=message):
        t.check_invariants()


# ------------------------------------------------------------------------------------ random walks vs. a plain list
class ListTable:
    """The plainest table: a Python list of [offset, size, owner] in address order, split and merged in place.
    The reference the linked table must match after every operation."""

    def __init__(self, usable: int):
        self.blocks = [[0, usable, FREE]]

    def _index(self, offset):
        return next(i for i, b in enumerate(self.blocks) if b[0] <= offset < b[0] + b[1])

    def place_at(self, offset, need, owner):
        i = self._index(offset)
        o, s, _ = self.blocks[i]
        parts = [[o, offset - o, FREE], [offset, need, owner], [offset + need, o + s - offset - need, FREE]]
        self.blocks[i : i + 1] = [p for p in parts if p[1] > 0]

    def release(self, offset):
        i = self._index(offset)
        self.blocks[i][2] = FREE
        if i + 1 < len(self.blocks) and self.blocks[i + 1][2] == FREE:
            self.blocks[i][1] += self.blocks.pop(i + 1)[1]
        if i > 0 and self.blocks[i - 1][2] == FREE:
            self.blocks[i - 1][1] += self.blocks.pop(i)[1]
            i -= 1
        return self.blocks[i][0]

    def best_fit(self, need):
        fits = [(s, o) for o, s, w in self.blocks if w == FREE and s >= need]
        return min(fits)[1] if fits else None


walk_steps = st.lists(st.tuples(st.sampled_from(["low", "high", "at", "release", "release", "read"]),
                                st.integers(0, 1 << 20), st.integers(1, 6)), min_size=1, max_size=400)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(steps=walk_steps, units=st.integers(1, 300))
def test_random_walk_matches_a_plain_list(steps, units):
    """place / place_at / release in random order, with the address-ordered columns read at random points (the
    cached order is then updated from whatever mix of born and dead ids piled up), compared after every step
    with the plain list: columns, best fit, block_at, neighbours, free bytes, and check_invariants()."""
    t, ref = BlockTable(units * K), ListTable(units * K)
    next_owner = 1
    for op, a, n in steps:
        free = [b for b in ref.blocks if b[2] == FREE]
        owned = [b for b in ref.blocks if b[2] != FREE]
        if op in ("low", "high", "at") and free:
            o, s, _ = free[a % len(free)]
            need = min(n, s // K) * K
            if op == "at":
                at = o + (a // 7) % (s // K - need // K + 1) * K
                assert t.place_at(at, need, next_owner) == at
            else:
                at = t.place(o, need - 100, next_owner, high=op == "high")
                assert at == (o + s - need if op == "high" else o)
            ref.place_at(at, need, next_owner)
            next_owner += 1
        elif op == "release" and owned:
            o = owned[a % len(owned)][0]
            assert t.release(o) == ref.release(o)
        elif op == "read":
            t.offsets  # noqa: B018 - a read of the columns brings the cached order up to date
        else:
            continue
        if a % 5 == 0 or op == "read":
            assert [[int(x) for x in b] for b in zip(t.offsets, t.sizes, t.owners)] == ref.blocks
            t.check_invariants()
        assert len(t) == len(ref.blocks)
        for need in (K, 3 * K, 64 * K):
            assert t.best_fit(need) == ref.best_fit(need)
        probe = (a * 97) % t.usable
        b = ref.blocks[ref._index(probe)]
        assert t.block_at(probe) == tuple(b)
        i = ref.blocks.index(b)
        below = tuple(ref.blocks[i - 1]) if i > 0 else None
        above = tuple(ref.blocks[i + 1]) if i + 1 < len(ref.blocks) else None
        assert t.neighbours(b[0]) == (below, above)
        assert t.free_bytes == sum(s for _, s, w in ref.blocks if w == FREE)
        assert t.largest_free == max((s for _, s, w in ref.blocks if w == FREE), default=0)
    assert [[int(x) for x in b] for b in zip(t.offsets, t.sizes, t.owners)] == ref.blocks
    t.check_invariants()


def test_ids_are_recycled_without_reads():
    """A long run of place / release with no read of the columns (a step that never needs eviction) keeps the
    id space bounded: dead ids are recycled once they fill half of it."""
    t = BlockTable(64 * K)
    live = []
    for i in range(20_000):
        live.append(t.place(t.best_fit(K), K, 1 + i, high=bool(i % 2)))
        if len(live) >= 40 or i % 3:
            t.release(live.pop((i * 7) % len(live)))
    assert len(t._off) <= 4 * 64, f"{len(t._off)} ids for at most 64 blocks"
    t.check_invariants()
