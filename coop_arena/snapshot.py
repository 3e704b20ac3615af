"""Memory snapshots in PyTorch's own format: a block's memory events and its arena's blocks as the dict that
`torch.cuda.memory._snapshot()` returns, for PyTorch's viewer (pytorch.org/memory_viz) and
`torch.cuda._memory_viz`. `Budget.memory_snapshot()` makes one; `coop-arena plan --snapshot` writes one.

Note [Memory snapshots]
Rationale: PyTorch users read a step's memory in PyTorch's viewer, from a pickled snapshot of the caching
  allocator: its segments, and its recent events with the stack that caused each. A Budget's step in that format
  opens in the same viewer, next to a snapshot of the same step without a Budget, and shows where it evicted and
  recomputed.
Approach: `memory_snapshot` converts a block's trace (telemetry.Event, oldest first) and, during a block, the
  live block table (Memory.snapshot()):
  - segments: one, the arena: `address` its base pointer (0 in a dry run on meta, whose tensors have no memory),
    `total_size` its usable bytes (the budget), `blocks` tiling it in address order, "active_allocated" for a
    storage's block (`size` the aligned block, `requested_size` the storage's bytes, `frames` those of the entry
    that placed it there) and "inactive" for a free one. During a block they are the live table; after it, the
    table as the trace leaves it (the block's exit resets the arena without events).
  - device_traces: one list per device index up to the arena's, the arena's own holding the entries; each event
    maps to entries as follows (`addr` = the arena's address + the block's offset, `size` = the aligned block):
      alloc (a new storage placed)       -> alloc
      restore (an evicted one placed)    -> alloc
      evict                              -> free_requested, free_completed
      free of a resident storage         -> free_requested, free_completed
      free of an evicted storage         -> nothing: its bytes went with its eviction
      move (relocation, compaction)      -> free_requested, free_completed at the old address, then alloc at the
                                            new one (the sum of sizes stays flat: both ranges are arena bytes)
      out_of_budget                      -> oom, `device_free` the arena's free bytes then
    Replaying the entries' sizes in order (alloc adds, free_completed subtracts) gives the arena's used bytes after
    each event; their maximum over a whole block is `stats.peak_bytes`.
  - frames: one per entry, {"filename": "coop_arena", "line": 0, "name": ...}, the name saying what happened to
    which storage and the op the runtime was running then (Event.op: str(OpOverload), or "block exit",
    "<Optimizer>.step", "coop_arena.pinned"): "aten.mm.default (storage 3)" for a new storage, "restore storage
    3 of aten.mm.default (for aten.add.Tensor)" (the op that made it, when the trace holds its alloc), "evict
    storage 3 (at aten.addmm.default)", "free storage 3 (at aten.relu.default)", "move storage 3 (for ...)",
    "out of budget placing storage 3 (for ...)". `kind(entry)` reads them back. An evict entry is any eviction:
    the policy's, to make room (`stats.evictions`), or the engine's own (a dead storage evicted but kept
    recomputable for its readers, Note [Dead storages]; an input restored only for a replay, Rule 3), which the
    trace does not tell apart: hence "at". A restore is a recomputation (`stats.rematerializations` counts
    these, and the replays of old versions into scratch storages, which are allocs: Note [Old versions]).
  What has no counterpart here, so never appears: segment_alloc and segment_free (the arena is allocated once,
  before the block, and lives through it), a free_requested that waits for a stream (a block is free at once),
  "active_awaiting_free" blocks, "snapshot" entries, `time_us` (the trace's clock is the analytic cost of the
  ops run, not time), streams other than 0, memory pools and expandable segments, Python stacks (the engine sees
  ops, not the lines that called them), and memory outside the arena: temporaries in the headroom, and the
  parameters, inputs, gradients and optimizer state that a Budget reads but never moves or counts.
Limitations: the trace keeps the last `trace_len` events of a block. When a block had more, an eviction, free or
  move of a storage placed before the first kept event has no known address and is left out (a move then shows
  as an alloc at its new address), and after the block the segment lacks the blocks placed before it: the
  Budget warns, and `coop-arena plan --snapshot` keeps up to 2**20 events.
"""

from __future__ import annotations

import pickle
from pathlib import Path

FILENAME = "coop_arena"  # every frame's file: the engine records ops, not Python lines


def _frame(name: str) -> list[dict]:
    return [{"filename": FILENAME, "line": 0, "name": name}]


def _cause(op: str | None, word: str = "for") -> str:
    return f" ({word} {op})" if op else ""


def memory_snapshot(events, *, capacity: int, alignment: int, address: int = 0, device: int = 0,
                    blocks: list[dict] | None = None) -> dict:
    """The snapshot dict of `events` (a block's trace, oldest first) in an arena of `capacity` usable bytes at
    `address` on device index `device`, placements rounded up to `alignment`. `blocks`: the live block table
    (Memory.snapshot()) during a block; None takes the table as the events leave it (Note [Memory snapshots])."""
    for name, v in (("capacity", capacity), ("alignment", alignment), ("address", address), ("device", device)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name in ("capacity", "alignment") else 0):
            raise ValueError(f"{name} must be an int {'> 0' if name in ('capacity', 'alignment') else '>= 0'}, "
                             f"got {v!r}")
    entries: list[dict] = []
    at: dict[int, tuple[int, int, int]] = {}  # sid -> (offset, block size, bytes) of the storages placed now
    frames_of: dict[int, list] = {}           # sid -> frames of the entry that placed it where it is
    made: dict[int, str] = {}                 # sid -> the op of its alloc event
    used = 0

    def place(sid: int, offset: int, nbytes: int, frames: list) -> None:
        nonlocal used
        size = -(-nbytes // alignment) * alignment
        at[sid] = (offset, size, nbytes)
        frames_of[sid] = frames
        used += size
        entries.append({"action": "alloc", "addr": address + offset, "size": size, "stream": 0, "frames": frames})

    def release(sid: int, frames: list) -> None:
        nonlocal used
        offset, size, _ = at.pop(sid)
        del frames_of[sid]
        used -= size
        for action in ("free_requested", "free_completed"):
            entries.append({"action": action, "addr": address + offset, "size": size, "stream": 0, "frames": frames})

    for e in events:
        kind, sid, op = e.kind, e.sid, e.op
        if kind == "alloc":
            if op:
                made[sid] = op
            place(sid, e.offset, e.nbytes, _frame(f"{op or 'alloc'} (storage {sid})"))
        elif kind == "restore":
            of = f" of {made[sid]}" if sid in made else ""
            place(sid, e.offset, e.nbytes, _frame(f"restore storage {sid}{of}{_cause(op)}"))
        elif kind == "move":
            frames = _frame(f"move storage {sid}{_cause(op)}")
            if sid in at:
                release(sid, frames)
            place(sid, e.offset, e.nbytes, frames)
        elif kind in ("evict", "free"):
            if sid in at:  # (not: an evicted storage freed, or one placed before the trace's first event)
                release(sid, _frame(f"{kind} storage {sid}{_cause(op, 'at')}"))
        elif kind == "out_of_budget":
            entries.append({"action": "oom", "size": -(-e.nbytes // alignment) * alignment,
                            "device_free": capacity - used, "stream": 0,
                            "frames": _frame(f"out of budget placing storage {sid}{_cause(op)}")})
    if blocks is None:
        blocks = _blocks_left(at, capacity)
    segment_blocks = []
    for b in blocks:
        active = b["sid"] is not None
        segment_blocks.append({"address": address + b["offset"], "size": b["size"],
                               "requested_size": b["nbytes"] if active else 0,
                               "state": "active_allocated" if active else "inactive",
                               "frames": frames_of.get(b["sid"], []) if active else []})
    allocated = sum(b["size"] for b in segment_blocks if b["state"] == "active_allocated")
    segment = {"device": device, "address": address, "total_size": capacity, "allocated_size": allocated,
               "active_size": allocated, "requested_size": sum(b["requested_size"] for b in segment_blocks),
               "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
               "frames": [], "blocks": segment_blocks}
    return {"segments": [segment], "device_traces": [[] for _ in range(device)] + [entries]}


def _blocks_left(at: dict, capacity: int) -> list[dict]:
    """The block table as Memory.snapshot() gives it, of the storages `at` holds and free blocks between them."""
    out, end = [], 0
    for sid, (offset, size, nbytes) in sorted(at.items(), key=lambda kv: kv[1][0]):
        if offset > end:
            out.append({"offset": end, "size": offset - end, "sid": None})
        out.append({"offset": offset, "size": size, "sid": sid, "nbytes": nbytes})
        end = offset + size
    if end < capacity:
        out.append({"offset": end, "size": capacity - end, "sid": None})
    return out


_VERBS = ("restore", "evict", "free", "move")


def kind(entry: dict) -> str:
    """What a trace entry of `memory_snapshot` records: "alloc" (a new storage), "restore", "evict", "free",
    "move" (its free at the old address and its alloc at the new one) or "oom", read from its action and its
    frame; an entry of another snapshot (PyTorch's own) reads as its action."""
    action = entry["action"]
    if action == "oom":
        return "oom"
    frames = entry.get("frames") or ()
    ours = len(frames) == 1 and frames[0].get("filename") == FILENAME
    verb = frames[0]["name"].split(" ", 1)[0] if ours else ""
    return verb if verb in _VERBS else action


def timeline(snapshot: dict) -> list[tuple[str, int]]:
    """(kind, bytes in use after it) for each entry of the snapshot's device trace that changes or reports the
    arena's use: allocs and completed frees (a free_requested joins its free_completed), and ooms."""
    traces = [t for t in snapshot.get("device_traces", ()) if t]
    if len(traces) > 1:
        raise ValueError(f"the snapshot has events on {len(traces)} devices; a timeline is of one")
    used, out = 0, []
    for entry in traces[0] if traces else ():
        action = entry["action"]
        if action == "alloc":
            used += entry["size"]
        elif action == "free_completed":
            used -= entry["size"]
        elif action != "oom":
            continue
        out.append((kind(entry), used))
    return out


def write(snapshot: dict, path) -> Path:
    """Pickle `snapshot` to `path`, as `torch.cuda.memory._dump_snapshot` does: the file the viewer opens."""
    path = Path(path)
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)
    return path
