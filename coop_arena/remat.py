"""Rematerialization: bringing evicted storages back by replaying their recipes, and keeping recipes valid.

Rules enforced here (see ../shared DESIGN numbering; Note [Restore plans] below for how):
3. A recomputation pins every input on its path until it completes; intermediates restored only to rebuild a
   needed storage are released as soon as what read them is rebuilt.
6. A write to a storage invalidates the recipes that read its old value: those readers are restored if needed and
   become unevictable ("frozen") before the write runs.
7. A replay that would start with recomputation already past `max_overhead` times the cost of the ops run so far
   raises Thrashing instead, before anything changes for that replay; every pin taken is released.
9. Restores never fight each other: the storages an op reads, and those a replay reads, cannot be evicted by the
   restores that serve the same op.
10. The logical clock advances by replayed work as by the program's own ops, so staleness tells a chain's start
    (read long ago) from its end (just rebuilt).

Note [Restore plans]
Rationale: restoring inputs one by one, each recursively, lets the restore of one input evict another input of
  the same op (which then comes back through a longer chain), holds every restored intermediate until the whole
  op is done (a deep chain fills the arena with one per level), and pins one half-built level per recursion.
Approach: `acquire(targets)` first pins the resident targets. The evicted targets and their evicted ancestors
  (through the recipes of each producer and of the writes since) form the plan; the resident storages they read
  form its boundary, pinned until their last reader in the plan has run. Plan nodes run in a topological order
  (depth first, inputs in program order, so earlier ancestors first); each is placed (which may evict any
  unpinned storage), replayed, and pinned until the last plan node that reads it is rebuilt. Then it is unpinned;
  if no wrapper holds it (restored only as an ancestor) it is evicted at once, otherwise it stays resident and
  evictable (a chain's backward pass reads it next). Targets stay pinned for the caller.
Limitations: boundary storages stay pinned for the whole plan, even those read only at its end. A plan is fixed
  when it starts: a boundary storage is never evicted during it, so the plan never grows.
"""

from __future__ import annotations

import warnings

import torch

from .errors import TensorLost, Thrashing, _internal_assert
from .lifetime import backs_evicted_live
from .memory import Memory
from .recipe import ArgRef, Recipe, replaying
from .storage import State, Storage
from . import ops

WARN_OVERHEAD = 3.0  # a step whose recompute overhead passes this warns once (RuntimeWarning)


class Remat:
    def __init__(self, memory: Memory, arena, counters, *, max_overhead: float | None, explain=None):
        self.memory = memory
        self.arena = arena
        self.counters = counters
        self.max_overhead = max_overhead
        self.meta = arena.device.type == "meta"
        self.explain = explain      # () -> str: what to tell a user whose step thrashes (from the Budget)
        self.warned = False

    # ============================================================================================ acquire
    def acquire(self, targets, op: str | None = None) -> list[Storage]:
        """Make every storage in `targets` (distinct) resident at once and pin each; returns the pins, which
        the caller releases with `release`. See Rules 3, 9 and Note [Restore plans]."""
        memory = self.memory
        pins: list[Storage] = []
        try:
            evicted = []
            for s in targets:
                if s.state is State.RESIDENT:
                    memory.pin(s)
                    pins.append(s)
                else:
                    evicted.append(s)
            if evicted:
                self._rebuild(evicted, {s.sid for s in targets}, pins, op)
        except BaseException:
            self.release(pins)
            raise
        return pins

    def release(self, pins) -> None:
        for s in pins:
            self.memory.unpin(s)

    def restore(self, s: Storage, op: str | None = None) -> None:
        """Bring one evicted storage back (unpinned)."""
        self.release(self.acquire([s], op))

    # ============================================================================================== plans
    def _plan(self, evicted: list[Storage]):
        """(plan nodes in topological order, readers per storage id, boundary storages)."""
        order: list[Storage] = []
        seen: dict[int, int] = {}  # sid -> 1 on the path, 2 done
        uses: dict[int, int] = {}
        boundary: dict[int, Storage] = {}
        for t in sorted(evicted, key=lambda s: s.sid):
            if t.sid in seen:
                continue
            seen[t.sid] = 1
            stack = [(t, iter(_inputs(t)))]
            while stack:
                node, it = stack[-1]
                for b in it:
                    uses[b.sid] = uses.get(b.sid, 0) + 1
                    if b.state is State.RESIDENT:
                        boundary[b.sid] = b
                    elif b.state is State.EVICTED:
                        mark = seen.get(b.sid)
                        _internal_assert(mark != 1, f"storage {b.sid} is its own ancestor")
                        if mark is None:
                            seen[b.sid] = 1
                            stack.append((b, iter(_inputs(b))))
                            break
                    else:
                        _internal_assert(False, f"storage {node.sid}'s recipe reads storage {b.sid}, which is freed")
                else:
                    stack.pop()
                    seen[node.sid] = 2
                    order.append(node)
        return order, uses, boundary

    def _rebuild(self, evicted, targets: set, pins: list, op) -> None:
        memory = self.memory
        order, uses, boundary = self._plan(evicted)
        for s in order:
            if s.payload.lost is not None:
                raise TensorLost(s.payload.lost)
        held: dict[int, Storage] = {}  # pinned here for the plan (not targets)
        try:
            for b in boundary.values():
                if b.sid not in targets:
                    memory.pin(b)
                    held[b.sid] = b
            for s in order:
                self._replay(s, op)
                if s.sid in targets:
                    pins.append(s)
                else:
                    held[s.sid] = s
                for b in _inputs(s):
                    n = uses[b.sid] = uses[b.sid] - 1
                    if n == 0 and b.sid in held:
                        del held[b.sid]
                        memory.unpin(b)
                        if (b.sid not in boundary and b.payload.wrappers == 0 and b.pins == 0 and b.evictable
                                and not backs_evicted_live(b)):
                            memory.evict(b)  # restored only as an ancestor: it goes (Rule 3)
        finally:
            for b in held.values():
                memory.unpin(b)

    def _replay(self, s: Storage, op) -> None:
        """Place evicted `s` (pinned), then replay its producer and writes into it. Its inputs are resident."""
        d = s.payload
        c = self.counters
        if self.max_overhead is not None and c.recompute_cost > (self.max_overhead - 1.0) * c.compute_cost:
            raise Thrashing(c.recompute_cost, c.compute_cost, self.max_overhead, op or str(d.recipe.func))
        memory = self.memory
        memory.restore(s, pinned=True, op=op or str(d.recipe.func))
        for b in _inputs(s):
            memory.touch(b)
        cost = 0.0
        recipe = d.recipe
        for r in [recipe, *d.mutations]:  # See Rule 5: collectives keep no recipe (collectives.py)
            _internal_assert(not ops.info(r.func).effectful, f"storage {s.sid}'s recipe holds the collective {r.func}")
        if not recipe.uninitialized:
            args, kwargs = self.views(recipe, None, 0)
            with replaying(recipe):
                out = recipe.func(*args, **kwargs)
            self.copy_into(s, out[d.index] if isinstance(out, (tuple, list)) else out)
            cost += recipe.cost
        for k, m in enumerate(d.mutations):
            margs, mkwargs = self.views(m, s, k)
            with replaying(m):
                m.func(*margs, **mkwargs)
            cost += m.cost
        c.recompute_cost += cost
        c.rematerializations += 1
        memory.advance(cost)  # See Rule 10
        memory.touch(s)
        if not self.warned and c.compute_cost and c.recompute_cost > (WARN_OVERHEAD - 1.0) * c.compute_cost:
            self.warned = True
            overhead = (c.compute_cost + c.recompute_cost) / c.compute_cost
            more = self.explain() if self.explain is not None else ""
            warnings.warn(f"this step is thrashing: recomputation has made it {overhead:.1f}x as costly as the ops "
                          f"run so far (warned once per step, above {WARN_OVERHEAD:g}x). {more}",
                          RuntimeWarning, stacklevel=2)

    # ============================================================================================== bytes
    def views(self, recipe: Recipe, self_storage, version: int):
        """The recipe's arguments with arena views in place of ArgRefs (all resident by now)."""
        flat, spec = ops.flatten(recipe.args, recipe.kwargs)
        for i, a in enumerate(flat):
            if isinstance(a, ArgRef):
                s = a.storage
                if s is self_storage:
                    _internal_assert(a.version == version, f"write {version} of storage {s.sid} read version {a.version}")
                else:
                    _internal_assert(a.version == s.payload.version,
                                     f"recipe reads storage {s.sid} at version {a.version}, it is at {s.payload.version}")
                _internal_assert(s.state is State.RESIDENT, f"storage {s.sid} is {s.state.value} during a replay")
                flat[i] = self.arena.view(s.offset, a.dtype, a.size, a.stride, a.offset)
        return ops.unflatten(flat, spec)

    def copy_into(self, s: Storage, o: torch.Tensor) -> None:
        if self.meta:
            return
        size, stride = tuple(o.size()), tuple(o.stride())
        if not ops.dense(size, stride):
            stride = contiguous_strides(size)
        self.arena.view(s.offset, o.dtype, size, stride, 0).copy_(o)

    # ============================================================================================ freezing
    def freeze_readers(self, s: Storage) -> None:
        """Before a write to `s` (Rule 6): storages whose recipes read its current value stop depending on it."""
        for ref in list(s.consumers):
            d = ref()
            if d is not None and d is not s:
                self.freeze(d)
        s.consumers[:] = [r for r in s.consumers if r() is s]

    def freeze(self, d: Storage) -> None:
        if d.state is State.FREED or d.payload.recipe is None:
            return
        if d.state is State.EVICTED:
            self.restore(d)
        self.make_unevictable(d)
        self.counters.frozen += 1

    def make_unevictable(self, s: Storage) -> None:
        s.payload.recipe = None
        s.payload.mutations = []
        if s.evictable:
            self.memory.make_unevictable(s)
            self.counters.count_unevictable(self.memory.table.round_up(s.nbytes), +1)


def _inputs(s: Storage) -> list:
    """The storages a replay of `s` reads, in program order."""
    return sorted(s.payload.reads(s), key=lambda b: b.sid)


def contiguous_strides(size) -> tuple:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))
