"""`transformers.Trainer` with each training step's forward and backward inside a Budget.

    from coop_arena.integrations.transformers import BudgetTrainer
    trainer = BudgetTrainer(model=model, args=args, train_dataset=ds, budget=0.5)   # or bytes, or a Budget
    trainer.train()
    print(trainer.step_budget.budget.stats, trainer.step_budget.train)

Why a subclass and not a `TrainerCallback`: a callback's hooks are notifications around the step
(`on_step_begin`, `on_pre_optimizer_step`, ...), none of which can hold a `with budget:` open around one
micro-batch's forward and backward alone. `Trainer.training_step` is exactly that (it calls `compute_loss` and
`accelerator.backward`), and transformers documents it as the method to override; `prediction_step` is one
evaluation batch. `BudgetMixin` overrides both, so it also goes in front of a Trainer subclass
(`class MyTrainer(BudgetMixin, Seq2SeqTrainer)`).

- Gradient accumulation: each micro-batch is one `training_step` and so one block; the gradients accumulate
  outside the arena between blocks; gradient clipping, the optimizer step, the scheduler and `zero_grad` run
  after the last micro-batch, outside any block.
- Evaluation: `evaluation="outside"` (the default) leaves `evaluate()` / `predict()` as they are;
  `evaluation="budget"` runs each evaluation batch under the same Budget with no_grad.
- The budget forms and how a fraction's peak is measured: `coop_arena.integrations.StepBudget`.

Limits: tested on the CPU with one process and the default optimizer (AdamW); not tested are multi-GPU (DDP,
FSDP, DeepSpeed through accelerate), mixed precision (`bf16`, `fp16`), `torch_compile=True`, and SageMaker model
parallelism (its forward and backward do not go through `training_step`'s body). docs/trainers.md lists them.
"""

from __future__ import annotations

import transformers

from ..budget import Budget
from . import StepBudget, gradients


class BudgetMixin:
    """Runs each training step (one micro-batch's forward and backward) of a `transformers.Trainer` as one block
    of a Budget. Goes before the Trainer class: `class T(BudgetMixin, transformers.Trainer)`.

    Arguments, besides the Trainer's own (keyword only):
      budget: bytes (int), a `coop_arena.Budget`, or a fraction in (0, 1] of the first training step's measured
        peak (see `coop_arena.integrations.StepBudget`).
      evaluation: "outside" (default) or "budget" (each evaluation batch under the Budget, with no_grad).
      budget_options: a dict of `coop_arena.Budget` keyword arguments, for bytes or a fraction.

    `step_budget` (a `StepBudget`) holds the Budget, the measured peak and the totals of the blocks.
    """

    def __init__(self, *args, budget: int | float | Budget, evaluation: str = "outside", budget_options: dict | None = None, **kwargs):
        self.step_budget = StepBudget(budget, evaluation=evaluation, **(budget_options or {}))  # validated first
        super().__init__(*args, **kwargs)

    def training_step(self, model, inputs, *args, **kwargs):
        with self.step_budget.block("train", device=self.args.device, keep=lambda: gradients(model.parameters())):
            return super().training_step(model, inputs, *args, **kwargs)

    def prediction_step(self, model, inputs, *args, **kwargs):
        with self.step_budget.block("eval", device=self.args.device):
            return super().prediction_step(model, inputs, *args, **kwargs)


class BudgetTrainer(BudgetMixin, transformers.Trainer):
    """`transformers.Trainer` with a Budget around each training step (`BudgetMixin`)."""
