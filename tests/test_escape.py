"""Tensors that escape a Budget behave like plain tensors, also on the paths that do not go through aten dispatch
(Note [Escaped tensors] in coop_arena/tensor.py).

Every path runs on the same tensor made three ways: without a Budget (the reference), inside a block with its
storage evicted first, and after the block with its storage evicted at exit (so the exit copy replays it). Inside
the block a path either gives the reference's result (restoring the storage) or, where it would hand out raw
arena memory, raises RawMemoryError before anything changes. A tensor whose storage was dropped by a failed
block raises TensorLost from every path.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import coop_arena
from coop_arena.storage import State

# numpy's warning that PyTorch's own __array__ takes no copy= argument (plain tensors give it too)
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")

X = torch.arange(4096, dtype=torch.float32).reshape(64, 64) / 7  # 16 KiB
W = nn.Parameter(torch.linspace(-1, 1, 4096).reshape(64, 64))  # a leaf that requires grad

CASES = {
    "float32": lambda: X * 2,
    "int64": lambda: torch.arange(2048).reshape(32, 64) * 3,
    "view": lambda: (X * 2)[1:, ::2],  # non-contiguous, storage offset 64
    "scalar": lambda: (X * 2).sum(),  # 0-d, like a loss
    "grad": lambda: W * 2,  # not a leaf, requires grad
}
LOST_CASES = ["float32", "int64", "view"]
BUDGET = 64 << 10  # four 16 KiB tensors: a few fillers evict the one under test


@pytest.fixture(autouse=True, scope="module")
def _frozen_heap():
    """A block that ends with an evicted storage still in use collects cycles first (Note [Block exit]); the
    objects alive before these tests are set aside from those collections, which then take milliseconds."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def _save_load(t):
    f = io.BytesIO()
    torch.save(t, f)
    f.seek(0)
    return torch.load(f)


def _parameter_step(t):
    p = nn.Parameter(t)
    opt = torch.optim.SGD([p], lr=0.1)
    (p * p).sum().backward()
    opt.step()
    return p


def _buffer(t):
    m = nn.Module()
    m.register_buffer("b", t)
    m2 = copy.deepcopy(m)
    return m.b is t, _save_load(m.state_dict())["b"], m2.b


def _deepcopy_views(t):
    a, b = copy.deepcopy([t, t[0]])
    return a, b, a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


PATHS = {
    "tolist": lambda t: t.tolist(),
    "numpy": lambda t: t.numpy(),
    "numpy_force": lambda t: t.numpy(force=True),
    "asarray": np.asarray,
    "array_copy": np.array,
    "asarray_nocopy": lambda t: np.asarray(t, copy=False),
    "save_load": _save_load,
    "pickle": lambda t: pickle.loads(pickle.dumps(t)),
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "deepcopy_views": _deepcopy_views,
    "dlpack": torch.from_dlpack,
    "dlpack_copy": lambda t: torch.from_dlpack(t, copy=True),
    "data_ptr": lambda t: t.data_ptr() - t.untyped_storage().data_ptr(),
    "untyped_storage": lambda t: t.untyped_storage().nbytes(),
    "repr": repr,
    "format": lambda t: format(t, ".3f" if t.dim() == 0 else ""),
    "iter": list,
    "index": lambda t: (t[1], t[..., 1:3]),
    "equal": lambda t: (torch.equal(t, t.clone()), torch.equal(t, t + 1)),
    "parameter": nn.Parameter,
    "parameter_copy": lambda t: copy.copy(nn.Parameter(t)),  # a Parameter still, as for a plain one
    "parameter_step": _parameter_step,
    "buffer": _buffer,
    "apply": lambda t: t.apply_(lambda v: v * 2 + 1),  # C++ over the bytes (it crashed the interpreter inside)
}
RAW = {"numpy", "dlpack", "data_ptr", "untyped_storage"}  # refused inside the block
# paths whose result may be a coop_arena.Tensor where the reference's is plain (views of the tensor itself)
WRAPPED = {"inside": {"copy", "iter", "index", "parameter", "parameter_copy", "buffer", "deepcopy_views", "apply"},
           "after": {"parameter", "parameter_step", "buffer", "apply"}}
SHARES = ("numpy", "numpy_force", "asarray", "asarray_nocopy", "copy", "dlpack", "parameter", "parameter_copy")  # memory, after


def canon(x, wrapped_ok: bool):
    """What a result is, as plain data: type, dtype, shape, strides, offset, requires_grad and values."""
    if isinstance(x, coop_arena.Tensor):
        assert wrapped_ok, "a coop_arena.Tensor where a plain tensor was expected"
        return ("tensor", isinstance(x, nn.Parameter), x.dtype, tuple(x.shape), x.stride(), x.storage_offset(),
                x.requires_grad, x.as_plain().tolist())
    if isinstance(x, torch.Tensor):
        assert type(x) in (torch.Tensor, nn.Parameter), type(x)
        return ("tensor", type(x) is nn.Parameter, x.dtype, tuple(x.shape), x.stride(), x.storage_offset(),
                x.requires_grad, x.tolist())
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.shape, x.strides, x.tolist())
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [canon(v, wrapped_ok) for v in x])
    return x


# PyTorch words one error differently for a subclass (nn.Parameter calls requires_grad_ on it): same type, same cause
REWORDED = {"Only Tensors of floating point and complex dtype can require gradients":
            "only Tensors of floating point dtype can require gradients"}


def run(fn, *args):
    try:
        return "ok", fn(*args)
    except Exception as e:  # the reference's error is part of its behaviour
        return "error", (type(e).__name__, REWORDED.get(str(e), str(e)))


def reference(case: str, path: str):
    t = CASES[case]()
    status, out = run(PATHS[path], t)
    return t, status, (canon(out, False) if status == "ok" else out), out


def evicted(case: str) -> coop_arena.Tensor:
    """The case's tensor, made in the active (tight) Budget and pushed out by fillers of its size that die again."""
    t = CASES[case]()
    s = t._cell.storage
    fillers = []
    for i in range(12):
        if s.state is State.EVICTED:
            break
        fillers.append(torch.full((4096,), float(i)))
        fillers = fillers[-3:]
    assert s.state is State.EVICTED, "the tight budget did not evict the tensor"
    return t


def memory(x) -> int:
    return x.__array_interface__["data"][0] if isinstance(x, np.ndarray) else x.data_ptr()


# Training an arena tensor in place inside a block freezes what read its old value (Rule 6), which a tight budget
# does not hold: inside the block nn.Parameter(t) itself is checked ("parameter"), its training after the block.
@pytest.mark.parametrize("path", [p for p in PATHS if p != "parameter_step"])
@pytest.mark.parametrize("case", CASES)
def test_inside_the_block(case, path):
    _, want_status, want, _ = reference(case, path)
    budget = coop_arena.Budget(BUDGET, device="cpu")
    with budget:
        t = evicted(case)
        before = budget.stats.rematerializations
        status, out = run(PATHS[path], t)
        if path in RAW:
            assert status == "error" and out[0] == "RawMemoryError", out
            assert "coop_arena.pinned(t)" in out[1] and f"storage {t._cell.storage.sid}" in out[1]
            if path != "dlpack":  # (__dlpack_device__, which from_dlpack asks first, reads is_pinned())
                assert t._cell.storage.state is State.EVICTED  # refused before anything changed
        else:
            got = canon(out, path in WRAPPED["inside"]) if status == "ok" else out
            if path in ("repr", "format") and got.startswith("coop_arena.Tensor("):  # where the bytes were
                assert got.startswith(f"coop_arena.Tensor(storage={t._cell.storage.sid}, evicted, ")
                got = got[got.index(", evicted, ") + len(", evicted, "):-1]
            assert (status, got) == (want_status, want)
            if status == "ok":
                assert budget.stats.rematerializations > before  # read from a restored storage
        if path == "copy":
            assert out._cell.storage is t._cell.storage  # a new tensor over the same bytes, as a plain copy is
        budget.check_invariants()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES)
def test_after_the_block(case, path):
    plain, want_status, want, want_out = reference(case, path)
    budget = coop_arena.Budget(BUDGET, device="cpu")
    with budget:
        t = evicted(case)
    st = budget.stats
    assert st.exit_rematerializations >= 1  # the exit copy replayed it
    assert 0 < st.exit_recompute_cost <= st.recompute_cost  # and its cost is counted apart, inside the total
    assert st.exit_overhead == st.exit_recompute_cost / st.compute_cost
    assert isinstance(t, coop_arena.Tensor) and t.untyped_storage()._cdata != budget.arena.key
    status, out = run(PATHS[path], t)
    got = canon(out, path in WRAPPED["after"]) if status == "ok" else out
    assert (status, got) == (want_status, want)
    if status == "ok" and path in SHARES:
        assert (memory(out) == t.data_ptr()) == (memory(want_out) == plain.data_ptr())


# deepcopy_views: in a later block t[0] is a plain tensor, and deepcopy of a plain tensor inside a block fails (its
# new_empty comes back from the arena), a limit of plain tensors, not of escaped ones
@pytest.mark.parametrize("path", [p for p in PATHS if p != "deepcopy_views"])
@pytest.mark.parametrize("case", ["float32", "view"])
def test_escaped_tensor_in_a_later_block(case, path):
    """In a later block an escaped tensor is an input from outside (Rule 1): every path works as on a plain one."""
    plain, want_status, want, want_out = reference(case, path)
    budget = coop_arena.Budget(BUDGET, device="cpu")
    with budget:
        t = evicted(case)
    with budget:
        status, out = run(PATHS[path], t)
        got = canon(out, True) if status == "ok" else out
        assert (status, got) == (want_status, want)
        if status == "ok" and path in SHARES:
            assert (memory(out) == t.data_ptr()) == (memory(want_out) == plain.data_ptr())


# numpy refuses copy=False before it asks the tensor anything, as for a plain tensor
@pytest.mark.parametrize("path", [p for p in PATHS if p != "asarray_nocopy"])
@pytest.mark.parametrize("case", LOST_CASES)
def test_lost_tensor_raises_tensor_lost_everywhere(case, path):
    budget = coop_arena.Budget(BUDGET, device="cpu")
    with pytest.raises(KeyError):
        with budget:
            t = evicted(case)
            raise KeyError("the step failed")
    assert budget.stats.dropped >= 1
    why = t._cell.storage.payload.lost
    assert why and "ended with an error" in why and "Run the step again" in why  # and what to do
    assert f"of {t._cell.storage.nbytes // 1024}.00 KiB ({t._cell.storage.nbytes} bytes) had been evicted" in why
    if path in ("repr", "format"):  # printing shows why instead of raising
        assert why in PATHS[path](t)
        return
    with pytest.raises(coop_arena.TensorLost) as err:
        PATHS[path](t)
    assert str(err.value) == why


def test_escaped_tensors_of_one_storage_share_their_copy():
    budget = coop_arena.Budget(BUDGET, device="cpu")
    with budget:
        y = X * 2
        v = y[1:, ::2]
    assert y.untyped_storage()._cdata == v.untyped_storage()._cdata
    assert v.data_ptr() == y.data_ptr() + 64 * 4
    assert torch.Tensor.data_ptr(v) == v.data_ptr()  # C++ that reads the wrapper's storage sees the same bytes
    v.numpy()[0, 0] = -1.0  # a write through numpy shows in every view, as on plain tensors
    assert y[1, 0].item() == -1.0
    f = io.BytesIO()
    torch.save([y, v], f)
    f.seek(0)
    a, b = torch.load(f)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # saved once, loaded as views


def test_raw_memory_through_pinned_inside_the_block():
    """What RawMemoryError points to: pinned() hands out raw arena bytes that numpy and DLPack share."""
    budget = coop_arena.Budget(BUDGET, device="cpu")
    with budget:
        t = X * 2
        with pytest.raises(coop_arena.RawMemoryError, match=r"coop_arena\.pinned\(t\)"):
            t.numpy()
        with coop_arena.pinned(t) as raw:
            a, d = raw.numpy(), torch.from_dlpack(raw)
            assert a.ctypes.data == raw.data_ptr() == d.data_ptr()
            assert raw.untyped_storage()._cdata == budget.arena.key
            a[0, 0] = -1.0
        assert t[0, 0].item() == -1.0


@torch.library.custom_op("coop_arena_test::value_and_index", mutates_args=())
def value_and_index(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, torch.arange(x.numel())


@value_and_index.register_fake
def _(x):
    return torch.empty_like(x), torch.empty(x.numel(), dtype=torch.int64, device=x.device)


def test_output_of_a_failed_op_is_lost_and_the_error_is_kept():
    """An op (with no out= overload) places its first output, then cannot place its second: the first's wrapper,
    freed with the error but still held by its traceback, ends the block as lost, and the OutOfBudget is what
    leaves the block."""
    budget = coop_arena.Budget(48 << 10, device="cpu")
    with pytest.raises(coop_arena.OutOfBudget) as err:
        with budget:
            value_and_index(X.flatten() * 1)  # 16 KiB in, 16 KiB placed, then 32 KiB do not fit
    assert budget.stats.dropped == 1
    held, tb = [], err.value.__traceback__
    while tb is not None:
        held += [v for vs in list(tb.tb_frame.f_locals.values()) if isinstance(vs, list)
                 for v in vs if isinstance(v, coop_arena.Tensor)]
        tb = tb.tb_next
    lost = [t for t in held if t._cell.storage.payload.lost is not None]
    assert len(lost) == 1 and lost[0].shape == (4096,) and lost[0].dtype == torch.float32
    with pytest.raises(coop_arena.TensorLost, match="was freed when the op that made it failed"):
        lost[0].tolist()


# ------------------------------------------------------------------------------------- rolling forward (coop)
def held_output_step(budget):
    """A 100-layer chain whose output the caller still holds after backward, as a training loop that keeps the
    logits does: the block's exit copies it out."""
    torch.manual_seed(0)
    layers = []
    for _ in range(100):
        layers += [nn.Linear(64, 64), nn.Tanh()]
    model = nn.Sequential(*layers)
    x = torch.randn(16, 64)
    with budget if budget is not None else contextlib.nullcontext():
        out = model(x)
        out.sum().backward()
    return model, out


def test_a_held_output_is_rolled_forward_instead_of_replayed_at_exit(monkeypatch):
    """Note [Dead storages]: when the storages the evicted output's rebuild reads die, coop restores the output
    then instead of keeping them, so the exit has nothing to replay; without that rule the same step replays a
    long run of the forward pass at exit. Both stay bitwise exact."""
    plain_model, plain_out = held_output_step(None)
    ample = coop_arena.Budget(1 << 30, device="cpu")
    held_output_step(ample)
    nbytes = int(0.15 * ample.stats.peak_bytes)
    runs = {}
    for rule in ("on", "off"):
        if rule == "off":
            monkeypatch.setattr(coop_arena.lifetime.Lifetime, "_roll_forward", lambda self, s: None)
        budget = coop_arena.Budget(nbytes, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            model, out = held_output_step(budget)
        assert torch.equal(out.as_plain(), plain_out.detach())
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), plain_model.parameters()))
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), plain_model.parameters()))
        runs[rule] = budget.stats
    assert runs["on"].evictions > 0 and runs["on"].rematerializations > 0
    assert runs["on"].exit_rematerializations == 0 and runs["on"].exit_recompute_cost == 0
    assert runs["off"].exit_rematerializations > 50, "the step replays nothing at exit: the test tests nothing"
    assert runs["on"].compute_overhead < runs["off"].compute_overhead < 3.0


def _pgd_step(model, x, y, budget=None):
    """Adversarial training as commonly written: the perturbation is updated through `.data` inside the step."""
    ctx = budget if budget is not None else contextlib.nullcontext()
    with ctx:
        delta = torch.zeros_like(x, requires_grad=True)
        for _ in range(3):
            nn.functional.cross_entropy(model(x + delta), y).backward()
            delta.data = (delta + 0.01 * delta.grad.sign()).clamp(-0.03, 0.03)
            delta.grad.zero_()
        model.zero_grad()
        loss = nn.functional.cross_entropy(model(x + delta.detach()), y)
        loss.backward()
    return [loss.detach(), delta.detach()] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("policy", ["coop", "dtr"])
def test_data_assignment_inside_the_block_is_honoured(policy):
    """`t.data = new` copies new's sizes and storage into the wrapper's TensorImpl, which holds no bytes: the
    wrapper kept reading its old storage, so a PGD loop trained on a perturbation that never moved (and a new value
    of another shape read past its storage, then failed at exit)."""
    def model():
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())], nn.Linear(64, 10))
    x, y = torch.randn(256, 64), torch.arange(256) % 10
    want = _pgd_step(model(), x, y)
    probe = coop_arena.Budget(1 << 24, device="cpu")
    _pgd_step(model(), x, y, probe)
    budget = coop_arena.Budget(probe.stats.peak_bytes * 7 // 10, device="cpu", policy=policy)
    got = _pgd_step(model(), x, y, budget)
    assert budget.stats.evictions > 0 and budget.stats.rematerializations > 0
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert not torch.equal(got[1], torch.zeros_like(x))  # the perturbation moved

    def grow(budget=None):  # a new value of another shape
        with budget if budget is not None else contextlib.nullcontext():
            h = torch.tanh(x * 2)
            h.data = torch.cat([h.data, h.data * 0.5], 1)
            out = h.sum(1) * 1
        return h, out
    (h0, o0), (h1, o1) = grow(), grow(coop_arena.Budget(1 << 20, device="cpu"))
    assert h1.shape == h0.shape == (256, 128) and torch.equal(h1, h0) and torch.equal(o1, o0)


def test_data_assignment_outside_the_block_and_refused_cases():
    """After the block a wrapper takes `new`'s bytes as a plain tensor would (shared, not copied); inside it, `new`
    must be a tensor of the same block (the arena does not hold another's bytes): a typed error says so."""
    outside = torch.ones(3)
    with coop_arena.Budget(1 << 20, device="cpu"):
        h = X * 2
        with pytest.raises(coop_arena.BudgetUsageError, match=r"t\.data = new\.clone\(\)"):
            h.data = outside
        assert torch.equal(h * 1, X * 2)  # nothing changed
    new = torch.full((4, 3), 7.0)
    h.data = new
    assert torch.equal(h * 1, new) and h.shape == (4, 3)
    new.add_(1)  # one storage, as for a plain tensor
    assert torch.equal(h * 1, torch.full((4, 3), 8.0))
    with coop_arena.Budget(1 << 20, device="cpu"):
        with pytest.raises(coop_arena.BudgetUsageError, match="earlier one"):
            h.data = X * 3


def test_data_assignment_and_apply_from_another_thread_are_refused():
    """Any op on a block's tensor from another thread raises BudgetUsageError (the block may move or evict its
    bytes at any moment); `t.data = u` and `t.apply_` did not, and changed the block's wrapper counts from there."""
    import threading
    results = {}
    budget = coop_arena.Budget(1 << 20, device="cpu")
    with budget:
        t, u = torch.ones(4) * 2, torch.ones(8) * 3

        def other():
            for name, fn in (("data", lambda: setattr(t, "data", u)), ("apply", lambda: t.apply_(lambda v: v))):
                try:
                    fn()
                    results[name] = "ran"
                except coop_arena.BudgetUsageError:
                    results[name] = "refused"
        th = threading.Thread(target=other)
        th.start()
        th.join()
        assert t.shape == (4,) and t._cell.storage.payload.wrappers == 1
    assert results == {"data": "refused", "apply": "refused"}
