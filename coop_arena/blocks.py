"""BlockTable: address-ordered blocks that tile one arena.

Note [Block table]
Rationale: every op places and releases storages, while only an allocation that needs eviction reads the whole
  table (Coop's sliding window walks memory in address order). So the common operations must be O(1) or
  O(log n) with small constants, and the window search must still get the blocks as columns in address order
  (numpy arrays of offset, size and owner) to run as a few vectorized or compiled passes.
Approach:
  - Blocks tile [0, usable) with no gap; `usable` is the arena size rounded down to `alignment`. The tail
    below one alignment unit is never handed out.
  - Every block is free (owner 0) or holds exactly one storage (owner = sid + 1).
  - Offsets and sizes are multiples of `alignment` (512 bytes by default).
  - Allocation splits a free block; the storage takes its low or its high edge (the caller says which: cheap
    tensor partitioning puts expensive storages low and cheap ones high). Release merges with free neighbours,
    so no two free blocks are ever adjacent.
  - A block is a record id. Ids index Python lists (fast scalar access) mirrored by numpy arrays (fast
    gathers): offset (fixed for the id's life: a split keeps the low part's id, a merge keeps the left id),
    size, owner, and the links `prev` / `next` of a doubly linked list in address order (-1 at the ends).
    A dict maps each block's offset to its id: lookup by offset and neighbours are O(1).
  - Free blocks are also kept in two sorted lists, by (size, offset) for best fit and by offset for "which
    free block contains this address": one bisect each, O(log n).
  - The address-ordered columns (`offsets`, `sizes`, `owners`) are derived, cached until the next mutation.
    A read after mutations updates the cached order of ids incrementally: ids that died are dropped with one
    mask, ids born since are merged in by offset, then the sizes and owners are gathered (O(n) vectorized,
    once per read, not per mutation). An id that dies before a read saw it is reused at once; one that sits
    in the cached order is reused after the next read has dropped it, and when such dead ids pile up to half
    the capacity a read is forced, so the id space stays within twice the number of blocks.
Limitations: inserting into or removing from the sorted free lists moves list pointers after the position (a
  C memmove, no Python loop); a read of the columns after a mutation costs O(n).

Invariants (checked by `check_invariants`): tiling without gap or overlap, alignment, no two adjacent free
blocks, links symmetric and in address order, the offset index and both free lists equal a recount, the numpy
mirrors equal the lists, the cached columns equal a fresh walk of the list, used bytes equal a recount.
"""

from __future__ import annotations

import bisect

import numpy as np

from .errors import _internal_assert
from .policy import compiled_decision

FREE = 0  # owner code of a free block
ALIGNMENT = 512  # the default granularity of placement, and so the smallest arena a Budget makes


class BlockTable:
    def __init__(self, nbytes: int, alignment: int = ALIGNMENT):
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment!r}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < alignment:
            raise ValueError(f"the arena must hold at least one block of {alignment} bytes, got nbytes={nbytes!r}")
        self.nbytes = nbytes
        self.alignment = alignment
        self.usable = nbytes // alignment * alignment
        # per id; every field is written by _new (creation), _set_size / _set_owner / the link updates in
        # place, place_at, release (the only mutations)
        self._off: list[int] = []
        self._size: list[int] = []
        self._owner: list[int] = []
        self._prev: list[int] = []
        self._next: list[int] = []
        cap = 64
        self._off_a = np.zeros(cap, np.int64)     # numpy mirrors of the three lists, for the gathers
        self._size_a = np.zeros(cap, np.int64)
        self._owner_a = np.zeros(cap, np.int64)
        self._alive_a = np.zeros(cap, np.bool_)
        self._at: dict[int, int] = {}             # offset -> id of the block starting there
        self._spare: list[int] = []               # ids not in use and not in the cached order: reusable
        self._dead: list[int] = []                # ids in the cached order that died since the last read
        self._born: set[int] = set()              # live ids not in the cached order (created since the last read)
        self._free: list[tuple[int, int]] = []    # sorted (size, offset) of free blocks
        self._free_at: list[int] = []             # sorted offsets of free blocks
        self.used_bytes = 0                       # sum of sizes of owned blocks; place/release only
        self._n = 0
        self._order = np.zeros(0, np.int64)       # ids in address order as of the last read
        self._order_off = np.zeros(0, np.int64)   # their offsets (fixed per id, so valid until the order changes)
        self._cols = None                         # (offsets, sizes, owners) cached, or None after a mutation
        self._new(0, self.usable, FREE, -1, -1)
        self._free_add(self.usable, 0)

    # ----------------------------------------------------------------------------------------------- queries
    def __len__(self) -> int:
        return self._n

    @property
    def offsets(self) -> np.ndarray:
        return (self._cols or self._columns())[0]

    @property
    def sizes(self) -> np.ndarray:
        return (self._cols or self._columns())[1]

    @property
    def owners(self) -> np.ndarray:
        return (self._cols or self._columns())[2]

    def round_up(self, nbytes: int) -> int:
        a = self.alignment
        n = (nbytes + a - 1) // a * a
        return n if n > a else a

    def index_of(self, offset: int) -> int:
        """Position in address order of the block starting at `offset`."""
        offsets = self.offsets
        i = int(offsets.searchsorted(offset))
        if not (i < self._n and offsets[i] == offset):
            _internal_assert(False, f"no block starts at offset {offset}")
        return i

    def block(self, i: int) -> tuple[int, int, int]:
        """(offset, size, owner) of block i in address order."""
        offsets, sizes, owners = self._cols or self._columns()
        return int(offsets[i]), int(sizes[i]), int(owners[i])

    def block_at(self, offset: int) -> tuple[int, int, int]:
        """(offset, size, owner) of the block containing the address `offset`: O(1) at a block start or inside a
        free block, else a search of the columns."""
        b = self._at.get(offset)
        if b is None:
            j = bisect.bisect_right(self._free_at, offset) - 1
            b = self._at[self._free_at[j]] if j >= 0 else -1
            if b < 0 or self._off[b] + self._size[b] <= offset:
                if not 0 <= offset < self.usable:
                    _internal_assert(False, f"offset {offset} is outside [0, {self.usable})")
                return self.block(int(self.offsets.searchsorted(offset, side="right")) - 1)
        return self._off[b], self._size[b], self._owner[b]

    def neighbours(self, offset: int) -> tuple[tuple[int, int, int] | None, tuple[int, int, int] | None]:
        """(offset, size, owner) of the blocks just below and just above the block starting at `offset`."""
        b = self._id(offset)
        p, q = self._prev[b], self._next[b]
        return (None if p < 0 else (self._off[p], self._size[p], self._owner[p]),
                None if q < 0 else (self._off[q], self._size[q], self._owner[q]))

    def best_fit(self, nbytes: int) -> int | None:
        """Offset of the smallest free block of at least `nbytes` (aligned), lowest address on ties."""
        return self.best_fit_aligned(self.round_up(nbytes))

    def best_fit_aligned(self, need: int) -> int | None:
        """`best_fit` of a size that is a multiple of the alignment already (round_up)."""
        free = self._free
        j = bisect.bisect_left(free, (need, -1))
        return free[j][1] if j < len(free) else None

    @property
    def free_bytes(self) -> int:
        return self.usable - self.used_bytes

    @property
    def largest_free(self) -> int:
        return self._free[-1][0] if self._free else 0

    # --------------------------------------------------------------------------------------------- mutation
    def place(self, free_offset: int, nbytes: int, owner: int, high: bool, aligned: bool = False) -> int:
        """Give `owner` an aligned range of `nbytes` at the low (or high) edge of the free block at
        `free_offset`; returns the range's offset. `aligned`: `nbytes` is rounded up already (round_up)."""
        need = nbytes if aligned else self.round_up(nbytes)
        b = self._id(free_offset)
        size, cur = self._size[b], self._owner[b]
        if owner <= 0 or cur != FREE or size < need:  # messages are formatted only on failure (a hot path)
            _internal_assert(owner > 0, f"owner code must be positive, got {owner}")
            _internal_assert(cur == FREE, f"block at {free_offset} is not free (owner {cur})")
            _internal_assert(False, f"free block at {free_offset} holds {size} bytes, {need} requested")
        self._free_remove(size, free_offset)
        if size == need:
            self._set_owner(b, owner)
            at = free_offset
        elif high:
            self._set_size(b, size - need)
            self._free_add(size - need, free_offset)
            at = free_offset + size - need
            self._new(at, need, owner, b, self._next[b])
        else:
            self._set_size(b, need)
            self._set_owner(b, owner)
            self._new(free_offset + need, size - need, FREE, b, self._next[b])
            self._free_add(size - need, free_offset + need)
            at = free_offset
        self.used_bytes += need
        return at

    def place_at(self, offset: int, nbytes: int, owner: int) -> int:
        """Give `owner` the aligned range of `nbytes` starting exactly at `offset`, inside one free block."""
        need = self.round_up(nbytes)
        off, size, cur = self.block_at(offset)
        _internal_assert(cur == FREE and off <= offset and offset + need <= off + size and offset % self.alignment == 0,
                         f"range {offset}+{need} is not inside the free block {off}+{size} (owner {cur})")
        if offset > off:  # split off the free bytes below the range
            b = self._at[off]
            self._free_remove(size, off)
            self._set_size(b, offset - off)
            self._free_add(offset - off, off)
            self._new(offset, off + size - offset, FREE, b, self._next[b])
            self._free_add(off + size - offset, offset)
        return self.place(offset, need, owner, high=False)

    def release(self, offset: int) -> int:
        """Free the block at `offset`, merging with free neighbours; returns the merged block's offset."""
        b = self._id(offset)
        if self._owner[b] == FREE:
            _internal_assert(False, f"block at {offset} is already free")
        self.used_bytes -= self._size[b]
        self._set_owner(b, FREE)
        q = self._next[b]
        if q >= 0 and self._owner[q] == FREE:
            self._merge(b, q, indexed=q)
        p = self._prev[b]
        if p >= 0 and self._owner[p] == FREE:
            self._merge(p, b, indexed=p)
            b = p
        self._free_add(self._size[b], self._off[b])
        return self._off[b]

    # ------------------------------------------------------------------------------------------------ inner
    def _id(self, offset: int) -> int:
        b = self._at.get(offset)
        if b is None:
            _internal_assert(False, f"no block starts at offset {offset}")
        return b

    def _set_size(self, b: int, size: int) -> None:
        self._size[b] = size
        self._size_a[b] = size
        self._cols = None

    def _set_owner(self, b: int, owner: int) -> None:
        self._owner[b] = owner
        self._owner_a[b] = owner
        self._cols = None

    def _new(self, off: int, size: int, owner: int, prev: int, nxt: int) -> int:
        """A block record linked between `prev` and `nxt` (ids, -1 for none)."""
        if not self._spare and len(self._dead) >= len(self._off_a) // 2:
            self._columns()  # recycle the dead ids (Note [Block table])
        if self._spare:
            b = self._spare.pop()
            self._off[b], self._size[b], self._owner[b], self._prev[b], self._next[b] = off, size, owner, prev, nxt
        else:
            b = len(self._off)
            if b == len(self._off_a):
                self._off_a, self._size_a, self._owner_a, self._alive_a = (
                    np.concatenate((a, np.zeros_like(a))) for a in (self._off_a, self._size_a, self._owner_a,
                                                                    self._alive_a))
            self._off.append(off)
            self._size.append(size)
            self._owner.append(owner)
            self._prev.append(prev)
            self._next.append(nxt)
        self._off_a[b], self._size_a[b], self._owner_a[b], self._alive_a[b] = off, size, owner, True
        if prev >= 0:
            self._next[prev] = b
        if nxt >= 0:
            self._prev[nxt] = b
        self._at[off] = b
        self._born.add(b)
        self._n += 1
        self._cols = None
        return b

    def _merge(self, lo: int, hi: int, indexed: int) -> None:
        """Block `hi` (just above `lo`) joins `lo`, which keeps its id; `indexed` is the one in the free lists."""
        self._free_remove(self._size[indexed], self._off[indexed])
        self._set_size(lo, self._size[lo] + self._size[hi])
        self._delete(hi)

    def _delete(self, b: int) -> None:
        p, q = self._prev[b], self._next[b]
        if p >= 0:
            self._next[p] = q
        if q >= 0:
            self._prev[q] = p
        del self._at[self._off[b]]
        self._alive_a[b] = False
        if b in self._born:  # never in the cached order: reusable at once
            self._born.discard(b)
            self._spare.append(b)
        else:
            self._dead.append(b)
        self._n -= 1
        self._cols = None

    def _columns(self):
        """Bring the cached order of ids up to date and gather the address-ordered columns (Note [Block table])."""
        compiled = compiled_decision()
        if compiled is not None:  # the same merge in one compiled pass (Note [Compiled decision])
            born = np.fromiter(self._born, np.int64, len(self._born))
            order, offsets, sizes, owners = compiled.columns(self._order, self._alive_a, born, self._off_a,
                                                             self._size_a, self._owner_a)
            self._spare.extend(self._dead)
            self._dead, self._born = [], set()
        else:
            order, offsets = self._order, self._order_off
            if self._dead:
                keep = self._alive_a[order]
                order, offsets = order[keep], offsets[keep]
                self._spare.extend(self._dead)
                self._dead = []
            if self._born:
                born = np.fromiter(self._born, np.int64, len(self._born))
                self._born = set()
                born_off = self._off_a[born]
                k = born_off.argsort()
                born, born_off = born[k], born_off[k]
                at = offsets.searchsorted(born_off)  # offsets are distinct: each born id goes before the first above
                order = np.insert(order, at, born)
                offsets = np.insert(offsets, at, born_off)
            sizes, owners = self._size_a[order], self._owner_a[order]
        self._order, self._order_off = order, offsets
        cols = (offsets, sizes, owners)
        for c in cols:
            c.flags.writeable = False  # shared by every reader until the next mutation
        self._cols = cols
        return cols

    def _free_add(self, size: int, off: int) -> None:
        bisect.insort(self._free, (size, off))
        bisect.insort(self._free_at, off)

    def _free_remove(self, size: int, off: int) -> None:
        free, free_at = self._free, self._free_at
        j = bisect.bisect_left(free, (size, off))
        k = bisect.bisect_left(free_at, off)
        if j == len(free) or free[j] != (size, off) or k == len(free_at) or free_at[k] != off:
            _internal_assert(False, f"free block ({size}, {off}) not indexed")
        del free[j]
        del free_at[k]

    # ----------------------------------------------------------------------------------------- observability
    def snapshot(self) -> list[dict]:
        return [
            {"offset": o, "size": s, "owner": w - 1 if w else None}
            for o, s, w in zip(self.offsets.tolist(), self.sizes.tolist(), self.owners.tolist())
        ]

    def _walk(self) -> list[int]:
        """Ids in address order, following the links from the block at offset 0."""
        out, b = [], self._at.get(0, -1)
        _internal_assert(b >= 0 and self._prev[b] == -1, "no first block at offset 0")
        while b >= 0:
            out.append(b)
            _internal_assert(len(out) <= len(self._off), "the block links form a cycle")
            q = self._next[b]
            _internal_assert(q < 0 or self._prev[q] == b, f"block {self._off[b]}: next {q} links back to "
                                                          f"{self._prev[q] if q >= 0 else None}")
            b = q
        return out

    def check_invariants(self) -> None:
        a = self.alignment
        ids = self._walk()
        _internal_assert(len(ids) == self._n, f"{len(ids)} blocks linked, {self._n} counted")
        off = [self._off[b] for b in ids]
        size = [self._size[b] for b in ids]
        own = [self._owner[b] for b in ids]
        _internal_assert(off[0] == 0, f"first block starts at {off[0]}, not 0")
        for i in range(len(ids) - 1):
            _internal_assert(off[i] + size[i] == off[i + 1], f"gap or overlap after block {i}: it ends at "
                                                             f"{off[i] + size[i]}, the next starts at {off[i + 1]}")
        end = off[-1] + size[-1]
        _internal_assert(end == self.usable, f"last block ends at {end}, arena usable size is {self.usable}")
        for o, s in zip(off, size):
            _internal_assert(s > 0 and o % a == 0 and s % a == 0, f"block {o}+{s} is empty or not aligned")
        for i in range(len(ids) - 1):
            _internal_assert(own[i] != FREE or own[i + 1] != FREE, f"free blocks at {off[i]} and {off[i + 1]} are adjacent")
        _internal_assert(self._at == dict(zip(off, ids)), "the offset index differs from a recount")
        recount = sorted((s, o) for o, s, w in zip(off, size, own) if w == FREE)
        _internal_assert(recount == self._free, f"free list {self._free[:4]}... differs from recount {recount[:4]}...")
        _internal_assert(sorted(o for _, o in recount) == self._free_at,
                         "free offsets differ from a recount")
        used = sum(s for s, w in zip(size, own) if w != FREE)
        _internal_assert(used == self.used_bytes, f"used_bytes is {self.used_bytes}, recount is {used}")
        owners = [w for w in own if w != FREE]
        _internal_assert(len(set(owners)) == len(owners), "a storage owns two blocks")
        ida = np.array(ids, np.int64)
        cached = set(self._order.tolist())
        _internal_assert(cached | self._born == set(ids) | set(self._dead) and not cached & self._born,
                         "the cached order, the ids born since and the ids dead since do not add up to the blocks")
        _internal_assert(not set(self._spare) & (cached | set(ids)), "a reusable id is still in use")
        _internal_assert(bool(self._alive_a[ida].all()) and int(self._alive_a.sum()) == len(ids),
                         "the alive mirror differs from the linked blocks")
        for name, col in (("offsets", off), ("sizes", size), ("owners", own)):
            mirror = {"offsets": self._off_a, "sizes": self._size_a, "owners": self._owner_a}[name][ida].tolist()
            _internal_assert(mirror == col, f"the numpy mirror of {name} differs from the lists")
            cached = getattr(self, name).tolist()
            _internal_assert(cached == col, f"the address-ordered {name} differ from a walk of the links")
