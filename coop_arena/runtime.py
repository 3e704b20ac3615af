"""Runtime: one Budget block's engine, put together from its parts.

    Dispatch (dispatch.py)   every op: unwrap, make inputs resident, run, place outputs, wrap, record
    Remat    (remat.py)      restore plans, replays, freezing readers before writes
    Lifetime (lifetime.py)   wrappers, dead storages, the end of the block
    Memory   (memory.py)     blocks, eviction policy, telemetry
    Arena    (arena.py)      the bytes

The Rules (../shared DESIGN numbering, extended) are written at the top of the module that enforces each:
1, 2 lifetime.py; 1 (other engines' state) bookkeeping.py; 3, 6, 7 (thrashing), 9, 10 remat.py; 4, 8 recipe.py;
5, 6 (writes), 7 (outputs) dispatch.py; 5 (collectives) collectives.py; 3, 7, 8 (placement) memory.py.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from . import ops
from .arena import Arena
from .dispatch import Dispatch
from .errors import BudgetUsageError, OutOfBudget, TensorLost, Thrashing, _internal_assert
from .lifetime import Lifetime, _readers
from .memory import Memory
from .remat import Remat
from .recipe import plain_dispatch
from .storage import State, recompute_cost
from .telemetry import RuntimeCounters


class Runtime:
    def __init__(self, memory: Memory, arena: Arena, *, recomputable_inplace: bool = True,
                 max_overhead: float | None = None, explain=None, bookkeeping=None, sizing: bool = False):
        self.memory = memory
        self.sizing = sizing  # new shapes of known ops sized by the device (Note [Shapes that change])
        self.arena = arena
        self.device = arena.device
        self.counters = RuntimeCounters()
        memory.mover = self.copy_bytes
        memory.may_relocate = True
        self.bookkeeping = bookkeeping  # bookkeeping.Bookkeeping: other engines' work in the block, or None
        self.remat = Remat(memory, arena, self.counters, max_overhead=max_overhead, explain=explain)
        self.lifetime = Lifetime(memory, arena, self.counters, self.remat)
        self.dispatch = Dispatch(self, recomputable_inplace=recomputable_inplace)
        self.mode = None  # the Budget's dispatch mode, set by the Budget (composite ops re-enter it)
        self.thread = threading.get_ident()  # the block's thread (the Budget creates its runtime on entering)
        self._reading = threading.local()    # .active: this thread is inside `reading()` (repr)

    def run(self, func, args, kwargs):
        return self.dispatch.run(func, args, kwargs)

    def _ours(self) -> bool:
        """Whether this thread may touch the block's bytes: the block's own, or one that runs with the block's
        mode (CUDA's autograd device threads), now or around a `reading()` that turned the mode off."""
        return (threading.get_ident() == self.thread or getattr(self._reading, "active", False)
                or self.mode in _get_current_dispatch_mode_stack())

    @contextlib.contextmanager
    def reading(self):
        """Around code that turns dispatch modes off and then runs ops on this block's tensors (PyTorch's repr):
        a thread that may touch them before keeps that right inside."""
        was = getattr(self._reading, "active", False)
        self._reading.active = was or self._ours()
        try:
            yield
        finally:
            self._reading.active = was

    def check_thread(self, func) -> None:
        """An arena tensor reached an op outside the Budget's dispatch mode while its block runs: from another
        thread (see _ours) that would race with the block's evictions and placements, so it is refused."""
        if not self._ours():
            raise BudgetUsageError(
                f"{func} got a tensor that lives in a Budget's arena while that Budget's block runs on another "
                f"thread; its bytes may be evicted or moved at any moment there. Use it on the block's thread, or "
                f"after the block ends (it then holds its own copy)")

    @property
    def live(self) -> dict:
        return self.lifetime.live

    def plain_view(self, t) -> torch.Tensor:
        """A plain view of wrapper `t`'s bytes in the arena, restoring its storage first (valid until the next op
        may evict it)."""
        s = t._cell.storage
        if s.state is not State.RESIDENT:
            self.remat.restore(s)
        _internal_assert(s.state is State.RESIDENT, f"storage {s.sid} is {s.state.value} after restoring it")
        return self.arena.view(s.offset, t.dtype, t.size(), t.stride(), t.storage_offset())

    def copy_bytes(self, src: int, dst: int, nbytes: int) -> None:
        """Copy a storage's bytes between two arena ranges that do not overlap (copy-on-write, Note
        [Relocation] in memory.py)."""
        self.arena.move(src, dst, nbytes)

    def settle(self, tensors, *, refilled: bool = False) -> None:
        """Make the block independent of the current values of `tensors` (outside the arena), which are about to be
        overwritten (Rule 5): of the storages computed from them (directly or through others), those a wrapper
        still uses are restored if evicted and made unevictable (lost, TensorLost on use, if they cannot all come
        back at once), and those nobody can reach any more are freed. Used before an optimizer step (optimizer.py)
        and before any other write into a tensor from outside the arena.

        `refilled`: the tensors' storage is about to be freed and later refilled with the same values (FSDP's
        reshard, sharded.py). The walk then stops at each storage a wrapper uses that was not written in place
        since it was computed: it is kept, and the replays of what was computed from it stop there, so those
        stay evictable (a storage written in place goes on: its old versions replay from the tensors). What
        nobody holds on the way is freed once unreachable, as for a write."""
        readers = self.dispatch._ext_readers
        work = []
        for t in tensors:
            work.extend(r() for r in readers.pop(ops.storage_key(t), ()))
        work = [s for s in work if s is not None]
        if not work:
            return
        direct = list(work)
        with plain_dispatch():
            lifetime = self.lifetime
            lifetime.drain()
            tainted: dict = {}  # storages whose replay would read an old value, directly or through others
            while work:
                s = work.pop()
                if s.sid in tainted or s.state is State.FREED or s.payload is None or s.payload.recipe is None:
                    continue  # (no payload: an output of the op now running, which reads what is kept here)
                tainted[s.sid] = s
                if not (refilled and s.payload.wrappers and not s.payload.mutations):
                    work.extend(_readers(s))  # (refilled: the replays of its readers stop at it once kept)
            keep = sorted((s for s in tainted.values() if s.payload.wrappers), key=lambda s: s.sid)
            if not refilled:
                keep = _cheaper_cut(direct, keep, self.memory.table.round_up)
            self._keep(keep, "FSDP freed the parameter it was computed from" if refilled else
                       "a write to a tensor outside the arena overwrote what it was computed from")
            for s in tainted.values():
                if (s.state is not State.FREED and not s.payload.wrappers and not s.pins and s.payload.recipe is not None
                        and not _readers(s)):
                    lifetime.live.pop(s.sid, None)
                    lifetime.forget(s)

    def _keep(self, keep: list, why: str) -> None:
        """Restore the storages of `keep` if evicted and make them unevictable; those that cannot all come back at
        once are lost (TensorLost on use, saying `why` they had to come back), as at the end of a block."""
        remat = self.remat
        try:  # all at once: a restore of one must not read another already made unevictable
            held = remat.acquire(keep)
        except (OutOfBudget, Thrashing, TensorLost) as e:
            held = []
            for s in keep:
                if s.state is not State.RESIDENT:
                    s.payload.lost = f"storage {s.sid} was evicted and could not be restored before {why}: {e}"
                    s.payload.drop_recipe()
        try:
            for s in keep:
                if s.state is State.RESIDENT:
                    remat.make_unevictable(s)
                    self.counters.frozen += 1
        finally:
            remat.release(held)

    def finish(self, failed: bool = False) -> None:
        self.lifetime.finish(failed)

    def close(self) -> None:
        """After the block, once its statistics are read: drop the references between the runtime's parts, so
        that they, and the records only they reach, are freed at once rather than by Python's cycle collection
        (Note [Cyclic collection] in lifetime.py)."""
        if self.memory.mover == self.copy_bytes:
            self.memory.mover = None
        self.dispatch = self.remat = self.lifetime = self.mode = self.bookkeeping = None


def _cheaper_cut(direct: list, held: list, size) -> list:
    """What `settle` keeps of the storages computed from an overwritten tensor: those a wrapper holds (`held`), or
    the tensor's direct readers instead, when they take fewer bytes. Kept at the value they read, they stop every
    replay downstream from reading the new one, and all that lies beyond stays evictable: a spectral-norm layer's
    power iteration rewrites its `_u` and `_v` at every forward, read first by two clones of a few hundred bytes;
    keeping what was held downstream made a discriminator's first call unevictable when it ran a second time.
    Not when a recipe reads an older version of a direct reader (a clone is `empty_like` then a `copy_` of the
    tensor: its readers read the version after the copy), which replays from the tensor (Note [Old versions] in
    remat.py); a direct reader that nothing holds or reads is not kept. Nor when keeping the direct readers would
    replay more than keeping the held ones (`_restore_cost`)."""
    frontier = {}
    for s in direct:
        if s.state is State.FREED or s.payload is None or s.payload.recipe is None or s.sid in frontier:
            continue
        readers = _readers(s)
        if any(r.payload is not None and any(sid == s.sid and v != s.payload.version
                                             for recipe in r.payload.recipes() for sid, v in recipe.versions)
               for r in readers):
            return held
        if s.payload.wrappers or readers:
            frontier[s.sid] = s
    if (sum(size(s.nbytes) for s in frontier.values()) < sum(size(s.nbytes) for s in held)
            and _restore_cost(frontier.values()) <= _restore_cost(held)):
        return sorted(frontier.values(), key=lambda s: s.sid)
    return held


def _restore_cost(storages) -> float:
    """What keeping `storages` would replay first: the recompute cost of each one not resident. A direct reader
    that is evicted (a dead one kept for what was computed from it: a parameter's transpose, a gradient's norm)
    costs its replay, and what it reads through evicted storages, while held ones that are resident cost
    nothing: keeping it to save a few bytes of resident tensors replayed, at every write into a parameter inside
    an ample block, the forward pass (a hand-written SGD update after `torch.func.grad`: 2.7x compute, nothing
    evicted to make room)."""
    return sum(recompute_cost(s) for s in storages if s.state is not State.RESIDENT)


def raise_recursion_limit(n: int = 20_000) -> None:
    """Deep autograd graphs and recipe argument trees recurse in PyTorch's own code."""
    if sys.getrecursionlimit() < n:
        sys.setrecursionlimit(n)
