"""BlockTable: address-ordered blocks that tile one arena.

Note [Block table]
Rationale: Coop's sliding window walks memory in address order, so the table keeps blocks *as columns in
  address order* (numpy arrays of offset, size and owner). The window search is then a handful of vector
  operations over those columns instead of a Python loop per block.
Approach:
  - Blocks tile [0, usable) with no gap; `usable` is the arena size rounded down to `alignment`. The tail
    below one alignment unit is never handed out.
  - Every block is free (owner 0) or holds exactly one storage (owner = sid + 1).
  - Offsets and sizes are multiples of `alignment` (512 bytes by default).
  - Allocation splits a free block; the storage takes its low or its high edge (the caller says which: cheap
    tensor partitioning puts expensive storages low and cheap ones high). Release merges with free neighbours,
    so no two free blocks are ever adjacent.
  - Neighbours of block i are i - 1 and i + 1 (O(1)); a block is found from its offset by binary search.
  - Free blocks are also kept in a list sorted by (size, offset): best fit is one bisect, O(log n).
Limitations: inserting or removing a block shifts the columns after it (a memmove, O(n) bytes, no Python loop).

Invariants (checked by `check_invariants`): tiling without gap or overlap, alignment, no two adjacent free
blocks, the free list equals a recount of free blocks, the column lengths agree.
"""

from __future__ import annotations

import bisect

import numpy as np

from .errors import _internal_assert

FREE = 0  # owner code of a free block


class BlockTable:
    def __init__(self, nbytes: int, alignment: int = 512):
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a positive power of two, got {alignment!r}")
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < alignment:
            raise ValueError(f"the arena must hold at least one block of {alignment} bytes, got nbytes={nbytes!r}")
        self.nbytes = nbytes
        self.alignment = alignment
        self.usable = nbytes // alignment * alignment
        cap = 64
        self._off = np.zeros(cap, np.int64)    # block start, address order; written by _insert/_delete
        self._size = np.zeros(cap, np.int64)   # block bytes; written by split/merge only
        self._owner = np.zeros(cap, np.int64)  # 0 free, else sid + 1; written by place/release only
        self._n = 1
        self._size[0] = self.usable
        self._free: list[tuple[int, int]] = [(self.usable, 0)]  # sorted (size, offset) of free blocks
        self.used_bytes = 0  # sum of sizes of owned blocks; written by place/release only

    # ----------------------------------------------------------------------------------------------- queries
    def __len__(self) -> int:
        return self._n

    @property
    def offsets(self) -> np.ndarray:
        return self._off[: self._n]

    @property
    def sizes(self) -> np.ndarray:
        return self._size[: self._n]

    @property
    def owners(self) -> np.ndarray:
        return self._owner[: self._n]

    def round_up(self, nbytes: int) -> int:
        a = self.alignment
        return max(a, (nbytes + a - 1) // a * a)

    def index_of(self, offset: int) -> int:
        i = int(np.searchsorted(self._off[: self._n], offset))
        _internal_assert(i < self._n and self._off[i] == offset, f"no block starts at offset {offset}")
        return i

    def block(self, i: int) -> tuple[int, int, int]:
        """(offset, size, owner) of block i."""
        return int(self._off[i]), int(self._size[i]), int(self._owner[i])

    def best_fit(self, nbytes: int) -> int | None:
        """Offset of the smallest free block of at least `nbytes` (aligned), lowest address on ties."""
        j = bisect.bisect_left(self._free, (self.round_up(nbytes), -1))
        return self._free[j][1] if j < len(self._free) else None

    @property
    def free_bytes(self) -> int:
        return self.usable - self.used_bytes

    @property
    def largest_free(self) -> int:
        return self._free[-1][0] if self._free else 0

    # --------------------------------------------------------------------------------------------- mutation
    def place(self, free_offset: int, nbytes: int, owner: int, high: bool) -> int:
        """Give `owner` an aligned range of `nbytes` at the low (or high) edge of the free block at
        `free_offset`; returns the range's offset."""
        _internal_assert(owner > 0, f"owner code must be positive, got {owner}")
        need = self.round_up(nbytes)
        i = self.index_of(free_offset)
        off, size, cur = self.block(i)
        _internal_assert(cur == FREE, f"block at {off} is not free (owner {cur})")
        _internal_assert(size >= need, f"free block at {off} holds {size} bytes, {need} requested")
        self._free_remove(size, off)
        if size == need:
            self._owner[i] = owner
            at = off
        elif high:
            self._size[i] = size - need
            self._free_add(size - need, off)
            at = off + size - need
            self._insert(i + 1, at, need, owner)
        else:
            self._size[i] = need
            self._owner[i] = owner
            self._insert(i + 1, off + need, size - need, FREE)
            self._free_add(size - need, off + need)
            at = off
        self.used_bytes += need
        return at

    def place_at(self, offset: int, nbytes: int, owner: int) -> int:
        """Give `owner` the aligned range of `nbytes` starting exactly at `offset`, inside one free block."""
        need = self.round_up(nbytes)
        i = int(np.searchsorted(self._off[: self._n], offset, side="right")) - 1
        off, size, cur = self.block(i)
        _internal_assert(cur == FREE and off <= offset and offset + need <= off + size and offset % self.alignment == 0,
                         f"range {offset}+{need} is not inside the free block {off}+{size} (owner {cur})")
        if offset > off:  # split off the free bytes below the range
            self._free_remove(size, off)
            self._size[i] = offset - off
            self._free_add(offset - off, off)
            self._insert(i + 1, offset, off + size - offset, FREE)
            self._free_add(off + size - offset, offset)
        return self.place(offset, need, owner, high=False)

    def release(self, offset: int) -> int:
        """Free the block at `offset`, merging with free neighbours; returns the merged block's offset."""
        i = self.index_of(offset)
        _internal_assert(self._owner[i] != FREE, f"block at {offset} is already free")
        self.used_bytes -= int(self._size[i])
        self._owner[i] = FREE
        if i + 1 < self._n and self._owner[i + 1] == FREE:
            self._free_remove(int(self._size[i + 1]), int(self._off[i + 1]))
            self._size[i] += self._size[i + 1]
            self._delete(i + 1)
        if i > 0 and self._owner[i - 1] == FREE:
            self._free_remove(int(self._size[i - 1]), int(self._off[i - 1]))
            self._size[i - 1] += self._size[i]
            self._delete(i)
            i -= 1
        self._free_add(int(self._size[i]), int(self._off[i]))
        return int(self._off[i])

    def _insert(self, i: int, off: int, size: int, owner: int) -> None:
        n = self._n
        if n == len(self._off):
            for name in ("_off", "_size", "_owner"):
                col = getattr(self, name)
                setattr(self, name, np.concatenate([col, np.zeros_like(col)]))
        for col in (self._off, self._size, self._owner):
            col[i + 1 : n + 1] = col[i:n].copy()
        self._off[i], self._size[i], self._owner[i] = off, size, owner
        self._n = n + 1

    def _delete(self, i: int) -> None:
        n = self._n
        for col in (self._off, self._size, self._owner):
            col[i : n - 1] = col[i + 1 : n].copy()
        self._n = n - 1

    def _free_add(self, size: int, off: int) -> None:
        bisect.insort(self._free, (size, off))

    def _free_remove(self, size: int, off: int) -> None:
        j = bisect.bisect_left(self._free, (size, off))
        _internal_assert(j < len(self._free) and self._free[j] == (size, off), f"free block ({size}, {off}) not indexed")
        del self._free[j]

    # ----------------------------------------------------------------------------------------- observability
    def snapshot(self) -> list[dict]:
        return [
            {"offset": int(o), "size": int(s), "owner": int(w) - 1 if w else None}
            for o, s, w in zip(self.offsets, self.sizes, self.owners)
        ]

    def check_invariants(self) -> None:
        n, a = self._n, self.alignment
        off, size, own = self.offsets, self.sizes, self.owners
        _internal_assert(n >= 1 and len(self._off) == len(self._size) == len(self._owner), "column lengths differ")
        _internal_assert(off[0] == 0, f"first block starts at {off[0]}, not 0")
        ends = off + size
        bad = np.nonzero(ends[:-1] != off[1:])[0]
        _internal_assert(bad.size == 0, f"gap or overlap after block {bad[:1]}: it ends at {ends[bad[:1]]}, "
                                        f"the next starts at {off[bad[:1] + 1]}")
        _internal_assert(ends[-1] == self.usable, f"last block ends at {ends[-1]}, arena usable size is {self.usable}")
        _internal_assert(bool(np.all(size > 0)), "a block has non-positive size")
        _internal_assert(bool(np.all(off % a == 0) and np.all(size % a == 0)), "a block is not aligned")
        free = own == FREE
        adj = np.nonzero(free[:-1] & free[1:])[0]
        _internal_assert(adj.size == 0, f"free blocks at {off[adj[:1]]} and {off[adj[:1] + 1]} are adjacent")
        recount = sorted(zip(size[free].tolist(), off[free].tolist()))
        _internal_assert(recount == self._free, f"free list {self._free[:4]}... differs from recount {recount[:4]}...")
        used = int(size[~free].sum())
        _internal_assert(used == self.used_bytes, f"used_bytes is {self.used_bytes}, recount is {used}")
        owners = own[~free]
        _internal_assert(len(np.unique(owners)) == owners.size, "a storage owns two blocks")
