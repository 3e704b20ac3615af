"""Storage records: one per storage a Budget has produced (a base and all of its views share one, Rule 2).

A record holds state only; decisions live in `policy.py`, mutation in `memory.py`. Each field names its only
writer. The compute graph between storages (`inputs` strong, `consumers` weak) serves the recompute-cost
estimate: DTR's equivalence classes of evicted storages, kept with union-find, so that evicting a storage next
to already-evicted ones is charged their cost too (a recompute would have to redo them). Each class root also
keeps its border (the resident storages next to a member), so that every cost that counts the class is refreshed
whenever the class changes (DTR's e*, kept true rather than refreshed only when a direct neighbour changes).
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field


class State(enum.Enum):
    RESIDENT = "resident"
    EVICTED = "evicted"
    FREED = "freed"


@dataclass(slots=True, eq=False, weakref_slot=True)
class Storage:
    sid: int                      # unique id in its Memory; Memory.allocate
    nbytes: int                   # bytes requested (the block is this rounded up); Memory.allocate
    cost: float                   # cost of recomputing it alone; Memory.allocate
    evictable: bool               # False for outputs of effectful ops; Memory.allocate / Memory.make_unevictable
    expensive: bool               # class for cheap tensor partitioning (cost / bytes >= threshold); Memory.allocate
    state: State = State.RESIDENT # Memory only
    offset: int = -1              # arena offset while resident, else -1; Memory only
    slot: int = -1                # row in Memory's columns while resident, else -1; Memory only
    pins: int = 0                 # >0: must stay resident; Memory.pin / Memory.unpin
    last_access: float = 0.0      # logical clock of the last use; Memory.touch
    inputs: tuple["Storage", ...] = ()                          # producer's input storages; Memory.allocate
    consumers: list = field(default_factory=list)               # weakrefs to storages reading this; Memory.allocate
    uf_parent: "Storage | None" = None  # union-find parent once evicted (a root points to itself; kept as a link
                                        # after restore or free, see Memory._leave_class); Memory only
    uf_cost: float = 0.0                # at a root: total cost of its class; Memory only
    uf_border: dict | None = None       # at a root: sid -> storage of resident storages next to a member (a
                                        # superset: entries that left residency are dropped when read); Memory only
    payload: object = None        # the runtime's data (recipe, views); the runtime only

    def neighbours(self):
        yield from self.inputs
        for ref in self.consumers:
            s = ref()
            if s is not None:
                yield s


def uf_find(s: Storage) -> Storage:
    while s.uf_parent is not s:
        s.uf_parent = s.uf_parent.uf_parent  # path halving
        s = s.uf_parent
    return s


def uf_union(a: Storage, b: Storage) -> None:
    ra, rb = uf_find(a), uf_find(b)
    if ra is not rb:
        if ra.sid > rb.sid:  # deterministic root choice
            ra, rb = rb, ra
        rb.uf_parent = ra
        ra.uf_cost += rb.uf_cost
        big, small = ra.uf_border, rb.uf_border
        if len(big) < len(small):
            big, small = small, big
        big.update(small)
        ra.uf_border, rb.uf_border = big, None


def neighbourhood_cost(s: Storage) -> float:
    """c of DTR: own cost plus the cost of each distinct evicted class adjacent to `s`."""
    total = s.cost
    seen = []
    for nb in s.neighbours():
        if nb.state is State.EVICTED and nb.uf_parent is not None:
            root = uf_find(nb)
            if not any(root is r for r in seen):
                seen.append(root)
                total += root.uf_cost
    return total


def add_consumer(parent: Storage, child: Storage) -> None:
    parent.consumers.append(weakref.ref(child))
