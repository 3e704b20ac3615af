"""The cost model's fast paths give torch.utils.flop_counter's FLOPs and the same cost floats (Note [FLOPs cache]).

- Closed forms against the formulas on many shapes: mm, addmm, bmm, baddbmm, convolution (1-3 spatial dims,
  strided, padded, dilated, grouped, transposed) and its backward (every output mask), attention forward and
  backward (grouped-query heads included); argument forms a closed form does not cover go to the formula.
- The cache: a hit returns what the formula returned; keys tell apart what a formula could tell apart.
- Every op the example models run, forward and backward on cpu and on meta: `op_cost` returns bitwise the float
  that the plain formula call gives (`reference_cost`, the model before the fast paths).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from training import train

import coop_arena
import coop_arena.dispatch as dispatch
import coop_arena.placement as placement
from coop_arena import cost, ops
from coop_arena.examples import MODELS
from coop_arena.plan import load, step
from torch.utils.flop_counter import shape_wrapper

aten = torch.ops.aten
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])


def reference_cost(formula, args, kwargs, in_leaves, out_leaves, outs) -> float:
    """op_cost as it was: the formula called through flop_counter's wrapper every time."""
    moved = sum(x.numel() * x.element_size() for x in list(in_leaves) + list(out_leaves) if isinstance(x, torch.Tensor))
    flops = 0
    if formula is not None:
        try:
            flops = formula(*args, **kwargs, out_val=outs)
        except Exception:
            flops = 0
    return float(moved) + float(flops) / cost.FLOPS_PER_BYTE


def formula_flops(formula, args, kwargs, outs):
    try:
        return formula(*args, **kwargs, out_val=outs)
    except Exception:
        return 0


def check(func, args, kwargs=None, outs=None, closed=True):
    """flops() on a cold cache and on a warm one equal the formula's int; `closed`: the closed form answered."""
    kwargs = kwargs or {}
    formula = ops.info(func).flops
    want = formula_flops(formula, args, kwargs, outs)
    if closed:
        assert cost._CLOSED[formula](args, kwargs, outs) == want
    cost._FLOPS.clear()
    for _ in range(2):
        got = cost.flops(formula, args, kwargs, outs)
        assert got == want and type(got) is type(want), (func, got, want)
    return want


def meta(*shape):
    return torch.empty(*shape, device="meta")


dim = st.integers(1, 7)


@settings(max_examples=150, **SETTINGS)
@given(b=dim, m=dim, k=dim, n=dim, beta=st.sampled_from([None, 0.5]))
def test_matmul_family(b, m, k, n, beta):
    kw = {} if beta is None else {"beta": beta, "alpha": 2.0}
    for func, args in ((aten.mm.default, (meta(m, k), meta(k, n))),
                       (aten.addmm.default, (meta(n), meta(m, k), meta(k, n))),
                       (aten.bmm.default, (meta(b, m, k), meta(b, k, n))),
                       (aten.baddbmm.default, (meta(b, m, n), meta(b, m, k), meta(b, k, n)))):
        kwargs = kw if func in (aten.addmm.default, aten.baddbmm.default) else {}
        assert check(func, args, kwargs, func(*args, **kwargs)) > 0


@st.composite
def convolutions(draw):
    d = draw(st.integers(1, 3))
    groups = draw(st.integers(1, 3))
    c_in, c_out = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    transposed = draw(st.booleans())
    stride = [draw(st.integers(1, 3)) for _ in range(d)]
    dilation = [draw(st.integers(1, 2)) for _ in range(d)]
    padding = [draw(st.integers(0, 2)) for _ in range(d)]
    output_padding = [draw(st.integers(0, max(s, dl) - 1)) for s, dl in zip(stride, dilation)] if transposed else [0] * d
    kernel = [draw(st.integers(1, 3)) for _ in range(d)]
    x = meta(draw(st.integers(1, 3)), c_in, *[draw(st.integers(1, 9)) for _ in range(d)])
    w = meta(c_in, c_out // groups, *kernel) if transposed else meta(c_out, c_in // groups, *kernel)
    bias = meta(c_out) if draw(st.booleans()) else None
    return (x, w, bias, stride, padding, dilation, transposed, output_padding, groups), draw(
        st.lists(st.booleans(), min_size=3, max_size=3))


@settings(max_examples=300, **SETTINGS)
@given(conv=convolutions())
def test_convolution_forward_and_backward(conv):
    args, mask = conv
    try:
        out = aten.convolution.default(*args)
    except RuntimeError:
        reject()  # an output with no elements or a padding the kernel rejects
    if out.numel() == 0:
        reject()
    assert check(aten.convolution.default, args, outs=out) > 0
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args
    bargs = (torch.empty_like(out), x, w, [out.shape[1]] if bias is not None or mask[2] else None, stride, padding, dilation,
             transposed, output_padding, groups, mask)
    grads = aten.convolution_backward.default(*bargs)
    check(aten.convolution_backward.default, bargs, outs=grads)


@settings(max_examples=150, **SETTINGS)
@given(b=st.integers(1, 3), h_kv=st.integers(1, 3), rep=st.integers(1, 3), s_q=dim, s_k=dim, d=dim, d_v=dim)
def test_attention_forward_and_backward(b, h_kv, rep, s_q, s_k, d, d_v):
    """Shapes only: the formulas read no outputs, so the ops need not run (they have no meta kernel here)."""
    h_q = h_kv * rep
    q, k, v = meta(b, h_q, s_q, d), meta(b, h_kv, s_k, d), meta(b, h_kv, s_k, d_v)
    fwd = check(aten._scaled_dot_product_efficient_attention.default, (q, k, v, None, True), {"scale": 0.5})
    grad_out = meta(b, h_q, s_q, d_v)
    bwd = check(aten._scaled_dot_product_efficient_attention_backward.default,
                (grad_out, q, k, v, None, grad_out, meta(b, h_q, s_q), meta(()), meta(()), 0.0, [True] * 4))
    assert fwd > 0 and bwd > fwd


@pytest.mark.parametrize("func,args,outs", [
    # shapes the formula rejects: 0 FLOPs, from the formula itself
    (aten.mm.default, (meta(2, 3), meta(4, 5)), None),
    (aten.bmm.default, (meta(2, 3, 4), meta(3, 4, 5)), None),
    # forms outside the closed forms: the formula decides (a call with an `out` keyword, too few arguments)
    (aten.mm.out, (meta(2, 3), meta(3, 5)), None),
    (aten._slow_conv2d_forward.default, (meta(1, 2, 5, 5), meta(3, 2, 3, 3), [3, 3], None, [1, 1], [0, 0]),
     meta(1, 3, 3, 3)),
    (aten._scaled_dot_product_efficient_attention.default, (meta(1, 3, 4, 8), meta(1, 2, 4, 8), meta(1, 2, 4, 8)),
     None),
])
def test_forms_outside_the_closed_forms_go_to_the_formula(func, args, outs):
    kwargs = {"out": meta(2, 5)} if func is aten.mm.out else {}
    formula = ops.info(func).flops
    assert cost._CLOSED[formula](args, kwargs, outs) is None
    check(func, args, kwargs, outs, closed=False)


def test_cache_keys_tell_apart_what_formulas_see():
    """A shape-wrapped formula (as flop_counter registers them) is called once per distinct view of its
    arguments: a repeated call hits; a tuple vs. a list, an int vs. a bool or a float, a keyword, another
    shape all miss."""
    calls = []

    def body(*shapes, out_shape=None, **kwargs):
        calls.append(1)
        return 7

    formula = shape_wrapper(body)
    q, r = meta(1, 2, 4, 8), meta(1, 2, 4, 9)
    forms = [((q, q), {}), ((q, r), {}), ((q, q, 0.5), {}), ((q, q, [1]), {}), ((q, q, (1,)), {}),
             ((q, q, True), {}), ((q, q, 1), {}), ((q, q, 1.0), {}), ((q, q), {"scale": 1})]
    cost._FLOPS.clear()
    for args, kwargs in forms + forms:
        assert cost.flops(formula, args, kwargs, None) == 7
    assert len(calls) == len(forms) == len(cost._FLOPS)
    assert cost.flops(formula, (q, q, [[1]]), {}, None) == 7  # nested lists are keys too; unhashable: no cache
    assert cost.flops(formula, (q, q, {"a": 1}), {}, None) == 7
    assert cost.flops(formula, (q, q, {"a": 1}), {}, None) == 7
    assert len(calls) == len(forms) + 3


# --------------------------------------------------------------------------------------- the example models
@pytest.fixture
def compare_costs(monkeypatch):
    seen = []

    def both(formula, args, kwargs, in_leaves, out_leaves, outs):
        got = cost.op_cost(formula, args, kwargs, in_leaves, out_leaves, outs)
        want = reference_cost(formula, args, kwargs, in_leaves, out_leaves, outs)
        assert got.hex() == want.hex(), (formula, got, want)
        seen.append(formula)
        return got

    for module in (dispatch, placement):  # placement costs an op once per configuration: start from none known
        monkeypatch.setattr(module, "op_cost", both)
    monkeypatch.setattr(placement, "_PLANS", {})
    return seen


@pytest.mark.parametrize("name", list(MODELS))
def test_example_models_cost_the_same(name, compare_costs):
    train(name, coop_arena.Budget(1 << 28, device="cpu"), steps=2)
    model, inputs = load(name, 16)
    step(model, inputs, coop_arena.Budget(1 << 40, device="meta"))
    with_formula = [f for f in compare_costs if f is not None]
    assert len(compare_costs) > 50
    if name != "lstm":  # the fused LSTM's matmuls happen inside one op with no formula
        assert len(with_formula) >= 6, f"{name}: only {len(with_formula)} ops with a FLOPs formula"
