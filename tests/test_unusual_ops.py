"""Ops at the edges of what an arena can hold: in-place ops that resize `self`, out= kernels that compute other bits
than their functional op, meta kernels that plan other strides than the device's, sparse tensors from outside the
block, ops that write an argument and also return fresh tensors, and a normal exit that cannot restore a tensor
the user holds. Each is exact or refused with a typed error, and the Budget stays usable after a refusal."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import coop_arena
from coop_arena import OutOfBudget, UnsupportedOp

aten = torch.ops.aten


def _budget(nbytes=1 << 24, **kw):
    return coop_arena.Budget(nbytes, device="cpu", headroom=0, **kw)


def _tight(step, probe):
    """`step` under the smallest of a few fractions of its peak that runs (the lower bound of its footprint need
    not: a recompute pins its inputs); returns the Budget and the step's result."""
    for frac in (0.4, 0.5, 0.6, 0.7, 0.8):
        budget = _budget(max(int(frac * probe.stats.peak_bytes), probe.stats.lower_bound))
        try:
            return budget, step(budget)
        except OutOfBudget:
            continue
    raise AssertionError(f"no budget below 0.8 of the peak ran: {probe.stats}")


def _exact_when_ample_and_tight(step):
    """`step(budget)` (None: plainly) gives plain PyTorch's tensors bit for bit under an ample Budget and a tight
    one, where tensors are evicted and recomputed."""
    plain = step(None)
    probe = _budget()
    assert all(torch.equal(a, b) for a, b in zip(step(probe), plain))
    budget, result = _tight(step, probe)
    assert all(torch.equal(a, b) for a, b in zip(result, plain))
    assert budget.stats.evictions > 0 and budget.stats.rematerializations > 0, budget.stats


def _still_usable(budget):
    x = torch.randn(8, 8)
    with budget:
        y = (x * 2).exp()
    assert torch.equal(y, (x * 2).exp())


# ------------------------------------------------------------------------------- in-place ops that resize self
def _addbmm_step(self_shape, budget):
    torch.manual_seed(0)
    inp = torch.randn(self_shape, requires_grad=True)
    b1, b2 = torch.randn(5, 5, 5, requires_grad=True), torch.randn(5, 5, 10, requires_grad=True)
    with budget if budget is not None else torch.enable_grad():
        x = inp.clone()
        x.addbmm_(b1, b2)
        y = (x.exp() * x).sum()
        y.backward()
    return [x.detach().clone()] + [t.grad for t in (inp, b1, b2)]


@pytest.mark.parametrize("self_shape", [(1,), (), (10,)])
def test_an_inplace_op_that_would_resize_self_is_refused(self_shape):
    """Plain PyTorch resizes `x` to (5, 10) when it broadcasts; an arena tensor cannot grow in place, and was left at
    its old shape with other bytes in it (and wrong gradients). Refused by name, before anything is written."""
    assert _addbmm_step(self_shape, None)[0].shape == (5, 10)
    budget = _budget()
    with pytest.raises(UnsupportedOp, match=r"addbmm_.*resizes `self` in place.*torch\.addbmm\(x"):
        _addbmm_step(self_shape, budget)
    _still_usable(budget)


def test_an_inplace_op_that_keeps_self_is_exact_under_eviction():
    _exact_when_ample_and_tight(lambda budget: _addbmm_step((5, 10), budget))


# ------------------------------------------------------------------- out= variants and meta layouts, checked
def _rowsum_op():
    """A custom op whose out= kernel sums in the other order than its functional kernel: other bits, as an out=
    kernel that reduces differently (linear.out on a 3-D input, on some builds) gives."""
    if hasattr(torch.ops, "coop_test_bits") and hasattr(torch.ops.coop_test_bits, "rowsum"):
        return torch.ops.coop_test_bits.rowsum
    lib = torch.library.Library("coop_test_bits", "DEF")
    lib.define("rowsum(Tensor x) -> Tensor")
    lib.define("rowsum.out(Tensor x, *, Tensor(a!) out) -> Tensor(a!)")

    def rowsum_out(x, *, out):
        acc = torch.zeros_like(out)
        for j in reversed(range(x.shape[-1])):
            acc += x[..., j]
        return out.copy_(acc)

    lib.impl("rowsum", lambda x: x.sum(-1), "CPU")
    lib.impl("rowsum.out", rowsum_out, "CPU")
    lib.impl("rowsum", lambda x: x.new_empty(x.shape[:-1]), "Meta")
    lib.impl("rowsum.out", lambda x, *, out: out, "Meta")
    _rowsum_op.lib = lib  # (kept alive with the op)
    return torch.ops.coop_test_bits.rowsum


def test_an_out_variant_that_computes_other_bits_is_not_used():
    op = _rowsum_op()
    x = torch.randn(64, 100, generator=torch.Generator().manual_seed(0))
    plain = op(x)
    out = torch.empty(64)
    op.out(x, out=out)
    assert not torch.equal(out, plain)  # the two kernels do differ
    budget = _budget()
    for _ in range(3):  # the first call of the configuration compares; later ones keep what it found
        with budget, torch.no_grad():
            y = op(x * 1)
        assert torch.equal(y, plain)


def test_eigenvectors_keep_the_devices_strides_and_gradients():
    """linalg_eig's eigenvectors are column-major on the CPU and row-major on meta: the plan is checked against the
    first call, and the gradients are bitwise plain PyTorch's."""
    a = torch.randn(5, 5, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def step():
        w, v = torch.linalg.eig(a)
        (v.abs().square().sum() + w.abs().sum()).backward()
        g, a.grad = a.grad, None
        return v.stride(), g

    plain_stride, plain_grad = step()
    for budget in (_budget(), _budget()):
        with budget:
            stride, grad = step()
        assert stride == plain_stride and torch.equal(grad, plain_grad)


# ------------------------------------------------------------------------------------------------- sparse
@pytest.mark.parametrize("layout", ["csr", "coo", "csc"])
def test_a_sparse_tensor_from_outside_the_block_is_read(layout):
    g = torch.Generator().manual_seed(0)
    dense = torch.randn(32, 32, generator=g).relu()
    s = {"csr": dense.to_sparse_csr, "coo": dense.to_sparse, "csc": dense.to_sparse_csc}[layout]()
    d = torch.randn(32, 16, generator=g, requires_grad=True)

    def step(budget):
        with budget if budget is not None else torch.enable_grad():
            h = torch.sparse.mm(s, d.tanh()) if layout != "csc" else s @ d.tanh()
            h = h.exp().tanh().sin()
            h.sum().backward()
        grad, d.grad = d.grad, None
        return h.detach().clone(), grad

    _exact_when_ample_and_tight(step)


def test_an_op_that_makes_a_sparse_tensor_is_refused_by_name():
    s = torch.randn(6, 6).relu().to_sparse_csr()
    budget = _budget()
    with pytest.raises(UnsupportedOp, match="sparse_sampled_addmm.*layout torch.sparse_csr"):
        with budget:
            torch.sparse.sampled_addmm(s, torch.randn(6, 3), torch.randn(3, 6))
    _still_usable(budget)


# ------------------------------------------------------------- ops that write an argument and return fresh ones
_W, _B = torch.linspace(0.5, 1.5, 3), torch.linspace(-0.1, 0.1, 3)
_WRITE_AND_RETURN = {
    "_native_batch_norm_legit": lambda x, rm, rv: aten._native_batch_norm_legit(x, _W, _B, rm, rv, True, 0.1,
                                                                                1e-5)[0],
    "_batch_norm_with_update": lambda x, rm, rv: aten._batch_norm_with_update(x, _W, _B, rm, rv, 0.1, 1e-5)[0],
    "rrelu_with_noise": lambda x, rm, rv: F.rrelu(x, training=True),
}


@pytest.mark.parametrize("name", sorted(_WRITE_AND_RETURN))
def test_an_op_that_writes_an_argument_and_returns_a_fresh_tensor_is_exact(name):
    """Their fresh outputs are copied into the arena, unevictable (a replay would write the argument again); the
    tensors around them are evicted and recomputed as usual."""
    op = _WRITE_AND_RETURN[name]

    def step(budget):
        torch.manual_seed(0)
        x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        rm, rv = torch.zeros(3), torch.ones(3)
        with budget if budget is not None else torch.enable_grad():
            h = op(x.tanh().exp(), rm, rv)
            (h.sin().cos() * h).sum().backward()
        return x.grad, rm, rv, h.detach().clone()

    _exact_when_ample_and_tight(step)


# ------------------------------------------------------------------------------------------------ block exit
@pytest.mark.parametrize("policy", ["coop", "dtr"])
def test_a_normal_exit_never_hands_back_a_dropped_tensor(policy):
    """`y` is evicted for an unevictable output that the budget has no room beside; at the exit its restore needs
    `h` and `y` at once. The exit raises OutOfBudget (naming it) instead of ending normally with `y` lost; what
    fits is copied out, and the Budget stays usable."""
    x = torch.randn(64, 64)
    nbytes = x.numel() * x.element_size()
    budget = _budget(2 * nbytes, policy=policy)
    with pytest.raises(OutOfBudget) as info:
        with budget:
            h = x * 2
            y = h.exp()
            del h
            u = F.rrelu(x, training=True)
    assert "could not be restored to be copied out" in "\n".join(getattr(info.value, "__notes__", []))
    assert budget.stats.dropped == 1 and budget.stats.evictions > 0
    assert u.shape == x.shape and torch.isfinite(u).all()  # copied out
    with pytest.raises(coop_arena.TensorLost):
        y.sum()
    _still_usable(budget)


def test_quantization_aware_training_is_exact():
    """Eager QAT's fake-quantize observers (`_fused_moving_avg_obs_fq_helper`) update their statistics in place and
    return fresh tensors: gradients and observer buffers are plain PyTorch's. (Those fresh outputs are unevictable,
    the activations of this model among them: its lower bound is its peak, so no smaller budget runs it.)"""
    import warnings

    import torch.ao.quantization as tq

    def step(budget):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4))
        m.qconfig = tq.get_default_qat_qconfig("x86")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the default observer's reduce_range deprecation)
            m = tq.prepare_qat(m.train())
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
        with budget if budget is not None else torch.enable_grad():
            m(x).square().sum().backward()
        return [p.grad for p in m.parameters()] + list(m.buffers())

    plain = step(None)
    probe = _budget()
    assert all(torch.equal(a, b) for a, b in zip(step(probe), plain))
    assert probe.stats.lower_bound >= probe.stats.peak_bytes, probe.stats


def test_a_gradient_that_autograd_makes_as_a_zero_tensor_is_exact():
    """sgn's backward gives a ZeroTensor (`_efficientzerotensor`: no memory, by design); as a leaf's gradient it
    used to stay outside the arena and be refused as a tensor whose memory was gone."""
    def step(budget):
        x = torch.randn(20, 20, generator=torch.Generator().manual_seed(0), requires_grad=True)
        with budget if budget is not None else torch.enable_grad():
            h = x.tanh().exp()
            (g,) = torch.autograd.grad((x.sgn() * 3 + h).sum(), [x], retain_graph=True)
            (x.sgn().sum() + h.sum()).backward()
        return [g.detach().clone(), x.grad]

    _exact_when_ample_and_tight(step)
