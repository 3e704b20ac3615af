"""Bookkeeping: the work inside a block that is not the step's own, and runs outside the arena.

Rule enforced here (see ../shared DESIGN numbering):
1. Tensors that exist before the block are read, never moved, evicted or counted; so is the model-sized state
   that other engines create inside it and keep across steps. Such state is made by ops that read nothing from
   the arena while one of these runs:
   - the forward bookkeeping of `DistributedDataParallel` (its forward minus the wrapped module's forward):
     bucket rebuilding, buffer broadcasts, join notifications;
   - the autograd engine's gradient accumulation hooks (DDP's reducer, an optimizer run from a
     post-accumulate-grad hook) and its final callbacks (DDP's `finalize_backward`);
   - FSDP2's hooks (sharded.py);
   - `copy.deepcopy` of a tensor or parameter from before the block (a module copied for an EMA or a target
     network), with the Budget's dispatch mode set aside (patches.py).
   Those ops run on plain tensors and return plain tensors; a write they make into a tensor outside the arena
   still freezes the storages that read its old value (Rule 5). An op that reads an arena tensor is the step's,
   wherever it runs, and goes through the arena as usual.

Note [DDP under a Budget]
Rationale: DDP's reducer keeps tensors across steps and reads some of them in C++ through their data pointer.
  At the second step's forward, `_rebuild_buckets` allocates an index tensor, fills it through an accessor and
  broadcasts it, then allocates the new buckets and their per-parameter views (with
  `gradient_as_bucket_view=True` each `.grad` then points into them). Made inside the arena these would be
  wrappers without storage (the accessor fails: "data is not allocated yet") and, once given storage, arena
  memory referenced by the reducer after the block. In backward, `finalize_backward` clones a bucket view into
  the `.grad` of a parameter that was unused on this rank but used on another (`find_unused_parameters=True`).
Approach: recognise the engines' own work by where it runs, not by what it is: a global module forward pre-hook
  and forward hook (public `torch.nn.modules.module` API, installed only while a Budget is active) track the
  DDP forward window; `torch._C._current_graph_task_id()` and `torch._C._current_autograd_node()` tell the
  autograd engine's accumulation hooks (the node is an `AccumulateGrad`) and final callbacks (no node) from the
  backward computation itself. Gradients still reach DDP as plain tensors because the accumulated gradient
  leaves the arena in a post-accumulate-grad hook (lifetime.py), which the engine runs inside `AccumulateGrad`
  before the node's post hooks, where DDP's reducer copies it into its bucket.
Limitations: communication hooks whose future callbacks run on a backend thread are not covered (the default
  hook has none); an op in the DDP window that reads nothing from the arena but produces an activation (a module
  that returns its input unchanged, cloned by `_DDPSink`) stays outside the arena, uncounted.
"""

from __future__ import annotations

import functools
import sys
import threading

import torch
from torch.nn.modules import module as _module
from torch.utils._python_dispatch import _disable_current_modes, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map

from . import patches, sharded
from .errors import BudgetUsageError
from .recipe import whole
from .tensor import Tensor

_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad


def _unsupported_sharded(fsdp2: bool) -> tuple:
    """The FSDP module classes a Budget cannot run, if FSDP was imported (no FSDP module can exist before):
    FSDP1 always, FSDP2 unless sharded.py's replacements were installed when the Budget opened (`fsdp2`)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return ()
    return (fsdp.FullyShardedDataParallel,) if fsdp2 else (fsdp.FSDPModule, fsdp.FullyShardedDataParallel)


def _ddp_class():
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel


class _Window:
    """One DDP forward in progress: its wrapped module, and how deep inside that module's forward we are."""

    __slots__ = ("ddp", "inner")

    def __init__(self, ddp):
        self.ddp = ddp
        self.inner = 0


class Bookkeeping:
    """Tells whether an op runs as another engine's bookkeeping (see Rule 1 above). Installed by a Budget for
    the length of one block."""

    def __init__(self):
        self._ddp = _ddp_class()
        self._windows: list[_Window] = []
        self._handles = ()
        self._thread = threading.get_ident()  # module hooks are global: modules run by other threads are not ours
        self.sharded_depth = 0                 # > 0 inside FSDP2's own work (sharded.py)
        self.settle = None                     # Runtime.settle, set by the Budget: before FSDP2 frees a parameter
        self.rooted = None                     # Dispatch.rooted, set by the Budget: around each backward's run
        self._refused: tuple = ()              # FSDP module classes that cannot run inside this block

    def open(self) -> None:
        self._thread = threading.get_ident()
        fsdp2 = sharded.replacements()
        patches.open(self, [*fsdp2, *_COPIES, *_ENGINE])
        self._refused = _unsupported_sharded(bool(fsdp2))  # module hooks run per module call: computed once
        if self._ddp is not None:
            self._handles = (_module.register_module_forward_pre_hook(self._pre),
                             _module.register_module_forward_hook(self._post, always_call=True))

    def close(self) -> None:
        patches.close(self)
        self.sharded_depth = 0
        for h in self._handles:
            h.remove()
        self._handles = ()
        self._windows.clear()

    def _pre(self, module, args) -> None:
        if threading.get_ident() != self._thread:
            return
        w = self._windows[-1] if self._windows else None
        if w is not None and module is w.ddp.module:
            w.inner += 1
        elif isinstance(module, self._ddp) and hasattr(module, "reducer"):  # no reducer: nothing to keep apart
            self._windows.append(_Window(module))
        elif self._refused and isinstance(module, self._refused):
            raise BudgetUsageError(
                f"{type(module).__name__} runs inside a Budget, which supports FSDP2 (fully_shard) only with the "
                f"FSDP internals of torch 2.13 and 2.14 (sharded.py), and FSDP1 not at all: FSDP frees and refills "
                f"its unsharded parameters' storage between forward and backward (UntypedStorage.resize_, which no "
                f"dispatch mode sees), so a recomputation could read freed memory. Use fully_shard with a supported "
                f"torch, or DistributedDataParallel, under a Budget, or run the FSDP model without one")

    def _post(self, module, args, output) -> None:
        if threading.get_ident() != self._thread:
            return
        w = self._windows[-1] if self._windows else None
        if w is None:
            return
        if module is w.ddp.module and w.inner:
            w.inner -= 1
        elif module is w.ddp:
            self._windows.pop()

    def active(self) -> bool:
        """True while an op that reads nothing from the arena belongs to an engine, not to the step."""
        if self.sharded_depth:
            return True
        if self._windows and self._windows[-1].inner == 0:
            return True
        if torch._C._current_graph_task_id() < 0:
            return False
        node = torch._C._current_autograd_node()
        return node is None or isinstance(node, _ACCUMULATE_GRAD)


def run_outside(dispatch, func, args, kwargs, written) -> object:
    """Run an op of an engine's bookkeeping on plain tensors (Rule 1 above). `written` are the tensors outside
    the arena it may write: the storages that read their old value are frozen first (Rule 5)."""
    for t in written:
        dispatch._freeze_readers_of_external(_plain(t))
    return func(*tree_map(_plain, args), **tree_map(_plain, kwargs))


def _outside(original, inside=lambda self: False):
    """`original`, a method, run with the Budget's dispatch mode set aside while a block is open (unless
    `inside(self)`): what it makes is state kept across steps, outside the arena (Rule 1)."""
    @functools.wraps(original)
    def run(self, *args, **kwargs):
        if patches.current() is None or inside(self):
            return original(self, *args, **kwargs)
        with whole(_disable_current_modes()):  # Note [Interrupts] in recipe.py
            return original(self, *args, **kwargs)
    return run


def _copied_outside(original):
    """A deep copy of a tensor from before the block (copy.deepcopy of a module: an EMA or target network) is
    state kept across steps, made outside the arena like the original (Rule 1). Wrappers copy themselves."""
    return _outside(original, inside=lambda self: isinstance(self, Tensor))


def _materialized_outside(original):
    """A lazy module's parameter materialized in its first forward (`nn.LazyLinear` inside the first block) is
    model state kept across steps, made outside the arena like a parameter from before the block (Rule 1)."""
    return _outside(original)


def _data_guarded(original):
    """`t.data = u` on a tensor from before the block (module.to(), .double(), .half() do it for every parameter),
    with `u` a tensor of a running block: set_data would give `t` the storage of a wrapper, which has no memory, so
    its next use after the block crashed the interpreter. Refused before anything changes. (A wrapper's own `data`
    setter, tensor.py, handles `t` made inside a block.)"""
    def set_data(self, new):
        if isinstance(new, Tensor) and new._cell.storage.payload.runtime is not None:
            raise BudgetUsageError(
                f"`t.data = u` inside a Budget, with t a tensor from before the block of shape {_shape(self)} and "
                f"dtype {self.dtype} and u a tensor made inside the block (shape {list(new.shape)}, {new.dtype}): "
                f"u's bytes live in the arena, where t cannot share them. module.to(), .double(), .half() and "
                f".float() do this for every parameter: convert the model outside the block, before it (nothing was "
                f"changed). To change a tensor's values inside the block use `with torch.no_grad(): t.copy_(u)`")
        bk = patches.current()
        if bk is not None and bk.settle is not None and _has_bytes(self) and not _same_view(self, new):
            # The recipes of the block read `self` as the object itself (Rule 1): a replay after the swap would
            # read `new`'s bytes. What read the old ones is settled first, as before a write (Rule 5).
            bk.settle([self])
        original.__set__(self, new)
    return property(lambda self: original.__get__(self, type(self)), set_data, doc=original.__doc__)


def _rooted(original):
    """`torch.autograd._engine_run_backward`, through which `backward()` and `autograd.grad()` both start the
    autograd engine: the Budget open in this thread is told the roots of the backward it runs (Note [Gradients
    of leaves] in dispatch.py)."""
    @functools.wraps(original)
    def run(t_outputs, *args, **kwargs):
        bk = patches.current()
        if bk is None or bk.rooted is None:
            return original(t_outputs, *args, **kwargs)
        with bk.rooted(t_outputs):
            return original(t_outputs, *args, **kwargs)
    return run


_COPIES = [(torch.Tensor, "__deepcopy__", _copied_outside), (torch.nn.Parameter, "__deepcopy__", _copied_outside),
           (torch.Tensor, "data", _data_guarded),
           (torch.nn.parameter.UninitializedTensorMixin, "materialize", _materialized_outside)]
_ENGINE = [(torch.autograd, "_engine_run_backward", _rooted)]


def _has_bytes(t: torch.Tensor) -> bool:
    """Whether ops can have read `t`'s own storage: not a lazy module's uninitialized parameter (materialized by
    `t.data = ...`), nor a tensor subclass that keeps its data in inner tensors, nor a sparse tensor."""
    return (t.layout == torch.strided and not isinstance(t, torch.nn.parameter.UninitializedTensorMixin)
            and not is_traceable_wrapper_subclass(t))


def _same_view(t: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether `t.data = new` changes nothing `t` reads (`module.to()` to the dtype and device it has)."""
    if not _has_bytes(new):
        return False
    return (t.untyped_storage()._cdata == new.untyped_storage()._cdata and t.dtype == new.dtype
            and t.size() == new.size() and t.stride() == new.stride() and t.storage_offset() == new.storage_offset())


def _shape(t) -> str:
    """A tensor's shape for a message; an uninitialized (lazy) parameter has none yet and raises when asked."""
    return "uninitialized" if isinstance(t, torch.nn.parameter.UninitializedTensorMixin) else str(list(t.shape))


def _plain(x):
    return x.as_plain() if isinstance(x, Tensor) else x  # a wrapper from an earlier block: its own copy
