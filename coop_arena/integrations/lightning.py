"""A Lightning `Trainer` with each training step's forward and backward inside a Budget: a Callback.

    from coop_arena.integrations.lightning import BudgetCallback
    callback = BudgetCallback(0.5)          # or bytes, or a coop_arena.Budget
    lightning.pytorch.Trainer(callbacks=[callback], ...).fit(module, loader)
    print(callback.step_budget.budget.stats, callback.step_budget.train)

Why a Callback: `on_train_batch_start` and `on_train_batch_end` enclose everything Lightning does with a batch:
`training_step`, `backward` and the optimizer step, with automatic optimization (where the forward and backward
run in a closure that `optimizer.step(closure)` calls) and manual (`self.manual_backward(loss)` and `opt.step()`
inside `training_step`) alike. No hook sits between the backward and an optimizer step that runs the closure, so
the block holds the optimizer step too; the Budget runs it as without a Budget (its state and update outside the
arena, bit for bit: Note [Optimizer steps] in coop_arena/optimizer.py). A precision plugin or a strategy could
wrap the closure alone, but it would take the place of the user's own (mixed precision, DDP); a callback composes
with them.

- Gradient accumulation (`accumulate_grad_batches`): each batch is a block; the optimizer step is inside the
  block of the batch that ends the accumulation.
- Evaluation: `evaluation="outside"` (the default) leaves validation, test and predict as they are;
  `evaluation="budget"` runs each of their batches as a block of the same Budget, with no_grad (under Lightning's
  inference mode where it uses it).
- A fraction's peak is measured from `on_train_batch_start` to the first `on_before_optimizer_step` (the gradients
  complete, before the optimizer's state exists), or to `on_train_batch_end` for a batch with no optimizer step;
  see `coop_arena.integrations.StepBudget` for the rest.
- An exception inside a block reaches `on_exception`, which ends the block with it (the Budget stays usable).
- A batch whose `on_train_batch_start` returns -1 (Lightning then skips the rest of the epoch) never reaches
  `on_train_batch_end`: its block ends at `on_train_epoch_end`, or when an evaluation batch starts.

Limits: tested with `lightning.pytorch.Trainer` (the `lightning` package; `pytorch_lightning.Trainer`, whose
Callback class is another, accepts the callback but is not tested), on the CPU with one process, 32-bit precision
and one optimizer (with gradient clipping and a per-batch learning-rate scheduler, both inside the block); not
tested are DDP, FSDP and DeepSpeed strategies, mixed precision, `torch.compile`d modules and several optimizers.
docs/trainers.md lists them.
"""

from __future__ import annotations

from lightning.pytorch import Callback

from ..budget import Budget
from . import StepBudget, gradients


class BudgetCallback(Callback):
    """Runs each training batch of a Lightning `Trainer` as one block of a Budget (forward, backward and the
    optimizer step), and evaluation batches too with `evaluation="budget"`.

    Arguments:
      budget: bytes (int), a `coop_arena.Budget`, or a fraction in (0, 1] of the first training step's measured
        peak (see `coop_arena.integrations.StepBudget`).
      evaluation: "outside" (default) or "budget" (validation, test and predict batches under the Budget).
      budget_options: a dict of `coop_arena.Budget` keyword arguments, for bytes or a fraction.

    `step_budget` (a `StepBudget`) holds the Budget, the measured peak and the totals of the blocks.
    """

    def __init__(self, budget: int | float | Budget, *, evaluation: str = "outside", budget_options: dict | None = None):
        self.step_budget = StepBudget(budget, evaluation=evaluation, **(budget_options or {}))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step_budget.begin("train", device=trainer.strategy.root_device,
                               keep=lambda: gradients(pl_module.parameters()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.step_budget.end_measurement()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.step_budget.end()

    def on_train_epoch_end(self, trainer, pl_module):
        self.step_budget.end()  # a batch whose on_train_batch_start returned -1 gets no on_train_batch_end

    def _begin_eval(self, trainer, *args):
        self.step_budget.end()  # (the same, should evaluation come first)
        self.step_budget.begin("eval", device=trainer.strategy.root_device)

    def _end_eval(self, *args):
        self.step_budget.end()

    on_validation_batch_start = on_test_batch_start = on_predict_batch_start = _begin_eval
    on_validation_batch_end = on_test_batch_end = on_predict_batch_end = _end_eval

    def on_exception(self, trainer, pl_module, exception):
        self.step_budget.end(exception)
