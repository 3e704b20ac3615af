"""A Budget used the ways a new user tries: from several threads, re-entered, across failures."""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest
import torch
import torch.nn as nn

import coop_arena


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(32, 32), nn.Tanh())], nn.Linear(32, 10))


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_entering_an_active_budget_from_another_thread_is_refused_and_changes_nothing():
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    reference = _mlp()
    nn.functional.cross_entropy(reference(x), y).backward()
    model = _mlp()
    budget = coop_arena.Budget(40 << 10, device="cpu")
    errors = []

    def other_thread():
        try:
            with budget:
                torch.randn(16) * 2
        except coop_arena.BudgetUsageError as e:
            errors.append(e)

    with budget:
        loss = nn.functional.cross_entropy(model(x), y)
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        loss.backward()
        budget.check_invariants()
    assert len(errors) == 1 and "another thread" in str(errors[0])
    assert budget.stats.evictions > 0 and budget.memory.used_bytes == 0
    assert all(torch.equal(a, b) for a, b in zip(_grads(reference), _grads(model)))
    assert type(torch.ones(2) * 2) is torch.Tensor  # no dispatch mode left behind
    with budget:  # still usable, from either thread
        z = torch.ones(4) * 3
    assert torch.equal(z.as_plain(), torch.full((4,), 3.0))


def test_an_arena_tensor_used_from_another_thread_during_the_block_is_refused():
    """Another thread would read bytes the block may evict or move at any moment: refused with a clear error. A
    thread that runs with the Budget's dispatch mode (as the autograd engine's device threads do on CUDA) goes
    through the mode as usual, and after the block any thread may use the tensor (it holds its own copy)."""
    budget, other = coop_arena.Budget(1 << 20, device="cpu"), coop_arena.Budget(1 << 20, device="cpu")
    seen = []

    def use(t, mode=None):
        try:
            with mode if mode is not None else contextlib.nullcontext():
                if mode is not None:  # PyTorch's repr turns the mode off and runs ops on the tensor
                    seen.append(repr(t))
                seen.append(t + 1)
        except coop_arena.BudgetUsageError as e:
            seen.append(e)

    def in_thread(*args):
        worker = threading.Thread(target=use, args=args)
        worker.start()
        worker.join()

    with budget:
        y = torch.ones(4) * 2
        in_thread(y)
        in_thread(y, budget._mode)
        assert isinstance(seen[2], coop_arena.Tensor)  # placed in the arena by the Budget's mode
        worker = threading.Thread(target=lambda: seen.append(_use_inside(other, y)))
        worker.start()
        worker.join()
    in_thread(y)
    assert isinstance(seen[0], coop_arena.BudgetUsageError)
    assert "aten.add.Tensor" in str(seen[0]) and "another thread" in str(seen[0])
    assert seen[1].startswith("coop_arena.Tensor(") and "tensor([2., 2., 2., 2.])" in seen[1]
    assert torch.equal(seen[2].as_plain(), torch.full((4,), 3.0))
    assert isinstance(seen[3], coop_arena.BudgetUsageError)  # from inside another Budget's block, too
    assert type(seen[4]) is torch.Tensor and torch.equal(seen[4], torch.full((4,), 3.0))


def _use_inside(budget, t):
    try:
        with budget:
            return t + 1
    except coop_arena.BudgetUsageError as e:
        return e


def test_an_interrupt_while_a_block_ends_leaves_the_budget_usable_from_its_thread(monkeypatch):
    budget = coop_arena.Budget(1 << 20, device="cpu")
    collect = budget._collect

    def interrupted(rt):
        monkeypatch.setattr(budget, "_collect", collect)
        raise KeyboardInterrupt

    monkeypatch.setattr(budget, "_collect", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with budget:
            torch.ones(4) * 2
    with budget:
        z = torch.ones(4) * 3
    assert torch.equal(z.as_plain(), torch.full((4,), 3.0)) and budget.memory.used_bytes == 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_budget_past_the_largest_offset_is_a_value_error(device):
    with pytest.raises(ValueError, match="at most"):
        coop_arena.Budget(1 << 63, device=device)
    with pytest.raises(ValueError, match="trace_len"):
        coop_arena.Budget(1 << 20, device=device, trace_len=-1)


@pytest.mark.parametrize("args,message", [
    (["mlp", "--budget", "1e400"], "not a finite"),
    (["mlp", "--budget", "1e30GiB"], "at most"),
    (["nosuch_module_xyz:build"], "cannot import"),
    (["coop_arena.examples:nope"], "has no attribute"),
    (["coop_arena.examples:MODELS"], "not callable"),
])
def test_cli_plan_bad_arguments_are_usage_errors(capsys, args, message):
    from coop_arena.cli import main
    with pytest.raises(SystemExit) as e:
        main(["plan", *args])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("k", range(1, 41))
def test_an_interrupt_inside_a_block_table_update_reaches_the_user_unchanged(k):
    """Ctrl-C can land between two statements of a table update during backward; the block then ends with the
    KeyboardInterrupt itself (not an internal error from freeing into the half-updated table), and the next block
    is exact."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    budget = coop_arena.Budget(1 << 20, device="cpu")
    calls = []
    with pytest.raises(KeyboardInterrupt):
        with budget:
            loss = nn.functional.cross_entropy(_mlp()(x), y)
            table = budget.memory.table
            free_add = table._free_add

            def interrupted(size, off):
                calls.append(off)
                if len(calls) == k:  # the block is free but not indexed yet, as after a signal at that line
                    table._free_add = free_add
                    raise KeyboardInterrupt
                free_add(size, off)

            table._free_add = interrupted
            loss.backward()
    assert len(calls) == k
    reference, model = _mlp(), _mlp()
    nn.functional.cross_entropy(reference(x), y).backward()
    with budget:
        nn.functional.cross_entropy(model(x), y).backward()
        budget.check_invariants()
    assert all(torch.equal(a, b) for a, b in zip(_grads(reference), _grads(model)))


def _live_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


@pytest.mark.parametrize("one_block", [False, True], ids=["block-per-step", "loop-in-one-block"])
def test_training_with_the_optimizer_inside_the_block_keeps_no_objects_per_step(one_block):
    """`optimizer.step()` inside the block, one block per step or the whole loop in one block: the Python objects
    alive stay the same from step to step, and the parameters are those of plain PyTorch."""
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))

    def train(budget, steps, counts):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        outer = budget if one_block and budget is not None else contextlib.nullcontext()
        with outer:
            for i in range(steps):
                with contextlib.nullcontext() if one_block or budget is None else budget:
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                if budget is not None and i in (59, steps - 1):
                    if one_block:  # the readers of external tensors are pruned in amortized bursts: prune now
                        budget._runtime.dispatch._prune_external_readers()
                    counts.append(_live_objects())
        return model

    reference = train(None, 160, [])
    budget, counts = coop_arena.Budget(40 << 10, device="cpu"), []
    model = train(budget, 160, counts)
    assert budget.stats.evictions > 0
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), model.parameters()))
    assert counts[1] <= counts[0] + 64, f"live objects grew from {counts[0]} to {counts[1]} in 100 steps"


def test_a_held_vjp_result_survives_the_end_of_a_tight_block():
    """A held tensor evicted when the block ends is copied out; its plan pins its whole path, which does not fit
    here, so it comes back by the narrow rebuild (Note [Restore plans]) instead of being dropped."""
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    model = _mlp()
    budget = coop_arena.Budget(39424, device="cpu")  # under half the peak of one training step of this model
    with budget:
        out, vjp = torch.func.vjp(model, x)
        (g,) = vjp(torch.ones_like(out))
        kept = out.detach().clone()
    assert budget.stats.evictions > 0
    assert budget.stats.restores_in_turn >= 1 and budget.stats.dropped == 0
    out2, vjp2 = torch.func.vjp(_mlp(), x)
    assert torch.equal(kept.as_plain(), out2.detach())
    assert torch.equal(g.as_plain(), vjp2(torch.ones_like(out2))[0])


def test_leaving_a_budget_that_is_not_entered_is_a_usage_error():
    budget = coop_arena.Budget(1 << 20, device="cpu")
    with pytest.raises(coop_arena.BudgetUsageError, match="not active"):
        budget.__exit__(None, None, None)
    with budget:
        z = torch.ones(4) * 2
    with pytest.raises(coop_arena.BudgetUsageError, match="not active"):
        budget.__exit__(None, None, None)
    assert torch.equal(z.as_plain(), torch.full((4,), 2.0))
    with budget:  # still usable
        torch.ones(4) * 3


def _evict_all_after_every_op(budget):
    from test_exactness import EvictAll
    return EvictAll(budget)


@pytest.mark.parametrize("recomputable_inplace", [True, False])
def test_an_op_writing_arena_and_outside_tensors_at_once_is_never_replayed(recomputable_inplace):
    """GradScaler.unscale_ writes the gradients (outside the arena) and `found_inf` (inside) in one op: a replay of
    `found_inf` must not unscale the gradients again (Rule 5)."""
    grads = [torch.full((4,), 16.0), torch.full((3,), 32.0)]
    budget = coop_arena.Budget(1 << 22, device="cpu", recomputable_inplace=recomputable_inplace)
    with _evict_all_after_every_op(budget):
        inv = torch.full((), 16.0).reciprocal()
        found = torch.zeros(())
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        checks = [(found * 1).item() for _ in range(3)]
    assert torch.equal(grads[0], torch.full((4,), 1.0)) and torch.equal(grads[1], torch.full((3,), 2.0))
    assert checks == [0.0, 0.0, 0.0]
    assert budget.stats.rematerializations > 0


def test_grad_scaler_step_inside_the_block_is_exact():
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))

    def train(budget):
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4)
        for _ in range(3):
            with _evict_all_after_every_op(budget) if budget is not None else contextlib.nullcontext():
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(model(x), y)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        return model

    budget = coop_arena.Budget(1 << 22, device="cpu")
    model = train(budget)
    assert budget.stats.rematerializations > 100
    assert all(torch.equal(a, b) for a, b in zip(train(None).parameters(), model.parameters()))


@pytest.mark.parametrize("steps", ["0", "-2"])
def test_cli_demo_with_no_steps_is_a_usage_error(capsys, steps):
    from coop_arena.cli import main
    with pytest.raises(SystemExit) as e:
        main(["demo", "--steps", steps])
    assert e.value.code == 2 and "--steps must be positive" in capsys.readouterr().err


def test_repeat_inside_a_budget_works_whatever_the_hash_seed():
    """`repeat` decomposed or not depending on the process (its meta probe keyed tensors by id(), and ids of dead
    temporaries are reused), and decomposed it read an index tensor it builds by pointer, a wrapper without
    storage under the Budget. It now runs whole wherever its kernel computes on host tensors (placement.py)."""
    import os
    import subprocess
    import sys
    code = ("import torch, coop_arena\n"
            "a = torch.randn(16, 16)\n"
            "with coop_arena.Budget(1 << 20, device='cpu'):\n"
            "    r = (a * 1).repeat(2, 1)\n"
            "assert torch.equal(r.as_plain(), a.repeat(2, 1))\n")
    failed = []
    for seed in range(4):
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        if run.returncode != 0:
            failed.append((seed, run.stderr.strip().splitlines()[-1][:120]))
    assert not failed, failed
