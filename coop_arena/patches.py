"""Methods of other libraries that a Budget replaces while it is open, for the thread that opened it (and the
autograd engine's threads running its backward).

Some work inside a block is not the step's and must not reach the arena, yet no dispatch mode can tell it
apart from the step's own ops: it is recognised by the library method it runs in (FSDP2's hooks, sharded.py;
deep copies of tensors from before the block, bookkeeping.py). What no op shows either is where a backward
starts: the module function through which autograd enters its engine is replaced too, with a module in place
of a class (bookkeeping.py; Note [Gradients of leaves] in dispatch.py). A replacement looks up the Bookkeeping of the
Budget open in the calling thread (`current()`) and behaves exactly as the original where there is none; the
originals are put back when the last open Budget closes. Methods are looked up on their classes at each call,
so replacing them on the class reaches objects made before. (`Tensor.data`'s setter, bookkeeping.py, refuses in
every thread what would break in any: sharing the storage of a running block's tensor, which has none.)
"""

from __future__ import annotations

import threading

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

_lock = threading.Lock()
_open: dict[int, object] = {}   # thread id -> the Bookkeeping of the Budget open in that thread
_saved: list[tuple] = []        # (class, name, original) while replaced


def current():
    """The Bookkeeping of the Budget open in this thread, or None. An autograd engine thread (on CUDA a backward
    runs on one per device, FSDP2's backward hooks with it) inherits the dispatch modes of the thread that called
    backward: there it is the Budget whose dispatch mode is active."""
    bk = _open.get(threading.get_ident())
    if bk is not None or not _open:
        return bk
    for mode in _get_current_dispatch_mode_stack():
        bk = getattr(getattr(mode, "runtime", None), "bookkeeping", None)
        if bk is not None and any(bk is b for b in list(_open.values())):
            return bk
    return None


def open(bookkeeping, replacements) -> None:
    """Register `bookkeeping` for this thread and replace each (class or module, name, wrap) of `replacements` not
    replaced yet by wrap(original). An attribute the class inherits is set on the class, then deleted again."""
    with _lock:
        _open[threading.get_ident()] = bookkeeping
        done = {(cls, name) for cls, name, _ in _saved}
        for cls, name, wrap in replacements:
            if (cls, name) not in done:
                inherited = name not in cls.__dict__  # (torch.Tensor.data lives on torch._C.TensorBase)
                original = next(c.__dict__[name] for c in getattr(cls, "__mro__", (cls,)) if name in c.__dict__)
                _saved.append((cls, name, None if inherited else original))
                setattr(cls, name, wrap(original))


def after_fork() -> None:
    """In a forked child (Note [Fork inside a block] in budget.py): another thread may have held the lock."""
    global _lock
    _lock = threading.Lock()


def close(bookkeeping) -> None:
    with _lock:
        if _open.get(threading.get_ident()) is bookkeeping:
            del _open[threading.get_ident()]
        if _open:
            return
        while _saved:  # one entry at a time: an interrupt part way leaves `_saved` naming what is still replaced
            cls, name, original = _saved[-1]
            if original is None:
                if name in cls.__dict__:
                    delattr(cls, name)  # it was inherited: the base class's comes back
            else:
                setattr(cls, name, original)
            _saved.pop()
