"""coop_arena.Tensor: the wrapper subclass every tensor produced inside a Budget is.

A wrapper carries only view metadata (its own sizes, strides, storage offset and dtype, in elements counted
from the start of its storage) and a `Cell`, shared by all views of one storage, that names the storage
record holding the bytes. Eviction and restoring happen per storage (Rule 2), so a view never holds bytes.

Outside a Budget (after the block ends) a wrapper reads the plain copy its storage was given on exit; any op
on it then runs on that plain tensor and returns plain tensors.

Note [Views kept]
Rationale: every op reads its inputs' metadata and makes a plain view of each one's bytes in the arena. On a
  wrapper subclass each metadata call costs several times what it costs on a plain tensor (sizes, strides, dtype,
  the conjugate and negative bits: about 3 us per input on the 2-core CPU), and a view costs as much again.
Approach: a wrapper keeps the metadata it was made with (`_meta`) and the plain view it was made from or placed
  into (`_kept`, with the storage offset it was made at, `_kept_at`). An op reads them instead, while the storage
  lies at that offset; a storage restored or moved elsewhere gets a new view at the next op. Whatever changes a
  wrapper's metadata or storage in place (an in-place view op, an out= kernel that resizes its output, `t.data =`,
  the copy-out at the block's end) forgets both. A written argument always gets a fresh view (a kernel such as
  `resize_` may change the view it is given). The views themselves come from `Arena.shared`, one per offset and
  layout: a training step places the same outputs at the same offsets at every step, so later steps make almost
  none.
Limitations: a wrapper holds one plain tensor more while its block runs, and the arena up to SHARED_MAX views.

Note [Escaped tensors]
Rationale: a wrapper that outlives its block (`loss`, logits, a kept activation) is the user's tensor: it must work
  wherever a plain tensor of its dtype, shape, strides and device works, including the paths that do not go
  through aten dispatch (C++ that reads the storage, tolist, numpy, pickling, copying, DLPack).
Approach: at block exit every live wrapper is given its storage's plain copy as its own storage (`adopt`, called by
  Lifetime.finish), so data_ptr, untyped_storage and C++ code that reads the storage (DDP's reducer) see real
  memory. The paths that PyTorch refuses for subclasses are methods below that call the same method on a plain
  tensor over the same bytes, with the same requires_grad (and nn.Parameter-ness), so PyTorch's own checks and
  formats apply. Paths that copy hand out plain tensors: copy.copy, copy.deepcopy, pickle and torch.load give a
  `torch.Tensor` (or an `nn.Parameter`). `detach` keeps the type, as PyTorch asks of a subclass (`nn.Parameter(t)`
  needs it), in a later block too.
  Inside the block the bytes live in the arena, where any op may evict or move them. Paths that only read values
  (tolist, repr, format, pickling, deepcopy, numpy(force=True), __array__, __dlpack__(copy=True)) restore the
  storage and read or copy it at once with dispatch disabled, so nothing runs in between that could evict it;
  copy.copy and detach give another wrapper over the same storage. Paths that hand out raw memory with no end in
  sight (data_ptr, untyped_storage, numpy(), __dlpack__) raise RawMemoryError, which points to
  `coop_arena.pinned(t)`, before anything is restored. `apply_` runs its function over the bytes in C++: inside
  the block on a copy, written back by a recorded copy_. `t.data = new` makes PyTorch copy new's sizes and storage
  into the wrapper's TensorImpl, which holds no bytes: the wrapper takes new's Cell too (inside the block only a
  tensor of the same block has arena bytes to share; after it, a plain `new` gets a Cell over its own storage).
Limitations: `torch.utils.dlpack.to_dlpack(t)` reads the TensorImpl in C++ without asking the wrapper: inside the
  block its capsule has no memory. Inside the block, `numpy.asarray(t)` is a copy (numpy allows one; `copy=False`
  is refused by numpy itself, as for plain tensors), and two views of one storage pickled together are saved as
  two copies (deepcopy keeps them views of one copy). A wrapper whose storage was lost at exit has no storage:
  every path above reaches `as_plain`, which raises TensorLost, except repr (and format, which prints it), which
  shows the message instead (a repr that raises breaks printing whatever holds the tensor).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .errors import BudgetUsageError, RawMemoryError

aten = torch.ops.aten


def with_bits(plain: torch.Tensor, conj: bool, neg: bool) -> torch.Tensor:
    """`plain` with the conjugate and negative bits a lazy `conj()` or `_neg_view()` gives a view: what its bytes
    mean. A view over arena bytes is made without them; the wrapper (or recipe argument) it stands for carries them."""
    if conj:
        torch._C._set_conj(plain, True)
    if neg:
        torch._C._set_neg(plain, True)
    return plain


class Cell:
    """The storage a wrapper's bytes live in. Shared by a base and its views; re-pointed only by copy-on-write."""

    __slots__ = ("storage", "__weakref__")

    def __init__(self, storage):
        self.storage = storage


class Tensor(torch.Tensor):
    """The tensor every op inside a Budget returns: view metadata over a storage in the arena, which may be evicted
    and recomputed at any time; autograd and ops treat it as any tensor. After the block it holds its own copy
    outside the arena and works wherever a plain tensor does (module docstring, Note [Escaped tensors])."""

    _cell: Cell
    # Methods on a wrapper (size(), stride(), ...) must not go through Python's __torch_function__: every op is
    # handled below autograd, in the Budget's dispatch mode or in __torch_dispatch__ here.
    __torch_function__ = torch._C._disabled_torch_function_impl

    _meta = None  # (dtype, size, stride, storage_offset, conj, neg) as made, or None: read them (Note [Views kept])
    _kept = None  # a plain view of its bytes in the arena, made when its storage was at `_kept_at`, or None

    @staticmethod
    def __new__(cls, cell: Cell, size, stride, storage_offset: int, dtype: torch.dtype, device: torch.device):
        if storage_offset:  # (requires_grad is False by default, and so is a storage offset of 0: a wrapper per op)
            t = torch.Tensor._make_wrapper_subclass(cls, size, strides=stride, storage_offset=storage_offset,
                                                    dtype=dtype, device=device)
        else:
            t = torch.Tensor._make_wrapper_subclass(cls, size, strides=stride, dtype=dtype, device=device)
        t._cell = cell
        return t

    def _forget_view(self) -> None:
        """Its metadata or its storage changed: what Note [Views kept] keeps is read again at the next op."""
        self._meta = self._kept = None

    def __init__(self, *args, **kwargs):  # everything happens in __new__
        super().__init__()

    def as_plain(self) -> torch.Tensor:
        """A plain tensor over this tensor's bytes (a Budget's arena inside the block, its own copy after)."""
        return self._cell.storage.payload.plain_view(self)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached only when no Budget is active: the op runs on plain tensors and returns plain tensors, except
        # detach, which keeps the type (See Note [Escaped tensors]).
        if func is aten.detach.default and not args[0]._inside():
            return args[0]._alias()
        for x in tree_leaves((args, kwargs)):
            if isinstance(x, Tensor):
                x._check_thread(func)
        unwrap = lambda x: x.as_plain() if isinstance(x, Tensor) else x
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    # ================================================== paths outside aten dispatch (See Note [Escaped tensors])
    @property
    def data(self) -> torch.Tensor:
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        """`t.data = new`: PyTorch copies `new`'s sizes, strides and storage into the wrapper's TensorImpl, which
        holds no bytes; the wrapper must also read `new`'s bytes from then on, through `new`'s Cell."""
        runtime = self._cell.storage.payload.runtime
        if runtime is not None:  # inside the block: only a tensor of this block has arena bytes to share
            runtime.check_thread("`t.data = new`")
            if not (isinstance(new, Tensor) and new._cell.storage.payload.runtime is runtime):
                raise BudgetUsageError(
                    f"`t.data = new` on a tensor made inside a Budget needs `new` made inside the same block (got "
                    f"a {type(new).__name__} from outside it, whose bytes the arena does not hold); assign "
                    f"`t.data = new.clone()` or use `new` itself")
            torch._C.TensorBase.data.__set__(self, new)
            self._forget_view()
            runtime.lifetime.rebind(self, new._cell)
            return
        if isinstance(new, Tensor) and new._inside():
            raise BudgetUsageError("`t.data = new` with `new` made inside a running Budget block and `t` from an "
                                   "earlier one: assign `t.data = new` inside the block that made `t`, or after it")
        torch._C.TensorBase.data.__set__(self, new)
        self._forget_view()
        self._cell = new._cell if isinstance(new, Tensor) else _escaped_cell(new)

    def _inside(self) -> bool:
        return self._cell.storage.payload.runtime is not None

    def _check_thread(self, func) -> None:
        """Inside the block, from another thread than the block's: BudgetUsageError (Runtime.check_thread)."""
        runtime = self._cell.storage.payload.runtime
        if runtime is not None:
            runtime.check_thread(func)

    def _plain(self, plain: torch.Tensor) -> torch.Tensor:
        """`plain` with this tensor's requires_grad, as an nn.Parameter if this tensor is one."""
        if getattr(self, "_is_param", False):
            return torch.nn.Parameter(plain, self.requires_grad)
        return plain.requires_grad_(self.requires_grad)

    def _view(self) -> torch.Tensor:
        """A plain tensor over these bytes, read at once (inside the block: valid until the next op)."""
        return self._plain(self.as_plain())

    def _own(self, memo: dict | None = None) -> torch.Tensor:
        """A plain tensor over a storage of its own with these bytes: the copy it holds after the block, a fresh
        copy of its storage inside it (one per storage and `memo`, so views copied together stay views)."""
        key = ("coop_arena.storage", id(self._cell.storage))
        storage = memo.get(key) if memo is not None else None
        if storage is None:
            plain = self._cell.storage.payload.plain_view(self, copy=True)
            if memo is not None:
                memo[key] = plain.untyped_storage()
        else:
            with torch._C._DisableTorchDispatch():
                plain = with_bits(torch.empty(0, dtype=self.dtype, device=self.device).set_(
                    storage, self.storage_offset(), self.size(), self.stride()), self.is_conj(), self.is_neg())
        return self._plain(plain)

    def _alias(self) -> Tensor:
        """Another wrapper over this escaped tensor's copy: its detach (PyTorch asks a subclass's detach to keep the
        type; nn.Parameter(t) needs it)."""
        storage = self.as_plain().untyped_storage()
        out = Tensor(self._cell, self.size(), self.stride(), self.storage_offset(), self.dtype, self.device)
        with_bits(out, self.is_conj(), self.is_neg())
        adopt([(out, storage)])
        return out

    def _raw(self, what: str, instead: str = "") -> torch.Tensor:
        """A plain tensor sharing these bytes, for a path that hands out raw memory: refused inside the block."""
        if self._inside():
            raise RawMemoryError(what, self._cell.storage.sid, instead)
        return self._view()

    def __repr__(self, *, tensor_contents=None):
        """A plain tensor's repr (PyTorch writes a subclass named Tensor as `Tensor(`, as wide as `tensor(`); inside
        the block, with the storage and its state before this read; a lost tensor shows why instead of raising."""
        d, s = self._cell.storage.payload, self._cell.storage
        if d.lost is not None:
            return f"coop_arena.Tensor(lost: {d.lost})"
        state = s.state.value
        with d.runtime.reading() if d.runtime is not None else contextlib.nullcontext():
            r = super().__repr__(tensor_contents=tensor_contents)  # turns the modes off and runs ops on `self`
        if r.startswith("Parameter("):
            r = "Parameter containing:\n" + r[len("Parameter("):-1]
        r = r.replace("Tensor(", "tensor(", 1)
        return f"coop_arena.Tensor(storage={s.sid}, {state}, {r})" if self._inside() else r

    def __format__(self, spec: str) -> str:
        if self.dim() != 0:
            return super().__format__(spec)
        with torch._C._DisableTorchDispatch():
            return self._view().__format__(spec)

    def tolist(self):
        with torch._C._DisableTorchDispatch():
            return self._view().tolist()

    def numpy(self, *, force: bool = False):
        with torch._C._DisableTorchDispatch():
            if force and self._inside():  # force=True allows a copy
                return self._own().numpy(force=True)
            return self._raw("t.numpy()", ", or t.numpy(force=True) or t.tolist() for a copy").numpy(force=force)

    def __array__(self, dtype=None):
        # PyTorch's signature, so numpy treats copy= as for a plain tensor; inside the block it gets a copy
        with torch._C._DisableTorchDispatch():
            return (self._own() if self._inside() else self._view()).__array__(dtype)

    def __dlpack__(self, **kwargs):
        with torch._C._DisableTorchDispatch():
            if self._inside() and kwargs.get("copy") is True:
                return self._own().__dlpack__(**kwargs)
            return self._raw("t.__dlpack__()", ", or pass copy=True for a copy").__dlpack__(**kwargs)

    def apply_(self, callable):
        """PyTorch runs `callable` over the bytes in C++, which a wrapper inside the block does not have (a null
        pointer: the interpreter crashed). Inside, it runs on a copy, written back by a `copy_` that the Budget
        records (Rule 6); like apply_, the write bumps no version counter."""
        if not self._inside():
            self.as_plain()  # (a lost tensor raises TensorLost; an escaped one has bytes of its own)
            return super().apply_(callable)
        self._check_thread("t.apply_()")
        with torch._C._DisableTorchDispatch():
            new = self._own().apply_(callable)  # (PyTorch's own errors: requires_grad, a non-CPU device)
        with torch.no_grad(), torch._C._AutoDispatchBelowADInplaceOrView():
            self.copy_(new)
        return self

    def data_ptr(self) -> int:
        return self._raw("t.data_ptr()").data_ptr()

    def untyped_storage(self) -> torch.UntypedStorage:
        return self._raw("t.untyped_storage()").untyped_storage()

    def __reduce_ex__(self, proto):
        with torch._C._DisableTorchDispatch():
            return self._own().__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        if not self.is_leaf:
            return super().__deepcopy__(memo)  # PyTorch's own error: only graph leaves can be deep-copied
        with torch._C._DisableTorchDispatch():
            plain = self._own(memo)
            memo.setdefault(id(memo), []).append(plain)  # its id keys `memo`: it must outlive it (copy's _keep_alive)
            return plain.__deepcopy__(memo)

    def __copy__(self):
        """Like a plain tensor's: a new leaf over the same bytes (another wrapper inside the block), an
        nn.Parameter if this tensor is one."""
        if self._inside():
            out = self.detach().requires_grad_(self.requires_grad)
            if getattr(self, "_is_param", False):
                out._is_param = True  # what nn.Parameter(t) gives a subclass: isinstance(out, nn.Parameter)
            return out
        return self._view()


def _escaped_cell(new: torch.Tensor) -> Cell:
    """A Cell over plain tensor `new`'s storage, for an escaped wrapper given `new` as its data: it reads and
    writes `new`'s bytes from then on, as a plain tensor would."""
    from .recipe import Data, dead_ref  # (recipe imports this module)
    from .storage import State, Storage
    with torch._C._DisableTorchDispatch():
        raw = torch.empty(0, dtype=torch.uint8, device=new.device).set_(new.untyped_storage())
    s = Storage(sid=-1, nbytes=raw.numel(), cost=0.0, evictable=False, expensive=False, state=State.FREED)
    s.payload = Data(runtime=None, cell_ref=dead_ref, recipe=None, index=0, detached=raw)
    return Cell(s)


def adopt(pairs) -> None:
    """Give each wrapper of the (wrapper, storage) `pairs` that storage (its bytes' own copy) as its real storage
    (See Note [Escaped tensors]); each keeps its own view of it. One call for many: about 2 us a wrapper."""
    with torch._C._DisableTorchDispatch(), torch._C._AutoDispatchBelowADInplaceOrView():
        for t, storage in pairs:
            torch.Tensor.set_(t, storage, t.storage_offset(), t.size(), t.stride())
            t._kept = None  # (its arena view: Note [Views kept])
