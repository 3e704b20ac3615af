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
   already placed for it are freed, so the Budget stays usable. A replay that would start with recomputation
   already past `max_overhead` times the cost of the ops run so far raises Thrashing at the same point.
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

import numpy as np
import torch

from . import ops
from .arena import Arena
from .cost import op_cost
from .errors import BudgetUsageError, OutOfBudget, TensorLost, Thrashing, UnsupportedOp, _internal_assert
from .memory import Memory
from .storage import State, Storage, add_consumer
from .tensor import Cell, Tensor

aten = torch.ops.aten

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
    cell_ref: weakref.ref       # the Cell its wrappers share (weak: Storage -> Data -> Cell -> Storage is no cycle)
    recipe: Recipe | None       # the producer; None: not recomputable (the storage is unevictable)
    index: int                  # which output of the producer
    mutations: list = field(default_factory=list)  # in-place writes since, in order (Rule 6)
    wrappers: int = 0           # live coop_arena.Tensor objects on this storage
    detached: torch.Tensor | None = None  # after the block: a plain copy of the bytes
    lost: str | None = None

    @property
    def version(self) -> int:
        return len(self.mutations)

    def cell(self, storage: Storage) -> Cell:
        c = self.cell_ref()
        if c is None:
            c = Cell(storage)
            self.cell_ref = weakref.ref(c)
        return c

    def plain_view(self, t: Tensor) -> torch.Tensor:
        with _plain_dispatch():
            if self.detached is not None:
                return self.detached.view(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset())
            if self.lost is not None:
                raise TensorLost(self.lost)
            rt = self.runtime
            _internal_assert(rt is not None, "a storage with neither an arena nor a copy")
            s = t._cell.storage
            if s.state is not State.RESIDENT:
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
    working_set_peak: int = 0       # largest bytes one op held at once: its inputs and its outputs
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
    with torch.set_grad_enabled(recipe.grad_mode), torch._C._AutoDispatchBelowADInplaceOrView(), _rng(recipe.rng):
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


class _Call:
    """One op call in progress: its arguments as given, as plain tensors, and as recorded for a recipe."""

    __slots__ = ("func", "op", "args", "kwargs", "leaves", "spec", "inputs", "plain", "recorded", "pargs", "pkwargs")

    def __init__(self, func, op, args, kwargs, leaves, spec):
        self.func, self.op, self.args, self.kwargs, self.leaves, self.spec = func, op, args, kwargs, leaves, spec
        self.inputs: list[Storage] = []


class Runtime:
    def __init__(self, memory: Memory, arena: Arena, *, recomputable_inplace: bool = True,
                 max_overhead: float | None = None):
        self.memory = memory
        self.max_overhead = max_overhead
        memory.mover = self._copy_bytes
        memory.may_relocate = True
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
        op = ops.info(func)
        if op.inplace_view:
            return self._run_inplace_view(func, args, kwargs)
        leaves, spec = ops.flatten(args, kwargs)
        call = _Call(func, op, args, kwargs, leaves, spec)
        pins = []
        try:
            owner = {}  # leaf index -> the storage it reads (a wrapper, or a raw view from as_plain/pinned)
            for i, x in enumerate(leaves):
                if isinstance(x, Tensor):
                    if x._cell.storage.payload.runtime is self:
                        owner[i] = x._cell.storage
                elif isinstance(x, torch.Tensor) and self.arena.owns(x):
                    owner[i] = self._storage_at(x, func)
            mine = {s.sid: s for s in owner.values()}
            call.inputs = [mine[sid] for sid in sorted(mine)]  # program order, as in restore()
            pins = self._resident_and_pinned(call.inputs)
            for s in call.inputs:
                self.memory.touch(s)
            self.memory.may_relocate = False  # raw views of the inputs are live until the op has run
            plain, recorded = list(leaves), list(leaves)
            for i, x in enumerate(leaves):
                if i in owner:
                    s = owner[i]
                    offset = x.storage_offset()
                    if not isinstance(x, Tensor):  # a raw view: its offset counts from the arena's start
                        offset -= s.offset // x.element_size()
                    size, stride = tuple(x.size()), tuple(x.stride())
                    plain[i] = self.arena.view(s.offset, x.dtype, size, stride, offset)
                    recorded[i] = ArgRef(s, s.payload.version, x.dtype, size, stride, offset)
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
            call.plain, call.recorded = plain, recorded
            call.pargs, call.pkwargs = ops.unflatten(plain, spec)
            if op.written:
                return self._run_write(call)
            if op.returns_alias:
                return self._run_view(call)
            return self._run_functional(call)
        finally:
            self.memory.may_relocate = True
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

    def _execute(self, call: "_Call"):
        """Run the op on plain tensors; returns (outputs, output leaves, recipe)."""
        rng = self._capture_rng(call)
        out = call.func(*call.pargs, **call.pkwargs)
        out_leaves = list(out) if isinstance(out, (tuple, list)) else [out]
        cost = op_cost(call.op.flops, call.pargs, call.pkwargs, call.plain, out_leaves, out)
        self._account(cost)
        rargs, rkwargs = ops.unflatten(call.recorded, call.spec)
        recipe = Recipe(call.func, rargs, rkwargs, rng, cost, uninitialized=call.op.uninitialized,
                        grad_mode=torch.is_grad_enabled())
        return out, out_leaves, recipe

    # ---------------------------------------------------------------------------------------- functional
    def _run_functional(self, call: "_Call"):
        func, op = call.func, call.op
        externals = [(pos, t) for pos, name, _ in op.tensor_args
                     if isinstance(t := ops.arg(call.pargs, call.pkwargs, pos, name, False), torch.Tensor)
                     and not self.arena.owns(t)]
        key, probe, written = None, None, ()
        if externals and self.device.type != "meta":
            key = (func, repr([a for a in call.plain if not isinstance(a, torch.Tensor)]))
            written = _UNMARKED_WRITES.get(key)
            if written is None:  # first call of this op and configuration: look for writes the schema hides
                probe = [(pos, t, t._version, t.clone()) for pos, t in externals]
        out, out_leaves, recipe = self._execute(call)
        self.memory.may_relocate = True  # the op has run: its inputs' views are dead, they may move
        if probe is not None:
            written = _UNMARKED_WRITES[key] = frozenset(
                pos for pos, t, v, before in probe if t._version != v or not torch.equal(t, before))
        evictable = not op.effectful
        for pos, t in externals:  # See Rule 5: writes into external tensors the schema does not mark
            if pos in written:
                self._freeze_readers_of_external(t)
                optional = any(p == pos and opt for p, _, opt in op.tensor_args)
                if optional and pos < len(recipe.args):
                    recipe.args = tuple(None if j == pos else a for j, a in enumerate(recipe.args))
                else:
                    evictable = False
        placed = []
        try:
            for j, o in enumerate(out_leaves):
                if isinstance(o, torch.Tensor) and o.device == self.device and o.numel() > 0:
                    out_leaves[j] = self._place_output(o, recipe, j, call.inputs, evictable, func, placed)
        except BaseException:
            for s in placed:
                self.memory.unpin(s)
                self._forget(s)
            raise
        for s in placed:
            self.memory.unpin(s)
        table = self.memory.table
        ws = sum(table.round_up(s.nbytes) for s in call.inputs) + sum(table.round_up(s.nbytes) for s in placed)
        self.counters.working_set_peak = max(self.counters.working_set_peak, ws)
        self._note_external_reads(call.recorded, placed)
        return tuple(out_leaves) if isinstance(out, tuple) else (out_leaves if isinstance(out, list) else out_leaves[0])

    def _place_output(self, o, recipe, index, inputs, evictable, func, placed):
        size, stride = tuple(o.size()), tuple(o.stride())
        if not ops.dense(size, stride):
            stride = _contiguous_strides(size)
        nbytes = _span_bytes(size, stride, 0, o.element_size())
        s = self.memory.allocate(nbytes, recipe.cost, evictable=evictable, inputs=inputs, pinned=True, op=str(func))
        placed.append(s)
        s.payload = Data(self, _dead_ref, recipe if evictable else None, index)
        if not evictable:
            self._count_unevictable(s, +1)
        if self.device.type != "meta":
            self.arena.view(s.offset, o.dtype, size, stride, 0).copy_(o)
        return self._wrap(s, o.dtype, size, stride, 0)

    # ---------------------------------------------------------------------------------------------- views
    def _run_view(self, call: "_Call"):
        if call.func is aten.as_strided.default and isinstance(call.args[0], Tensor):
            # its storage offset counts from the start of the tensor's storage; the plain view's storage is the
            # whole arena, so the offset moves by where the storage lies in it
            t, plain = call.args[0], call.pargs[0]
            rest = list(call.pargs[1:])
            given = rest[2] if len(rest) > 2 else call.pkwargs.get("storage_offset")
            shift = plain.storage_offset() - t.storage_offset()
            offset = (t.storage_offset() if given is None else given) + shift
            out = aten.as_strided.default(plain, rest[0], rest[1], offset)
            return self._wrap_alias(out, call.inputs, call.func)
        out = call.func(*call.pargs, **call.pkwargs)
        if isinstance(out, torch.Tensor):
            return self._wrap_alias(out, call.inputs, call.func) if self.arena.owns(out) else out
        return type(out)(self._wrap_alias(o, call.inputs, call.func)
                         if isinstance(o, torch.Tensor) and self.arena.owns(o) else o for o in out)

    def _wrap_alias(self, o, inputs, func):
        s = self._input_holding(o, inputs, func, "returned a view of")
        rel = o.storage_offset() * o.element_size() - s.offset
        _internal_assert(rel % o.element_size() == 0, f"{func}: view offset {rel} not a multiple of its item size")
        return self._wrap(s, o.dtype, o.size(), o.stride(), rel // o.element_size())

    def _run_inplace_view(self, func, args, kwargs):
        """An op that changes a tensor's shape in place (unsqueeze_, as_strided_): the new metadata is computed
        on a meta view of the same storage (which checks it stays inside), then set on the wrapper itself.
        No bytes move and nothing is recorded: later ops read the wrapper's metadata when they run."""
        t = args[0] if args else None
        if not isinstance(t, Tensor):  # a tensor from before the Budget: its metadata is its owner's business
            if isinstance(t, torch.Tensor) and self.arena.owns(t):
                raise UnsupportedOp(func, "it changes in place the shape of a raw view of the arena")
            with _plain_dispatch():
                return func(*args, **kwargs)
        if t._cell.storage.payload.runtime is not self:
            raise UnsupportedOp(func, "it changes in place the shape of a tensor from another Budget block")
        s = t._cell.storage
        try:
            with _plain_dispatch():
                base = torch.empty(s.nbytes // t.element_size(), dtype=t.dtype, device="meta")
                v = base.as_strided(t.size(), t.stride(), t.storage_offset())
                func(v, *args[1:], **kwargs)
        except RuntimeError as e:
            raise UnsupportedOp(func, f"the new shape does not fit the tensor's storage: {e}") from e
        with torch._C._DisableTorchDispatch():
            torch.Tensor.as_strided_(t, v.size(), v.stride(), v.storage_offset())
        return t

    # ---------------------------------------------------------------------------------------------- writes
    def _written(self, call: "_Call", args, kwargs):
        """(alias sets, value) of each argument the schema marks written, from `args`/`kwargs`."""
        return [(sets, ops.arg(args, kwargs, pos, name, kw_only)) for pos, name, kw_only, sets in call.op.written]

    def _run_write(self, call: "_Call"):
        func = call.func
        targets = []  # arena storages written
        for _, value in self._written(call, call.pargs, call.pkwargs):
            for v in (value if isinstance(value, (list, tuple)) else [value]):
                if v is None:
                    continue
                if self.arena.owns(v):
                    s = self._input_holding(v, call.inputs, func, "writes")
                    if not any(s is t for t in targets):
                        targets.append(s)
                else:  # See Rule 5: a write outside the arena is an effect; what read the old value is frozen
                    self._freeze_readers_of_external(v)
        if not self.recomputable_inplace and targets:
            return self._run_write_cow(call, targets)
        for s in targets:  # See Rule 6
            self._freeze_readers(s)
        out, _, recipe = self._execute(call)
        for s in targets:
            if len(targets) == 1 and s.payload.recipe is not None:
                s.payload.mutations.append(recipe)
                for b in call.inputs:
                    if b is not s:
                        add_consumer(b, s)
            else:  # a write to several storages at once cannot be replayed into one: keep them
                self._make_unevictable(s)
        self._note_external_reads(call.recorded, targets)
        return self._results_of_write(call, out, call.inputs)

    def _results_of_write(self, call: "_Call", out, inputs):
        """An output aliasing a written argument is that argument's original object (autograd expects `self`)."""
        written = {}
        for sets, v in self._written(call, call.args, call.kwargs):
            for name in sets:
                written[name] = v
        returns = call.func._schema.returns
        if not returns:
            return out
        outs = out if len(returns) > 1 else (out,)
        res = []
        for r, o in zip(returns, outs):
            alias = r.alias_info
            if alias is not None and alias.is_write and any(n in written for n in alias.before_set):
                res.append(written[next(n for n in alias.before_set if n in written)])
            elif isinstance(o, torch.Tensor) and self.arena.owns(o):
                res.append(self._wrap_alias(o, inputs, call.func))
            elif isinstance(o, torch.Tensor) and o.device == self.device and o.numel() > 0:
                raise UnsupportedOp(call.func, "it writes its arguments and also returns a fresh tensor")
            else:
                res.append(o)
        return tuple(res) if len(returns) > 1 else res[0]

    def _run_write_cow(self, call: "_Call", targets):
        """Copy-on-write (the ablation of Rule 6): the written storage is copied to a fresh one, the write goes
        there, and every wrapper of the old storage moves to the new one; the old value keeps its recipe."""
        if len(targets) > 1:
            raise UnsupportedOp(call.func, "copy-on-write of a write to several storages")
        old = targets[0]
        new = self._clone_storage(old, call.inputs, call.func)
        for i, a in enumerate(call.recorded):  # the op now reads and writes the copy
            if isinstance(a, ArgRef) and a.storage is old:
                call.recorded[i] = ArgRef(new, 0, a.dtype, a.size, a.stride, a.offset)
                call.plain[i] = self.arena.view(new.offset, a.dtype, a.size, a.stride, a.offset)
        call.pargs, call.pkwargs = ops.unflatten(call.plain, call.spec)
        self.memory.pin(new)
        try:
            out, _, recipe = self._execute(call)
        finally:
            self.memory.unpin(new)
        new.payload.mutations.append(recipe)
        for b in call.inputs:
            if b is not old:
                add_consumer(b, new)
        self._note_external_reads(call.recorded, [new])
        return self._results_of_write(call, out, [new])

    def _clone_storage(self, old: Storage, inputs, func) -> Storage:
        cost = float(old.nbytes) * 2
        new = self.memory.allocate(old.nbytes, cost, inputs=(old,), pinned=True, op=str(func))
        try:
            self._copy_bytes(old.offset, new.offset, old.nbytes)
        finally:
            self.memory.unpin(new)
        self._account(cost)
        ref = ArgRef(old, old.payload.version, torch.uint8, (old.nbytes,), (1,), 0)
        recipe = Recipe(aten.clone.default, (ref,), {}, None, cost)
        cell = old.payload.cell(old)
        new.payload = Data(self, weakref.ref(cell), recipe, 0, wrappers=old.payload.wrappers)
        cell.storage = new
        old.payload.cell_ref = _dead_ref
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
        restore finds it resident, and `s` itself is not held while its ancestors are rebuilt (a residual
        chain would otherwise pin one half-built block per level).
        """
        d = s.payload
        if d.lost is not None:
            raise TensorLost(d.lost)
        _internal_assert(d.recipe is not None, f"storage {s.sid} was evicted but has no recipe")
        recipes = ([] if d.recipe.uninitialized else [d.recipe]) + d.mutations
        needed: dict[int, Storage] = {}
        for r in recipes:
            for a in ops.flatten(r.args, r.kwargs)[0]:
                if isinstance(a, ArgRef) and a.storage is not s:
                    needed[a.storage.sid] = a.storage
        pins = self._resident_and_pinned([needed[sid] for sid in sorted(needed)])
        try:
            c = self.counters
            if self.max_overhead is not None and c.recompute_cost > (self.max_overhead - 1.0) * c.compute_cost:
                raise Thrashing(c.recompute_cost, c.compute_cost, self.max_overhead, str(d.recipe.func))
            self.memory.restore(s, pinned=True, op=str(d.recipe.func))
            pins.append(s)
            if not d.recipe.uninitialized:
                pargs, pkwargs = self._views(d.recipe, None, 0)
                with _replaying(d.recipe):
                    out = d.recipe.func(*pargs, **pkwargs)
                self._copy_into(s, out[d.index] if isinstance(out, (tuple, list)) else out)
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

    def _resident_and_pinned(self, storages: list) -> list:
        """Make all `storages` resident at the same time and pin them (Rule 3).

        They are first restored without pins, so a deep chain behind one input does not keep the others
        pinned while it is rebuilt (pins would pile up one per level). A second pass pins each, restoring
        again what a later restore evicted (rare: a just-restored storage has staleness 1, the most expensive
        to evict). One unpinned pass only: more would multiply work at every level of a deep chain.
        """
        for b in storages:
            if b.state is State.EVICTED:
                self.restore(b)
                self._restored.append(b)
        pins = []
        try:
            for b in storages:
                if b.state is State.EVICTED:
                    self.restore(b)
                    self._restored.append(b)
                self.memory.pin(b)
                pins.append(b)
        except BaseException:
            for b in pins:
                self.memory.unpin(b)
            raise
        return pins

    def _views(self, recipe: Recipe, self_storage, version):
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

    def _copy_bytes(self, src: int, dst: int, nbytes: int) -> None:
        """Copy a storage's bytes between two arena ranges that do not overlap (copy-on-write, Note
        [Relocation] in memory.py)."""
        self.arena.move(src, dst, nbytes)

    def _copy_into(self, s: Storage, o: torch.Tensor) -> None:
        if self.device.type == "meta":
            return
        size, stride = tuple(o.size()), tuple(o.stride())
        if not ops.dense(size, stride):
            stride = _contiguous_strides(size)
        self.arena.view(s.offset, o.dtype, size, stride, 0).copy_(o)

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

    def _note_external_reads(self, recorded: list, storages) -> None:
        if not storages:
            return
        for a in recorded:
            if isinstance(a, torch.Tensor):
                lst = self._ext_readers.setdefault(a.untyped_storage()._cdata, [])
                lst.extend(weakref.ref(s) for s in storages)

    # ========================================================================================== lifetime
    def _wrap(self, s: Storage, dtype, size, stride, offset: int) -> Tensor:
        cell = s.payload.cell(s)
        t = Tensor(cell, size, stride, offset, dtype, self.device)
        s.payload.wrappers += 1
        self.live[s.sid] = s
        weakref.finalize(t, _wrapper_died, cell)
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

    def _storage_at(self, t: torch.Tensor, func) -> Storage:
        """The resident storage holding a raw arena view's first byte."""
        byte = t.storage_offset() * t.element_size()
        table = self.memory.table
        i = int(np.searchsorted(table.offsets, byte, side="right")) - 1
        off, size, owner = table.block(i)
        if owner == 0:
            raise UnsupportedOp(func, f"it reads arena bytes at offset {byte} that no live tensor owns (a raw "
                                      f"view used after its tensor was evicted or freed)")
        return self.memory._slots[owner - 1]

    def _input_holding(self, t: torch.Tensor, inputs, func, what: str) -> Storage:
        """The input storage a plain arena tensor `t` (an op's view or written argument) lies in; an empty
        view may start right at its storage's end."""
        byte = t.storage_offset() * t.element_size()
        for s in inputs:
            if s.offset <= byte < s.offset + max(s.nbytes, 1) or (t.numel() == 0 and s.offset <= byte <= s.offset + s.nbytes):
                return s
        raise UnsupportedOp(func, f"it {what} arena memory that belongs to none of its inputs")

    def _capture_rng(self, call: _Call):
        if not call.op.random:
            return None
        gen = _generator_for(self.device, call.pkwargs)
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
            except (OutOfBudget, Thrashing, TensorLost) as e:
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


def _dead_ref():
    return None


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
