"""Telemetry as plain data: counters, a bounded event trace. Tests, reports and error messages read these."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import NamedTuple


@dataclass(slots=True)
class MemoryStats:
    """Counters of one Memory since its last reset. Written by Memory only (the runtime adds its own)."""

    budget: int = 0
    allocations: int = 0          # placements of new storages
    restores: int = 0             # placements of evicted storages brought back
    eviction_events: int = 0      # placements that needed eviction
    evictions: int = 0            # storages evicted by a policy to make room
    evicted_bytes: int = 0        # block bytes those evictions released
    excess_bytes: int = 0         # evicted bytes minus what each request needed beyond the free bytes of its range
    search_seconds: float = 0.0   # time spent choosing victims, all events
    search_seconds_max: float = 0.0
    fragmentation_sum: float = 0.0  # sum over eviction events of free bytes / budget before evicting
    peak_bytes: int = 0           # high-water mark of bytes held by resident storages (aligned)
    relocations: int = 0          # blocks copied out of a window (Note [Relocation])
    relocated_bytes: int = 0      # their bytes, and those of slid blocks
    compactions: int = 0          # placements that slid blocks together (Note [Compaction])

    @property
    def fragmentation(self) -> float:
        """Mean free bytes / budget over the placements that needed eviction (0 when none did)."""
        return self.fragmentation_sum / self.eviction_events if self.eviction_events else 0.0

    @property
    def search_seconds_per_event(self) -> float:
        return self.search_seconds / self.eviction_events if self.eviction_events else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["fragmentation"] = self.fragmentation
        d["search_seconds_per_event"] = self.search_seconds_per_event
        return d


@dataclass(slots=True)
class RuntimeCounters:
    """Counters of one block's runtime (the Memory keeps its own). Written by the runtime's parts only."""

    ops: int = 0
    compute_cost: float = 0.0       # cost of every op as the program ran it
    recompute_cost: float = 0.0     # cost of every replay
    rematerializations: int = 0     # storages restored by replaying their recipes
    exit_rematerializations: int = 0  # of those, replays at block exit to copy out what the user still holds
    exit_recompute_cost: float = 0.0  # the cost of those exit replays (part of recompute_cost)
    restores_in_turn: int = 0       # ops whose inputs came back one at a time (remat.py, Rule 9's fallback)
    unevictable_bytes: int = 0      # now: resident bytes that may not be evicted (not counting pins)
    unevictable_peak: int = 0
    working_set_peak: int = 0       # largest bytes one op held at once: its inputs and its outputs
    frozen: int = 0                 # storages made unevictable by a later write to what they read
    dropped: int = 0                # storages given up at exit after an error (TensorLost on use)
    escaped_bytes: int = 0          # bytes copied out of the arena at exit for the tensors the program still holds
    live_bytes: int = 0             # now: bytes of storages a wrapper uses (without copy-on-write's moves)
    live_peak: int = 0
    placed_bytes: int = 0           # output bytes written into the arena, replays included
    temporary_bytes: int = 0        # of those, bytes computed into a temporary first and copied in
    temporary_peak: int = 0         # largest sum of one op's temporaries (alive at once, outside the arena)
    replayed_ops: int = 0           # of `ops`, those run while the block followed a recording (Note [Step replay])
    off_arena: int = 0              # ops that read only tensors on another device and ran there (dispatch)
    off_arena_device: str = ""     # the device of the first of them

    def count_placed(self, nbytes: int, via_temporary: int, alive: int) -> None:
        """An op (or replay) wrote `nbytes` of outputs into the arena, `via_temporary` of them through temporaries
        first; `alive` bytes of temporaries existed at once while it ran."""
        self.placed_bytes += nbytes
        self.temporary_bytes += via_temporary
        if alive > self.temporary_peak:
            self.temporary_peak = alive

    def count_live(self, nbytes: int) -> None:
        """Bytes of storages a wrapper uses, resident or not: what the step would hold without eviction."""
        self.live_bytes += nbytes
        if self.live_bytes > self.live_peak:
            self.live_peak = self.live_bytes

    def count_unevictable(self, nbytes: int, sign: int) -> None:
        self.unevictable_bytes += sign * nbytes
        self.unevictable_peak = max(self.unevictable_peak, self.unevictable_bytes)


class Event(NamedTuple):
    kind: str      # "alloc", "restore", "evict", "free", "move", "out_of_budget"
    sid: int
    offset: int
    nbytes: int
    clock: float
    op: str | None = None  # the op the runtime was running when it happened (Memory.op); None outside a runtime


_event = tuple.__new__  # an Event from its six fields, without NamedTuple's keyword handling (one per memory event)


@dataclass(slots=True)
class Trace:
    """The most recent `maxlen` events, oldest first."""

    maxlen: int = 10_000
    events: deque = field(default_factory=deque)

    def __post_init__(self):
        self.events = deque(maxlen=self.maxlen)

    def add(self, kind: str, sid: int, offset: int, nbytes: int, clock: float, op: str | None = None) -> None:
        self.events.append(_event(Event, (kind, sid, offset, nbytes, clock, op)))

    def evictions(self) -> list[int]:
        return [e.sid for e in self.events if e.kind == "evict"]
