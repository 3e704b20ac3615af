"""Trainer integrations: a Budget around each training step of a `transformers.Trainer` or a Lightning `Trainer`.

    from coop_arena.integrations.transformers import BudgetTrainer   # pip install coop-arena[transformers]
    from coop_arena.integrations.lightning import BudgetCallback     # pip install coop-arena[lightning]

This module holds what both share, `StepBudget`: how the budget is given (bytes, a Budget, or a fraction of the
first step's measured peak), the opening and closing of one block per training step, and evaluation inside or
outside the Budget. It imports neither trainer; each integration module imports its own, so `import coop_arena`
never does.

Note [Fraction of the measured peak]
Rationale: the bytes a step needs are rarely known before it runs; "train at 60 % of what this step takes" is.
Approach: the first training step runs without a Budget under PyTorch's profiler (`coop_arena.footprint.profiler`,
  the same measurement as `coop_arena.footprint.measure`): its peak is the most bytes it held at once on the
  trainer's device, the parameters' gradients it made left out (model state, like the parameters; Note [Measured
  footprint]). From the second step on, the steps run under `Budget(int(fraction * peak))` on that device. The
  measurement ends when the gradients are complete: before the optimizer step where a trainer runs it inside the
  step (Lightning), so the optimizer's state and temporaries are not part of the peak, as they are not part of a
  Budget.
Limitations: the first step is the one measured: a later step with larger shapes (a longer sequence) needs more
  than it, and a first step that allocates once-only memory (lazy modules, caches) measures more. The first step's
  own memory is not capped. Evaluation under the Budget before the first training step has no Budget to run in
  and runs without one (a warning says so).
"""

from __future__ import annotations

import numbers
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from .. import footprint
from ..budget import Budget
from ..errors import warn

EVALUATION = ("outside", "budget")


@dataclass
class Totals:
    """What the blocks of one kind (training steps, or evaluation batches) did, summed over the run."""

    blocks: int = 0              # blocks run under the Budget
    evictions: int = 0           # storages evicted, all blocks together (BudgetStats.evictions)
    rematerializations: int = 0  # storages recomputed, all blocks together
    peak_bytes: int = 0          # the highest BudgetStats.peak_bytes of a block

    def add(self, stats) -> None:
        self.blocks += 1
        self.evictions += stats.evictions
        self.rematerializations += stats.rematerializations
        self.peak_bytes = max(self.peak_bytes, stats.peak_bytes)


def _check_budget(budget, options: dict):
    """`budget` as given to an integration: (Budget or None, nbytes or None, fraction or None); ValueError if bad."""
    accepted = ("accepted: an int number of bytes > 0 (Budget(nbytes) on the trainer's device), a coop_arena.Budget, "
                "or a float fraction in (0, 1] of the first training step's measured peak")
    if isinstance(budget, Budget):
        if options:
            raise ValueError(f"Budget options {sorted(options)} were given with a ready coop_arena.Budget; pass them "
                             f"to coop_arena.Budget(...) itself, or give the budget as bytes or a fraction")
        return budget, None, None
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise ValueError(f"budget={budget!r} ({type(budget).__name__}) is not a budget; {accepted}")
    if isinstance(budget, numbers.Integral):
        if budget <= 0:
            raise ValueError(f"budget={budget!r} bytes is not positive; {accepted}")
        return None, int(budget), None
    if not 0.0 < budget <= 1.0:  # (NaN fails this too)
        raise ValueError(f"budget={budget!r} is a float outside (0, 1]; {accepted} (for 60 % of the measured peak, "
                         f"budget=0.6; for bytes, an int)")
    return None, None, float(budget)


class StepBudget:
    """The Budget a trainer's training steps run under, one block per step (forward and backward inside it).

    Arguments (a bad value raises ValueError):
      budget: an int number of bytes (a `Budget(budget, device=<the trainer's device>, **budget_options)` made at
        the first step), a ready `coop_arena.Budget` (used as it is), or a float in (0, 1]: that fraction of the
        first training step's peak, which is measured by running that step without a Budget under PyTorch's
        profiler (Note [Fraction of the measured peak]: the most bytes the step held at once on the device, its
        parameters' gradients left out), the Budget made for the later steps.
      evaluation: "outside" (evaluation runs as without coop_arena) or "budget" (each evaluation batch is a block
        of the same Budget, under `torch.no_grad()`).
      budget_options: keyword arguments of `coop_arena.Budget` (policy, headroom, max_overhead, ...), for a budget
        given as bytes or a fraction.

    After training, `budget` is the Budget (its `stats` are the last block's), `peak` the measured first step's
    peak (fraction form), and `train` / `eval` the `Totals` of the training and evaluation blocks.
    """

    def __init__(self, budget: int | float | Budget, *, evaluation: str = "outside", **budget_options):
        self._budget, self.nbytes, self.fraction = _check_budget(budget, budget_options)
        if evaluation not in EVALUATION:
            raise ValueError(f"evaluation={evaluation!r} is not one of {EVALUATION}: 'outside' runs evaluation "
                             f"without a Budget, 'budget' runs each evaluation batch under it with no_grad")
        self.evaluation = evaluation
        self.options = budget_options
        self.peak: int | None = None  # the measured first step's peak, bytes (fraction form)
        self.train, self.eval = Totals(), Totals()
        self._open: ExitStack | None = None  # the block (or the measurement) in progress
        self._kind = None                    # "train" or "eval" while a Budget block is open
        self._measuring = None               # (profiler, keep, device) while the first step is measured
        self._warned = False

    @property
    def budget(self) -> Budget | None:
        """The Budget the steps run under; None until the first training step (bytes) or its end (fraction)."""
        return self._budget

    # ------------------------------------------------------------------------------------------- blocks
    def begin(self, kind: str, *, device=None, keep=()) -> None:
        """Open the block of one training step (kind "train") or evaluation batch ("eval"). `device`: the
        trainer's, where a Budget made here allocates its arena; `keep`: a function returning the tensors that are
        model state after the step (the parameters' gradients), left out of a measured peak."""
        if kind not in ("train", "eval"):
            raise ValueError(f"kind={kind!r}: a block is 'train' (a training step) or 'eval' (an evaluation batch)")
        if self._open is not None:
            raise RuntimeError("coop_arena: a trainer opened a step's block while the previous one was still open; "
                               "please report this (with the trainer and its version)")
        if kind == "eval" and self.evaluation == "outside":
            return
        if self._budget is None and self.nbytes is not None:
            self._budget = Budget(self.nbytes, device=device, **self.options)
        if self._budget is None and kind == "eval":  # evaluation before the first training step measured the peak
            if not self._warned:
                warn("coop_arena: evaluation before the first training step runs without a Budget: the budget is a "
                     "fraction of the first training step's peak, not measured yet", RuntimeWarning)
                self._warned = True
            return
        with ExitStack() as stack:  # (what was entered is left again if a later enter raises)
            if self._budget is None:  # a fraction: this training step is measured
                device = device or "cpu"
                self._measuring = (stack.enter_context(footprint.profiler(device)), keep, device)
            else:
                if kind == "eval":
                    stack.enter_context(torch.no_grad())
                stack.enter_context(self._budget)
            self._open, self._kind = stack.pop_all(), None if self._measuring else kind

    def end_measurement(self) -> None:
        """End the first step's measurement if one is in progress, and make the Budget of the later steps."""
        if self._measuring is None:
            return
        prof, keep, device = self._measuring
        self._measuring = None
        self._open.close()
        self._open = None
        self.peak = footprint.of_profile(prof, keep=keep, device=device).excess
        if self.peak <= 0:
            raise ValueError(f"budget={self.fraction!r} is a fraction of the first training step's peak, but the "
                             f"profiler saw the step allocate nothing on {device}: give the budget in bytes")
        self._budget = Budget(int(self.fraction * self.peak), device=device, **self.options)

    def end(self, exc: BaseException | None = None) -> None:
        """Close the block that `begin` opened (nothing if it opened none), with the exception that ended the step
        if one did (the Budget then stays usable, as after any failed block)."""
        if self._measuring is not None:
            if exc is None:
                self.end_measurement()
                return
            self._measuring = None  # a failed first step measures nothing
        stack, kind = self._open, self._kind
        self._open = self._kind = None
        if stack is None:
            return
        if exc is None:
            stack.close()
        else:
            stack.__exit__(type(exc), exc, exc.__traceback__)
        if kind is not None and exc is None:
            (self.train if kind == "train" else self.eval).add(self._budget.stats)

    @contextmanager
    def block(self, kind: str, *, device=None, keep=()):
        """`begin` ... `end` around the body, for a trainer whose step is one call."""
        self.begin(kind, device=device, keep=keep)
        try:
            yield
        except BaseException as e:
            self.end(e)
            raise
        self.end()


def gradients(parameters) -> list:
    """The `.grad` of each parameter that has one: what a step leaves as model state (`keep` for `begin`)."""
    return [p.grad for p in parameters if p.grad is not None]
