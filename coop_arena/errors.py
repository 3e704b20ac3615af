"""Typed errors.

User errors carry the data that explains them (what was asked, what was available, what to do); internal
bugs go through `_internal_assert`, which says so and asks for a report. Nothing here is raised by `assert`.
Warnings go through `warn`, which reports them at the user's line.
"""

from __future__ import annotations

import os
import sys
import warnings


class CoopArenaError(RuntimeError):
    """Base class of every error coop_arena raises on purpose."""


def in_units(n: int, digits: int) -> str | None:
    """`n` bytes in the largest binary unit that gives at least 1 (GiB, MiB, KiB), or None below 1 KiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return None


def _fmt(n: int) -> str:
    units = in_units(n, 2)
    return f"{units} ({n} bytes)" if units else f"{n} bytes"


class OutOfBudget(CoopArenaError):
    """A request that cannot be met even after evicting everything evictable.

    Raised before anything changes (Rule 7): the block table, the stats and every live tensor are as they were.
    The bytes that eviction cannot touch come in two kinds, kept apart because they call for different fixes:
    `pinned` bytes are held for the op in progress (its inputs, the outputs placed so far, the inputs of a
    recompute it needs: all of them must be resident at once; also tensors held by `coop_arena.pinned`), and
    `unevictable` bytes belong to tensors that can never be recomputed (outputs of effectful ops, tensors written
    through `coop_arena.pinned`, readers of a value that was overwritten).
    """

    def __init__(self, requested: int, budget: int, unevictable: int, largest_window: int, op: str | None = None,
                 *, pinned: int = 0, restore: bool = False, need: int | None = None):
        self.requested = requested
        need = requested if need is None else need  # the request rounded up to the arena's alignment
        self.budget = budget
        self.unevictable = unevictable
        self.pinned = pinned
        self.largest_window = largest_window
        self.op = op
        self.restore = restore  # True: the request was a restore of an evicted tensor the op needs
        if op is None:
            what, holder = "", "the op in progress"
        elif restore:
            what, holder = f" to restore an evicted tensor that {op} needs", op
        else:
            what, holder = f" for the output of {op}", op
        at_once = pinned + need
        if at_once + unevictable > budget:
            advice = (f"{holder} needs at least {_fmt(at_once)} resident at once (what it pins plus this request), "
                      f"which with the unevictable bytes is more than the budget. Raise the budget to at least "
                      f"{_fmt(at_once + unevictable)}")
        else:
            advice = (f"The pinned and unevictable blocks split the rest into ranges too small for this request. "
                      f"Raise the budget (at least {_fmt(need - largest_window)} more would be needed for this "
                      f"request)")
        super().__init__(
            f"cannot place {_fmt(requested)}{what}{f' ({_fmt(need)} aligned)' if need != requested else ''}: the "
            f"budget is {_fmt(budget)}, of which {_fmt(pinned)} is pinned "
            f"for {holder} (its inputs, its outputs placed so far and the inputs of any recompute it needs) and "
            f"{_fmt(unevictable)} is held by unevictable tensors; the largest contiguous range that eviction could "
            f"free is {_fmt(largest_window)}. {advice}, use a smaller batch, or keep fewer tensors alive across the "
            f"step."
        )


class Thrashing(CoopArenaError):
    """Recomputation passed the Budget's `max_overhead`: the step could go on, but at a cost its user ruled out.

    Raised before the replay that would pass the limit, at the same point as an `OutOfBudget` from a restore,
    so the Budget stays usable.
    """

    def __init__(self, recompute_cost: float, compute_cost: float, max_overhead: float, op: str | None = None,
                 budget: int | None = None):
        self.recompute_cost = recompute_cost
        self.compute_cost = compute_cost
        self.max_overhead = max_overhead
        self.op = op
        self.budget = budget
        where = f" while rebuilding an input of {op}" if op else ""
        overhead = (compute_cost + recompute_cost) / max(compute_cost, 1e-30)
        size = f" of {_fmt(budget)}" if budget is not None else ""
        super().__init__(
            f"the step's overhead has reached {overhead:.2f}x{where}, past the limit of max_overhead={max_overhead:g} "
            f"(overhead = (compute + recompute) / compute: recomputation has cost {recompute_cost:.4g}, "
            f"{recompute_cost / max(compute_cost, 1e-30):.2f}x the {compute_cost:.4g} of the ops run so far). The "
            f"budget{size} is too small for this step to run at that overhead: raise the budget, use a smaller "
            f"batch, or raise max_overhead (None for no limit)."
        )


class UnsupportedOp(CoopArenaError):
    """An operator the runtime cannot record or place correctly; raised instead of a silent wrong result."""

    def __init__(self, func: object, reason: str):
        self.func = func
        self.reason = reason
        super().__init__(f"coop_arena cannot run {func} inside a Budget: {reason}")


class BudgetUsageError(CoopArenaError):
    """A Budget used the wrong way: nested, re-entered, or given a tensor on another device."""


class ArenaAllocationError(CoopArenaError):
    """The device could not allocate a Budget's arena (raised by the Budget's constructor, before any block)."""

    def __init__(self, nbytes: int, device: str, reason: str):
        self.nbytes = nbytes
        self.device = device
        self.reason = reason
        super().__init__(
            f"could not allocate the arena of {_fmt(nbytes)} on {device}: the device refused it ({reason}). The "
            f"arena is allocated at once, in full, when the Budget is made: ask for a budget that the device has "
            f"free, or plan one without allocating anything with device='meta' (`coop-arena plan`)."
        )


class RawMemoryError(BudgetUsageError):
    """Raw memory of a tensor asked for inside its Budget (a pointer, its storage, a numpy array or DLPack capsule
    sharing its bytes): the bytes live in the arena, where any later op may evict or move them."""

    def __init__(self, what: str, sid: int, instead: str = ""):
        self.what = what
        self.sid = sid
        super().__init__(
            f"{what} would hand out the arena memory of a coop_arena.Tensor (storage {sid}) inside its Budget, "
            f"where the next op may evict or move those bytes. For raw memory that stays put, use "
            f"`with coop_arena.pinned(t) as raw:` and call it on `raw` inside that `with`{instead}; after the block "
            f"the tensor holds its own copy and {what} works as on any tensor."
        )


class TensorLost(CoopArenaError):
    """A tensor that escaped a failed block could not be restored, so its value is gone."""


class CompileNotApplied(UserWarning):
    """A compiled module (torch.compile) ran inside a Budget, where PyTorch runs it uncompiled."""


class FootprintExceeded(RuntimeWarning):
    """A block's footprint (its arena plus what it allocated outside the arena, model state excepted) went over the
    Budget's `nbytes`: the first block, while the headroom for temporaries is learned (Note [Headroom])."""


class AutocastNotPlanned(UserWarning):
    """torch.autocast was on in a dry run on `meta`, where it has no effect: the plan is for the step without it."""


class InternalError(CoopArenaError):
    """A broken invariant inside coop_arena: a bug, not a misuse."""


def _internal_assert(cond: bool, msg: str) -> None:
    if not cond:
        raise InternalError(f"{msg}. This is a bug in coop_arena; please report it with the code that triggered it.")


def _internal_files() -> tuple[str, ...]:
    """Path prefixes of the code a warning is not reported in: coop_arena's, torch's and contextlib's."""
    import contextlib

    import torch
    return (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.dirname(os.path.abspath(torch.__file__))
            + os.sep, os.path.abspath(contextlib.__file__))


def warn(message: str, category: type[Warning]) -> None:
    """`warnings.warn(message, category)` reported at the user's line: the innermost frame whose code is neither
    coop_arena's nor torch's (nor contextlib's, which calls `__exit__` for an ExitStack). No fixed `stacklevel`
    finds it: the same warning comes from a block's `__exit__`, from an op's dispatch in the forward pass (the
    user's code, then torch.nn's frames, then ours) or in the backward pass (`loss.backward()`, then
    torch.autograd's frames, then ours). Where every frame is ours or torch's (a thread of autograd's own), the
    warning names the frame that called this function."""
    internal = _internal_files()
    caller = frame = sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame = frame.f_back
    frame = frame or caller
    g = frame.f_globals
    warnings.warn_explicit(message, category, frame.f_code.co_filename, frame.f_lineno,
                           module=g.get("__name__", "<string>"), registry=g.setdefault("__warningregistry__", {}))
    # (no module_globals, as warnings.warn passes none: with them, warn_explicit asks the module's loader for
    # its source, and the loader of `python -c`'s __main__ raises ImportError instead of answering)
