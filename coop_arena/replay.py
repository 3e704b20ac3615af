"""Step replay: a Budget's later blocks follow the memory decisions the block before them made.

Note [Step replay]
Rationale: training repeats one step, and the engine's decisions depend only on the program, the budget and the
  policy (Rule 8): a later block of the same Budget makes, at the same points, the decisions the block before it
  made. While a block provably runs the same program, the eviction search, and the bookkeeping that serves only
  the search, can be skipped: the policy's columns (each resident storage's kind and last access), the recompute
  costs and the walks that mark them stale along chains of evicted storages.
Approach:
  - Each block of a Budget made with `replay=True` records its stream: every op as (op, the sids of the arena
    storages it reads, the clock), every memory event (alloc, restore, evict, free, move, with sid, offset, bytes,
    clock and op), and the changes of the records that no event shows (a storage made unevictable, a write that
    adds cost and inputs to one, an address fixed by `pinned()`), in order; and for each placement that needed
    eviction, what was applied there: the victims' offsets, the blocks moved or slid and where to, the stats
    it added, or that no plan was found (FAILED: the placement raised OutOfBudget, which a restore's fallback
    can catch and go on from, so the block goes on too).
  - The next block follows the recording of the last block that ended normally. Each entry of its stream is
    compared with the recording's next one. While all have been equal, the memory is in the state the recorded
    block was in at that point (the same records, table and clock: sids and the clock start from 0 in every
    block), so a placement that needs eviction applies the recorded plan instead of searching (after checking
    that each victim is resident, unpinned and evictable), and a dead resident storage that the recorded block
    dropped or kept straight away (Note [Dead storages] in lifetime.py) is dropped or kept without the walk
    over its evicted readers that decided it there. Meanwhile the decision state is not kept.
  - That walk reads which evicted storages a wrapper still uses, which no memory event shows: so from the block's
    first eviction on, the stream also holds the storages whose deaths each drain handles, in order, and a
    "drop" or "keep" fact for each outcome (a drop's own event would not do: a restore's plan may evict the same
    storage as its first victim, with the same event).
  - At the first entry that differs (another op, another input, an event at another offset, size or clock, a
    placement the recording did not evict for, or anything that reads the policy's columns), the block stops
    following for good: the decision state is rebuilt from the records (every resident storage's kind and last
    access; every recompute cost marked stale, so the next plan refreshes it) and the normal path goes on,
    recording. The following block then follows that recording.
  - A recording is flat: one 64-bit hash per stream entry and the plans packed as integers, in three arrays, with
    no Python object per entry (a training loop run inside one block must not keep objects per step); at most
    STREAM_MAX entries, after which the block records no more (and the next follows nothing).
  - `stats.replayed_ops` counts the ops of a block run while it followed; the decisions, the trace, the stats
    (search timings aside) and the bits are those of the normal path (tests compare them).
Limitations: the guard is the stream of ops and memory events, not each op's tensor metadata: a step whose ops
  read the same storages and place the same bytes at the same costs is the same step for memory decisions, which
  is all that is replayed (the ops themselves, their recipes and the records run as usual). Entries are compared
  by hash: two different entries with equal 64-bit hashes at the same position would go unnoticed, and a recorded
  plan is still checked before it is applied (any evictable victim keeps the step exact). What replay saves is the
  search and its bookkeeping only (bench/results/host_overhead.md measures it): wrappers, records, the block table
  and binding arguments cost their host time at every op.
"""

from __future__ import annotations

from array import array

STREAM_MAX = 1 << 21  # entries a block records at most (16 MiB of hashes): beyond it, it records nothing more


class Applied:
    """What a placement that needed eviction applied (Memory._apply), by address, to be applied again."""

    __slots__ = ("victims", "start", "moves", "slide", "evicted", "excess")

    def __init__(self, victims, start, moves, slide, evicted, excess):
        self.victims = victims  # offsets of the evicted blocks
        self.start = start      # the start of the planned range (its free block then serves the request)
        self.moves = moves      # (offset, destination) of blocks relocated or slid, in the order they were applied
        self.slide = slide      # a compaction (Note [Compaction] in memory.py): the moves are slides
        self.evicted = evicted  # the stats it added: evicted bytes,
        self.excess = excess    # and bytes evicted beyond the request's need

    @property
    def failed(self) -> bool:
        """The placement found no plan (it raised OutOfBudget, which a restore's fallback may have caught)."""
        return self.start < 0


FAILED = Applied((), -1, (), False, 0, 0)  # what a placement that found no plan applied


class Recording:
    """One block's stream (Note [Step replay]): flat arrays of integers."""

    __slots__ = ("stream", "plans", "index")

    def __init__(self, stream=None, plans=None, index=None):
        self.stream = stream if stream is not None else array("q")  # a hash per entry
        self.plans = plans if plans is not None else array("q")     # Applied records, packed (_pack)
        self.index = index if index is not None else array("q")     # where each record starts in `plans`

    def plan_at(self, k: int) -> tuple[int, Applied]:
        """(stream position, Applied) of the k-th plan."""
        p, i = self.plans, self.index[k]
        pos, start, slide, evicted, excess, n = p[i:i + 6]
        victims = tuple(p[i + 6:i + 6 + n])
        m = p[i + 6 + n]
        flat = p[i + 7 + n:i + 7 + n + 2 * m]
        return pos, Applied(victims, start, tuple(zip(flat[::2], flat[1::2])), bool(slide), evicted, excess)

    def add_plan(self, pos: int, a: Applied) -> None:
        self.index.append(len(self.plans))
        self.plans.extend([int(x) for x in (pos, a.start, a.slide, a.evicted, a.excess, len(a.victims), *a.victims,
                                            len(a.moves), *(x for move in a.moves for x in move))])

    def prefix(self, n: int) -> "Recording":
        """The recording of its first `n` stream entries."""
        k = 0
        while k < len(self.index) and self.plans[self.index[k]] < n:
            k += 1
        end = self.index[k] if k < len(self.index) else len(self.plans)
        return Recording(self.stream[:n], self.plans[:end], self.index[:k])


class Replay:
    """A block's side of Note [Step replay], owned by its Memory: follows `follow` (a Recording, or None) while the
    stream matches it, records otherwise."""

    __slots__ = ("follow", "pos", "k", "rec")

    def __init__(self, follow: Recording | None):
        self.follow = follow          # the recording being followed; None once the stream has differed
        self.pos = 0                  # entries of `follow` matched so far
        self.k = 0                    # plans of `follow` passed so far
        self.rec = None if follow is not None else Recording()  # this block's own recording, while not following

    def add(self, entry: tuple) -> bool:
        """Append `entry` to the stream; False when it ends the following (the caller rebuilds the decision
        state)."""
        h = hash(entry)
        f = self.follow
        if f is None:
            rec = self.rec
            if rec is not None:
                rec.stream.append(h)
                if len(rec.stream) >= STREAM_MAX:
                    self.rec = None  # too long a block to keep: the next block follows nothing
            return True
        i = self.pos
        if i < len(f.stream) and f.stream[i] == h:
            self.pos = i + 1
            return True
        self.stop()
        self.rec.stream.append(h)
        return False

    def stop(self) -> None:
        """Stop following: this block's recording is the followed one up to here."""
        f, self.follow = self.follow, None
        self.rec = f.prefix(self.pos)

    def next_is(self, entry: tuple) -> bool:
        """While following, whether the recording's next stream entry is `entry` (by hash); nothing is consumed."""
        f, i = self.follow, self.pos
        return f is not None and i < len(f.stream) and f.stream[i] == hash(entry)

    def recorded_plan(self) -> Applied | None:
        """While following, what the recorded block applied at this point of its stream (None: nothing)."""
        f = self.follow
        if f is None:
            return None
        while self.k < len(f.index):
            pos, applied = f.plan_at(self.k)
            if pos > self.pos:
                return None
            self.k += 1
            if pos == self.pos:
                return applied
        return None

    def note_applied(self, applied: Applied) -> None:
        if self.follow is None and self.rec is not None:
            self.rec.add_plan(len(self.rec.stream), applied)

    def take(self) -> Recording | None:
        """The block's recording, for the next block to follow (the followed one itself when all of it matched)."""
        f = self.follow
        if f is not None:
            if self.pos == len(f.stream):
                return f
            self.stop()
        return self.rec
