"""CuPy interop: the `backend` argument, pinned views as DLPack producers, and kernels from another array
library registered with torch.library.custom_op, recorded and recomputed like any op.

On the CPU the same mechanism runs with numpy in CuPy's place (numpy reads and writes torch CPU tensors
through DLPack). The CUDA tests need CuPy (`pip install 'coop-arena[cupy]'`) and a GPU; one of them runs the
CuPy example of docs/custom-kernels.md as written.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import coop_arena
from coop_arena import arena as arena_mod
from training import bitwise_equal

CUDA = torch.cuda.is_available()
try:
    import cupy
except Exception as e:  # missing, or built for another CUDA
    cupy, CUPY_MISSING = None, f"needs CuPy (pip install 'coop-arena[cupy]'): {type(e).__name__}: {e}"
else:
    CUPY_MISSING = None


def needs_cupy(test):
    for mark in (pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device"),
                 pytest.mark.skipif(CUPY_MISSING is not None, reason=CUPY_MISSING or "")):
        test = mark(test)
    return test


# ---------------------------------------------------------------------------------------------- the backend
def test_backend_is_validated():
    with pytest.raises(ValueError, match=r"unknown backend 'jax'; accepted: torch, cupy"):
        coop_arena.Budget(1 << 20, device="cpu", backend="jax")
    with pytest.raises(ValueError, match="backend='cupy'.*CUDA device.*cpu"):
        coop_arena.Budget(1 << 20, device="cpu", backend="cupy")
    with pytest.raises(ValueError, match="backend='cupy'.*meta"):
        coop_arena.Budget(1 << 20, device="meta", backend="cupy")
    assert coop_arena.Budget(1 << 20, device="cpu", backend="torch").arena.backend == "torch"


def test_cupy_backend_without_cupy_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    with pytest.raises(ImportError, match=r"backend='cupy' needs CuPy.*coop-arena\[cupy\]"):
        arena_mod._cupy_buffer(1024, torch.device("cuda", 0))


# ------------------------------------------------------------------------------------------- pinned views
def test_pinned_views_share_arena_memory_through_dlpack():
    budget = coop_arena.Budget(1 << 20, device="cpu")
    w = torch.randn(32, 32)
    expected = w @ w
    with budget:
        y = w @ w
        with coop_arena.pinned(y, readonly=True) as raw:
            start = budget.arena.buffer.data_ptr()
            assert start <= raw.data_ptr() < start + budget.arena.nbytes
            array = np.from_dlpack(raw)  # what cupy.from_dlpack(raw) is on CUDA
            assert array.ctypes.data == raw.data_ptr() and torch.from_dlpack(raw).data_ptr() == raw.data_ptr()
            assert np.array_equal(array, expected.numpy())
        with coop_arena.pinned(y) as raw:
            np.from_dlpack(raw)[:] *= 2  # a write from the other library lands in the arena
        assert not y._cell.storage.evictable  # no recipe can rebuild it now
        z = y.sum()
    assert torch.equal(y.as_plain(), expected * 2) and torch.equal(z, (expected * 2).sum())


# --------------------------------------------------------------------------------- custom ops through DLPack
NUMPY_CALLS = []


@torch.library.custom_op("coop_arena_test::numpy_scale", mutates_args=(), device_types="cpu")
def numpy_scale(x: torch.Tensor, s: float) -> torch.Tensor:
    """The documented CuPy kernel (docs/custom-kernels.md) with numpy in CuPy's place: it reads and writes through
    DLPack."""
    NUMPY_CALLS.append(x.numel())
    x = x.detach().contiguous()  # DLPack exports no tensor that requires grad
    y = torch.empty_like(x)
    np.multiply(np.from_dlpack(x), np.float32(s), out=np.from_dlpack(y))
    return y


@numpy_scale.register_fake
def _(x, s):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.s = inputs[1]


numpy_scale.register_autograd(lambda ctx, grad: (numpy_scale(grad, ctx.s), None), setup_context=_setup)


class ScaledMLP(nn.Module):
    """Linear layers with a library kernel after each activation."""

    def __init__(self, scale_op, width=256, depth=8):
        super().__init__()
        self.scale_op = scale_op
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = self.scale_op(torch.relu(layer(x)), 0.5)
        return x.square().mean()


def train_scaled(scale_op, budget, device, steps=2):
    torch.manual_seed(0)
    model = ScaledMLP(scale_op).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for i in range(steps):
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(i)).to(device)
        opt.zero_grad()
        with budget if budget is not None else torch.enable_grad():
            model(x).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_recomputed(scale_op, calls: list, device: str) -> None:
    """Train through `scale_op` plainly, then under half the engine's peak: the op's kernel runs again for the
    recomputations and the parameters come out bitwise equal."""
    calls.clear()
    expected = train_scaled(scale_op, None, device)
    plain_calls = len(calls)
    assert bitwise_equal(expected, train_scaled(scale_op, None, device)), "plain PyTorch does not reproduce itself"
    probe = coop_arena.Budget(1 << 26, device=device)
    train_scaled(scale_op, probe, device, steps=1)
    budget = coop_arena.Budget(int(0.5 * probe.stats.peak_bytes), device=device)
    calls.clear()
    got = train_scaled(scale_op, budget, device)
    assert budget.stats.rematerializations > 0 and len(calls) > plain_calls, (budget.stats, len(calls), plain_calls)
    assert bitwise_equal(expected, got)


def test_custom_op_through_dlpack_is_recomputed_on_cpu():
    check_recomputed(numpy_scale, NUMPY_CALLS, "cpu")


# ----------------------------------------------------------------------------------------------- CUDA, CuPy
EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "custom-kernels.md"


def documented_example() -> str:
    """The documented CuPy example (docs/custom-kernels.md: the python block after its test marker)."""
    found = re.search(r"<!-- tests/test_cupy.py runs this block.*?-->\s*```python\n(.*?)```", EXAMPLE.read_text(),
                      re.S)
    assert found, "docs/custom-kernels.md lost its CuPy example"
    return found.group(1)


def test_documented_example_is_found():
    code = documented_example()
    assert "cupy.RawKernel" in code and "torch.library.custom_op" in code and "register_fake" in code
    compile(code, str(EXAMPLE), "exec")


@pytest.fixture(scope="module")
def example():
    namespace = {"__name__": "documented_cupy_example"}
    exec(compile(documented_example(), str(EXAMPLE), "exec", dont_inherit=True), namespace)  # mylib::cupy_scale
    return namespace


class CountingKernel:
    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __call__(self, grid, block, args):
        self.calls.append(grid)
        self.kernel(grid, block, args)


@needs_cupy
def test_documented_cupy_kernel_is_recorded_and_recomputed(example):
    counting = example["_scale"] = CountingKernel(example["_scale"])
    check_recomputed(example["cupy_scale"], counting.calls, "cuda")


@needs_cupy
def test_cupy_backend_shares_its_memory_and_trains_exactly():
    budget = coop_arena.Budget(1 << 26, device="cuda", backend="cupy")
    owner = budget.arena._owner
    assert isinstance(owner, cupy.ndarray) and owner.data.ptr == budget.arena.buffer.data_ptr()
    assert owner.nbytes == budget.arena.nbytes
    expected = train_scaled(torch.mul, None, "cuda")
    probe = coop_arena.Budget(1 << 26, device="cuda")
    train_scaled(torch.mul, probe, "cuda", steps=1)
    tight = coop_arena.Budget(int(0.5 * probe.stats.peak_bytes), device="cuda", backend="cupy")
    got = train_scaled(torch.mul, tight, "cuda")
    assert tight.stats.rematerializations > 0 and bitwise_equal(expected, got)


@needs_cupy
def test_pinned_view_runs_a_cupy_kernel():
    budget = coop_arena.Budget(1 << 22, device="cuda")
    w = torch.randn(64, 64, device="cuda")
    with budget:
        y = w @ w
        with coop_arena.pinned(y) as raw:
            view = cupy.asarray(raw)  # through __cuda_array_interface__: no copy
            assert view.data.ptr == raw.data_ptr()
            cupy.multiply(view, 3, out=view)
    assert torch.equal(y.as_plain(), (w @ w) * 3)

