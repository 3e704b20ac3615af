"""coop_arena: train PyTorch models under a hard memory budget (Coop sliding-window rematerialization)."""

from .errors import (ArenaAllocationError, AutocastNotPlanned, BudgetUsageError, CompileNotApplied, CoopArenaError,
                     OutOfBudget, RawMemoryError, TensorLost, Thrashing, UnsupportedOp)
from .memory import Memory

__all__ = ["ArenaAllocationError", "AutocastNotPlanned", "BudgetUsageError", "CompileNotApplied", "CoopArenaError", "Memory", "OutOfBudget",
           "RawMemoryError", "TensorLost", "Thrashing", "UnsupportedOp"]

from .budget import Budget, BudgetStats, pinned  # noqa: E402
from .tensor import Tensor  # noqa: E402

__all__ += ["Budget", "BudgetStats", "Tensor", "pinned"]
