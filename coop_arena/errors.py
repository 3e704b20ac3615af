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


class UnsupportedOp(CoopArenaError):
    """An operator the runtime cannot record or place correctly; raised instead of a silent wrong result."""

    def __init__(self, func: object, reason: str):
        self.func = func
        self.reason = reason
        super().__init__(f"coop_arena cannot run {func} inside a Budget: {reason}")


class BudgetUsageError(CoopArenaError):
    """A Budget used the wrong way: nested, re-entered, or given a tensor on another device."""


class TensorLost(CoopArenaError):
    """A tensor that escaped a failed block could not be restored, so its value is gone."""


class InternalError(CoopArenaError):
    """A broken invariant inside coop_arena: a bug, not a misuse."""


def _internal_assert(cond: bool, msg: str) -> None:
    if not cond:
        raise InternalError(f"{msg}. This is a bug in coop_arena; please report it with the code that triggered it.")
