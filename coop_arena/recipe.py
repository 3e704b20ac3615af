"""Recipes: how the op that produced or wrote a storage is recorded, and how it is replayed bit for bit.

Also the runtime's part of each storage record (`Data`, in `Storage.payload`): the producer's recipe, the
in-place writes since, and the wrappers that use the storage.

Rules enforced here (see ../shared DESIGN numbering):
4. A random op recomputes the same bits: the generator state before it ran is part of its recipe, and a replay
   runs with that state (and puts the generator back afterwards).
8. A replay runs under the conditions the op first ran under (grad mode, below autograd, no dispatch mode).
"""

from __future__ import annotations

import functools
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from . import ops
from .errors import TensorLost, _internal_assert
from .storage import State, Storage
from .tensor import Cell, with_bits


@dataclass(slots=True, eq=False)
class ArgRef:
    """A recipe argument that lives in the arena: the storage, the version it had, and the view."""

    storage: Storage
    version: int
    dtype: torch.dtype
    size: tuple
    stride: tuple
    offset: int
    conj: bool = False      # the view's conjugate and negative bits (tensor.with_bits)
    neg: bool = False


@dataclass(slots=True, eq=False)
class Recipe:
    func: object
    args: tuple             # with ArgRef leaves for arena tensors, plain tensors for external ones
    kwargs: dict
    rng: object             # (generator, state) captured before a random op ran, else None (Rule 4)
    cost: float
    uninitialized: bool = False
    grad_mode: bool = True  # some kernels return different outputs with grad mode off (mkldnn_rnn_layer's workspace)
    reads: tuple = ()       # the storages its ArgRefs name, in first-seen order (filled by `make`)
    versions: frozenset = frozenset()  # (sid, version) of each storage it reads as it was then (filled by `make`)
    direct: object = None   # placement.OpPlan when its out= variant writes into the arena (Note [Direct placement])

    @staticmethod
    def make(func, args, kwargs, rng, cost, *, uninitialized=False, grad_mode=True, direct=None,
             leaves=None) -> "Recipe":
        """`leaves`: the flat arguments (ops.flatten) when the caller has them."""
        seen: dict[int, Storage] = {}
        versions = set()
        for a in ops.flatten(args, kwargs)[0] if leaves is None else leaves:
            if type(a) is ArgRef:
                seen.setdefault(a.storage.sid, a.storage)
                versions.add((a.storage.sid, a.version))
        return Recipe(func, args, kwargs, rng, cost, uninitialized, grad_mode, tuple(seen.values()),
                      frozenset(versions), direct)

    def without_arg(self, pos: int) -> None:
        """Record the positional argument `pos` as None (an external tensor the op wrote, Rule 5)."""
        self.args = tuple(None if j == pos else a for j, a in enumerate(self.args))


@dataclass(slots=True, eq=False)
class Data:
    """The runtime's part of a storage record (`Storage.payload`)."""

    runtime: object             # the Runtime that owns the bytes; None once the block has ended; Lifetime
    cell_ref: weakref.ref       # the Cell its wrappers share (weak: Storage -> Data -> Cell -> Storage is no cycle)
    recipe: Recipe | None       # the producer; None: not recomputable (the storage is unevictable); Dispatch, Remat
    index: int                  # which output of the producer
    mutations: list = field(default_factory=list)  # in-place writes since, in order (Rule 6); Dispatch, Remat
    wrappers: int = 0           # live coop_arena.Tensor objects on this storage; Lifetime
    detached: torch.Tensor | None = None  # after the block: a plain copy of the bytes; Lifetime
    lost: str | None = None     # why the bytes are gone (a failed or interrupted block); Lifetime
    base_version: int = 0       # writes dropped with the recipe when it became unevictable; Remat.make_unevictable

    @property
    def version(self) -> int:
        """Writes since the producer: what recipes that read this storage record (ArgRef.version)."""
        return self.base_version + len(self.mutations)

    def drop_recipe(self) -> None:
        """Its storage will never be replayed: the recipe and writes go (it stays resident for good, is lost, is
        freed, or its block has ended)."""
        self.base_version = self.version  # readers recorded the version it has: it stays
        self.recipe = None
        self.mutations = []

    def recipes(self) -> list:
        """What a restore replays, in order: the producer (unless it is uninitialized memory), then the writes."""
        r = self.recipe
        _internal_assert(r is not None, "a storage without a recipe was asked for its replay")
        return ([] if r.uninitialized else [r]) + self.mutations

    def reads(self, s: Storage) -> list:
        """The storages a restore of `s` needs resident, in first-seen order, `s` itself left out."""
        seen: dict[int, Storage] = {}
        for r in ([self.recipe] if self.recipe is not None and not self.recipe.uninitialized else []) + self.mutations:
            for b in r.reads:
                if b is not s:
                    seen.setdefault(b.sid, b)
        return list(seen.values())

    def cell(self, storage: Storage) -> Cell:
        c = self.cell_ref()
        if c is None:
            c = Cell(storage)
            self.cell_ref = weakref.ref(c)
        return c

    def plain_view(self, t, *, copy: bool = False) -> torch.Tensor:
        """A plain tensor over wrapper `t`'s bytes: its own copy after the block, the arena inside it (with
        `copy=True`, inside it: a fresh copy of the whole storage, for paths that hand the bytes out). It has `t`'s
        conjugate and negative bits."""
        rt = self.runtime
        if rt is not None and not copy and self.detached is None and self.lost is None:
            s = t._cell.storage
            if s.state is State.RESIDENT:  # nothing to restore: only the view is made (Note [Plain ops])
                with torch._C._DisableTorchDispatch(), torch._C._AutoDispatchBelowADInplaceOrView():
                    view = rt.arena.view(s.offset, t.dtype, t.size(), t.stride(), t.storage_offset())
                return with_bits(view, t.is_conj(), t.is_neg())
        with plain_dispatch():
            if self.detached is not None:
                view = self.detached.view(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset())
            elif self.lost is not None:
                raise TensorLost(self.lost)
            else:
                rt = self.runtime
                _internal_assert(rt is not None, "a storage with neither an arena nor a copy")
                view = rt.plain_view(t)  # restores the storage if it is evicted
                if copy:
                    s = t._cell.storage
                    own = rt.arena.bytes(s.offset, s.nbytes).clone()
                    view = own.view(t.dtype).as_strided(t.size(), t.stride(), t.storage_offset())
            return with_bits(view, t.is_conj(), t.is_neg())


def dead_ref():
    return None


def generator_for(device: torch.device, op: ops.OpInfo, args, kwargs: dict):
    """The generator a random op draws from: its `generator` argument (a keyword, or positional as in poisson
    and _standard_gamma), else the device's default one."""
    g = None if op.generator is None else ops.arg(args, kwargs, op.generator[0], "generator", op.generator[1])
    if g is not None:
        return g
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return None  # meta: no bits to reproduce


# Note [Swapping a CUDA generator's state]
# Rationale: `set_state` on a CUDA generator (like `manual_seed`) also tells cuDNN to re-seed the dropout state of
#   its RNNs: the next training LSTM/GRU with dropout draws a new seed from the generator (advancing it) and uses
#   other dropout masks. Plain PyTorch never calls it during a step, so a replay that did would change the bits
#   of every cuDNN RNN with dropout after it, and of every random op after that.
# Approach: a CUDA generator's state is an object the generator points to. Capture takes a copy of it
#   (`clone_state`); a replay points the generator at a fresh copy of that (`graphsafe_set_state`) and back at
#   its own, untouched object afterwards, which re-arms nothing. Other generators (the CPU's, which has no such
#   swap) go through get_state / set_state, which has no such side effect there.
def _swaps(gen) -> bool:
    return gen.device.type == "cuda" and hasattr(gen, "graphsafe_set_state")  # (torch >= 2.4 has it)


def capture_rng(device: torch.device, op: ops.OpInfo, args, kwargs: dict):
    """(generator, state) before op `op` runs on `args`, `kwargs` if it is random, or may be (an untagged custom
    op's first call) (Rule 4), else None."""
    if op.random is False:
        return None
    gen = generator_for(device, op, args, kwargs)
    if gen is None:
        return None
    return gen, (gen.clone_state() if _swaps(gen) else gen.get_state())


# Note [Interrupts]
# Rationale: the context managers below change the thread's state (the dispatch mode stack, the dispatch keys
#   autograd uses, grad mode, a generator's state) for the length of a `with`. Made by @contextmanager, each has
#   a moment, after its generator yielded and before the `with` body starts, where an interrupt (Ctrl-C's
#   KeyboardInterrupt, raised between any two bytecodes) leaves its generator suspended: its __exit__ never
#   runs, the Budget's mode stays popped and autograd stays off for the thread, and whenever Python later
#   collects the generator its cleanup puts them back at some unrelated moment (a finished block's mode pushed
#   back onto the stack made every later op of the process fail).
# Approach: `whole` enters such a context manager and, when anything is raised on the way in, closes its
#   generator at once, which runs its cleanup in order; the `with` statement then owns everything that was
#   changed or nothing. Budget.__enter__ and __exit__ undo and close step by step, each step also when the one
#   before was interrupted (budget.py).
#   The way out has the same moment: an interrupt as `whole.__exit__` (or contextlib's) starts, before the
#   generator resumes, leaves it suspended, and its cleanup ran whenever the traceback that reaches it was
#   freed, after the block: it put back grad mode and dispatch keys saved inside a dispatch (autograd off for
#   the thread from then on), and pushed the finished block's mode back onto the stack. So each `whole` is
#   listed for its thread from its entry until its exit has run, and the Budget's exit first closes, newest
#   first, those its block entered and never left (`close_entered`): the mode stack and a replay's generator
#   state come back from them, while grad mode and the dispatch keys stay as the unwinding (the dispatcher's
#   and autograd's own guards) left them.
#   The Budget's exit itself copies out what is still held, which may replay (`replaying`, `_rng`) and runs under
#   `plain_dispatch`: there no dispatcher's guard unwinds, so the exit keeps the dispatch keys and grad mode it
#   started with around that work, and closes after it what the work left open.
_entered = threading.local()  # .open: this thread's `whole`s entered and not left, oldest first


def entered() -> list:
    """This thread's `whole`s entered and not left yet, oldest first (the list itself)."""
    try:
        return _entered.open
    except AttributeError:
        _entered.open = []
        return _entered.open


def close_entered(depth: int) -> None:
    """Close, newest first, the generators of this thread's `whole`s entered above `depth` whose exit never ran
    (an interrupt stopped it before it began): their cleanup runs now (Note [Interrupts])."""
    stack = entered()
    if len(stack) <= depth:
        return
    grad = torch.is_grad_enabled()
    try:
        with torch._C._PreserveDispatchKeyGuard():
            while len(stack) > depth:
                stack.pop().cm.gen.close()  # (a no-op for a generator that already finished)
    finally:
        torch._C._set_grad_enabled(grad)


class whole:
    """`with whole(cm):` enters generator context manager `cm` all or nothing (Note [Interrupts])."""

    __slots__ = ("cm",)

    def __init__(self, cm):
        self.cm = cm

    def __enter__(self):
        stack = entered()
        try:
            out = self.cm.__enter__()
            stack.append(self)
        except BaseException:
            self.cm.gen.close()  # suspended at its yield if the interrupt came after it: its cleanup runs now
            if stack and stack[-1] is self:
                stack.pop()
            raise
        return out

    def __exit__(self, *exc):
        try:
            return self.cm.__exit__(*exc)
        finally:
            stack = _entered.open
            for i in range(len(stack) - 1, -1, -1):  # the newest, unless one entered after it was left open
                if stack[i] is self:
                    del stack[i]
                    break


def whole_contextmanager(genfunc):
    """@contextmanager, entered with `whole`."""
    cm = contextmanager(genfunc)

    @functools.wraps(genfunc)
    def make(*args, **kwargs):
        return whole(cm(*args, **kwargs))
    make.unguarded = cm  # the plain @contextmanager, for tests that interrupt it
    return make


@whole_contextmanager
def plain_dispatch():
    """Run ops as the dispatch handler does (no autograd, no dispatch mode), for work started elsewhere."""
    with whole(torch.utils._python_dispatch._disable_current_modes()), torch._C._AutoDispatchBelowADInplaceOrView():
        yield


# Note [Plain ops]
# plain_dispatch pops every dispatch mode off the stack and puts them back, through two generator context
# managers: about 6 us, paid twice for each leaf gradient that leaves the arena and for each `as_plain()` (an eighth
# of the ops of a small MLP's step, 3 % of its host time). Code that runs ops only on plain tensors, and neither
# enters a mode nor reads the mode stack, gets the same effect from two C++ guards (under 1 us, and no generator
# an interrupt could leave suspended, Note [Interrupts], when written inline in one `with`): with the Python
# dispatch key excluded no mode and no tensor subclass sees the ops, and autograd is skipped as in plain_dispatch.
# A restore runs ops in modes of its own (a decomposed op re-enters the Budget's): it keeps plain_dispatch.


def rewind(saved) -> None:
    """Put a generator back at the state `capture_rng` saved: an op that drew, then failed to place its outputs
    (Rule 7; plain PyTorch allocates before it draws)."""
    if saved is None:
        return
    gen, state = saved
    if isinstance(state, torch.Tensor):
        gen.set_state(state)
    else:  # Note [Swapping a CUDA generator's state]
        gen.graphsafe_set_state(state.clone_state())


@whole_contextmanager
def replaying(recipe: Recipe):
    """The conditions the op first ran under: grad mode and, for a random op, the generator state (Rule 4)."""
    grad = torch.is_grad_enabled()
    try:  # (torch.set_grad_enabled sets the mode when made, before its `with` begins)
        torch._C._set_grad_enabled(recipe.grad_mode)
        with torch._C._AutoDispatchBelowADInplaceOrView(), _rng(recipe.rng):
            yield
    finally:
        torch._C._set_grad_enabled(grad)


@whole_contextmanager
def _rng(saved):
    if saved is None:
        yield
        return
    gen, state = saved
    swaps = not isinstance(state, torch.Tensor)  # a copy of a CUDA generator's state, not get_state()'s bytes: Note
    # [Swapping a CUDA generator's state]
    now = gen.graphsafe_get_state() if swaps else gen.get_state()
    try:
        rewind(saved)
        yield
    finally:
        if swaps:
            gen.graphsafe_set_state(now)
        else:
            gen.set_state(now)
