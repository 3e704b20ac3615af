"""Rematerialization: bringing evicted storages back by replaying their recipes, and keeping recipes valid.

Rules enforced here (see ../shared DESIGN numbering; Note [Restore plans] below for how):
3. A recomputation pins every input on its path until it completes; intermediates restored only to rebuild a
   needed storage are released as soon as what read them is rebuilt.
6. A write to a storage keeps the recipes that read its old value replayable: they rebuild that version when they
   run (Note [Old versions]). Only when the old version cannot be rebuilt are they restored if needed and made
   unevictable ("frozen") before the write runs.
7. A replay that would start with recomputation already past `max_overhead` times the cost of the ops run so far
   raises Thrashing instead, before anything changes for that replay; every pin taken is released.
9. Restores never fight each other: the storages an op reads, and those a replay reads, cannot be evicted by the
   restores that serve the same op. The one exception is the fallback when that does not fit (below).
10. The logical clock advances by replayed work as by the program's own ops, so staleness tells a chain's start
    (read long ago) from its end (just rebuilt).

Note [Restore plans]
Rationale: restoring inputs one by one, each recursively, lets the restore of one input evict another input of
  the same op (which then comes back through a longer chain), holds every restored intermediate until the whole
  op is done (a deep chain fills the arena with one per level), and pins one half-built level per recursion.
Approach: `acquire(targets)` first pins the resident targets. The evicted targets and their evicted ancestors
  (through the recipes of each producer and of the writes since) form the plan; the resident storages they read
  form its boundary, each pinned from just before its first reader in the plan runs until its last reader has
  run (one evicted in between by the plan's own placements is restored first, by a plan of its own). Plan nodes run in a topological order
  (depth first, inputs in program order, so earlier ancestors first); each is placed (which may evict any
  unpinned storage), replayed, and pinned until the last plan node that reads it is rebuilt. Then it is unpinned;
  if no wrapper holds it (restored only as an ancestor) it is evicted at once, otherwise it stays resident and
  evictable (a chain's backward pass reads it next). Targets stay pinned for the caller.
Fallback: holding every input of the op while one of them is rebuilt can need more than the budget (the op's
  inputs plus a restore path's own inputs and outputs: a backward op of an attention layer whose evicted input
  is rebuilt through a projection of the same size). When the joint plan raises OutOfBudget, the inputs are
  acquired one at a time instead, the evicted ones first (in program order), each pinned once resident; an
  input not reached yet may be evicted by an earlier one's plan and is restored at its turn, beside those
  pinned before it. An input whose own plan does not fit is rebuilt narrowly: each replay pins only what it
  reads while it runs, the same recursion one level down for each evicted input, oldest input first and, if
  that fails, newest first (a deep chain then goes down before anything at its top is held), then the one
  costliest to rebuild first (where cheap inputs are older than the chain in some ops and newer in others: a
  weight cast once by autocast and read by two passes); an attempt gives
  up once it would replay one storage more than NARROW_REPLAYS times (its rebuilds evict what they need next,
  and newest first can take exponential work on residual chains). Only if every attempt fails does the op
  fail, with the first attempt's error, OutOfBudget, also when the fallback ran past `max_overhead` (not tried
  when the inputs alone exceed the budget). Counted in `stats.restores_in_turn`. It runs only where an acquire
  used to fail: there the op failed, or, at block exit and before an optimizer step (Runtime._keep), a held
  tensor was dropped as lost; every acquire that succeeded is unchanged.
Limitations: the order is one topological order (depth first), not the one that needs the least memory. The
  narrow rebuild is DTR's recursion: inputs rebuilt at one level stay pinned while the next is rebuilt, and a
  step that fits only through it can cost many times its ops (a 24-step GRUCell at half its peak: 59x). A
  replay that raises leaves its storage evicted and unpinned (its bytes were not its value yet). Keeping the
  plan nodes a wrapper holds pinned until the whole plan ends (so that its later placements cannot evict them)
  was measured and not adopted (2026-12-06): the pins pile up, and ResNet-50 at 0.2, Swin-T at 0.2 and
  ResNet-152 at 0.1 of their peaks no longer fit, U-Net at 0.3 1.49x -> 7.99x, GPT-2 at 0.25 1.32x -> 2.63x.

Note [Old versions]
Rationale: an in-place write (Rule 6) overwrites a value other recipes may still read. Freezing those readers
  (unevictable, recipe dropped) keeps them forever: a recurrent cell's in-place gate updates froze one storage
  per timestep. The old value is recomputable, as the producer and the writes before it are all recorded.
Approach: a recipe argument names the version it read. A plan node is a storage at its current version, or an
  old version `(storage, k)`: that one is replayed (producer, then the first k writes) into a scratch range that
  is pinned, unevictable and freed after its last reader in the plan. At the write, each reader of the old value
  is charged its replay (`before_write`). A storage with no recipe has no old version to rebuild: its readers
  are frozen as before, and so are readers of tensors written outside the arena (Rule 5).
"""

from __future__ import annotations

import torch

from .arena import grew
from .errors import OutOfBudget, TensorLost, Thrashing, UnsupportedOp, _internal_assert, warn
from .lifetime import keeps_dead
from .memory import Memory
from .recipe import ArgRef, Recipe, replaying
from .storage import State, Storage, recompute_cost
from .tensor import with_bits
from . import ops, placement

WARN_OVERHEAD = 3.0  # a step whose recompute overhead passes this warns once (RuntimeWarning)
NARROW_REPLAYS = 8   # replays of one storage within one narrow rebuild before it gives up (Note [Restore plans])
_NARROW_ORDERS = {  # the narrow rebuild's orders of a replay's evicted inputs (Note [Restore plans], fallback)
    "oldest": lambda b: b.sid,
    "newest": lambda b: -b.sid,
    "costliest": lambda b: (-recompute_cost(b), b.sid),
}


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
        except OutOfBudget as joint:
            self.release(pins)
            table = memory.table
            if sum(table.round_up(s.nbytes) for s in targets) > table.usable:
                raise  # the targets alone exceed the budget: no order of restores can help
            try:
                return self._acquire_in_turn(targets, op, plans=len(targets) > 1)
            except (OutOfBudget, Thrashing, _Fighting):  # the op fails as it did without the fallback
                raise joint from None
        except BaseException:
            self.release(pins)
            raise
        return pins

    def _acquire_in_turn(self, targets, op, *, plans: bool) -> list[Storage]:
        """The fallback of Rule 9 (Note [Restore plans]): the targets one at a time, evicted ones first, each
        pinned once resident; one not yet reached may be evicted meanwhile and is restored at its turn. Each is
        rebuilt by its own plan (when `plans`; a lone target's plan has just failed) or, where that does not fit,
        narrowly. Raises the OutOfBudget of the first target that does not fit beside those pinned before it (the
        caller raises its own instead)."""
        pins: list[Storage] = []
        try:
            for s in sorted(targets, key=lambda s: (s.state is State.RESIDENT, s.sid)):
                if s.state is State.RESIDENT:
                    self.memory.pin(s)
                    pins.append(s)
                    continue
                if plans:
                    try:
                        self._rebuild([s], {s.sid}, pins, op)
                        continue
                    except OutOfBudget:
                        _internal_assert(s.state is not State.RESIDENT, f"storage {s.sid}'s plan failed after it")
                try:
                    self._rebuild_narrow(s, op, {}, order="oldest")
                except (OutOfBudget, _Fighting):  # the other order: a deep chain's newest input first
                    try:
                        self._rebuild_narrow(s, op, {}, order="newest")
                    except (OutOfBudget, _Fighting):  # the deepest input first, wherever the chain is
                        self._rebuild_narrow(s, op, {}, order="costliest")
                pins.append(s)
        except BaseException:
            self.release(pins)
            raise
        self.counters.restores_in_turn += 1
        return pins

    def _rebuild_narrow(self, s: Storage, op, replays: dict, *, order: str) -> None:
        """Rebuild evicted `s` (left pinned) pinning only what each replay reads, while it runs: the same
        recursion one level down for each input, evicted inputs first, oldest, newest or costliest to rebuild
        first among them (Note [Restore plans], fallback). An input restored earlier may be evicted by a later
        one's rebuild and comes back at its turn. Costliest first rebuilds the input with the deepest chain of
        evicted ancestors before the cheap ones, so that at no level a cheap input waits pinned while a deep one
        is rebuilt: where the cheap inputs are older than the chain in some ops and newer in others (weights cast
        once by autocast and read again by a second pass, a checkpointed block run twice), both of the other
        orders hold one cheap input pinned per level. `replays` counts this attempt's replays per storage: one
        rebuilt more than NARROW_REPLAYS times means the rebuilds evict what they need next (their work would grow
        exponentially): _Fighting."""
        if s.payload.lost is not None:
            raise TensorLost(s.payload.lost)
        n = replays[s.sid] = replays.get(s.sid, 0) + 1
        if n > NARROW_REPLAYS:
            raise _Fighting
        reads = _Node(s, None).reads()
        if any(version is not None for _, version in reads):  # old versions need a plan (Note [Old versions])
            self._rebuild([s], {s.sid}, [], op)
            return
        held: list[Storage] = []
        rebuilt: list[Storage] = []
        try:
            key = _NARROW_ORDERS[order]
            for b, _ in sorted(reads, key=lambda r: (r[0].state is State.RESIDENT, 0 if r[0].state is State.RESIDENT
                                                     else key(r[0]))):
                _internal_assert(b.state is not State.FREED, f"storage {s.sid}'s replay reads storage {b.sid}, which is freed")
                if b.state is State.RESIDENT:
                    self.memory.pin(b)
                else:
                    self._rebuild_narrow(b, op, replays, order=order)
                    rebuilt.append(b)
                held.append(b)
            self._replay(s, op, {})
        finally:
            self.release(held)
        memory = self.memory
        for b in rebuilt:  # restored only as an ancestor: it goes (Rule 3)
            if b.state is State.RESIDENT and _only_an_ancestor(b, memory):
                memory.evict(b)

    def release(self, pins) -> None:
        for s in pins:
            self.memory.unpin(s)

    def restore(self, s: Storage, op: str | None = None) -> None:
        """Bring one evicted storage back (unpinned)."""
        self.release(self.acquire([s], op))

    # ============================================================================================== plans
    def _plan(self, evicted: list[Storage]):
        """(plan nodes in topological order, readers per node key, boundary storages). A node is an evicted
        storage (key: its sid) or an old version of a storage that a recipe still reads (key: (sid, version),
        Note [Old versions])."""
        order: list[_Node] = []
        seen: dict = {}  # node key -> 1 on the path, 2 done
        uses: dict = {}
        boundary: dict[int, Storage] = {}
        for t in sorted(evicted, key=lambda s: s.sid):
            if t.sid in seen:
                continue
            seen[t.sid] = 1
            if t.payload.lost is not None:
                raise TensorLost(t.payload.lost)
            root = _Node(t, None)
            stack = [(root, iter(root.reads()))]
            while stack:
                node, it = stack[-1]
                for b, version in it:
                    key = b.sid if version is None else (b.sid, version)
                    uses[key] = uses.get(key, 0) + 1
                    if version is None and b.state is State.RESIDENT:
                        boundary[b.sid] = b
                    elif version is not None or b.state is State.EVICTED:
                        mark = seen.get(key)
                        if mark == 1:
                            _internal_assert(False, f"storage {b.sid} is its own ancestor")
                        if mark is None:
                            if b.payload.lost is not None:
                                raise TensorLost(b.payload.lost)
                            seen[key] = 1
                            child = _Node(b, version)
                            stack.append((child, iter(child.reads())))
                            break
                    else:
                        _internal_assert(False, f"storage {node.s.sid}'s replay reads storage {b.sid}, which is freed")
                else:
                    stack.pop()
                    seen[node.key] = 2
                    order.append(node)
        return order, uses, boundary

    def _rebuild(self, evicted, targets: set, pins: list, op) -> None:
        memory = self.memory
        order, uses, boundary = self._plan(evicted)
        held: dict = {}      # node key -> storage pinned here for the plan (not targets)
        shadows: dict = {}   # (sid, version) -> the scratch storage holding that old version
        try:
            for node in order:
                for b, version in node.reads():  # the boundary is pinned from its first reader on, not before
                    if version is None and b.sid in boundary and b.sid not in targets and b.sid not in held:
                        if b.state is State.EVICTED:  # a placement earlier in this plan evicted it
                            self._rebuild([b], set(), [], op)
                        memory.pin(b)
                        held[b.sid] = b
                s = node.s
                if node.version is None:
                    if s.state is State.RESIDENT:  # a nested plan (above) rebuilt it already
                        memory.pin(s)
                    else:
                        self._replay(s, op, shadows)
                    if s.sid in targets:
                        pins.append(s)
                    else:
                        held[s.sid] = s
                else:
                    held[node.key] = shadows[node.key] = self._replay_old(s, node.version, op, shadows)
                for b, version in node.reads():
                    key = b.sid if version is None else (b.sid, version)
                    n = uses[key] = uses[key] - 1
                    if n == 0 and key in held:
                        x = held.pop(key)
                        memory.unpin(x)
                        if version is not None:
                            memory.free(shadows.pop(key))
                        elif b.sid not in boundary and _only_an_ancestor(b, memory):
                            memory.evict(b)  # restored only as an ancestor: it goes (Rule 3)
        finally:
            for key, x in held.items():
                memory.unpin(x)
                if key in shadows:
                    memory.free(shadows.pop(key))

    def _check_thrashing(self, op) -> None:
        c = self.counters
        if self.max_overhead is not None and c.recompute_cost > (self.max_overhead - 1.0) * c.compute_cost:
            raise Thrashing(c.recompute_cost, c.compute_cost, self.max_overhead, op, budget=self.memory.budget)

    def _replay(self, s: Storage, op, shadows: dict) -> None:
        """Place evicted `s` (pinned), then replay its producer and writes into it. Its inputs are resident."""
        d = s.payload
        self._check_thrashing(op or str(d.recipe.func))
        memory = self.memory
        memory.restore(s, pinned=True, op=op or str(d.recipe.func))
        try:
            for b in _inputs(s):
                memory.touch(b)
            cost = self._run_recipes(s, s.offset, len(d.mutations), shadows)
        except BaseException:  # its bytes are not its value: evicted again, so nothing reads them or stays pinned
            memory.unpin(s)
            memory.evict(s)
            raise
        self._replayed(cost)
        memory.touch(s)

    def _replay_old(self, s: Storage, version: int, op, shadows: dict) -> Storage:
        """A scratch storage (pinned, unevictable, freed after its last reader) holding `s` as it was after
        `version` writes (Note [Old versions])."""
        self._check_thrashing(op or str(s.payload.recipe.func))
        scratch = self.memory.allocate(s.nbytes, 0.0, evictable=False, pinned=True, op=op)
        try:
            self._replayed(self._run_recipes(s, scratch.offset, version, shadows))
        except BaseException:
            self.memory.unpin(scratch)
            self.memory.free(scratch)
            raise
        return scratch

    def _run_recipes(self, s: Storage, offset: int, version: int, shadows: dict) -> float:
        """Replay `s`'s producer and its first `version` writes into the range at `offset`; returns their cost."""
        d = s.payload
        recipe = d.recipe
        cost = 0.0
        for r in [recipe, *d.mutations[:version]]:  # See Rule 5: collectives keep no recipe (collectives.py)
            _internal_assert(not ops.info(r.func).effectful, f"storage {s.sid}'s recipe holds the collective {r.func}")
        if recipe.uninitialized:
            pass  # the range is all a replay needs
        elif recipe.direct is not None:
            self._replay_direct(offset, recipe, d.index, shadows)
            cost += recipe.cost
        else:
            args, kwargs = self.views(recipe, shadows)
            with replaying(recipe):
                out = recipe.func(*args, **kwargs)
            o = out[d.index] if isinstance(out, (tuple, list)) else out
            size = tuple(o.size())
            if placement.span_bytes(size, placement.layout(size, o.stride()), o.element_size()) != s.nbytes:
                # its bytes would not fill the range, or would run into the next block's
                raise UnsupportedOp(recipe.func, f"its replay gave an output of shape {list(size)} "
                                                 f"({o.numel() * o.element_size()} bytes) where its first run placed "
                                                 f"{s.nbytes} bytes: its result is not a function of its inputs "
                                                 f"(a nondeterministic kernel, or random draws the Budget does not "
                                                 f"see), so it cannot be recomputed")
            self.copy_into(offset, o)
            nbytes = o.numel() * o.element_size()
            self.counters.count_placed(nbytes, nbytes, sum(x.numel() * x.element_size() for x in
                                                           (out if isinstance(out, (tuple, list)) else [out])
                                                           if isinstance(x, torch.Tensor)))
            cost += recipe.cost
        for k, m in enumerate(d.mutations[:version]):
            margs, mkwargs = self.views(m, shadows, s, k, offset)
            try:
                with replaying(m):
                    m.func(*margs, **mkwargs)
            except RuntimeError as e:
                if not grew(e):
                    raise
                raise UnsupportedOp(m.func, f"its replay resized its out= argument past the {s.nbytes} bytes its "
                                            f"first run wrote: its result is not a function of its inputs (a "
                                            f"nondeterministic kernel upstream), so it cannot be recomputed") from e
            cost += m.cost
        return cost

    def _replayed(self, cost: float) -> None:
        c = self.counters
        c.recompute_cost += cost
        c.rematerializations += 1
        self.memory.advance(cost)  # See Rule 10
        if not self.warned and c.compute_cost and c.recompute_cost > (WARN_OVERHEAD - 1.0) * c.compute_cost:
            self.warned = True
            overhead = (c.compute_cost + c.recompute_cost) / c.compute_cost
            more = self.explain() if self.explain is not None else ""
            warn(f"this step is thrashing: recomputation has made it {overhead:.1f}x as costly as the ops "
                 f"run so far (warned once per step, above {WARN_OVERHEAD:g}x). {more}",
                 RuntimeWarning)

    # ============================================================================================== bytes
    def views(self, recipe: Recipe, shadows: dict, self_storage=None, version: int = 0, self_offset: int = -1):
        """The recipe's arguments with arena views in place of ArgRefs: the storage itself when the version
        matches, else the scratch copy of that old version (all resident by now)."""
        flat, spec = ops.flatten(recipe.args, recipe.kwargs)
        for i, a in enumerate(flat):
            if isinstance(a, ArgRef):
                s = a.storage
                if s is self_storage:
                    _internal_assert(a.version == version, f"write {version} of storage {s.sid} read version {a.version}")
                    if not self.meta:  # the write may resize its out= view: never past the storage's range
                        flat[i] = with_bits(self.arena.fixed_view(self_offset, s.nbytes, a.dtype, a.size, a.stride,
                                                                  a.offset), a.conj, a.neg)
                        continue
                    offset = self_offset
                elif a.version == s.payload.version:
                    _internal_assert(s.state is State.RESIDENT, f"storage {s.sid} is {s.state.value} during a replay")
                    offset = s.offset
                else:
                    scratch = shadows.get((s.sid, a.version))
                    _internal_assert(scratch is not None, f"recipe reads storage {s.sid} at version {a.version}, it "
                                                          f"is at {s.payload.version} and no replay rebuilt that")
                    offset = scratch.offset
                flat[i] = with_bits(self.arena.view(offset, a.dtype, a.size, a.stride, a.offset), a.conj, a.neg)
        return ops.unflatten(flat, spec)

    def _replay_direct(self, offset: int, recipe: Recipe, index: int, shadows: dict) -> None:
        """Replay an op through its out= variant: output `index` straight into the range at `offset`, the others
        (outputs of the same op that are not being restored) into temporaries (Note [Direct placement])."""
        plan = recipe.direct
        args, kwargs = self.views(recipe, shadows)
        outs, temporary = {}, 0
        for j, (name, o) in enumerate(zip(plan.out_names, plan.outputs)):
            if j == index:
                outs[name] = self.arena.view(offset, o.dtype, o.size, o.stride, 0)
            else:
                outs[name] = torch.empty_strided(o.size, o.stride, dtype=o.dtype, device=self.arena.device)
                temporary += o.nbytes
        with replaying(recipe):
            plan.out_op(*args, **kwargs, **outs)
        self.counters.count_placed(plan.outputs[index].nbytes, 0, temporary)

    def copy_into(self, offset: int, o: torch.Tensor) -> None:
        """Write a temporary output into the range at `offset` with the layout it was placed with
        (placement.layout)."""
        if self.meta:
            return
        size = tuple(o.size())
        self.arena.view(offset, o.dtype, size, placement.layout(size, o.stride()), 0).copy_(o)

    # ============================================================================================ freezing
    def before_write(self, s: Storage) -> None:
        """Before an in-place write to `s` (Rule 6): a reader of its current value stays recomputable from that
        old version (Note [Old versions]); it is charged the old version's replay. Without a recipe for `s`, no
        old version can be rebuilt: its readers are frozen instead."""
        d = s.payload
        if d.recipe is None:
            self.freeze_readers(s)
            return
        old = sum(r.cost for r in d.recipes())
        version = d.version
        for r in s.readers():
            if r is not s and r.payload.recipe is not None and _reads_version(r, s, version):
                self.memory.extend(r, old, s.inputs)

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
        resident = s.state is State.RESIDENT
        if resident:  # restoring its readers must not evict it: it would be evicted without a recipe
            self.memory.pin(s)
        try:
            self._freeze_old_readers(s)
        finally:
            if resident:
                self.memory.unpin(s)
        s.payload.drop_recipe()
        if s.evictable:
            self.memory.make_unevictable(s)
            self.counters.count_unevictable(self.memory.table.round_up(s.nbytes), +1)

    def _freeze_old_readers(self, s: Storage) -> None:
        """`s` is about to drop its recipe, and with it every old version (before one of its writes) that other
        recipes still read (Note [Old versions]): nothing could rebuild those any more. Their readers are frozen
        first, while the old versions can still be replayed; one that cannot be restored now is lost (TensorLost
        when a wrapper or a replay needs it), as a held tensor is when it cannot come back before an optimizer
        step (Runtime._keep)."""
        d = s.payload
        if d.recipe is None or not d.mutations:
            return
        version = d.version
        for r in list(s.readers()):
            if r is s or r.payload is None or r.payload.recipe is None or not any(
                    sid == s.sid and v != version for recipe in r.payload.recipes() for sid, v in recipe.versions):
                continue
            try:
                self.freeze(r)
            except (OutOfBudget, Thrashing, TensorLost) as e:
                r.payload.lost = (f"storage {r.sid} was evicted and could not be restored before storage {s.sid}, "
                                  f"an earlier value of which it was computed from, had to stay resident (so that "
                                  f"value could no longer be recomputed): {e}")
                r.payload.drop_recipe()


class _Fighting(Exception):
    """Internal: a narrow rebuild replayed one storage more than NARROW_REPLAYS times."""


def _only_an_ancestor(b: Storage, memory: Memory) -> bool:
    """Restored only to rebuild what read it: no wrapper, no pin, evictable, and no evicted storage in use needs
    it kept (Rule 3; lifetime.keeps_dead)."""
    return b.payload.wrappers == 0 and b.pins == 0 and b.evictable and not keeps_dead(b, memory)


def _inputs(s: Storage) -> list:
    """The storages a replay of `s` reads, in program order."""
    return sorted(s.payload.reads(s), key=lambda b: b.sid)


class _Node:
    """A plan node: an evicted storage (version None), or an old version of a storage that a recipe reads."""

    __slots__ = ("s", "version", "key")

    def __init__(self, s: Storage, version):
        self.s, self.version = s, version
        self.key = s.sid if version is None else (s.sid, version)

    def reads(self) -> list:
        """(storage, version or None for its current one) its replay reads, in program order, itself left out."""
        d = self.s.payload
        recipes = ([] if d.recipe.uninitialized else [d.recipe]) + d.mutations[: len(d.mutations) if self.version is
                                                                                 None else self.version]
        seen = {}
        for r in recipes:
            for a in ops.flatten(r.args, r.kwargs)[0]:
                if isinstance(a, ArgRef) and a.storage is not self.s:
                    b = a.storage
                    v = None if a.version == b.payload.version else a.version
                    seen.setdefault((b.sid, -1 if v is None else v), (b, v))
        return [seen[k] for k in sorted(seen)]


def _reads_version(r: Storage, s: Storage, version: int) -> bool:
    """Whether a recipe of `r` reads `s` as it is at `version` (a reader of an older one was charged at the write
    that ended it, Note [Old versions])."""
    key = (s.sid, version)
    return any(key in recipe.versions for recipe in r.payload.recipes())
