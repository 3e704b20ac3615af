"""Runtime: what a Budget does with each op: unwrap, make resident, run, place outputs, wrap, record.

Rules (from the design, cited in the code as "See Rule N"):
1. Tensors that existed before the block (plain tensors, or coop tensors from an earlier block) are read, never
   moved, evicted or counted. Everything produced inside lives in the arena and counts, with one exception: a
   leaf's gradient leaves the arena as soon as autograd has accumulated it (a post-accumulate-grad hook), since
   it is model-sized state like the parameter itself and is final from then on.
2. Eviction and recomputation work per storage: a base and its views go and come back together.
3. A recomputation pins every input on its path until it completes; intermediates restored only to rebuild a
   needed tensor (no live wrapper) are released right after use.
4. A random op recomputes the same bits: the generator state before it ran is part of its recipe.
5. An op with effects outside its outputs is never recomputed; its outputs are unevictable. A write into a tensor
   outside the arena is such an effect. An op that wrote an external tensor its schema does not mark (BatchNorm's
   running statistics) is recorded with that argument set to None when the schema allows it (the update
   happens once, in the original step), else its outputs are unevictable.
6. An in-place op keeps the tensor's address; the storage's recipe becomes its producer followed by every write
   since (recomputable in-place). Storages whose recipes read the value before the write can no longer be
   recomputed from it: they are restored if needed and become unevictable ("frozen") before the write runs.
   With recomputable_inplace=False a write goes to a fresh copy instead (copy-on-write, the ablation).
7. A request that cannot be met raises OutOfBudget; every pin taken for the op is released and outputs
   already placed for it are freed, so the Budget stays usable.
8. Decisions depend only on the program, budget and policy: costs are analytic (cost.py), not timed.

Outputs are computed by the op into a temporary and copied into their arena range at once (the temporary is
then dropped); ops whose output is uninitialized memory (the empty family) are recorded as such and replay as
nothing.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as _dense
from torch.utils._pytree import tree_flatten, tree_unflatten

from .arena import Arena
from .cost import op_cost
from .errors import BudgetUsageError, OutOfBudget, TensorLost, UnsupportedOp, _internal_assert
from .memory import Memory
from .storage import State, Storage, add_consumer
from .tensor import Cell, Tensor

aten = torch.ops.aten

# Ops whose output bytes are uninitialized: a replay only needs the range, not the op (nor its inputs).
_UNINITIALIZED = {aten.empty_like, aten.empty, aten.new_empty, aten.new_empty_strided, aten.empty_strided}
# Namespaces of ops with effects outside their outputs (collectives): outputs unevictable (Rule 5).
_EFFECTFUL_NAMESPACES = {"_c10d_functional", "c10d", "c10d_functional", "_dtensor"}
# (op, its non-tensor arguments) -> positions of external tensor arguments it writes although its schema does
# not say so (native_batch_norm's running statistics). Found by comparing the arguments around the first call.
_UNMARKED_WRITES: dict = {}


@dataclass(slots=True, eq=False)
class ArgRef:
    """A recipe argument that lives in the arena: the storage, the version it had, and the view."""

    storage: Storage
    version: int
    dtype: torch.dtype
    size: tuple
    stride: tuple
    offset: int


@dataclass(slots=True, eq=False)
class Recipe:
    func: object
    args: tuple             # with ArgRef leaves for arena tensors, plain tensors for external ones
    kwargs: dict
    rng: object             # (generator, state) captured before a random op ran, else None (Rule 4)
    cost: float
    uninitialized: bool = False
    grad_mode: bool = True  # some kernels return different outputs with grad mode off (mkldnn_rnn_layer's workspace)


@dataclass(slots=True, eq=False)
class Data:
    """The runtime's part of a storage record (`Storage.payload`). Written by Runtime only."""

    runtime: "Runtime | None"
    cell: Cell
    recipe: Recipe | None       # the producer; None: not recomputable (the storage is unevictable)
    index: int                  # which output of the producer
    mutations: list = field(default_factory=list)  # in-place writes since, in order (Rule 6)
    wrappers: int = 0           # live coop_arena.Tensor objects on this storage
    detached: torch.Tensor | None = None  # after the block: a plain copy of the bytes
    lost: str | None = None

    @property
    def version(self) -> int:
        return len(self.mutations)

    def plain_view(self, t: Tensor) -> torch.Tensor:
        if self.detached is not None:
            return self.detached.view(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset())
        if self.lost is not None:
            raise TensorLost(self.lost)
        rt = self.runtime
        _internal_assert(rt is not None, "a storage with neither an arena nor a copy")
        s = self.cell.storage
        if s.state is not State.RESIDENT:
            with _plain_dispatch():
                rt.restore(s)
        return rt.arena.view(s.offset, t.dtype, t.size(), t.stride(), t.storage_offset())


@dataclass(slots=True)
class RuntimeCounters:
    ops: int = 0
    compute_cost: float = 0.0       # cost of every op as the program ran it
    recompute_cost: float = 0.0     # cost of every replay
    rematerializations: int = 0     # storages restored by replaying their recipes
    unevictable_bytes: int = 0      # now: resident bytes that may not be evicted (not counting pins)
    unevictable_peak: int = 0
    frozen: int = 0                 # storages made unevictable by a later write to what they read


def _span_bytes(size, stride, offset: int, itemsize: int) -> int:
    if any(n == 0 for n in size):
        return 0
    return (offset + 1 + sum((n - 1) * st for n, st in zip(size, stride))) * itemsize


def _contiguous_strides(size) -> tuple:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _generator_for(device: torch.device, kwargs: dict):
    g = kwargs.get("generator")
    if g is not None:
        return g
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None  # meta: no bits to reproduce


@contextmanager
def _plain_dispatch():
    """Run ops as the dispatch handler does (no autograd, no dispatch mode), for restores started elsewhere."""
    with torch.utils._python_dispatch._disable_current_modes(), torch._C._AutoDispatchBelowADInplaceOrView():
        yield


@contextmanager
def _replaying(recipe: "Recipe"):
    """The conditions the op first ran under: grad mode and, for a random op, the generator state (Rule 4)."""
    with torch.set_grad_enabled(recipe.grad_mode), _rng(recipe.rng):
        yield


@contextmanager
def _rng(saved):
    if saved is None:
        yield
        return
    gen, state = saved
    now = gen.get_state()
    gen.set_state(state)
    try:
        yield
    finally:
        gen.set_state(now)


def _written_args(func, args, kwargs):
    """(position or name, value) of every argument the schema marks as written."""
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            if i < len(args) and not a.kwarg_only:
                out.append((i, args[i]))
            elif a.name in kwargs:
                out.append((a.name, kwargs[a.name]))
    return out


class Runtime:
    def __init__(self, memory: Memory, arena: Arena, *, recomputable_inplace: bool = True):
        self.memory = memory
        self.arena = arena
        self.device = arena.device
        self.recomputable_inplace = recomputable_inplace
        self.counters = RuntimeCounters()
        self.live: dict[int, Storage] = {}          # storages with live wrappers
        self._dead: list[Storage] = []              # storages whose last wrapper died; handled at safe points
        self._ext_readers: dict[int, list] = {}     # external storage key -> weakrefs of storages reading it
        self._externals: dict[int, weakref.ref] = {}  # leaves from before the block that ops read (for .grad)
        self._hooks: list = []                        # their post-accumulate-grad hooks
        self._restored: list[Storage] = []         # intermediates restored for the op in progress (Rule 3)

    # ============================================================================================ dispatch
    def run(self, func, args, kwargs):
        self._drain_dead()
        if torch.Tag.inplace_view in func.tags:
            raise UnsupportedOp(func, "it changes a tensor's shape or storage in place; use the out-of-place "
                                      "form (e.g. x = x.unsqueeze(0) instead of x.unsqueeze_(0))")
        flat, spec = tree_flatten((args, kwargs))
        plain, recorded, pins, inputs = list(flat), list(flat), [], []
        try:
            mine = {x._cell.storage.sid: x._cell.storage for x in flat
                    if isinstance(x, Tensor) and x._cell.storage.payload.runtime is self}
            for sid in sorted(mine):  # program order, as in restore()
                s = mine[sid]
                self._make_resident(s)
                self.memory.pin(s)
                pins.append(s)
                self.memory.touch(s)
                inputs.append(s)
            for i, x in enumerate(flat):
                if isinstance(x, Tensor) and x._cell.storage.payload.runtime is self:
                    s = x._cell.storage
                    plain[i] = self.arena.view(s.offset, x.dtype, x.size(), x.stride(), x.storage_offset())
                    recorded[i] = ArgRef(s, s.payload.version, x.dtype, tuple(x.size()), tuple(x.stride()),
                                         x.storage_offset())
                elif isinstance(x, torch.Tensor):  # See Rule 1: read, never moved
                    p = x.as_plain() if isinstance(x, Tensor) else x
                    if p.device != self.device and p.dim() > 0:
                        raise BudgetUsageError(
                            f"{func} got a tensor on {p.device}, but this Budget's arena is on {self.device}; "
                            f"move the model and its inputs to {self.device} before entering the Budget")
                    plain[i] = recorded[i] = p
                    if x.requires_grad and x.is_leaf and id(x) not in self._externals:
                        self._externals[id(x)] = weakref.ref(x)
                        self._hooks.append(x.register_post_accumulate_grad_hook(_grad_leaves_arena))
            pargs, pkwargs = tree_unflatten(plain, spec)
            rargs, rkwargs = tree_unflatten(recorded, spec)
            written = _written_args(func, pargs, pkwargs)
            if written:
                return self._run_write(func, args, kwargs, pargs, pkwargs, rargs, rkwargs, written, inputs)
            if any(r.alias_info is not None for r in func._schema.returns):
                return self._run_view(func, pargs, pkwargs, inputs)
            return self._run_functional(func, pargs, pkwargs, rargs, rkwargs, inputs)
        finally:
            for s in pins:
                self.memory.unpin(s)
            self._release_restored()
            self._drain_dead()

    def _release_restored(self) -> None:
        """See Rule 3: intermediates restored only to rebuild what an op needed go once the op is done (not
        after each nested restore, which would rebuild a shared chain again for every input)."""
        restored, self._restored = self._restored, []
        for r in restored:
            if r.payload.wrappers == 0 and r.pins == 0 and r.state is State.RESIDENT and r.evictable:
                self.memory.evict(r)

    # ---------------------------------------------------------------------------------------- functional
    def _run_functional(self, func, pargs, pkwargs, rargs, rkwargs, inputs):
        rng = self._capture_rng(func, pkwargs)
        externals = [(k, t) for k, t in self._direct_tensor_args(func, pargs, pkwargs) if not self.arena.owns(t)]
        key, probe, written = None, None, ()
        if externals and self.device.type != "meta":
            key = (func, repr([a for a in tree_flatten((pargs, pkwargs))[0] if not isinstance(a, torch.Tensor)]))
            written = _UNMARKED_WRITES.get(key)
            if written is None:  # first call of this op and configuration: look for writes the schema hides
                probe = [(k, t, t._version, t.clone()) for k, t in externals]
        out = func(*pargs, **pkwargs)
        if probe is not None:
            written = _UNMARKED_WRITES[key] = frozenset(
                k for k, t, v, before in probe if t._version != v or not torch.equal(t, before))
        cost = op_cost(func, pargs, pkwargs, out)
        self._account(cost)
        evictable = func.namespace not in _EFFECTFUL_NAMESPACES
        for k, t in externals:  # See Rule 5: writes into external tensors the schema does not mark
            if k in written:
                self._freeze_readers_of_external(t)
                arg = func._schema.arguments[k] if isinstance(k, int) else None
                if arg is not None and isinstance(arg.type, torch.OptionalType):
                    rargs = tuple(None if j == k else a for j, a in enumerate(rargs))
                else:
                    evictable = False
        recipe = Recipe(func, rargs, rkwargs, rng, cost, uninitialized=func.overloadpacket in _UNINITIALIZED,
                        grad_mode=torch.is_grad_enabled())
        flat, spec = tree_flatten(out)
        placed = []
        try:
            for j, o in enumerate(flat):
                if isinstance(o, torch.Tensor) and o.device == self.device and o.numel() > 0:
                    flat[j] = self._place_output(o, recipe, j, inputs, evictable, str(func), placed)
        except BaseException:
            for s in placed:
                self.memory.unpin(s)
                self._forget(s)
            raise
        for s in placed:
            self.memory.unpin(s)
        self._note_external_reads(rargs, rkwargs, placed)
        return tree_unflatten(flat, spec)

    def _place_output(self, o, recipe, index, inputs, evictable, op, placed):
        stride = tuple(o.stride())
        if not _dense(o):
            stride = _contiguous_strides(o.size())
        nbytes = _span_bytes(o.size(), stride, 0, o.element_size())
        s = self.memory.allocate(nbytes, recipe.cost, evictable=evictable, inputs=inputs, pinned=True, op=op)
        placed.append(s)
        cell = Cell(s)
        s.payload = Data(self, cell, recipe if evictable else None, index)
        if not evictable:
            self._count_unevictable(s, +1)
        dst = self.arena.view(s.offset, o.dtype, o.size(), stride, 0)
        if self.device.type != "meta":
            dst.copy_(o)
        return self._wrap(s, o.dtype, o.size(), stride, 0)

    # ---------------------------------------------------------------------------------------------- views
    def _run_view(self, func, pargs, pkwargs, inputs):
        out = func(*pargs, **pkwargs)
        flat, spec = tree_flatten(out)
        for j, o in enumerate(flat):
            if isinstance(o, torch.Tensor) and self.arena.owns(o):
                flat[j] = self._wrap_alias(o, inputs, func)
        return tree_unflatten(flat, spec)

    def _wrap_alias(self, o, inputs, func):
        byte = o.storage_offset() * o.element_size()
        for s in inputs:
            if s.offset <= byte < s.offset + max(s.nbytes, 1) or (o.numel() == 0 and s.offset <= byte <= s.offset + s.nbytes):
                rel = byte - s.offset
                _internal_assert(rel % o.element_size() == 0, f"{func}: view offset {rel} not a multiple of its item size")
                return self._wrap(s, o.dtype, o.size(), o.stride(), rel // o.element_size())
        raise UnsupportedOp(func, "it returned a view of arena memory that belongs to none of its inputs")

    # ---------------------------------------------------------------------------------------------- writes
    def _run_write(self, func, args, kwargs, pargs, pkwargs, rargs, rkwargs, written, inputs):
        targets = []  # arena storages written
        for key, value in written:
            values = value if isinstance(value, (list, tuple)) else [value]
            for v in values:
                if v is None:
                    continue
                if self.arena.owns(v):
                    s = self._owner_of(v, inputs, func)
                    if not any(s is t for t in targets):
                        targets.append(s)
                else:  # See Rule 5: a write outside the arena is an effect; what read the old value is frozen
                    self._freeze_readers_of_external(v)
        if not self.recomputable_inplace and targets:
            return self._run_write_cow(func, args, kwargs, rargs, rkwargs, targets, inputs)
        for s in targets:  # See Rule 6
            self._freeze_readers(s)
        rng = self._capture_rng(func, pkwargs)
        out = func(*pargs, **pkwargs)
        cost = op_cost(func, pargs, pkwargs, out)
        self._account(cost)
        recipe = Recipe(func, rargs, rkwargs, rng, cost, grad_mode=torch.is_grad_enabled())
        for s in targets:
            if len(targets) == 1 and s.payload.recipe is not None:
                s.payload.mutations.append(recipe)
                for b in inputs:
                    if b is not s:
                        add_consumer(b, s)
            else:  # a write to several storages at once cannot be replayed into one: keep them
                self._make_unevictable(s)
        self._note_external_reads(rargs, rkwargs, targets)
        return self._results_of_write(func, out, args, kwargs, inputs)

    def _results_of_write(self, func, out, args, kwargs, inputs):
        """An output aliasing a written argument is that argument's original object (autograd expects `self`)."""
        written = {}
        for key, v in _written_args(func, args, kwargs):
            a = func._schema.arguments[key] if isinstance(key, int) else next(
                x for x in func._schema.arguments if x.name == key)
            for name in a.alias_info.before_set:
                written[name] = v
        returns = func._schema.returns
        if not returns:
            return out
        outs = out if len(returns) > 1 else (out,)
        res = []
        for r, o in zip(returns, outs):
            alias = r.alias_info
            if alias is not None and alias.is_write and any(n in written for n in alias.before_set):
                res.append(written[next(n for n in alias.before_set if n in written)])
            elif isinstance(o, torch.Tensor) and self.arena.owns(o):
                res.append(self._wrap_alias(o, inputs, func))
            elif isinstance(o, torch.Tensor) and o.device == self.device and o.numel() > 0:
                raise UnsupportedOp(func, "it writes its arguments and also returns a fresh tensor")
            else:
                res.append(o)
        return tuple(res) if len(returns) > 1 else res[0]

    def _run_write_cow(self, func, args, kwargs, rargs, rkwargs, targets, inputs):
        """Copy-on-write (the ablation of Rule 6): the written storage is copied to a fresh one, the write goes
        there, and every wrapper of the old storage moves to the new one; the old value keeps its recipe."""
        if len(targets) > 1:
            raise UnsupportedOp(func, "copy-on-write of a write to several storages")
        old = targets[0]
        new = self._clone_storage(old, inputs, func)
        # rebuild the plain arguments against the new storage
        flat, spec = tree_flatten((args, kwargs))
        plain = []
        for x in flat:
            if isinstance(x, Tensor) and x._cell.storage.payload.runtime is self:
                s = x._cell.storage
                plain.append(self.arena.view(s.offset, x.dtype, x.size(), x.stride(), x.storage_offset()))
            elif isinstance(x, Tensor):
                plain.append(x.as_plain())
            else:
                plain.append(x)
        pargs, pkwargs = tree_unflatten(plain, spec)
        rflat, rspec = tree_flatten((rargs, rkwargs))
        rflat = [ArgRef(new, 0, a.dtype, a.size, a.stride, a.offset) if isinstance(a, ArgRef) and a.storage is old
                 else a for a in rflat]
        rargs, rkwargs = tree_unflatten(rflat, rspec)
        rng = self._capture_rng(func, pkwargs)
        self.memory.pin(new)
        try:
            out = func(*pargs, **pkwargs)
        finally:
            self.memory.unpin(new)
        cost = op_cost(func, pargs, pkwargs, out)
        self._account(cost)
        new.payload.mutations.append(Recipe(func, rargs, rkwargs, rng, cost, grad_mode=torch.is_grad_enabled()))
        for b in inputs:
            if b is not old:
                add_consumer(b, new)
        self._note_external_reads(rargs, rkwargs, [new])
        return self._results_of_write(func, out, args, kwargs, [new])

    def _clone_storage(self, old: Storage, inputs, func) -> Storage:
        cost = float(old.nbytes) * 2
        new = self.memory.allocate(old.nbytes, cost, inputs=(old,), pinned=True, op=str(func))
        try:
            self.arena.bytes(new.offset, old.nbytes).copy_(self.arena.bytes(old.offset, old.nbytes))
        finally:
            self.memory.unpin(new)
        self._account(cost)
        ref = ArgRef(old, old.payload.version, torch.uint8, (old.nbytes,), (1,), 0)
        recipe = Recipe(aten.clone.default, (ref,), {}, None, cost)
        cell = old.payload.cell
        new.payload = Data(self, cell, recipe, 0, wrappers=old.payload.wrappers)
        cell.storage = new
        old.payload.cell = Cell(old)
        old.payload.wrappers = 0
        if old.sid in self.live:
            del self.live[old.sid]
            self.live[new.sid] = new
        self._dead.append(old)
        return new

    # ======================================================================================= rematerializing
    def _make_resident(self, s: Storage) -> None:
        if s.state is State.EVICTED:
            self.restore(s)
        _internal_assert(s.state is State.RESIDENT, f"storage {s.sid} is {s.state.value} after restoring it")

    def restore(self, s: Storage) -> None:
        """Rebuild an evicted storage in the arena from its recipe. See Rule 3.

        Every input of the producer and of the writes since is made resident and pinned first, in program
        order (earliest storage first): an early input is often an ancestor of a later one, so the later one's
        restore finds it resident, and `s` itself is not held while its ancestors are rebuilt, which keeps
        the pinned set of a deep chain small (a residual chain would otherwise pin one block per level).
        """
        d = s.payload
        if d.lost is not None:
            raise TensorLost(d.lost)
        _internal_assert(d.recipe is not None, f"storage {s.sid} was evicted but has no recipe")
        recipes = ([] if d.recipe.uninitialized else [d.recipe]) + d.mutations
        needed: dict[int, Storage] = {}
        for r in recipes:
            for a in tree_flatten((r.args, r.kwargs))[0]:
                if isinstance(a, ArgRef) and a.storage is not s:
                    needed[a.storage.sid] = a.storage
        pins: list[Storage] = []
        try:
            for sid in sorted(needed):
                b = needed[sid]
                if b.state is State.EVICTED:
                    self.restore(b)
                    self._restored.append(b)
                self.memory.pin(b)
                pins.append(b)
            self.memory.restore(s, pinned=True, op=str(d.recipe.func))
            pins.append(s)
            if not d.recipe.uninitialized:
                pargs, pkwargs = self._views(d.recipe, None, 0)
                with _replaying(d.recipe):
                    out = d.recipe.func(*pargs, **pkwargs)
                self._copy_into(s, tree_flatten(out)[0][d.index])
            self.counters.recompute_cost += d.recipe.cost
            for k, m in enumerate(d.mutations):
                margs, mkwargs = self._views(m, s, k)
                with _replaying(m):
                    m.func(*margs, **mkwargs)
                self.counters.recompute_cost += m.cost
            self.counters.rematerializations += 1
        finally:
            for p in pins:
                self.memory.unpin(p)

    def _views(self, recipe: Recipe, self_storage, version):
        """The recipe's arguments with arena views in place of ArgRefs (all resident by now)."""
        flat, spec = tree_flatten((recipe.args, recipe.kwargs))
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
        return tree_unflatten(flat, spec)

    def _copy_into(self, s: Storage, o: torch.Tensor) -> None:
        if self.device.type == "meta":
            return
        stride = tuple(o.stride()) if _dense(o) else _contiguous_strides(o.size())
        self.arena.view(s.offset, o.dtype, o.size(), stride, 0).copy_(o)

    # ======================================================================================= freezing
    def _freeze_readers(self, s: Storage) -> None:
        """Before a write to `s`: storages whose recipes read its current value stop depending on it."""
        for ref in list(s.consumers):
            d = ref()
            if d is not None and d is not s:
                self._freeze(d)
        s.consumers[:] = [r for r in s.consumers if r() is s]

    def _freeze_readers_of_external(self, t: torch.Tensor) -> None:
        for ref in self._ext_readers.pop(t.untyped_storage()._cdata, ()):
            d = ref()
            if d is not None:
                self._freeze(d)

    def _freeze(self, d: Storage) -> None:
        if d.state is State.FREED or d.payload.recipe is None:
            return
        if d.state is State.EVICTED:
            self.restore(d)
        self._make_unevictable(d)
        self.counters.frozen += 1

    def _make_unevictable(self, s: Storage) -> None:
        s.payload.recipe = None
        s.payload.mutations = []
        if s.evictable:
            self.memory.make_unevictable(s)
            self._count_unevictable(s, +1)

    def _count_unevictable(self, s: Storage, sign: int) -> None:
        c = self.counters
        c.unevictable_bytes += sign * self.memory.table.round_up(s.nbytes)
        c.unevictable_peak = max(c.unevictable_peak, c.unevictable_bytes)

    def _note_external_reads(self, rargs, rkwargs, storages) -> None:
        if not storages:
            return
        for a in tree_flatten((rargs, rkwargs))[0]:
            if isinstance(a, torch.Tensor):
                lst = self._ext_readers.setdefault(a.untyped_storage()._cdata, [])
                lst.extend(weakref.ref(s) for s in storages)

    # ========================================================================================== lifetime
    def _wrap(self, s: Storage, dtype, size, stride, offset: int) -> Tensor:
        t = Tensor(s.payload.cell, size, stride, offset, dtype, self.device)
        s.payload.wrappers += 1
        self.live[s.sid] = s
        weakref.finalize(t, _wrapper_died, s.payload.cell)
        return t

    def _drain_dead(self) -> None:
        if not self._dead:
            return
        dead, self._dead = self._dead, []
        for s in dead:
            if s.payload.wrappers > 0 or s.state is State.FREED:
                continue
            if s.pins:
                self._dead.append(s)
                continue
            self.live.pop(s.sid, None)
            needed = any(r() is not None and r().state is not State.FREED for r in s.consumers)
            if needed and s.payload.recipe is not None:
                if s.state is State.RESIDENT:  # dead but a recipe may read it: evict, keep the recipe
                    self.memory.evict(s)
            elif not needed:
                self._forget(s)

    def _forget(self, s: Storage) -> None:
        if s.state is State.RESIDENT and not s.evictable:
            self._count_unevictable(s, -1)
        if s.state is not State.FREED:
            self.memory.free(s)

    def _owner_of(self, t: torch.Tensor, inputs, func) -> Storage:
        byte = t.storage_offset() * t.element_size()
        for s in inputs:
            if s.offset <= byte < s.offset + max(s.nbytes, 1):
                return s
        raise UnsupportedOp(func, "it writes arena memory that belongs to none of its inputs")

    def _direct_tensor_args(self, func, pargs, pkwargs):
        for i, a in enumerate(func._schema.arguments):
            v = pargs[i] if i < len(pargs) else pkwargs.get(a.name)
            if isinstance(v, torch.Tensor):
                yield i, v

    def _capture_rng(self, func, pkwargs):
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return None
        gen = _generator_for(self.device, pkwargs)
        return None if gen is None else (gen, gen.get_state())

    def _account(self, cost: float) -> None:
        self.counters.ops += 1
        self.counters.compute_cost += cost
        self.memory.advance(cost)

    # ========================================================================================== exit
    def finish(self) -> None:
        """End of the block: every storage a live wrapper uses gets a plain copy outside the arena; then the
        arena is emptied."""
        with _plain_dispatch():
            self._finish()

    def _finish(self) -> None:
        self._drain_dead()
        # resident ones first, while nothing else needs room; then the evicted ones in program order, so what
        # an earlier one restores can serve the later ones (the policy evicts copied ones when room is needed)
        live = sorted(self.live.values(), key=lambda s: (s.state is not State.RESIDENT, s.sid))
        for s in live:
            d = s.payload
            try:
                if s.state is State.EVICTED:
                    self.restore(s)
                d.detached = self.arena.bytes(s.offset, s.nbytes).clone()
            except (OutOfBudget, TensorLost) as e:
                d.lost = f"storage {s.sid} was evicted when its Budget ended and could not be restored: {e}"
        for s in live:
            s.payload.runtime = None
            s.payload.recipe = None
            s.payload.mutations = []
        for h in self._hooks:
            h.remove()
        for ref in self._externals.values():
            t = ref()
            if t is not None and isinstance(t.grad, Tensor):
                g = t.grad
                with torch.no_grad():
                    t.grad = g.as_plain()
        self.live.clear()
        self._externals.clear()
        self._ext_readers.clear()


def _grad_leaves_arena(leaf: torch.Tensor) -> None:
    """A leaf's gradient is final once autograd has accumulated it: it moves out of the arena at once, like the
    parameter it belongs to (model-sized state, not counted), and is never evicted or recomputed."""
    g = leaf.grad
    if isinstance(g, Tensor) and g._cell.storage.payload.runtime is not None:
        with _plain_dispatch():
            leaf.grad = g.as_plain().clone()


def _wrapper_died(cell: Cell) -> None:
    s = cell.storage
    d = s.payload
    d.wrappers -= 1
    if d.wrappers == 0 and d.runtime is not None:
        d.runtime._dead.append(s)


def raise_recursion_limit(n: int = 20_000) -> None:
    """Deep recompute chains recurse once per evicted ancestor."""
    if sys.getrecursionlimit() < n:
        sys.setrecursionlimit(n)
