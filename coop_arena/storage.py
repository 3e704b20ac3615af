"""Storage records: one per storage a Budget has produced (a base and all of its views share one, Rule 2).

A record holds state only; decisions live in `policy.py`, mutation in `memory.py`. Each field names its only
writer. The compute graph between storages (`inputs` strong, `consumers` weak) serves the recompute-cost estimate.

Note [Recompute cost]
Rationale: a policy must know what bringing a storage back would cost *now*: its own producer and writes, plus
  every evicted storage its replay would have to rebuild first. DTR's e* approximates this with union-find classes
  of evicted storages, charged to every resident neighbour in both directions. Measured on the suite, that breaks
  down in the backward pass: the records of dead gradients and the activations they read join one class spanning
  the whole step, every resident storage borders it, every cost becomes the same, and eviction degenerates to
  least-recently-used (ResNet-50 at 25% of its peak evicted a live skip-connection gradient whose replay then
  needed the whole forward pass again, and failed).
Approach: `recompute_cost(s)` = the cost of `s` plus the cost of each distinct evicted storage reachable from it
  through evicted inputs (exactly the replays a restore plan of `s` would run, remat.py). A change of state of one
  storage changes the cost of the resident storages reachable from it forward through evicted readers
  (`dependents`); Memory marks those stale and refreshes them before its next plan, so every cost a policy reads
  is exact. Between two plans (an epoch) an evicted storage is walked through at most once: the residents beyond
  it are stale already, storages that become resident are stale from then on, and a storage that gains inputs
  is marked itself. (Walking a backward pass's chain of dead records at every death made the host time per op
  quadratic.)
Limitations: evicting a storage also makes its evicted readers costlier to restore; that is not charged to it
  (DTR's other direction). Measured, exact rather than union-find, on coop (suite points and the 100-layer
  chain): adding the costs of every evicted storage reachable forward through evicted readers; of only those on
  a path to one a wrapper uses; of only the used ones; the same capped at the storage's own cost; and only for
  dead storages. Each lowered some overheads (the chain at 0.2 1.649x -> 1.34-1.37x, ResNet-152 at 0.1
  1.877x -> 1.49-1.69x, U-Net at 0.45 1.337x -> 1.19-1.22x) and broke edges (ResNet-50 no longer fits at 0.2
  or at 0.175, DenseNet-121 at 0.125; BERT-Large at 0.1 up to 1.60x, Swin-T at 0.2 up to 4.53x). The exit
  replays that the chain and ResNet-152 points paid are avoided instead by Note [Dead storages]' rolling
  forward and Note [Moving instead of evicting]'s holes. A walk stops after `WALK_LIMIT` storages (the cost is
  then a lower bound).
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field

WALK_LIMIT = 100_000


class State(enum.Enum):
    RESIDENT = "resident"
    EVICTED = "evicted"
    FREED = "freed"


@dataclass(slots=True, eq=False, weakref_slot=True)
class Storage:
    sid: int                      # unique id in its Memory; Memory.allocate
    nbytes: int                   # bytes requested (the block is this rounded up); Memory.allocate
    cost: float                   # cost of replaying its producer and writes; Memory.allocate / Memory.add_write
    evictable: bool               # False for outputs of effectful ops; Memory.allocate / Memory.make_unevictable
    expensive: bool               # class for cheap tensor partitioning; Memory.allocate
    state: State = State.RESIDENT # Memory only
    offset: int = -1              # arena offset while resident, else -1; Memory only
    slot: int = -1                # row in Memory's columns while resident, else -1; Memory only
    pins: int = 0                 # >0: must stay resident; Memory.pin / Memory.unpin
    last_access: float = 0.0      # logical clock of the last use; Memory.touch
    inputs: list = field(default_factory=list)     # storages its producer and writes read; Memory.allocate / add_write
    consumers: list = field(default_factory=list)  # weakrefs to storages whose recipes read this; add_input
    payload: object = None        # the runtime's data (recipe, views); the runtime only

    def readers(self):
        """The storages whose recipes read this one and that are not freed."""
        for ref in self.consumers:
            r = ref()
            if r is not None and r.state is not State.FREED:
                yield r


def _gone(ref) -> bool:
    r = ref()
    return r is None or r.state is State.FREED


def prune(s: Storage, upto: int | None = None) -> None:
    """Drop the references in `s.consumers[:upto]` to readers that are gone or freed (a freed storage never comes
    back). Every walk skips them anyway; left in place, a storage read by many short-lived readers (a gradient
    fanned out to N ops, a base split into N views) was walked whole at each one's death: O(N) per op. Called
    between ops only (lifetime._has_readers), never while a walk over `s.consumers` is under way."""
    refs = s.consumers
    head = refs if upto is None else refs[:upto]
    kept = [ref for ref in head if not _gone(ref)]
    if len(kept) != len(head):
        refs[:len(head)] = kept


def add_input(child: Storage, parent: Storage) -> None:
    child.inputs.append(parent)
    parent.consumers.append(weakref.ref(child))


def recompute_cost(s: Storage) -> float:
    """See Note [Recompute cost]: the cost of `s` plus each distinct evicted storage reachable through evicted
    inputs."""
    total = s.cost
    seen = {s.sid}
    work = list(s.inputs)
    while work:
        p = work.pop()
        if p.sid in seen or p.state is not State.EVICTED:
            continue
        seen.add(p.sid)
        total += p.cost
        if len(seen) > WALK_LIMIT:
            break
        work.extend(p.inputs)
    return total


def dependents(s: Storage, walked: set) -> list:
    """The resident storages whose recompute cost counts `s` (or would, once `s` is evicted): reachable from `s`
    forward through evicted readers. Evicted storages already in `walked` are not walked again (Memory keeps it per
    epoch between plans: what lies beyond them is marked already, Note [Recompute cost])."""
    out, work = [], [s]
    while work:
        for r in work.pop().readers():
            if r.state is State.RESIDENT:
                out.append(r)
            elif r.sid not in walked:
                walked.add(r.sid)
                work.append(r)
    return out
