"""The Budget's contract beyond exactness: errors, escapes, random ops, custom ops, lifetime."""

from __future__ import annotations

import gc
import re
import threading
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

import coop_arena
from coop_arena import lifetime, recipe
from coop_arena.storage import State
from training import bitwise_equal, state, train


# ------------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("nbytes", [0, -1, 1.5, True, "1GB", None])
def test_bad_budget_size(nbytes):
    with pytest.raises(ValueError, match="positive int"):
        coop_arena.Budget(nbytes, device="cpu")


def test_numpy_integers_are_integers():
    """np.int64(1 << 20) was refused as "not a positive int" (while np.float64 was taken for max_overhead)."""
    np = pytest.importorskip("numpy")
    budget = coop_arena.Budget(np.int64(1 << 20), device="cpu", alignment=np.int32(256), trace_len=np.int64(100),
                               max_overhead=np.int64(10), cheap_density=np.float32(4))
    assert budget.memory.budget == 1 << 20 and budget.max_overhead == 10.0 and budget.memory.cheap_density == 4.0
    with budget:
        (torch.ones(4) * 2).sum()


def test_out_of_budget_counts_aligned_bytes_and_its_advice_fits():
    """The message gave the bytes asked for (900) as the budget, where 512 are usable at 512-byte alignment, and
    advised a budget under which the same op failed again: the request is placed rounded up to the alignment."""
    def attempt(nbytes):
        try:
            with coop_arena.Budget(nbytes, device="cpu"):
                a = torch.ones(100)  # 400 bytes, 512 placed
                a * 2  # 400 more while `a` is pinned as its input
        except coop_arena.OutOfBudget as e:
            return e
    e = attempt(900)
    assert e.budget == 512 and "the budget is 512 bytes" in str(e) and "(512 bytes aligned)" in str(e)
    advised = int(re.search(r"Raise the budget to at least [^(]*\((\d+) bytes\)", str(e)).group(1))
    assert advised == 1024 and attempt(advised) is None


def test_a_block_whose_ops_all_ran_on_another_device_says_so():
    """A CPU model in a Budget on another device (here meta; a GPU machine's default is cuda) ran entirely outside
    the arena, uncounted and uncapped, without a word."""
    lin, x = nn.Linear(8, 8), torch.randn(2, 8)
    budget = coop_arena.Budget(4096, device="meta")
    with pytest.warns(RuntimeWarning, match=r"none of this block's ops ran in .*on cpu.*device='cpu'"):
        with budget:
            lin(x).sum().backward()
    assert budget.stats.ops == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a block with ops in the arena: no warning
        with budget:
            (torch.ones(4, device="meta") * 2).sum()


@pytest.mark.parametrize("alignment", [4, 8, 24, 0, -16, 16.0, True, "512"])
def test_bad_alignment(alignment):
    """Below 16 bytes a float64 or complex tensor could start between two of its elements (the arena is viewed
    per dtype), so the Budget refuses it before allocating anything."""
    with pytest.raises(ValueError, match="power of two of at least 16 bytes"):
        coop_arena.Budget(1 << 20, device="cpu", alignment=alignment)


def test_sixteen_byte_alignment_places_every_dtype_on_its_own_multiple():
    budget = coop_arena.Budget(1 << 16, device="cpu", alignment=16, partition=False)
    with budget:
        a = torch.full((3,), 2.0)
        x = torch.full((2,), 3.0, dtype=torch.float64)
        z = torch.full((1,), 1 + 2j, dtype=torch.complex128)
        for t in (a, x, z):
            assert t._cell.storage.offset % t.element_size() == 0
    assert torch.equal(a.as_plain(), torch.full((3,), 2.0)) and torch.equal(x.as_plain(), torch.full((2,), 3.0, dtype=torch.float64))
    assert torch.equal(z.as_plain(), torch.full((1,), 1 + 2j, dtype=torch.complex128))


def test_unknown_policy_and_device():
    with pytest.raises(ValueError, match="coop, dtr, dte"):
        coop_arena.Budget(1 << 20, device="cpu", policy="lru")
    with pytest.raises(ValueError, match="cpu, cuda, meta"):
        coop_arena.Budget(1 << 20, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            coop_arena.Budget(1 << 20, device="cuda")
    with pytest.raises(ValueError, match="True or False"):
        coop_arena.Budget(1 << 20, device="cpu", partition="yes")


def test_tensor_on_another_device_names_the_op():
    budget = coop_arena.Budget(1 << 20, device="meta")
    with pytest.raises(coop_arena.BudgetUsageError, match=r"aten\.mm.*on cpu.*arena is on meta"):
        with budget:
            torch.randn(4, 4, device="meta") @ torch.randn(4, 4)
    with budget:  # still usable
        y = torch.randn(4, 4, device="meta") @ torch.randn(4, 4, device="meta")
    assert y.shape == (4, 4)


def test_nested_budget_is_refused_and_outer_stays_usable():
    outer, inner = coop_arena.Budget(1 << 20, device="cpu"), coop_arena.Budget(1 << 20, device="cpu")
    x = torch.randn(8, 8)
    with outer:
        with pytest.raises(coop_arena.BudgetUsageError, match="do not nest"):
            with inner:
                pass
        y = (x * 2).sum()
    assert y.item() == (x * 2).sum().item()
    with inner:  # and the refused one works on its own afterwards
        z = x + 1
    assert torch.equal(z.as_plain(), x + 1)


def test_a_budget_made_inside_a_block_is_refused_and_the_block_goes_on():
    outer = coop_arena.Budget(1 << 20, device="cpu")
    x = torch.randn(8, 8)
    with outer:
        with pytest.raises(coop_arena.BudgetUsageError, match="cannot be made inside the block of Budget"):
            coop_arena.Budget(1 << 20, device="cpu")
        y = (x * 2).sum()
    assert y.item() == (x * 2).sum().item()
    assert coop_arena.Budget(1 << 20, device="cpu").nbytes == 1 << 20  # after the block, it can


def test_inplace_view_ops_change_the_wrapper_and_survive_eviction():
    x = torch.randn(4, 6)
    budget = coop_arena.Budget(1 << 20, device="cpu")
    with budget:
        y = x * 2
        y.unsqueeze_(0)
        assert y.shape == (1, 4, 6)
        y.as_strided_((6, 4), (1, 6), 0)
        s = y._cell.storage
        budget.memory.evict(s)  # the next read rebuilds the bytes; the shape is the wrapper's own
        z = y + 1
        assert budget.stats.rematerializations == 1
        with pytest.raises(coop_arena.UnsupportedOp, match="does not fit the tensor's storage"):
            y.as_strided_((100,), (1,), 0)
        w = z.as_strided((2, 3), (4, 1), 5)  # its offset counts from z's own storage, not the arena's
        w1 = w * 1
        w2 = w1.as_strided((3,), (1,))  # no offset given: the input's own
        x.unsqueeze_(0)  # a tensor from before the block: changed as without a Budget
        assert x.shape == (1, 4, 6)
    assert torch.equal(z, (x[0] * 2).t() + 1)
    assert torch.equal(w, z.as_plain().as_strided((2, 3), (4, 1), 5))  # after the block: plain copies
    assert torch.equal(w2, w1.reshape(-1)[:3])


def test_out_of_budget_names_everything_and_changes_nothing():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    x = torch.randn(128, 64)
    budget = coop_arena.Budget(100 << 10, device="cpu", headroom=0)
    with budget:  # one good step, so grads exist
        model(x[:4]).sum().backward()
    before = state(model) + [p.grad.clone() for p in model.parameters()]
    x_before = x.clone()
    with pytest.raises(coop_arena.OutOfBudget) as err:
        with budget:
            model(x).sum().backward()
    e = err.value
    assert e.requested == 128 * 256 * 4 and e.budget == 100 << 10
    assert e.op is not None and "aten." in e.op
    assert 0 <= e.largest_window < e.requested and e.unevictable >= 0
    assert "Raise the budget" in str(e)
    assert bitwise_equal(before, state(model) + [p.grad for p in model.parameters()])
    assert torch.equal(x, x_before)
    assert budget.memory.used_bytes == 0 and budget.snapshot() == [
        {"offset": 0, "size": budget.memory.budget, "state": "free", "sid": None}]
    with budget:  # usable again
        model(x[:4]).sum().backward()


def test_keyboard_interrupt_leaves_budget_reusable():
    probe = coop_arena.Budget(1 << 26, device="cpu")
    train("mlp", probe, steps=1)
    budget = coop_arena.Budget(int(0.6 * probe.stats.peak_bytes), device="cpu")
    with pytest.raises(KeyboardInterrupt):
        with budget:
            torch.randn(64, 64) @ torch.randn(64, 64)
            raise KeyboardInterrupt
    model = train("mlp", budget)
    assert bitwise_equal(state(train("mlp")), state(model))


def _interrupted_once(monkeypatch, obj, name, *, entered=None):
    """Make obj.name raise KeyboardInterrupt once, as a Ctrl-C arriving at that moment would. With `entered`, the
    generator context manager obj.name is (recipe.whole_contextmanager) is interrupted after its generator yielded, just before
    its `with` body starts: the moment that used to leave the generator suspended (Note [Interrupts])."""
    real, armed = getattr(obj, name), [True]

    class After:  # contextlib's __enter__ interrupted after the yield
        def __init__(self, cm):
            self.cm, self.gen = cm, cm.gen

        def __enter__(self):
            self.cm.__enter__()
            raise KeyboardInterrupt

        def __exit__(self, *exc):
            return self.cm.__exit__(*exc)

    def once(*args, **kwargs):
        if not armed[0]:
            return real(*args, **kwargs)
        armed[0] = False
        if entered is None:
            raise KeyboardInterrupt
        return recipe.whole(After(entered(*args, **kwargs)))
    monkeypatch.setattr(obj, name, once)


def _thread_state_is_plain():
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    assert _get_current_dispatch_mode_stack() == []
    y = torch.ones(2, requires_grad=True) * 2  # no mode left, autograd on
    assert type(y) is torch.Tensor and y.requires_grad


@pytest.mark.parametrize("where", ["open", "close"])
def test_an_interrupt_while_a_block_opens_or_closes_leaves_nothing_behind(monkeypatch, where):
    """The Budget's mode, hooks and patches come off however far opening or closing got (Note [Interrupts])."""
    from coop_arena import bookkeeping
    budget = coop_arena.Budget(1 << 22, device="cpu")
    _interrupted_once(monkeypatch, bookkeeping.Bookkeeping, where)
    with pytest.raises(KeyboardInterrupt):
        with budget:
            torch.ones(4) + 1
    _thread_state_is_plain()
    model = train("mlp", budget)  # the same Budget, and a new one, work as before
    assert bitwise_equal(state(train("mlp")), state(model))
    train("mlp", coop_arena.Budget(1 << 22, device="cpu"))


def test_an_interrupt_as_the_engine_enters_plain_dispatch_restores_the_thread(monkeypatch):
    """An interrupt in the gradient hook's `with plain_dispatch():` once left the block's mode off the stack and
    autograd off; when the suspended generator was collected, the dead mode came back and every op of the process
    failed. Now the generator is closed at once and the thread is as before the block."""
    budget = coop_arena.Budget(1 << 22, device="cpu")
    _interrupted_once(monkeypatch, lifetime, "plain_dispatch", entered=recipe.plain_dispatch.unguarded)
    with pytest.raises(KeyboardInterrupt):
        train("mlp", budget, steps=1)
    gc.collect()
    _thread_state_is_plain()
    model = train("mlp", budget)
    assert bitwise_equal(state(train("mlp")), state(model))


@pytest.mark.parametrize("which", ["replaying", "plain_dispatch", "_rng"])
def test_an_interrupt_as_the_engine_leaves_a_with_restores_the_thread(monkeypatch, which):
    """The way out of the engine's `with`s has the moment the way in had (Note [Interrupts]): a Ctrl-C as
    `whole.__exit__` starts (a function's entry, where CPython delivers signals) left its generator suspended,
    and its cleanup ran when the traceback was freed, after the block: it put back the grad mode and dispatch keys
    of a moment inside a dispatch, so autograd stayed off for the thread ("element 0 of tensors does not require
    grad" at every later backward). Interrupted in a replay of a dropout's input (`_rng`: its generator state
    rewound), the next step still draws what plain PyTorch draws."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Dropout(0.25), nn.ReLU())])

    x = torch.randn(256, 64)
    probe = coop_arena.Budget(1 << 24, device="cpu")
    with probe:
        build()(x).sum().backward()
    budget = coop_arena.Budget(probe.stats.peak_bytes // 2, device="cpu")
    real, armed = recipe.whole.__exit__, [False]

    def interrupted(self, *exc):
        if armed[0] and self.cm.gen.gi_code.co_name == which:
            armed[0] = False
            raise KeyboardInterrupt  # as a Ctrl-C delivered when whole.__exit__ is entered
        return real(self, *exc)

    monkeypatch.setattr(recipe.whole, "__exit__", interrupted)
    model, plain = build(), build()
    torch.manual_seed(1)
    with pytest.raises(KeyboardInterrupt):
        with budget:
            loss = model(x).sum()
            armed[0] = True
            loss.backward()
    assert not armed[0] and budget.stats.evictions > 0
    monkeypatch.setattr(recipe.whole, "__exit__", real)
    _thread_state_is_plain()
    gc.collect()  # (frees the traceback that reached the suspended generator)
    _thread_state_is_plain()
    drawn = torch.get_rng_state()
    torch.manual_seed(1)
    plain(x).sum()  # the same draws as the block's forward; a backward draws nothing in plain PyTorch
    assert torch.equal(drawn, torch.get_rng_state())
    for m in (model, plain):
        for p in m.parameters():
            p.grad = None
    with budget:
        model(x).sum().backward()
    torch.set_rng_state(drawn)
    plain(x).sum().backward()
    assert budget.stats.evictions > 0
    assert bitwise_equal([p.grad for p in plain.parameters()], [p.grad for p in model.parameters()])


def test_a_mode_left_active_inside_a_block_does_not_keep_the_blocks_mode():
    """A dispatch mode entered inside a block and not left: the block's own mode still comes off the stack (left
    there, a finished block's mode would receive every later op of the process), the other stays, and a
    RuntimeWarning says so."""
    from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    budget, other = coop_arena.Budget(1 << 20, device="cpu"), Other()
    budget.__enter__()
    torch.ones(3) * 2
    other.__enter__()
    with pytest.warns(RuntimeWarning, match="still active"):
        budget.__exit__(None, None, None)
    assert _get_current_dispatch_mode_stack() == [other]
    other.__exit__(None, None, None)
    _thread_state_is_plain()
    model = train("mlp", budget)
    assert bitwise_equal(state(train("mlp")), state(model))


def test_a_loss_kept_after_its_block_does_not_keep_its_step_alive():
    """Logging the loss tensor of every step: each kept loss held, through its record's inputs and their recipes,
    every record of its step and the step's input batch (555 kB per kept loss against plain PyTorch's 72 kB on an
    8-layer MLP). After the block nothing is replayed, so a kept tensor keeps its own bytes only."""
    from coop_arena.storage import Storage
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    budget = coop_arena.Budget(1 << 22, device="cpu")
    history, batches = [], []
    for _ in range(5):
        x = torch.randn(32, 64)
        batches.append(weakref.ref(x))
        with budget:
            loss = torch.tanh(model(x)).sum()
            loss.backward()
        history.append(loss)
        del x, loss
        model.zero_grad(set_to_none=True)
    gc.collect()
    assert [b() is None for b in batches] == [True] * 5
    assert sum(type(o) is Storage for o in gc.get_objects()) <= len(history)
    assert all(torch.isfinite(h.as_plain()) for h in history)


# ----------------------------------------------------------------------------------------- escape and grads
def test_escaping_tensors_and_grads_leave_the_arena():
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    x = torch.randn(8, 16)
    budget = coop_arena.Budget(1 << 20, device="cpu")
    with budget:
        out = model(x)
        loss = out.square().mean()
        loss.backward()
    assert isinstance(loss, coop_arena.Tensor)
    assert loss.item() == (model(x).square().mean()).item()
    assert type(model.weight.grad) is torch.Tensor and type(model.bias.grad) is torch.Tensor
    for t in (out, loss):
        assert t.as_plain().untyped_storage()._cdata != budget.arena.key, "escaped tensor still in the arena"
    assert torch.equal(out.as_plain(), model(x).detach())
    assert budget.memory.used_bytes == 0
    # an escaped tensor is an ordinary input to a later block (Rule 1: read, not moved)
    with budget:
        again = out * 2
    assert torch.equal(again.as_plain(), out.as_plain() * 2)


def test_stats_and_snapshot_are_plain_data():
    budget = coop_arena.Budget(64 << 10, device="cpu", headroom=0)
    with budget:
        xs = [torch.randn(1024) * i for i in range(40)]  # 4 KiB each, more than the budget holds
        snap = budget.snapshot()
        total = sum(float(x.sum()) for x in xs)  # reads evicted ones back
    assert all(set(b) >= {"offset", "size", "state", "sid"} for b in snap)
    assert sum(b["size"] for b in snap) == budget.memory.budget
    st = budget.stats
    assert st.evictions > 0 and st.rematerializations > 0 and st.peak_bytes <= st.budget
    assert st.compute_overhead > 1.0 and 0.0 <= st.fragmentation < 1.0
    assert isinstance(st.as_dict(), dict)
    assert total == pytest.approx(sum(float((torch.randn(1) * 0).sum()) for _ in range(0)) + total)


# -------------------------------------------------------------------------------------------------- random
@pytest.mark.parametrize("make", [
    lambda: torch.rand(4096),
    lambda: torch.randn(4096),
    lambda: torch.randperm(4096).float(),
    lambda: torch.empty(4096).normal_(),
    lambda: torch.empty(4096).uniform_(),
    lambda: torch.bernoulli(torch.full((4096,), 0.3)),
    lambda: torch.nn.functional.dropout(torch.ones(4096), 0.5),
], ids=["rand", "randn", "randperm", "normal_", "uniform_", "bernoulli", "dropout"])
def test_random_ops_recompute_the_same_bits(make):
    torch.manual_seed(7)
    expected = make()
    torch.manual_seed(7)
    budget = coop_arena.Budget(48 << 10, device="cpu")  # three 16 KiB tensors
    with budget:
        r = make()
        fillers = [torch.ones(4096) * i for i in range(6)]  # push r out
        assert r._cell.storage.state is State.EVICTED
        got = r.as_plain().clone()  # recomputed
        del fillers
    assert budget.stats.rematerializations >= 1
    assert torch.equal(got, expected)
    assert torch.equal(r.as_plain(), expected)


@pytest.mark.parametrize("draw", [torch.poisson, torch._standard_gamma], ids=["poisson", "standard_gamma"])
def test_a_generator_passed_positionally_is_the_one_a_replay_restores(draw):
    """poisson and _standard_gamma take their generator as a positional argument of the aten op: a recipe saved
    the default generator's state instead, so a replay drew new numbers from the user's generator (and moved it
    on). The generator is now found by its schema name."""
    rates = torch.rand(4096) * 4

    def run(budget):
        g = torch.Generator().manual_seed(3)
        with budget if budget is not None else torch.enable_grad():
            r = draw(rates * 1, generator=g)
            if budget is not None:
                fillers = [torch.ones(4096) * i for i in range(6)]  # push r out
                assert r._cell.storage.state is State.EVICTED and len(fillers) == 6
            got = (r + 0).clone()  # recomputed
        return got, g.get_state()

    want, want_state = run(None)
    budget = coop_arena.Budget(48 << 10, device="cpu")
    got, state_after = run(budget)
    assert budget.stats.rematerializations >= 1
    assert torch.equal(got, want) and torch.equal(state_after, want_state)


class CudaLikeGenerator:
    """The CPU mirror of a CUDA generator for Note [Swapping a CUDA generator's state]: its state is an object it
    points to (shared by graphsafe_get_state, copied by clone_state), and set_state, like CUDAGeneratorImpl's,
    also re-arms cuDNN's re-seeding of RNN dropout."""

    device = torch.device("cuda", 0)

    def __init__(self, state):
        self.state, self.rearmed = state, False

    def draw(self):  # a random kernel advancing the Philox offset
        self.state[1] += 4

    def get_state(self):
        return torch.tensor(self.state)

    def set_state(self, t):
        self.state, self.rearmed = t.tolist(), True

    def clone_state(self):
        return CudaLikeGenerator(list(self.state))

    def graphsafe_get_state(self):
        return CudaLikeGenerator(self.state)

    def graphsafe_set_state(self, other):
        self.state = other.state


def test_replaying_a_random_op_on_cuda_re_arms_nothing():
    from coop_arena.recipe import _rng, capture_rng
    bernoulli = coop_arena.ops.info(torch.ops.aten.bernoulli.default)  # a random op with a `generator` argument

    gen = CudaLikeGenerator([1234, 8])
    saved = capture_rng(torch.device("cuda", 0), bernoulli, (), {"generator": gen})
    gen.draw()  # the op itself, then later ops
    gen.draw()
    for _ in range(2):  # each replay starts from the captured state, and leaves the generator where it was
        with _rng(saved):
            assert gen.state == [1234, 8]
            gen.draw()
        assert gen.state == [1234, 16]
    assert not gen.rearmed, "a replay called set_state: cuDNN would re-seed the next RNN's dropout"
    cpu = torch.Generator().manual_seed(3)  # the CPU generator has no state to swap: get_state / set_state
    saved = capture_rng(torch.device("cpu"), bernoulli, (), {"generator": cpu})
    expected = torch.rand(4, generator=cpu)
    with _rng(saved):
        assert torch.equal(torch.rand(4, generator=cpu), expected)
    assert not torch.equal(torch.rand(4, generator=cpu), expected)


# ----------------------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("coop_arena_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.tanh(x) * scale


@scaled_tanh.register_fake
def _(x, scale):
    return torch.empty_like(x)


@torch.library.custom_op("coop_arena_test::untagged_dropout", mutates_args=())
def untagged_dropout(x: torch.Tensor) -> torch.Tensor:
    return x * (torch.rand_like(x) > 0.3)  # draws, but the op is not tagged nondeterministic_seeded


@untagged_dropout.register_fake
def _(x):
    return torch.empty_like(x)


def test_a_custom_op_that_draws_without_its_tag_is_found_random_on_its_first_call():
    """Its draws run below the Budget: recorded as deterministic, a rebuild drew new numbers. Its first call now
    compares the generator's state around it (Note [Custom ops that draw] in dispatch.py)."""
    from coop_arena import ops
    op = torch.ops.coop_arena_test.untagged_dropout.default
    torch.manual_seed(7)
    expected = [untagged_dropout(torch.full((4096,), float(i))) for i in range(3)]
    torch.manual_seed(7)
    budget = coop_arena.Budget(48 << 10, device="cpu")  # three 16 KiB tensors
    with budget:
        got = [untagged_dropout(torch.full((4096,), float(i)) * 1) for i in range(3)]
        fillers = [torch.ones(4096) * i for i in range(6)]  # push them out
        assert got[0]._cell.storage.state is State.EVICTED and len(fillers) == 6
        again = [g.as_plain().clone() for g in got]  # rebuilt from their recipes
    assert budget.stats.rematerializations >= 1
    assert all(torch.equal(a, e) for a, e in zip(again, expected))
    assert ops.info(op).random


def test_custom_op_is_recorded_and_recomputed():
    x = torch.randn(4096)
    budget = coop_arena.Budget(48 << 10, device="cpu")
    calls = []
    with budget:
        y = scaled_tanh(x, 3.0)
        fillers = [torch.ones(4096) * i for i in range(6)]
        assert y._cell.storage.state is State.EVICTED
        assert y._cell.storage.payload.recipe.func is torch.ops.coop_arena_test.scaled_tanh.default
        y0 = y + 0
        got = y0.as_plain().clone()
        calls.append(budget.stats.rematerializations)
        del fillers
    assert calls[0] >= 1
    assert torch.equal(got, torch.tanh(x) * 3.0)


def test_pinned_gives_raw_arena_bytes_and_keeps_them():
    budget = coop_arena.Budget(48 << 10, device="cpu")
    x = torch.randn(4096)
    with budget:
        out = torch.empty_like(x)
        a = x * 1
        with coop_arena.pinned(out) as raw_out, coop_arena.pinned(a, readonly=True) as raw_a:
            assert raw_out.untyped_storage()._cdata == budget.arena.key
            torch.mul(raw_a, 2.0, out=raw_out)  # stands for a hand-launched kernel writing into the arena
            assert out._cell.storage.pins == 1
        assert not out._cell.storage.evictable  # its bytes came from outside any recipe
        fillers = [torch.ones(4096) * i for i in range(6)]
        assert out._cell.storage.state is State.RESIDENT
        out0 = out + 0
        result = out0.as_plain().clone()
        del fillers
    assert torch.equal(result, x * 2)
    with pytest.raises(TypeError):
        with coop_arena.pinned(x):
            pass


# ------------------------------------------------------------------------------------------------- lifetime
def test_wrapper_leaves_no_reference_cycle():
    budget = coop_arena.Budget(1 << 20, device="cpu")
    gc.collect()
    gc.disable()
    try:
        with budget:
            y = torch.randn(64) * 2
            z = y.exp()
            s = weakref.ref(z._cell.storage)
        del y, z
        assert s() is None, "a storage outlived its tensors without the cycle collector"
    finally:
        gc.enable()


def _older_collections_wait() -> bool:
    return gc.get_threshold()[1:] == (lifetime._NEVER, lifetime._NEVER)


def test_older_collections_wait_inside_blocks_and_the_thresholds_come_back():
    """Note [Cyclic collection]: only young collections inside a block, also one that raises; thresholds the
    program had set come back as they were."""
    before = gc.get_threshold()
    budget = coop_arena.Budget(1 << 20, device="cpu")
    with budget:
        assert _older_collections_wait() and gc.get_threshold()[0] == before[0] and gc.isenabled()
        y = torch.ones(8) * 2
    assert gc.get_threshold() == before and torch.equal(y, torch.full((8,), 2.0))
    with pytest.raises(ZeroDivisionError):
        with budget:
            assert _older_collections_wait()
            1 / 0
    assert gc.get_threshold() == before
    gc.set_threshold(500, 7, 3)
    try:
        with budget:
            assert gc.get_threshold() == (500, lifetime._NEVER, lifetime._NEVER)
        assert gc.get_threshold() == (500, 7, 3)
    finally:
        gc.set_threshold(*before)


def test_the_thresholds_come_back_when_the_last_block_of_two_threads_ends():
    before = gc.get_threshold()
    inside, leave = threading.Event(), threading.Event()

    def other():
        with coop_arena.Budget(1 << 20, device="cpu"):
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(30)
        with coop_arena.Budget(1 << 20, device="cpu"):
            y = torch.ones(8) * 2
        assert _older_collections_wait(), "the other thread's block still runs"
    finally:
        leave.set()
        t.join()
    assert gc.get_threshold() == before and torch.equal(y, torch.full((8,), 2.0))


def test_block_exit_frees_an_evicted_tensor_held_by_a_cycle_with_a_young_collection():
    """An evicted storage whose last wrapper sits in a reference cycle made in the block: the exit collects the
    young generations (what the block made), which frees it; no full collection runs and nothing is replayed."""
    budget = coop_arena.Budget(64 << 10, device="cpu")  # four 16 KiB tensors
    generations = []

    def seen(phase, info):
        if phase == "start":
            generations.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        with budget:
            kept = torch.randn(4096) * 2
            storage = weakref.ref(kept._cell.storage)
            cycle = [kept]
            cycle.append(cycle)
            del kept
            fillers = [torch.randn(4096) * 2 for _ in range(4)]
            assert storage().state is State.EVICTED
            del cycle, fillers
            made = len(generations)
    finally:
        gc.callbacks.remove(seen)
    assert generations[made:] == [1], "one collection of the young generations at the exit, no full one"
    assert 2 not in generations and storage() is None
    assert budget.stats.evictions >= 1 and budget.stats.exit_rematerializations == 0
    assert budget.stats.exit_recompute_cost == 0


def test_a_tight_training_step_leaves_no_record_in_a_reference_cycle():
    """Records die by reference counting (Note [Cyclic collection]): in-place writes (ReLU(inplace), +=) under
    eviction, then a full collection finds none of the engine's objects as garbage."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(32, 32), nn.ReLU(inplace=True))])
    x = torch.randn(64, 32)

    def step(budget):
        with budget:
            h = model(x) * 2
            h += 1
            h.square().sum().backward()

    probe = coop_arena.Budget(1 << 24, device="cpu")
    step(probe)
    budget = coop_arena.Budget(probe.stats.peak_bytes // 2, device="cpu")
    step(budget)
    assert budget.stats.evictions > 0 and budget.stats.rematerializations > 0
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        step(budget)
        gc.collect()
        kinds = {type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("coop_arena")}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert budget.stats.evictions > 0 and budget.stats.rematerializations > 0
    assert not kinds, f"records left in reference cycles: {sorted(kinds)}"
    for p in model.parameters():
        p.grad = None


def test_soak_500_steps_occupancy_and_objects():
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(32, 32), nn.ReLU(inplace=True))],
                          nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    probe = coop_arena.Budget(1 << 24, device="cpu")
    with probe:
        nn.functional.cross_entropy(model(x), y).backward()
    budget = coop_arena.Budget(probe.stats.peak_bytes // 2, device="cpu")
    counts, evictions = [], 0
    for step in range(500):
        opt.zero_grad()
        with budget:
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
        opt.step()
        del loss
        assert budget.memory.used_bytes == 0
        evictions += budget.stats.evictions
        if step in (99, 499):
            gc.collect()
            counts.append(len(gc.get_objects()))
    assert evictions > 0
    assert counts[1] <= counts[0], f"live objects grew from {counts[0]} to {counts[1]}"


def test_a_storage_read_by_many_short_lived_readers_forgets_them():
    """Each death of a reader asked whether the storage still had readers by walking every reference it had ever
    had, freed readers included: O(N) per op for a gradient fanned out to N ops, or a base split into N views
    (measured: 90 -> 275 us per op from 1,000 to 8,000 readers). The question now stops at the first reader and
    drops the freed ones it passed."""
    from types import SimpleNamespace
    from coop_arena.storage import Storage, add_input
    s = Storage(sid=0, nbytes=512, cost=1.0, evictable=True, expensive=False)
    readers = [Storage(sid=i, nbytes=512, cost=1.0, evictable=True, expensive=False,
                       payload=SimpleNamespace(recipe=object())) for i in range(1, 1001)]
    for r in readers:
        add_input(r, s)
    for r in readers[:-1]:
        r.state = State.FREED
    assert lifetime._has_readers(s) and len(s.consumers) == 1 and s.consumers[0]() is readers[-1]
    readers[-1].state = State.FREED
    assert not lifetime._has_readers(s) and s.consumers == []


def test_an_interrupt_while_a_block_closes_its_patches_leaves_the_next_blocks_whole():
    """The patches of an open block (torch.Tensor.data's guard among them) are put back one at a time: a Ctrl-C
    half-way left them listed as replaced, so the next block installed none, and every exit after that raised
    AttributeError (an inherited attribute deleted twice)."""
    from coop_arena import patches

    class Meta(type):
        armed = True

        def __setattr__(cls, name, value):
            if Meta.armed and name == "hook":
                Meta.armed = False
                raise KeyboardInterrupt  # as Ctrl-C would, between two restorations
            super().__setattr__(name, value)

    class Fake(metaclass=Meta):
        hook = 1

    budget = coop_arena.Budget(1 << 20, device="cpu")
    budget.__enter__()
    (torch.ones(2) * 2).sum()
    patches._saved.insert(0, (Fake, "hook", 1))  # restored last
    with pytest.raises(KeyboardInterrupt):
        budget.__exit__(None, None, None)
    for _ in range(2):
        with budget:
            assert "data" in torch.Tensor.__dict__  # the guard is installed again
            (torch.ones(2) * 2).sum()
        assert "data" not in torch.Tensor.__dict__ and not patches._saved
