"""Typed errors.

User errors carry the data that explains them (what was asked, what was available, what to do); internal
bugs go through `_internal_assert`, which says so and asks for a report. Nothing here is raised by `assert`.
"""

from __future__ import annotations


class CoopArenaError(RuntimeError):
    """Base class of every error coop_arena raises on purpose."""


def _fmt(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


class OutOfBudget(CoopArenaError):
    """A request that cannot be met even after evicting everything evictable.

    Raised before anything changes (Rule 7): the block table, the stats and every live tensor are as they were.
    """

    def __init__(self, requested: int, budget: int, unevictable: int, largest_window: int, op: str | None = None):
        self.requested = requested
        self.budget = budget
        self.unevictable = unevictable
        self.largest_window = largest_window
        self.op = op
        where = f" for the output of {op}" if op else ""
        super().__init__(
            f"cannot place {_fmt(requested)}{where}: the budget is {_fmt(budget)}, of which {_fmt(unevictable)} "
            f"is held by unevictable or pinned tensors, and the largest contiguous range that eviction could "
            f"free is {_fmt(largest_window)}. Raise the budget (at least {_fmt(requested - largest_window)} more "
            f"would be needed for this request), use a smaller batch, or keep fewer tensors alive across the step."
        )


class Thrashing(CoopArenaError):
    """Recomputation passed the Budget's `max_overhead`: the step could go on, but at a cost its user ruled out.

    Raised before the replay that would pass the limit, at the same point as an `OutOfBudget` from a restore,
    so the Budget stays usable.
    """

    def __init__(self, recompute_cost: float, compute_cost: float, max_overhead: float, op: str | None = None):
        self.recompute_cost = recompute_cost
        self.compute_cost = compute_cost
        self.max_overhead = max_overhead
        self.op = op
        where = f" while rebuilding an input of {op}" if op else ""
        super().__init__(
            f"recomputation{where} has cost {recompute_cost:.4g}, {recompute_cost / max(compute_cost, 1e-30):.2f}x "
            f"the {compute_cost:.4g} of the ops run so far, past the limit of max_overhead={max_overhead:g} "
            f"(overhead = (compute + recompute) / compute). The budget is too small for this step to run at that "
            f"overhead: raise the budget, use a smaller batch, or raise max_overhead (None for no limit)."
        )


class UnsupportedOp(CoopArenaError):
    """An operator the runtime cannot record or place correctly; raised instead of a silent wrong result."""

    def __init__(self, func: object, reason: str):
        self.func = func
        self.reason = reason
        super().__init__(f"coop_arena cannot run {func} inside a Budget: {reason}")


class BudgetUsageError(CoopArenaError):
    """A Budget used the wrong way: nested, re-entered, or given a tensor on another device."""


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


class InternalError(CoopArenaError):
    """A broken invariant inside coop_arena: a bug, not a misuse."""


def _internal_assert(cond: bool, msg: str) -> None:
    if not cond:
        raise InternalError(f"{msg}. This is a bug in coop_arena; please report it with the code that triggered it.")
