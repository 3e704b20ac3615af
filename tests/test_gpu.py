"""The CUDA path, on a real GPU (`@pytest.mark.gpu`: skipped with a reason elsewhere; `make gpu-check` runs it).

Each test states a property the CPU suite can only check through a mirror: the device a Budget resolves to,
training bitwise equal to plain PyTorch under eviction, random ops replayed from the CUDA generator's seed and
Philox offset, relocation through the Triton kernel, the stream guard, no host synchronisation added per op,
and pinned views as CUDA array interface / DLPack producers.

Bitwise comparisons run with `torch.use_deterministic_algorithms(True, warn_only=True)` (the `deterministic`
fixture; `make gpu-check` also sets CUBLAS_WORKSPACE_CONFIG, which cuBLAS reads at start) and first check that
plain PyTorch reproduces itself, so a mismatch is the Budget's, not the GPU's.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
import torch.nn.functional as F

import coop_arena
from coop_arena.arena import Arena
from coop_arena.storage import State
from training import bitwise_equal, state, train

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]
compiled = pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET=1: the GPU layer needs compiled Triton kernels")


@pytest.fixture
def deterministic():
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(was, warn_only=warn_only)


def plain_reference(name: str):
    """Plain PyTorch's parameters after train(name) on CUDA, checked to reproduce themselves."""
    ref = state(train(name, device="cuda"))
    assert bitwise_equal(ref, state(train(name, device="cuda"))), (
        f"plain PyTorch does not reproduce itself on {torch.cuda.get_device_name()} for {name}: a nondeterministic "
        f"kernel, so no comparison with a Budget can be made")
    return ref


def engine_stats(name: str) -> coop_arena.BudgetStats:
    """One step under an ample Budget: the engine's peak (no eviction) and lower bound."""
    probe = coop_arena.Budget(1 << 30, device="cuda")
    train(name, probe, steps=1, device="cuda")
    assert probe.stats.evictions == 0
    return probe.stats


def engine_peak(name: str) -> int:
    return engine_stats(name).peak_bytes


def check_exact_under_eviction(name: str, fraction: float, **kw):
    ref = plain_reference(name)
    st = engine_stats(name)
    nbytes = int(fraction * st.peak_bytes)
    if nbytes < 1.25 * st.lower_bound:  # on CUDA one op can hold most of a step's peak (cuDNN runs the whole
        nbytes = (st.lower_bound + st.peak_bytes) // 2  # multi-layer LSTM, reserve space included, as one op)
    budget = coop_arena.Budget(nbytes, device="cuda", **kw)
    seen = []
    model = train(name, budget, device="cuda", check=lambda b: seen.append(b.stats))
    assert all(s.evictions > 0 and s.rematerializations > 0 and s.peak_bytes <= s.budget for s in seen), seen
    assert bitwise_equal(ref, state(model)), f"{name} under {budget} differs from plain PyTorch"


# ------------------------------------------------------------------------------------------------- devices
def test_default_device_is_the_current_cuda_device():
    current = torch.device("cuda", torch.cuda.current_device())
    assert coop_arena.Budget(1 << 20).device == current
    budget = coop_arena.Budget(1 << 20, device="cuda")
    assert budget.device == current
    w = torch.randn(64, 64, device="cuda")  # a parameter-like tensor from before the block: read, not refused
    with budget:
        y = torch.relu(w @ w)
        assert isinstance(y, coop_arena.Tensor) and budget.arena.owns(y.as_plain())
    assert budget.stats.peak_bytes >= 2 * 64 * 64 * 4 and torch.equal(y.as_plain(), torch.relu(w @ w))


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt", "lstm"])
def test_training_is_bitwise_plain_pytorch_under_eviction(deterministic, name):
    check_exact_under_eviction(name, 0.5)


@pytest.mark.parametrize("policy", ["dtr", "dte"])
def test_baselines_are_exact_too(deterministic, policy):
    check_exact_under_eviction("gpt", 0.5, policy=policy)


def test_adversarial_training_through_cudnn_batch_norm_is_exact_and_keeps_no_gradient(deterministic):
    # cuDNN's batch-norm backward is recorded without the running statistics it does not read (dispatch.py,
    # _UNREAD_IN_TRAINING): the next forward's update of them must not keep the gradients computed since, and its
    # replays without them must give the same bits.
    from test_workflows import adversarial_model, adversarial_step

    def run(budget=None):
        model = adversarial_model().cuda()
        x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(1)).cuda()
        y = torch.arange(8, device="cuda") % 10
        with budget if budget is not None else contextlib.nullcontext():
            loss = adversarial_step(model, x, y)
        return [loss] + [p.grad for p in model.parameters()] + list(model.buffers())

    expected = run()
    assert bitwise_equal(expected, run()), "plain PyTorch does not reproduce itself here"
    probe = coop_arena.Budget(1 << 30, device="cuda")
    run(probe)
    budget = coop_arena.Budget(probe.stats.peak_bytes // 2, device="cuda")
    assert bitwise_equal(expected, run(budget))
    assert budget.stats.evictions > 0 and budget.stats.frozen == 0


# --------------------------------------------------------------------------------------------------- random
def test_cuda_generator_state_is_seed_and_philox_offset():
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    gen.manual_seed(1234)
    before = gen.get_state()
    assert before.dtype == torch.uint8 and before.numel() == 16  # uint64 seed, int64 offset
    x = torch.ones(1 << 20, device="cuda")
    first = F.dropout(x, 0.5)
    after = gen.get_state()
    seed0, offset0 = before.view(torch.int64).tolist()
    seed1, offset1 = after.view(torch.int64).tolist()
    assert seed0 == seed1 == 1234 and offset1 > offset0  # the kernel reserved Philox numbers
    gen.set_state(before)
    assert torch.equal(F.dropout(x, 0.5), first) and torch.equal(gen.get_state(), after)


RANDOM = {
    "rand": lambda: torch.rand(4096, device="cuda"),
    "randn": lambda: torch.randn(4096, device="cuda"),
    "randperm": lambda: torch.randperm(4096, device="cuda"),
    "normal_": lambda: torch.empty(4096, device="cuda").normal_(),
    "bernoulli": lambda: torch.bernoulli(torch.full((4096,), 0.3, device="cuda")),
    "dropout": lambda: F.dropout(torch.ones(4096, device="cuda"), 0.5),
}


def test_random_ops_recompute_the_same_bits_on_cuda():
    torch.manual_seed(7)
    expected = {name: make() for name, make in RANDOM.items()}
    torch.manual_seed(7)
    budget = coop_arena.Budget(1 << 20, device="cuda")
    got = {}
    with budget:
        for name, make in RANDOM.items():
            r = make()
            budget.memory.evict(r._cell.storage)  # the next read replays the op from its saved seed and offset
            got[name] = r.as_plain().clone()
            assert r._cell.storage.state is State.RESIDENT
    assert budget.stats.rematerializations >= len(RANDOM)
    for name in RANDOM:
        assert torch.equal(got[name].as_plain(), expected[name]), name


def test_a_cudnn_lstm_with_dropout_replays_the_same_bits():
    """A multi-layer LSTM's inter-layer dropout on cuDNN draws from cuDNN's own state buffer (an argument of the
    op, which cuDNN may advance), not only from the CUDA generator that a replay restores (Rule 4). Its output,
    evicted and replayed, must be the bits first computed, or the engine must keep it resident (unevictable)."""
    torch.manual_seed(0)
    lstm = torch.nn.LSTM(64, 128, num_layers=2, dropout=0.3, device="cuda")
    x = torch.randn(16, 8, 64, device="cuda")
    budget = coop_arena.Budget(1 << 26, device="cuda")
    with budget:
        out, _ = lstm(x)
        # (its flat weight buffer, returned beside the fresh outputs, once made the op pass for a view: the outputs
        # came back as plain tensors, outside the arena)
        assert isinstance(out, coop_arena.Tensor)
        first = out.as_plain().clone()
        storage = out._cell.storage
        if storage.evictable:
            budget.memory.evict(storage)  # the next read replays _cudnn_rnn
            again = out.as_plain().clone()
            assert storage.state is State.RESIDENT and budget.stats.rematerializations >= 1
            assert torch.equal(first, again), "the replayed LSTM drew another dropout mask"
        out.sum().backward()
    assert all(p.grad is not None for p in lstm.parameters())


def test_a_replay_leaves_the_next_cudnn_rnn_dropout_as_plain(deterministic):
    """Replaying a random op must not re-seed cuDNN's RNN dropout (Note [Swapping a CUDA generator's state] in
    recipe.py): set_state would make the next training LSTM with dropout draw a new seed, hence other masks and
    a generator moved on for every random op after it."""
    lstm = torch.nn.LSTM(64, 128, num_layers=2, dropout=0.3, device="cuda")
    x = torch.randn(16, 8, 64, device="cuda")

    def run(budget=None):
        torch.manual_seed(0)
        with budget if budget is not None else torch.enable_grad():
            first, _ = lstm(x)
            d = F.dropout(x * 2, 0.5)
            if budget is not None:
                budget.memory.evict(d._cell.storage)
                d = d + 0  # replays the dropout with the generator state it first ran with
            second, _ = lstm(x)
            outs = [t.as_plain().clone() if isinstance(t, coop_arena.Tensor) else t.detach().clone()
                    for t in (first, d, second)]
        return outs + [torch.cuda.default_generators[torch.cuda.current_device()].get_state()]

    expected = run()
    assert all(torch.equal(a, b) for a, b in zip(expected, run())), "plain PyTorch does not reproduce itself"
    budget = coop_arena.Budget(1 << 26, device="cuda")
    got = run(budget)
    assert budget.stats.rematerializations >= 1
    for name, a, b in zip(["first LSTM", "dropout", "second LSTM", "generator state"], got, expected):
        assert torch.equal(a, b), name


# ---------------------------------------------------------------------------------------------- relocation
@compiled
def test_arena_move_on_cuda_is_a_memmove():
    arena = Arena(1 << 22, torch.device("cuda", torch.cuda.current_device()), 1 << 22)
    arena.buffer.copy_(torch.randint(0, 256, (1 << 22,), dtype=torch.uint8, device="cuda"))
    for src, dst, n in [(0, 2 << 20, 1 << 20), (4096, 0, 3 << 20), (0, 4096, 3 << 20), (7, 8, 1 << 20)]:
        expected = arena.buffer.clone()
        expected[dst:dst + n] = arena.buffer[src:src + n].clone()
        arena.move(src, dst, n)
        assert torch.equal(arena.buffer, expected), (src, dst, n)


@compiled
def test_relocation_on_cuda_goes_through_the_kernel_and_stays_exact(deterministic, monkeypatch):
    from coop_arena.kernels import copy as kcopy
    from test_relocation import StackRNN

    calls, real = [], kcopy.arena_move
    monkeypatch.setattr(kcopy, "arena_move", lambda *a: (calls.append(a[1:]), real(*a)))

    def run(budget, steps=2):
        torch.manual_seed(0)
        model = StackRNN().cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for i in range(steps):
            x = torch.randn(48, 16, 32, generator=torch.Generator().manual_seed(i)).cuda()
            opt.zero_grad()
            with budget if budget is not None else torch.enable_grad():
                model(x).pow(2).mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    probe = coop_arena.Budget(1 << 26, device="cuda")
    run(probe, steps=1)
    budget = coop_arena.Budget(int(0.5 * probe.stats.peak_bytes), device="cuda")
    params = run(budget)
    assert budget.stats.relocations > 0 and len(calls) >= budget.stats.relocations
    assert bitwise_equal(run(None), params)


# ------------------------------------------------------------------------------------------------- streams
def test_an_op_on_a_side_stream_is_refused_and_the_block_stays_usable():
    w = torch.randn(256, 256, device="cuda")
    side = torch.cuda.Stream()
    budget = coop_arena.Budget(4 << 20, device="cuda")
    with budget:
        y = w @ w
        with torch.cuda.stream(side):
            with pytest.raises(coop_arena.BudgetUsageError, match="stream"):
                y.relu()
        z = y.relu().sum()
    assert torch.equal(z.as_plain(), (w @ w).relu().sum())


def test_a_block_entered_on_a_side_stream_runs_there():
    w = torch.randn(256, 256, device="cuda")
    side = torch.cuda.Stream()
    budget = coop_arena.Budget(4 << 20, device="cuda")
    with budget:
        a = (w @ w).relu().sum()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        with budget:  # waits for the previous block's stream first
            b = (w @ w).relu().sum()
        with pytest.raises(coop_arena.BudgetUsageError):
            with budget:
                with torch.cuda.stream(torch.cuda.default_stream()):
                    w @ w
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(a.as_plain(), b.as_plain())


# ---------------------------------------------------------------------------------------- host syncs
def _syncs(fn) -> list[str]:
    """Warnings of every synchronising CUDA call `fn` makes (torch.cuda.set_sync_debug_mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("name, fraction", [("mlp", 1.0), ("gpt", 1.0), ("mlp", 0.5), ("cnn", 0.5)])
def test_a_block_adds_no_host_synchronisation(name, fraction):
    from coop_arena.examples import MODELS, batch, loss_fn

    torch.manual_seed(0)
    model = MODELS[name]().cuda()
    x, y = batch(name, 0, "cuda")
    budget = coop_arena.Budget(int(fraction * engine_peak(name)), device="cuda")

    def plain():
        loss_fn(name, model(x), y).backward()

    def block():
        with budget:
            loss_fn(name, model(x), y).backward()

    block()  # first block: one-time probes per op configuration
    expected = _syncs(plain)
    got = _syncs(block)
    assert len(got) <= len(expected), f"the block synchronised {len(got)} times, plain PyTorch {len(expected)}: {got}"
    if fraction < 1.0:
        assert budget.stats.rematerializations > 0


def test_the_first_block_copies_no_argument_from_outside_the_arena_on_the_device():
    """The first call of an op configuration compares its arguments from outside the arena before and after it
    (Note [Probing for hidden writes] in dispatch.py): the copies are in host memory, not on the device, where they
    would be outside the budget and the counted temporaries (here a 400 MB embedding table)."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(200_000, 512).cuda().requires_grad_(False)  # 400 MB, read by the first op
    head = torch.nn.Linear(512, 8).cuda()
    ids = torch.randint(0, 200_000, (8, 77), device="cuda")  # a configuration no other test ran
    budget = coop_arena.Budget(64 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with budget:
        head(emb(ids)).square().sum().backward()
    torch.cuda.synchronize()
    over = torch.cuda.max_memory_allocated() - base - budget.stats.temporary_peak
    assert over < 64 << 20, f"{over} bytes on the device beyond the arena and the counted temporaries"


# --------------------------------------------------------------------------------------------- pinned views
def test_pinned_views_are_cuda_array_interface_and_dlpack_producers():
    budget = coop_arena.Budget(4 << 20, device="cuda")
    w = torch.randn(128, 128, device="cuda")
    with budget:
        y = w @ w
        with coop_arena.pinned(y, readonly=True) as raw:
            iface = raw.__cuda_array_interface__
            start = budget.arena.buffer.data_ptr()
            assert iface["data"][0] == raw.data_ptr() and start <= raw.data_ptr() < start + budget.arena.nbytes
            assert iface["shape"] == (128, 128) and iface["typestr"] == "<f4"
            shared = torch.from_dlpack(raw)
            assert shared.data_ptr() == raw.data_ptr() and torch.equal(shared, w @ w)
