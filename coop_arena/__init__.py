"""coop_arena: train PyTorch models under a hard memory budget (Coop sliding-window rematerialization)."""

from .errors import (ArenaAllocationError, AutocastNotPlanned, BudgetUsageError, CompileNotApplied, CoopArenaError,
                     FootprintExceeded, OutOfBudget, RawMemoryError, TensorLost, Thrashing, UnsupportedOp)
from .memory import Memory

__all__ = ["ArenaAllocationError", "AutocastNotPlanned", "BudgetUsageError", "CompileNotApplied", "CoopArenaError", "FootprintExceeded", "Memory", "OutOfBudget",
           "RawMemoryError", "TensorLost", "Thrashing", "UnsupportedOp"]

from .budget import Budget, BudgetStats, pinned  # noqa: E402
from .tensor import Tensor  # noqa: E402
from . import footprint  # noqa: E402

__all__ += ["Budget", "BudgetStats", "Tensor", "pinned"]
