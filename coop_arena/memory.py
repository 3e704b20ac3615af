"""Memory: storages placed in one block table, evicted by one policy, with telemetry.

Allocation policy (Note [Placement]):
- A request is rounded up to the alignment. If a free block fits, the smallest one is used (best fit, lowest
  address on ties): no eviction.
- Otherwise the policy plans (pure) and `apply` evicts the plan's victims (the only mutation), which leaves one
  free block covering the plan's range; the request is placed there.
- Cheap tensor partitioning: a storage whose cost per byte is at least `cheap_density` is *expensive* and is
  placed at the low-address edge of its free block; a cheap one at the high-address edge. Cheap storages so
  gather into runs that form low-cost windows. `partition=False` places everything at the low edge. (A
  threshold that follows the step, the 0.3 quantile of the densities placed so far, was measured against this
  fixed one over the suite: lower smallest ratios on the BiLSTM, Swin-T and U-Net, higher on ResNet-50,
  DenseNet-121 and GPT-2 (0.25 to 0.31); the fixed one stays. Also measured on the points where partitioning
  loses (U-Net 0.45/0.35, Swin-T 0.3/0.21, Inception V3 0.35/0.3, BiLSTM 0.5) and where it wins (ResNet-50/152,
  DenseNet-121, BERT-Large and GPT-2 at their smallest ratios): expensive by op class (matmul, convolution,
  attention), thresholds 2 and 8, class-aware first fit from either end of the arena, partitioning only without
  eviction and only after it; placing each storage at the edge of its free block whose neighbour's cost
  density is closest to its own (BiLSTM at 0.5 1.40x -> 1.26x, U-Net at 0.45 1.34x -> 1.24x, DenseNet-121 at
  0.125 1.73x -> 1.38x, but GPT-2 at 0.25 1.29x -> 1.40x, Swin-T at 0.1875 1.46x -> 2.54x, ResNet-152 no
  longer fits at 0.1). Each fixed some losing points and lost winning ones: near the edge the result moves by
  5-15 % under small placement changes. A threshold of 3, over a full `coop-arena evaluate`: coop better at 29
  of 161 points that fit both ways and worse at 26, geometric mean 0.998; BiLSTM at 0.5 1.425x -> 1.265x, U-Net
  at 0.3 1.491x -> 1.356x, smallest ratios ResNet-50 0.175 -> 0.15 and DenseNet-121 0.125 -> 0.1125, but
  Inception V3 at 0.175 1.429x -> 1.749x, ResNet-152 at 0.25 past DTR's + 2 %, U-Net's smallest 0.25 -> 0.2625,
  and partitioning still loses to none at 8 points, against 10.)
- Relocation (coop only, Note [Relocation]): when no window exists because pinned or unevictable blocks split
  the arena, a window may also cover such blocks; they are copied to free blocks outside it (a copy, never a
  recomputation) and the rest of the window is evicted.
- Moving instead of evicting (coop only, Note [Moving instead of evicting]): an expensive evictable block of
  the window may be copied to a free block outside it instead of evicted, when that makes the plan cheaper.
- Compaction (coop only, Note [Compaction]): when relocation finds no destination either, the cheapest blocks
  of one segment between fixed blocks are evicted and the rest slide together, leaving one free range.
- A request that no plan can serve raises OutOfBudget before anything changes (Rule 7).

Rules enforced here (see Rule N in ../shared DESIGN numbering):
- Rule 3: a pinned storage is never evicted; pinning needs a resident storage.
- Rule 7: failed requests change nothing (the plan is computed before any mutation).
- Rule 8: decisions depend only on sizes, costs, the logical clock and the order of calls.

Columns: resident storages occupy rows ("slots") of three arrays (`kind`, `c`, `last`); block owners are
slot + 1 and row 0 is the FREE sentinel, so a policy reads its per-block columns with one gather.
"""

from __future__ import annotations

import math
import time
import weakref
from typing import NoReturn

import numpy as np

from . import policy as _policy
from .blocks import FREE as _FREE_OWNER
from .blocks import ALIGNMENT, BlockTable
from .errors import OutOfBudget, _internal_assert
from .policy import BLOCKED, EVICTABLE, FREE, POLICIES
from .replay import FAILED, Applied, Recording, Replay
from .storage import State, Storage, add_input, dependents, recompute_cost
from .telemetry import Event, MemoryStats, Trace, _event


def _check_nbytes(nbytes, what: str = "nbytes") -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
        raise TypeError(f"{what} must be an int number of bytes, got {type(nbytes).__name__} {nbytes!r}")
    if nbytes <= 0:
        raise ValueError(f"{what} must be positive, got {nbytes}")
    return int(nbytes)


def _check_cost(cost, what: str = "cost") -> float:
    if isinstance(cost, bool) or not isinstance(cost, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} must be a number, got {type(cost).__name__} {cost!r}")
    cost = float(cost)
    if not (math.isfinite(cost) and cost >= 0):
        raise ValueError(f"{what} must be a finite number >= 0, got {cost!r}")
    return cost


def _take_hole(holes: list, nbytes: int) -> int | None:
    """The offset of `nbytes` taken from the low end of the best-fitting hole (smallest, then lowest) of `holes`
    ([offset, size] lists, updated), or None when none is large enough."""
    fit = [j for j, (_, size) in enumerate(holes) if size >= nbytes]
    if not fit:
        return None
    j = min(fit, key=lambda j: (holes[j][1], holes[j][0]))
    at = holes[j][0]
    holes[j][0] += nbytes
    holes[j][1] -= nbytes
    return at


def _kind_of(s: Storage) -> int:
    """A resident storage's kind column, from its record: BLOCKED while pinned or unevictable, else EVICTABLE."""
    return BLOCKED if (s.pins or not s.evictable) else EVICTABLE


class Memory:
    """The bookkeeping of one arena without its bytes: storages placed in a block table of `nbytes`, evicted by
    one policy (plan, then apply), with stats, a trace and `check_invariants()`. A Budget owns one; on its own it
    plans placements and evictions for sizes and costs given by hand (the module docstring has the rules)."""

    def __init__(self, nbytes: int, *, policy: str = "coop", partition: bool = True, alignment: int = ALIGNMENT,
                 cheap_density: float = 4.0, trace_len: int = 10_000, relocate: bool = True):
        nbytes = _check_nbytes(nbytes, "the budget")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}")
        if not isinstance(partition, bool):
            raise TypeError(f"partition must be True or False, got {partition!r}")
        if not (isinstance(cheap_density, (int, float)) and math.isfinite(cheap_density) and cheap_density >= 0):
            raise ValueError(f"cheap_density must be a finite number >= 0, got {cheap_density!r}")
        if not isinstance(relocate, bool):
            raise TypeError(f"relocate must be True or False, got {relocate!r}")
        self.policy = policy
        self.partition = partition
        self.relocate = relocate and policy == "coop"
        # Relocation copies bytes through `mover(src, dst, nbytes)` (set by the runtime that owns the bytes) and
        # only while `may_relocate` is true: the runtime clears it while raw views of resident storages are live.
        self.mover = None
        self.may_relocate = True
        self.cheap_density = float(cheap_density)
        self.table = BlockTable(nbytes, alignment)
        self.trace_len = trace_len
        self.reset()

    # --------------------------------------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        """Forget every storage: the whole arena is one free block again."""
        self.table = BlockTable(self.table.nbytes, self.table.alignment)
        cap = 64
        self._kind = np.zeros(cap, np.int8)      # per slot+1: FREE (row 0 only), EVICTABLE or BLOCKED
        self._c = np.zeros(cap, np.float64)      # per slot+1: recompute cost (storage.py)
        self._last = np.zeros(cap, np.float64)   # per slot+1: last access
        self._slots: list[Storage | None] = []   # slot -> resident storage
        self._free_slots: list[int] = []
        self._next_sid = 0
        self._fixed: dict[int, int] = {}        # sid -> holds of storages that must keep their address
        self._stale: dict[int, Storage] = {}    # resident storages whose c column is out of date (Note [Recompute
                                                # cost] in storage.py); refreshed before every plan
        self._walked: set[int] = set()          # evicted storages walked through since the last plan
        self.clock = 0.0
        self.op: str | None = None  # the op the runtime is running (set by it), which each event records as its cause
        self.stats = MemoryStats(budget=self.table.usable)
        self.trace = Trace(self.trace_len)
        self._replay: Replay | None = None  # Note [Step replay]: this block's recording, and what it follows
        self._following = False             # while it follows, the decision state (columns, stale costs) waits

    def start_replay(self, follow: Recording | None) -> None:
        """Record this block's stream, following `follow` (the recording of an earlier block) while it matches
        (Note [Step replay] in replay.py)."""
        self._replay = Replay(follow)
        self._following = follow is not None

    def take_recording(self) -> Recording | None:
        """The block's recording (None without start_replay): for the next block to follow."""
        return self._replay.take() if self._replay is not None else None

    def note_op(self, func, inputs) -> None:
        """An op of the program reads `inputs` (storages) now: part of the stream Note [Step replay] compares."""
        r = self._replay
        if r is not None and not r.add(("op", id(func), tuple([s.sid for s in inputs]), self.clock)):
            self._resync()

    @property
    def following(self) -> bool:
        """Whether the block still follows a recording (Note [Step replay])."""
        return self._following

    def note_deaths(self, dead: list) -> None:
        """The storages whose last wrapper died (`dead`) are handled now, in this order: part of the stream Note
        [Step replay] compares, since a death's outcome reads which evicted storages a wrapper still uses (Note
        [Dead storages] in lifetime.py). Asked from the block's first eviction on (before it, none is kept)."""
        r = self._replay
        if r is not None and not r.add(("dead", tuple([s.sid for s in dead]))):
            self._resync()

    def recorded_outcome(self, s: Storage) -> str | None:
        """While following: "drop" or "keep" where the recorded block decided so of dead resident `s` at this point
        of its stream, straight away (Note [Step replay]: the state is the recorded block's, so the walk that
        decided it there, lifetime.keeps_dead, would decide it here the same way); None otherwise."""
        if not self._following:
            return None
        r = self._replay
        return "drop" if r.next_is(("drop", s.sid)) else "keep" if r.next_is(("keep", s.sid)) else None

    def _fact(self, *entry) -> None:
        """A change of the records that no memory event shows, for Note [Step replay]'s stream."""
        r = self._replay
        if r is not None and not r.add(entry):
            self._resync()

    def _event(self, kind: str, sid: int, offset: int, nbytes: int) -> None:
        e = _event(Event, (kind, sid, offset, nbytes, self.clock, self.op))
        self.trace.events.append(e)
        r = self._replay
        if r is not None and not r.add(e):
            self._resync()

    def _resync(self) -> None:
        """The block stopped following (Note [Step replay]): the decision state is rebuilt from the records."""
        self._following = False
        kind, last, stale = self._kind, self._last, self._stale
        for slot, s in enumerate(self._slots):
            if s is None:
                kind[slot + 1] = FREE
                continue
            kind[slot + 1] = _kind_of(s)
            last[slot + 1] = s.last_access
            stale[s.sid] = s
        self._walked.clear()

    def _stop_following(self) -> None:
        """Before anything reads the policy's columns: the decision state must be whole again."""
        if self._following:
            self._replay.stop()
            self._resync()

    @property
    def budget(self) -> int:
        return self.table.usable

    @property
    def used_bytes(self) -> int:
        return self.table.used_bytes

    # ------------------------------------------------------------------------------------------------ public
    def allocate(self, nbytes: int, cost: float, *, evictable: bool = True, inputs=(), pinned: bool = False,
                 op: str | None = None) -> Storage:
        """Place a new storage of `nbytes`, evicting if needed. `cost` is the cost of recomputing it."""
        if type(nbytes) is not int or nbytes <= 0:  # (the checks' common case first: every op allocates)
            nbytes = _check_nbytes(nbytes)
        if type(cost) is not float or not 0.0 <= cost < math.inf:
            cost = _check_cost(cost)
        for s in inputs:
            if type(s) is not Storage:
                raise TypeError(f"inputs must be Storage records, got {type(s).__name__}")
        s = Storage(sid=self._next_sid, nbytes=nbytes, cost=cost, evictable=bool(evictable),
                    expensive=cost >= self.cheap_density * nbytes, state=State.EVICTED, inputs=list(inputs))
        self._place(s, op, pinned)  # raises before anything changed
        self._next_sid += 1
        for parent in s.inputs:
            parent.consumers.append(weakref.ref(s))
        self.stats.allocations += 1
        self._event("alloc", s.sid, s.offset, nbytes)
        if not s.evictable:
            self._fact("unevictable", s.sid)
        return s

    def restore(self, s: Storage, *, pinned: bool = False, op: str | None = None) -> int:
        """Place an evicted storage again (its bytes are the caller's to rewrite); returns its offset."""
        self._check_mine(s)
        if s.state is not State.EVICTED:
            raise ValueError(f"storage {s.sid} is {s.state.value}; only an evicted storage can be restored")
        self._place(s, op, pinned)
        self.stats.restores += 1
        self._event("restore", s.sid, s.offset, s.nbytes)
        if not self._following:
            self._mark_dependents(s)
        return s.offset

    def evict(self, s: Storage) -> None:
        """Release a resident storage's bytes; it stays recomputable by its owner."""
        if not self._holds(s):
            self._check_mine(s)
        if s.state is not State.RESIDENT:
            raise ValueError(f"storage {s.sid} is {s.state.value}; only a resident storage can be evicted")
        if s.pins:
            raise ValueError(f"storage {s.sid} is pinned {s.pins} time(s); unpin it before evicting it")
        self._evict(s)

    def drop(self, s: Storage) -> None:
        """Evict a resident storage that died, under pressure (Note [Dead storages] in lifetime.py). Its own stream
        entry tells this eviction from a plan's victim (a restore's plan may evict the same storage first)."""
        self._fact("drop", s.sid)
        self.evict(s)

    def keep(self, s: Storage) -> None:
        """A resident storage that died stays (Note [Dead storages]): only a stream entry, as for `drop`."""
        self._fact("keep", s.sid)

    def free(self, s: Storage) -> None:
        """Forget a storage for good (resident or evicted)."""
        if not self._holds(s):
            self._check_mine(s)
        if s.state is State.FREED:
            raise ValueError(f"storage {s.sid} is already freed; freeing twice is a caller bug")
        if s.pins:
            raise ValueError(f"storage {s.sid} is pinned {s.pins} time(s); unpin it before freeing it")
        was = s.state
        if was is State.RESIDENT:
            self._release(s)
        s.state = State.FREED
        self._event("free", s.sid, -1, s.nbytes)
        if was is not State.RESIDENT and not self._following:
            self._mark_dependents(s)

    def pin(self, s: Storage) -> None:
        if not self._holds(s):
            self._check_mine(s)
            raise ValueError(f"storage {s.sid} is {s.state.value}; only a resident storage can be pinned")
        if not s.pins and not self._following:
            self._kind[s.slot + 1] = BLOCKED
        s.pins += 1

    def unpin(self, s: Storage) -> None:
        if type(s) is not Storage or s.pins <= 0 or not (s.state is not State.RESIDENT or self._holds(s)):
            self._check_mine(s)
            raise ValueError(f"storage {s.sid} is not pinned; unpin must match an earlier pin")
        s.pins -= 1
        if s.pins == 0 and s.state is State.RESIDENT and not self._following:
            self._kind[s.slot + 1] = EVICTABLE if s.evictable else BLOCKED

    def fix(self, s: Storage) -> None:
        """Keep a pinned storage at its address (a raw view of it is out in the world): never relocated."""
        self._check_mine(s)
        if not s.pins:
            raise ValueError(f"storage {s.sid} is not pinned; pin it before fixing its address")
        self._fixed[s.sid] = self._fixed.get(s.sid, 0) + 1
        self._fact("fix", s.sid)

    def unfix(self, s: Storage) -> None:
        n = self._fixed.get(s.sid, 0)
        if n <= 0:
            raise ValueError(f"storage {s.sid} is not fixed; unfix must match an earlier fix")
        if n == 1:
            del self._fixed[s.sid]
        else:
            self._fixed[s.sid] = n - 1
        self._fact("unfix", s.sid)

    def touch(self, s: Storage) -> None:
        if type(s) is not Storage or s.state is State.RESIDENT and not self._holds(s):
            self._check_mine(s)
        if s.state is State.RESIDENT and not self._following:
            self._last[s.slot + 1] = self.clock
        s.last_access = self.clock

    def add_write(self, s: Storage, cost: float, inputs=()) -> None:
        """An in-place write to resident `s` joined its recipe: replaying it now costs `cost` more and reads
        `inputs` too."""
        self._check_mine(s)
        if s.state is not State.RESIDENT:
            raise ValueError(f"storage {s.sid} is {s.state.value}; only a resident storage can be written")
        self.extend(s, cost, inputs)

    def extend(self, s: Storage, cost: float, inputs=()) -> None:
        """A replay of `s` now costs `cost` more and reads `inputs` too (its own write, or the rebuilding of an
        old version of a storage it reads)."""
        self._check_mine(s)
        if s.state is State.FREED:
            raise ValueError(f"storage {s.sid} is freed; a freed storage is never replayed")
        s.cost += _check_cost(cost)
        added = []
        for b in inputs:
            if b is not s and not any(b is x for x in s.inputs):
                add_input(s, b)
                added.append(b.sid)
        self._fact("extend", s.sid, s.cost, tuple(added))
        if self._following:
            return
        if s.state is State.RESIDENT:
            self._stale[s.sid] = s
        else:
            self._mark_dependents(s)

    def make_unevictable(self, s: Storage) -> None:
        self._check_mine(s)
        s.evictable = False
        self._fact("unevictable", s.sid)
        if s.state is State.RESIDENT and not self._following:
            self._kind[s.slot + 1] = BLOCKED

    def advance(self, cost: float) -> None:
        """Move the logical clock by the cost of an op that ran."""
        self.clock += _check_cost(cost)  # a clock that went back would make staleness <= 0

    def fits(self, nbytes: int) -> bool:
        return self.table.best_fit(nbytes) is not None

    def plan(self, nbytes: int) -> _policy.EvictionPlan | None:
        """The policy's plan for a request that no free block serves (pure, but for bringing costs up to
        date)."""
        return self._plan(self.table.round_up(nbytes))

    @property
    def unevictable_bytes(self) -> int:
        _, sizes, kind, _, _ = self._columns()
        return int(sizes[kind == BLOCKED].sum())

    def largest_window(self) -> int:
        _, sizes, kind, _, _ = self._columns()
        return _policy.largest_window(sizes, kind)

    def resident(self) -> list[Storage]:
        return [s for s in self._slots if s is not None]

    # ------------------------------------------------------------------------------------------------ inner
    def _holds(self, s) -> bool:
        """Whether `s` is a resident storage of this Memory (the common case of _check_mine, without its errors)."""
        try:
            return s.state is State.RESIDENT and self._slots[s.slot] is s
        except (AttributeError, IndexError):
            return False

    def _check_mine(self, s: Storage) -> None:
        if not isinstance(s, Storage):
            raise TypeError(f"expected a Storage record, got {type(s).__name__}")
        if s.state is State.RESIDENT and (s.slot >= len(self._slots) or self._slots[s.slot] is not s):
            raise ValueError(f"storage {s.sid} does not belong to this Memory")

    def _columns(self):
        self._stop_following()
        own = self.table.owners
        return self.table.offsets, self.table.sizes, self._kind[own], self._c[own], self._last[own]

    def _refresh_costs(self) -> None:
        """Every resident storage's c column equals its recompute cost (Note [Recompute cost])."""
        if self._stale:
            for s in self._stale.values():
                if s.state is State.RESIDENT:
                    self._c[s.slot + 1] = recompute_cost(s)
            self._stale.clear()
        self._walked.clear()

    def _mark_dependents(self, s: Storage) -> None:
        for d in dependents(s, self._walked):
            self._stale[d.sid] = d

    def _plan(self, need: int, prices=None) -> _policy.EvictionPlan | None:
        """The policy's plan for `need` bytes; coop reads `prices` (`_prices()`, made once per eviction event and
        shared with the move, relocation and compaction plans)."""
        if self.policy == "coop":
            kind, h, _ = self._prices() if prices is None else prices
            return _policy.coop_window(self.table.offsets, self.table.sizes, kind, h.copy(), need)
        self._stop_following()
        self._refresh_costs()
        off, sizes, kind, c, last = self._columns()
        return _policy.plan(self.policy, off, sizes, kind, c, last, self.clock, need)

    def _place(self, s: Storage, op: str | None, pinned: bool) -> None:
        table = self.table
        need = table.round_up(s.nbytes)
        at = table.best_fit_aligned(need)
        if at is None and self._following:  # Note [Step replay]: what the recorded block applied here
            applied = self._replay.recorded_plan()
            if applied is not None and applied.failed:
                self._out_of_budget(s, op, need)  # the same state found no plan then: it finds none now
            at = self._apply_recorded(applied, need) if applied is not None else None
        if at is None:
            t0 = time.perf_counter()
            prices = self._prices() if self.policy == "coop" else None
            plan = self._plan(need, prices)
            moves = ()
            slide = False
            can_move = self.relocate and self.may_relocate and self.mover is not None
            if plan is not None and plan.victims and can_move:
                cheaper = self._move_plan(need, plan, prices)
                if cheaper is not None:
                    plan, moves = cheaper
            if plan is None and can_move:
                plan, moves = self._relocation_plan(need, prices)
                if plan is None:
                    plan, moves = self._compaction_plan(need, prices)
                    slide = plan is not None
            dt = time.perf_counter() - t0
            if plan is None:
                if self._replay is not None:
                    self._replay.note_applied(FAILED)
                self._out_of_budget(s, op, need)
            at = self._apply(plan, need, dt, moves, slide)
        slot = self._free_slots.pop() if self._free_slots else self._new_slot()
        s.offset = table.place(at, need, slot + 1, high=self.partition and not s.expensive, aligned=True)
        s.slot = slot
        s.state = State.RESIDENT
        self._slots[slot] = s
        if pinned:
            s.pins += 1
        s.last_access = self.clock
        if not self._following:
            row = slot + 1
            self._kind[row] = _kind_of(s)
            self._stale[s.sid] = s  # its c column is computed before the next plan (_refresh_costs), when later
            # changes may have changed it again (and may not walk to it: storage.dependents)
            self._last[row] = self.clock
        if table.used_bytes > self.stats.peak_bytes:
            self.stats.peak_bytes = table.used_bytes

    # Note [Relocation]
    # Rationale: an op pins its inputs while its output is placed; many small inputs (a stack or cat of per-step
    #   tensors) or a few unevictable ones can split the arena so that no run of blocks free of them covers the
    #   request, although far more than the request is evictable. Moving a block is a copy of its bytes, much
    #   cheaper than the recomputations a failed step (or a larger budget) would cost.
    # Approach: the window search runs again with pinned and unevictable blocks counted as evictable at the
    #   price of a copy (2 x bytes over staleness, in the units of c/s), except those fixed at their address.
    #   The BLOCKED blocks inside the chosen window get destinations in the free blocks outside it (largest
    #   first, best fit, low edge); if one finds none, there is no plan. Only then does anything change: each
    #   block is placed at its destination, its bytes copied (source and destination never overlap), its old
    #   range released; the evictable blocks of the window are evicted as in any plan.
    # Limitations: only when the plain plan fails, only for coop, and only while the runtime holds no raw view
    #   of a resident storage (`may_relocate`). Copies count in the runtime's overhead as 2 x bytes.
    def _relocation_plan(self, need: int, prices, attempts: int = 8):
        table = self.table
        kind, h, copy = prices
        movable = (kind == BLOCKED) & ~self._fixed_blocks()
        if not movable.any():
            return None, ()
        sizes = table.sizes
        h = h.copy()
        h[movable] = copy[movable]
        kind2 = kind.copy()
        kind2[movable] = EVICTABLE
        for _ in range(attempts):
            plan = _policy.coop_window(table.offsets, sizes, kind2, h.copy(), need)
            if plan is None:
                return None, ()
            result, stuck = self._destinations(plan, movable, kind, h)
            if result is not None:
                return result
            movable[stuck] = False  # nowhere to put it: it stays, and the search runs again around it
            kind2[stuck] = BLOCKED
        return None, ()

    def _destinations(self, plan, movable, kind, h):
        """(plan without the moved blocks, moves), or (None, index of a block that has no destination). A block
        that finds no free hole outside the window takes the range of the cheapest evictable block outside it
        that is big enough, evicted for it."""
        moves, stuck = self._copies(plan, movable, kind,
                                    lambda i, fits: min(fits.tolist(), key=lambda b: (h[b], b)) if fits.size else None)
        if stuck is not None:
            return None, stuck
        evict = tuple(sorted([i for i in plan.victims if not movable[i]] + [b for b, _ in moves if b is not None]))
        return (_policy.EvictionPlan(evict, plan.start, plan.end, plan.cost, plan.policy),
                tuple((self._storage_at(i), at) for _, (i, at) in moves)), None

    def _prices(self):
        """Per block in address order: its kind, its eviction price c/s and the price of copying it, 2 x bytes / s
        (s = staleness; the units of c/s, Note [Relocation]), with the costs brought up to date first. Row 0
        (FREE) has c == 0, so free blocks get 0 as coop_window requires. Read-only for the plans that share it."""
        self._stop_following()
        self._refresh_costs()
        own = self.table.owners
        compiled = _policy.compiled_decision()
        if compiled is not None:  # Note [Compiled decision] in compiled.py: the same bits in one pass
            return compiled.prices(own, self._kind, self._c, self._last, self.table.sizes, self.clock)
        stale = self.clock - self._last[own]
        stale += 1.0  # (clock - last + 1.0, as _policy.heuristic computes it: the same bits)
        return self._kind[own], self._c[own] / stale, 2.0 * self.table.sizes / stale

    def _fixed_blocks(self) -> np.ndarray:
        """Per block in address order: whether its storage must keep its address (`fix`)."""
        own = self.table.owners
        if not self._fixed:
            return np.zeros(len(own), bool)
        return np.isin(own, [s.slot + 1 for s in self._slots if s is not None and s.sid in self._fixed])

    def _holes_outside(self, plan):
        """(mask of the blocks outside the plan's range, its free blocks as [offset, size] lists)."""
        table = self.table
        offsets, sizes = table.offsets, table.sizes
        outside = (offsets + sizes <= plan.start) | (offsets >= plan.end)
        free = np.flatnonzero(outside & (table.owners == _FREE_OWNER))
        return outside, [list(hole) for hole in zip(offsets[free].tolist(), sizes[free].tolist())]

    # Note [Moving instead of evicting]
    # Rationale: near the edge the free bytes lie in holes too small for a request, and the cheapest window
    #   can still hold an expensive block (a convolution's or a matmul's output). Copying that block into a hole
    #   outside the window costs a read and a write of its bytes; evicting it costs its recomputation, often far
    #   more. Coop's own answer to fragmentation is to use the holes, not to recompute around them.
    # Approach: after the plain window is found, the search runs once more with each evictable block priced at
    #   the smaller of its eviction (c/s) and a copy (2 x bytes / s, as in Note [Relocation]). The blocks of that
    #   window priced as copies get destinations in the free blocks outside it (largest first, best fit). One
    #   that finds none gets a hole made for it: the smallest evictable block outside the window that holds it
    #   and whose eviction costs less than its own is evicted, and it takes that block's range (as relocation
    #   does, Note [Relocation]). One for which no such block exists either is priced at its eviction again and
    #   the search reruns: the window was chosen on the price of a copy that cannot happen. Each rerun prices
    #   one more block at its eviction, so there are at most as many as candidates (up to 57 at the BiLSTM's
    #   edge, 9-14 elsewhere on the suite).
    #   The plan is taken only if its total is below the plain plan's; it is applied as a relocation (victims
    #   evicted, bytes copied).
    #   Why holes are made: the output a training step still holds (logits: a few hundred KiB) lies among
    #   activations hundreds of times larger, late in the backward pass its recompute is the whole forward
    #   pass, and it was evicted when no free hole outside the window fitted it; the block's copy-out at exit then
    #   replayed that forward pass (ResNet-152 at 0.1: 0.29 of the step's compute). Measured on the suite with
    #   Note [Dead storages]' rolling forward (docs/evaluation.md has the whole table): ResNet-152 at 0.1 1.877x ->
    #   1.513x, ResNet-50 at 0.175 4.27x -> 1.51x, DenseNet-121 at 0.125 1.731x -> 1.423x, the 100-layer chain
    #   at 0.2 1.649x -> 1.360x (1.06x its optimum); but ResNet-50 at 0.2 1.357x -> 3.410x. Taking the
    #   cheapest such block instead of the smallest fitted U-Net at 0.25 but failed ResNet-50 at 0.2 (both
    #   measured without rolling forward).
    #   Why the search reruns: a block that found no destination used to be evicted at its full price inside
    #   a window chosen for its copy. At ResNet-50 at 0.2 that evicted live 352 MiB gradients whose rebuild was
    #   the backward pass so far (3.410x); rerunning it gives 1.316x, U-Net at 0.275 3.844x -> 1.436x, ResNet-152
    #   at 0.1125 1.729x -> 1.380x, and multi-head attention at half its peak fits where every policy failed.
    #   Over 70 suite points (dry runs, sweep beside the evaluation): 28 lower, 19 higher (the most: Inception
    #   V3 at 0.2 1.324x -> 1.411x, U-Net at 0.3125 1.312x -> 1.403x), geometric mean of the overhead 0.954x.
    #   Also letting pinned blocks move here (as relocation does) was measured and not kept: higher at 6 of 35
    #   of those points, lower at 1. With the rerun, making the hole from the cheapest such block instead of the
    #   smallest was measured again over the 70 points: lower at 20, higher at 7; Swin-T, DenseNet-121 and
    #   BERT-Large fit one step lower (0.15, 0.1125, 0.0875) and GPT-2 at 0.5 drops to 1.114x, but Swin-T at
    #   0.175 rises from 1.33x to 2.40x (a restore of 1,139 replays) and fits at 0.15 only at 5.38x, two cliffs;
    #   the smallest stays. Also not kept: keeping the stuck block out of the rerun's window (ResNet-50 no
    #   longer fits at 0.175, Swin-T at 0.1625 5.45x) and taking the cheaper of the rerun's plan and the old one
    #   (GPT-2 at 0.5 back to 1.115x, but U-Net at 0.275 3.77x and ResNet-50 at 0.175 2.86x), and rerunning
    #   only for a block whose eviction alone costs the plain plan's price (U-Net at 0.275 3.77x, ResNet-50 at
    #   0.175 2.75x): where GPT-2 gains, these lose. The reruns were first capped at 8 (the plain plan stood
    #   when they ran out); without the cap the evaluation moved at 25 of 162 coop points: GPT-2 lower at every
    #   ratio from 0.65 down (0.5 1.132x -> 1.120x, 0.45 1.163x -> 1.133x, 0.2375 1.387x -> 1.348x), the BiLSTM
    #   higher at seven ratios (0.3 1.675x -> 1.750x) and lower at 0.55 (1.383x -> 1.207x), U-Net at 0.3 1.472x ->
    #   1.491x.
    # Limitations: one window per search, rerun as above, not a search over all sets of moves; coop only, and
    #   only while nothing holds a raw view. A copy keeps a block resident, which near the edge changes later
    #   choices: on the 100-layer chain at 0.2 the overhead went from 1.13x to 1.28x the optimum when moves came
    #   (before holes were made for them). Moving only blocks read more recently than the median evictable block
    #   kept the chain at 1.11x but lost the suite more (Inception V3's smallest ratio 0.175 -> 0.2125, above
    #   DTE's; six points above the better baseline instead of four), so every block may move. Also measured
    #   and not kept: charging each move the plain plan's price per byte for the hole it fills (chain 1.14x;
    #   DenseNet-121 no longer fits at 0.125, ResNet-152 at 0.1 rises to 3.18x), and moving only into holes
    #   smaller than every one of the last 64 requests (chain 1.12x, ResNet-50 fits at 0.15 and ResNet-152 at
    #   0.1 drops to 1.63x; Inception V3 at 0.35/0.3/0.2125 1.11/1.19/1.29x -> 1.19/1.28/1.58x, Swin-T at 0.3
    #   1.13x -> 1.22x).
    def _move_plan(self, need: int, plain: _policy.EvictionPlan, prices):
        """(plan, moves) cheaper than `plain` that copies evictable blocks of its window to free blocks outside
        it (or to the range of a cheaper block outside it, evicted to make room) where a copy costs less than
        their eviction, or None."""
        kind, h, move = prices
        table = self.table
        compiled = _policy.compiled_decision()
        if compiled is None:
            cand = (kind == EVICTABLE) & (move < h)
            if not cand.any():
                return None
            plan, moves = self._move_search(need, plain, kind, h, move, cand)
            if not moves:
                return None
            evict = [i for i in plan.victims if not cand[i]] + [b for b, _ in moves if b is not None]
            cost = float(h[evict].sum()) + sum(float(move[i]) for _, (i, _) in moves)
            start, end, moves = plan.start, plan.end, [m for _, m in moves]
        else:  # Note [Compiled decision] in compiled.py: the same search and totals, compiled
            lo, r, _, moved, at, made, count, cand = compiled.move_search(
                table.offsets, table.sizes, table.owners, kind, h, move, need, plain.cost)
            if count <= 0:
                return None
            evict, copies = compiled.move_total(kind, move, cand, lo, r, moved, made, count)
            cost = float(h[evict].sum()) + copies
            evict = evict.tolist()
            start, end = int(table.offsets[lo]), int(table.offsets[r] + table.sizes[r])
            moves = zip(moved[:count].tolist(), at[:count].tolist())
        if cost >= plain.cost:
            return None
        moved = tuple((self._storage_at(i), a) for i, a in moves)
        return _policy.EvictionPlan(tuple(sorted(evict)), start, end, cost, "coop"), moved

    def _move_search(self, need, plain, kind, h, move, cand):
        """The move plan's window and its moves ([] when it has no cheaper window); `cand` is updated in place
        (Note [Moving instead of evicting]; compiled.move_search is the same loop, compiled)."""
        h2 = np.where(cand, move, h)
        sizes = self.table.sizes

        def smallest_cheaper(i, fits):  # the smallest block whose eviction costs less than block i's, then the
            fits = fits[h[fits] + move[i] < h[i]]  # cheapest of those, then the lowest (fits ascends)
            if not fits.size:
                return None
            fits = fits[sizes[fits] == sizes[fits].min()]
            return int(fits[h[fits].argmin()])  # argmin: the first of equal prices
        while True:  # each rerun prices one more block at its eviction: at most one per candidate
            plan = _policy.coop_window(self.table.offsets, self.table.sizes, kind, h2, need)  # (zeroes BLOCKED)
            if plan is None or plan.cost >= plain.cost:
                return None, []
            moves, stuck = self._copies(plan, cand, kind, smallest_cheaper)
            if stuck is None:
                return plan, moves
            cand[stuck] = False  # no destination: priced at its eviction, and the search runs again
            h2[stuck] = h[stuck]

    def _copies(self, plan, movers, kind, hole_from):
        """A destination outside the window for each block of it in `movers`, largest first: a free hole (best
        fit), or else the range of the block `hole_from(i, fits)` picks among `fits`, the evictable blocks outside
        the window big enough for block i (it is evicted for it; None: no destination). Returns ([(block evicted
        to make the hole or None, (block, destination))], None), or (None, the first block that finds none)."""
        table = self.table
        sizes, offsets = table.sizes, table.offsets
        outside, holes = self._holes_outside(plan)
        spare = outside & (kind == EVICTABLE)
        moves = []
        for i in sorted((i for i in plan.victims if movers[i]), key=lambda i: (-int(sizes[i]), i)):
            made = None
            at = _take_hole(holes, int(sizes[i]))
            if at is None:  # make a hole
                made = hole_from(i, np.nonzero(spare & (sizes >= sizes[i]))[0])
                if made is None:
                    return None, i
                made = int(made)
                spare[made] = False
                holes.append([int(offsets[made]), int(sizes[made])])
                at = _take_hole(holes, int(sizes[i]))  # the only hole that fits
            moves.append((made, (i, at)))
        return moves, None

    # Note [Compaction]
    # Rationale: relocation needs a destination outside the window for each block it moves. When an op's own
    #   inputs are about as large as the request (a backward op reading two activations of the output's size),
    #   no such destination exists, although the budget holds all three once the blocks sit side by side: the
    #   step fails on fragmentation alone, where an allocator that compacts would fit.
    # Approach: the last resort, after the window search and relocation found nothing. Fixed blocks split the
    #   arena into segments. In a segment whose bytes minus its BLOCKED bytes cover the request, the evictable
    #   blocks with the least c/s per byte are evicted until its free bytes do; every other block of the segment
    #   slides down, in address order, to the segment's start, which leaves one free range at its end. The
    #   segment with the cheapest evictions wins (lowest address on ties). Each slide copies a block to an
    #   address at or below its own (source and destination may overlap: Arena.move copies as if through a
    #   temporary), and the blocks above it have not moved yet, so no copy overwrites bytes still to be copied.
    # Limitations: it may copy most of the arena; copies count in the overhead as 2 x bytes, as relocations do.
    #   Same conditions as relocation (coop, `may_relocate`, a mover).
    def _compaction_plan(self, need: int, prices):
        """(EvictionPlan of the free range left at the end of the chosen segment, slides in address order), or
        (None, ())."""
        table = self.table
        own, sizes, offsets = table.owners, table.sizes, table.offsets
        kind, h, _ = prices
        cuts = [-1, *np.nonzero(self._fixed_blocks())[0].tolist(), len(own)]
        best = None
        for lo, hi in zip(cuts, cuts[1:]):
            seg = np.arange(lo + 1, hi)
            if seg.size == 0:
                continue
            room = int(sizes[seg][kind[seg] != BLOCKED].sum())
            if room < need:
                continue
            short = need - int(sizes[seg][kind[seg] == FREE].sum())
            evictable = seg[kind[seg] == EVICTABLE]
            order = evictable[np.lexsort((evictable, h[evictable] / sizes[evictable]))]
            take = int(np.searchsorted(np.cumsum(sizes[order]), short)) + 1 if short > 0 else 0
            victims = np.sort(order[:take])
            cost = float(h[victims].sum())
            if best is None or cost < best[0]:
                best = (cost, seg, victims)
        if best is None:
            return None, ()
        cost, seg, victims = best
        gone = set(victims.tolist())
        cursor, slides = int(offsets[seg[0]]), []
        for i in seg.tolist():
            if own[i] == _FREE_OWNER or i in gone:
                continue
            if offsets[i] != cursor:
                slides.append((self._storage_at(i), cursor))
            cursor += int(sizes[i])
        end = int(offsets[seg[-1]] + sizes[seg[-1]])
        return _policy.EvictionPlan(tuple(victims.tolist()), cursor, end, cost, self.policy), tuple(slides)

    def _slide(self, slides) -> None:
        """Apply a compaction's slides, in address order (Note [Compaction])."""
        table = self.table
        self.stats.compactions += 1
        for s, dest in slides:
            old = s.offset
            table.release(old)
            table.place_at(dest, table.round_up(s.nbytes), s.slot + 1)
            self._moved(s, old, dest)

    def _relocate(self, moves) -> None:
        """Every destination is taken before any old range is released; destinations lie outside the window and
        sources inside it, so no copy overwrites bytes still to be copied."""
        table = self.table
        placed = []
        for s, dest in moves:
            placed.append((s, s.offset, table.place_at(dest, table.round_up(s.nbytes), s.slot + 1)))
        for s, old, new in placed:
            table.release(old)
            self._moved(s, old, new)

    def _moved(self, s: Storage, old: int, new: int) -> None:
        """Copy `s`'s bytes to its new range (already its own in the table) and count the copy."""
        self.mover(old, new, s.nbytes)
        s.offset = new
        self.stats.relocations += 1
        self.stats.relocated_bytes += self.table.round_up(s.nbytes)
        self._event("move", s.sid, new, s.nbytes)

    def _out_of_budget(self, s: Storage, op: str | None, need: int) -> NoReturn:
        """No plan serves `need`: the out_of_budget event, then OutOfBudget saying what blocked the request. The
        block kinds are read from the records, not from the policy's columns (which would stop the following):
        a block that follows its recording fails where the recorded block failed and goes on following."""
        table, slots = self.table, self._slots
        self._event("out_of_budget", s.sid, -1, s.nbytes)
        owners = table.owners.tolist()
        kind = np.full(len(owners), FREE, np.int8)
        held = np.zeros(len(owners), bool)  # pinned for the op in progress
        for i, o in enumerate(owners):
            if o != _FREE_OWNER:
                v = slots[o - 1]
                kind[i] = _kind_of(v)
                held[i] = v.pins > 0
        sizes, blocked = table.sizes, kind == BLOCKED
        raise OutOfBudget(s.nbytes, table.usable, int(sizes[blocked & ~held].sum()),
                          _policy.largest_window(sizes, kind), op, pinned=int(sizes[blocked & held].sum()),
                          restore=s.sid < self._next_sid, need=need)  # a restored storage already has its id

    def _apply(self, plan: _policy.EvictionPlan, need: int, search_seconds: float, moves=(), slide=False) -> int:
        """Relocate (or, for a compaction, slide) the planned blocks and evict the plan's victims; returns the
        offset of the free block that now covers the plan's range."""
        table, st = self.table, self.stats
        off, sizes = table.offsets, table.sizes
        victims = [self._storage_at(i) for i in plan.victims]
        evicted = sum(int(sizes[i]) for i in plan.victims)
        # (a compaction's victims all end up in its range: the blocks above them slide down over their bytes)
        inside = evicted if slide else sum(int(sizes[i]) for i in plan.victims if plan.start <= off[i] < plan.end)
        # the request takes the range's free bytes first; eviction had to supply only the rest
        useful = max(0, need - ((plan.end - plan.start) - inside))
        st.eviction_events += 1
        st.excess_bytes += evicted - useful
        st.fragmentation_sum += table.free_bytes / table.usable
        st.search_seconds += search_seconds
        st.search_seconds_max = max(st.search_seconds_max, search_seconds)
        st.evictions += len(victims)
        st.evicted_bytes += evicted
        if self._replay is not None:  # (moves by address, before any moved: Note [Step replay])
            self._replay.note_applied(Applied(tuple(int(off[i]) for i in plan.victims), plan.start,
                                              tuple((m.offset, dest) for m, dest in moves), slide, evicted,
                                              evicted - useful))
        for v in victims:  # first: some relocation destinations are ranges of victims outside the window
            if not (v is not None and v.pins == 0 and v.evictable):
                _internal_assert(False, f"{plan} picked an unevictable block")
            self._evict(v)
        if slide:
            self._slide(moves)
        elif moves:
            self._relocate(moves)
        o, size, owner = table.block_at(plan.start)
        _internal_assert(owner == _FREE_OWNER and o + size >= plan.end and size >= need,
                         f"after applying {plan}, block {o}+{size} (owner {owner}) does not cover the range")
        return o

    def _apply_recorded(self, a: Applied, need: int) -> int | None:
        """Apply again what the recorded block applied at this point (Note [Step replay]), as `_apply` did; returns
        the offset of the free block that covers the planned range, or None, with nothing changed, when a victim
        or a moved block is not there as recorded (resident, unpinned, evictable; moves allowed now)."""
        table, slots = self.table, self._slots
        victims, moves = [], []
        for off in a.victims:
            o, _, owner = table.block_at(off)
            v = slots[owner - 1] if owner != _FREE_OWNER and o == off else None
            if v is None or v.pins or not v.evictable:
                return None
            victims.append(v)
        if a.moves and not (self.relocate and self.may_relocate and self.mover is not None):
            return None
        for src, dest in a.moves:
            o, _, owner = table.block_at(src)
            if owner == _FREE_OWNER or o != src:
                return None
            moves.append((slots[owner - 1], dest))
        st = self.stats
        st.eviction_events += 1
        st.excess_bytes += a.excess
        st.fragmentation_sum += table.free_bytes / table.usable
        st.evictions += len(victims)
        st.evicted_bytes += a.evicted
        for v in victims:
            self._evict(v)
        if a.slide:
            self._slide(moves)
        elif moves:
            self._relocate(moves)
        o, size, owner = table.block_at(a.start)
        _internal_assert(owner == _FREE_OWNER and size >= need,
                         f"after applying the recorded plan at {a.start}, block {o}+{size} (owner {owner}) does not "
                         f"hold {need} bytes")
        return o

    def _storage_at(self, i: int) -> Storage:
        """The storage that owns the i-th block in address order (a block that is not free)."""
        return self._slots[int(self.table.owners[i]) - 1]

    def _new_slot(self) -> int:
        slot = len(self._slots)
        self._slots.append(None)
        if slot + 2 > len(self._kind):
            self._kind = np.concatenate([self._kind, np.zeros_like(self._kind)])
            self._c = np.concatenate([self._c, np.zeros_like(self._c)])
            self._last = np.concatenate([self._last, np.zeros_like(self._last)])
        return slot

    def _release(self, s: Storage) -> None:
        self.table.release(s.offset)
        self._slots[s.slot] = None
        self._free_slots.append(s.slot)
        if not self._following:
            self._kind[s.slot + 1] = FREE
        s.offset = s.slot = -1

    def _evict(self, s: Storage) -> None:
        self._release(s)
        s.state = State.EVICTED
        self._event("evict", s.sid, -1, s.nbytes)
        if not self._following:
            self._mark_dependents(s)

    # ----------------------------------------------------------------------------------------- observability
    def snapshot(self) -> list[dict]:
        """The blocks in address order as plain data: offset, size, state and owner sid."""
        out = []
        for o, size, own in zip(self.table.offsets.tolist(), self.table.sizes.tolist(), self.table.owners.tolist()):
            if own == _FREE_OWNER:
                out.append({"offset": o, "size": size, "state": "free", "sid": None})
            else:
                s = self._slots[own - 1]
                state = "pinned" if s.pins else ("resident" if s.evictable else "unevictable")
                out.append({"offset": o, "size": size, "state": state, "sid": s.sid, "nbytes": s.nbytes,
                            "cost": s.cost, "expensive": s.expensive})
        return out

    def check_invariants(self) -> None:
        """The table's invariants, the records against the table, and (unless a block is following a recording,
        Note [Step replay], when they wait) the policy's columns against the records."""
        table = self.table
        table.check_invariants()
        _internal_assert(self._kind[0] == FREE and self._c[0] == 0, "row 0 of the columns is not the FREE sentinel")
        owners = table.owners
        columns = not self._following
        live = 0
        for slot, s in enumerate(self._slots):
            if s is None:
                _internal_assert(not columns or self._kind[slot + 1] == FREE,
                                 f"empty slot {slot} has kind {self._kind[slot + 1]}")
                continue
            live += 1
            _internal_assert(s.state is State.RESIDENT and s.slot == slot,
                             f"storage {s.sid} in slot {slot} has state {s.state.value} and slot {s.slot}")
            i = table.index_of(s.offset)
            _internal_assert(int(owners[i]) == slot + 1, f"block at {s.offset} is owned by {owners[i] - 1}, "
                                                          f"storage {s.sid} claims it (slot {slot})")
            _internal_assert(int(table.sizes[i]) == table.round_up(s.nbytes),
                             f"storage {s.sid} needs {table.round_up(s.nbytes)} bytes, its block has {table.sizes[i]}")
            _internal_assert(s.pins >= 0, f"storage {s.sid} has {s.pins} pins")
            if not columns:
                continue
            want = _kind_of(s)
            _internal_assert(self._kind[slot + 1] == want, f"storage {s.sid}: kind column {self._kind[slot + 1]}, "
                                                            f"record says {want}")
            _internal_assert(self._last[slot + 1] == s.last_access,
                             f"storage {s.sid}: last column {self._last[slot + 1]}, record {s.last_access}")
            if s.sid not in self._stale:
                c = recompute_cost(s)
                _internal_assert(self._c[slot + 1] == c, f"storage {s.sid}: c column {self._c[slot + 1]}, "
                                                         f"recompute cost {c}")
        owned = int(np.count_nonzero(owners))
        _internal_assert(live == owned, f"{live} resident storages, {owned} owned blocks")
        _internal_assert(sorted(self._free_slots) == [i for i, s in enumerate(self._slots) if s is None],
                         "free slot list differs from a recount")
        _internal_assert(self.stats.peak_bytes >= table.used_bytes and self.stats.peak_bytes <= table.usable,
                         f"peak {self.stats.peak_bytes} vs used {table.used_bytes} and budget {table.usable}")
