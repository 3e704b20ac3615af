"""Trainer integrations (coop_arena/integrations/): a few steps of each trainer under a budget small enough that
tensors are evicted and recomputed, parameters and buffers bit for bit those of the same trainer run without a
Budget from the same seed. Models are built from configs, data made here: nothing is downloaded."""

from __future__ import annotations

import functools
import tempfile
import warnings

import pytest
import torch

import coop_arena
from coop_arena.integrations import StepBudget
from training import bitwise_equal, state

pytest.importorskip("transformers")  # (both are in the test extra: this only guards a partial environment)
pytest.importorskip("lightning")

pytestmark = pytest.mark.filterwarnings(
    # a Budget's first block may go over its cap while it learns its headroom (FootprintExceeded, Note [Headroom])
    "ignore::coop_arena.FootprintExceeded")


# ------------------------------------------------------------------------------------------------ transformers
class Tokens(torch.utils.data.Dataset):
    """Random token sequences, their own labels (causal language modelling)."""

    def __init__(self, n, seq=64, vocab=256, seed=0):
        self.x = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def hf_run(output_dir, budget=None, **budget_kwargs):
    """Three optimizer steps of a 2-layer GPT-2 (dropout 0.1) with 2 micro-batches each, evaluated after step 2 and
    at the end; (trainer, model, eval losses)."""
    import transformers

    from coop_arena.integrations.transformers import BudgetTrainer

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64,
                                                                 n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0))
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        per_device_eval_batch_size=8, eval_strategy="steps", eval_steps=2, seed=0, use_cpu=True, report_to="none",
        save_strategy="no", logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    kwargs = dict(model=model, args=args, train_dataset=Tokens(16), eval_dataset=Tokens(16, seed=1))
    trainer = (transformers.Trainer(**kwargs) if budget is None
               else BudgetTrainer(**kwargs, budget=budget, **budget_kwargs))
    trainer.train()
    return trainer, model, [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]


@functools.cache
def hf_plain():
    with tempfile.TemporaryDirectory() as d:
        _, model, losses = hf_run(d)
    return state(model), losses


def test_transformers_accumulation_evaluation_under_budget(tmp_path):
    """Bytes; each micro-batch a block; each evaluation batch a block too (evaluation="budget")."""
    trainer, model, losses = hf_run(tmp_path, 2_200_000, evaluation="budget")
    sb = trainer.step_budget
    assert sb.train.blocks == 6  # 3 steps x 2 micro-batches
    assert sb.train.evictions > 0 and sb.train.rematerializations > 0
    assert sb.eval.blocks == 4 and sb.eval.evictions > 0  # 2 evaluations x 2 batches
    expected_state, expected_losses = hf_plain()
    assert bitwise_equal(state(model), expected_state)
    assert losses == expected_losses and len(losses) == 2


def test_transformers_fraction_evaluation_outside(tmp_path):
    """A fraction: the first step measured without a Budget, the later ones under half its peak."""
    trainer, model, losses = hf_run(tmp_path, 0.5)
    sb = trainer.step_budget
    assert sb.peak > 1 << 20
    assert sb.budget.nbytes == int(0.5 * sb.peak)
    assert sb.train.blocks == 5  # the first micro-batch was the measurement
    assert sb.train.evictions > 0 and sb.train.rematerializations > 0
    assert sb.eval.blocks == 0
    expected_state, expected_losses = hf_plain()
    assert bitwise_equal(state(model), expected_state)
    assert losses == expected_losses


# --------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("budget", [0.0, 1.5, -0.5, float("nan"), 0, -4096, True, "1GB", None, [1 << 20]])
def test_bad_budget_says_what_is_accepted(budget):
    with pytest.raises(ValueError, match=r"budget=.*accepted: an int number of bytes > 0"):
        StepBudget(budget)


def test_bad_evaluation_and_options_with_a_ready_budget():
    with pytest.raises(ValueError, match=r"evaluation='inside' is not one of \('outside', 'budget'\)"):
        StepBudget(1 << 20, evaluation="inside")
    with pytest.raises(ValueError, match=r"Budget options \['policy'\] were given with a ready coop_arena.Budget"):
        StepBudget(coop_arena.Budget(1 << 20, device="cpu"), policy="dtr")


def test_evaluation_before_a_fraction_is_measured_runs_without_a_budget():
    sb = StepBudget(0.5, evaluation="budget")
    with pytest.warns(RuntimeWarning, match="evaluation before the first training step runs without a Budget"):
        with sb.block("eval", device="cpu"):
            torch.ones(4).sum()
    assert sb.budget is None and sb.eval.blocks == 0


def test_trainer_checks_its_budget_before_anything_else(tmp_path):
    from coop_arena.integrations.transformers import BudgetTrainer

    with pytest.raises(ValueError, match=r"budget=2\.0 is a float outside \(0, 1\]"):
        BudgetTrainer(model=None, budget=2.0)


def test_importing_coop_arena_imports_no_trainer():
    import subprocess
    import sys

    code = ("import sys, coop_arena, coop_arena.integrations; "
            "print(sorted(m for m in ('transformers', 'lightning', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------------------------------- lightning
class LayerMix(torch.nn.Module):
    """An MLP whose head reads the mean of every block's output (a scalar mix of layers): all of them are alive
    at once even under no_grad, so evaluation at a small budget evicts too."""

    def __init__(self, width=128, depth=6):
        super().__init__()
        self.inp = torch.nn.Linear(32, width)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.LayerNorm(width), torch.nn.Tanh(),
                                torch.nn.Dropout(0.1)) for _ in range(depth))
        self.head = torch.nn.Linear(width, 8)

    def forward(self, x):
        hidden = [self.inp(x)]
        for block in self.blocks:
            hidden.append(block(hidden[-1]))
        return self.head(sum(hidden[1:], hidden[0]) / len(hidden))


def lightning_module(manual: bool, skip_batch=None):
    import lightning.pytorch as L

    class Classifier(L.LightningModule):
        """LayerMix with dropout and LayerNorm (no buffers: BatchNorm's statistics are tested in the core suite);
        manual optimization calls manual_backward and the optimizer itself."""

        def __init__(self):
            super().__init__()
            self.automatic_optimization = not manual
            self.net = LayerMix()

        def loss(self, batch):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def training_step(self, batch, batch_idx):
            loss = self.loss(batch)
            self.log("train_loss", loss)
            if manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.loss(batch))

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self.loss(batch))

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # stepped inside the block (automatic)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": lr, "interval": "step"}}

        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == skip_batch else None  # -1: Lightning skips the rest of the epoch

    return Classifier()


def lightning_run(root, manual, callback=None, accumulate=1, skip_batch=None):
    """Three optimizer steps (batches of 256; automatic optimization clips the gradients' norm), validated every
    second batch, then tested: (module, metrics of the last training step, validation and test)."""
    import lightning.pytorch as L

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(2048, 32, generator=g), torch.randint(0, 8, (2048,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=256)
    module = lightning_module(manual, skip_batch)
    trainer = L.Trainer(
        max_steps=3, accumulate_grad_batches=accumulate, gradient_clip_val=None if manual else 0.05, val_check_interval=2, limit_val_batches=2,
        limit_test_batches=2, num_sanity_val_steps=0, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        callbacks=[callback] if callback is not None else [])  # (not deterministic=True: it sets process-wide
    # flags, torch.use_deterministic_algorithms and cudnn's, which torch.testing's common_utils, imported by other
    # test modules, freezes; the CPU kernels used here are deterministic, and the bitwise comparison checks it)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*does not have many workers.*")  # (num_workers=0 on purpose)
        trainer.fit(module, loader, loader)
        metrics = {k: v.item() for k, v in trainer.callback_metrics.items()}
        metrics.update(trainer.test(module, loader, verbose=False)[0])
    return module, metrics


@functools.cache
def lightning_plain(manual, accumulate):
    with tempfile.TemporaryDirectory() as d:
        module, metrics = lightning_run(d, manual, accumulate=accumulate)
    return state(module), metrics


@pytest.mark.parametrize("manual, budget, evaluation, accumulate", [
    (False, 1_300_000, "budget", 2),  # automatic optimization with accumulation, bytes, evaluation under the budget
    (True, 0.4, "outside", 1),      # manual optimization, a fraction, evaluation outside
])
def test_lightning(tmp_path, manual, budget, evaluation, accumulate):
    from coop_arena.integrations.lightning import BudgetCallback

    callback = BudgetCallback(budget, evaluation=evaluation)
    module, metrics = lightning_run(tmp_path, manual, callback, accumulate)
    sb = callback.step_budget
    batches = 3 * accumulate
    if isinstance(budget, float):
        assert sb.peak > 0 and sb.budget.nbytes == int(budget * sb.peak)
        batches -= 1  # the first batch was the measurement
    assert sb.train.blocks == batches
    assert sb.train.evictions > 0 and sb.train.rematerializations > 0
    if evaluation == "budget":
        assert sb.eval.blocks == 4 * 2 and sb.eval.evictions > 0  # validation after batches 2, 4, 6; test; 2 batches each
    else:
        assert sb.eval.blocks == 0
    expected_state, expected_metrics = lightning_plain(manual, accumulate)
    assert bitwise_equal(state(module), expected_state)
    assert metrics == expected_metrics and set(metrics) == {"train_loss", "val_loss", "test_loss"}


def test_lightning_step_that_does_not_fit_ends_its_block(tmp_path):
    """OutOfBudget leaves fit through on_exception, which closes the block: no dispatch mode is left behind and
    the Budget runs a block again."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from coop_arena.integrations.lightning import BudgetCallback

    callback = BudgetCallback(200_000)
    with pytest.raises(coop_arena.OutOfBudget):
        lightning_run(tmp_path, False, callback)
    assert _get_current_dispatch_mode() is None
    with callback.step_budget.budget:
        y = torch.ones(8) * 2
    assert torch.equal(y, torch.full((8,), 2.0))


def test_lightning_skipped_batch_ends_its_block(tmp_path):
    """A batch skipped by on_train_batch_start returning -1 gets no on_train_batch_end: its block ends with the
    epoch, and training goes on in the next epoch (one step per epoch here)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from coop_arena.integrations.lightning import BudgetCallback

    callback = BudgetCallback(1_300_000, evaluation="budget")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the skipped batch's block runs no op
        module, _ = lightning_run(tmp_path, False, callback, skip_batch=1)
    assert _get_current_dispatch_mode() is None
    assert module.trainer.global_step == 3 and module.trainer.current_epoch == 3
    assert callback.step_budget.train.blocks == 5  # batches 0 and 1 of epochs 0 and 1, batch 0 of epoch 2


def test_a_block_that_cannot_open_leaves_nothing_open():
    """Budgets do not nest: a step's block entered inside another Budget's raises BudgetUsageError, and the
    no_grad it entered first is left again."""
    sb = StepBudget(coop_arena.Budget(1 << 20, device="cpu"), evaluation="budget")
    outer = coop_arena.Budget(1 << 20, device="cpu")
    with outer, pytest.raises(coop_arena.BudgetUsageError):
        sb.begin("eval", device="cpu")
    assert torch.is_grad_enabled()
    with sb.block("eval", device="cpu"):
        assert not torch.is_grad_enabled()
    assert sb.eval.blocks == 1
