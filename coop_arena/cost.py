"""The analytic cost model: deterministic, the same on cpu, cuda and meta (Rule 8).

cost(op) = bytes moved (inputs read + outputs written) + FLOPs / FLOPS_PER_BYTE

FLOPs come from torch.utils.flop_counter's formulas where it knows the op (matmuls, convolutions, attention
and their backward); every other op is charged the bytes it moves. FLOPS_PER_BYTE is a machine balance: a
FLOP costs this fraction of moving one byte. It makes a matmul with a long inner dimension expensive per
byte and a pointwise op cheap, which is what cheap tensor partitioning needs. Costs are in byte-equivalents.

Note [FLOPs cache]
Rationale: a formula call goes through flop_counter's pytree wrapper, about 50 us per matmul-family op, more
  than the rest of the runtime's work for that op; training repeats the same few shapes.
Approach: most formulas are registered through flop_counter's `shape_wrapper`, which hands the formula the
  arguments with every tensor replaced by its shape (such a formula exposes `__wrapped__`). Their result is
  therefore a function of that shape structure alone, and is cached under a key that encodes it exactly
  (tensor shapes, containers with their types, other values with their types). The cached value is the int
  the formula returned, so costs are the same floats as without the cache. Formulas registered raw (flash /
  efficient attention, which read nested tensors' offsets) are called every time.
  The matmul, convolution and attention families skip even the key: their formulas' arithmetic is written
  out below on the shapes they read (`_CLOSED`), for the argument forms the runtime sees; any other form (an
  unexpected arity, a non-tensor where a shape is read, shapes the formula would reject) goes to the formula.
  tests/test_cost.py checks them against flop_counter on many shapes, backward and transposed included.
Limitations: the cache holds at most _CACHE_SIZE keys and starts over when full.
"""

from __future__ import annotations

from math import prod

import torch
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

FLOPS_PER_BYTE = 16.0
_CACHE_SIZE = 1 << 16
_FLOPS: dict = {}  # (formula, shape key of args, kwargs, outputs) -> FLOPs


def _key(x):
    """What a shape-wrapped formula sees of `x`, as a hashable value: a tensor's shape (the formula cannot tell it
    from a tuple of the same numbers either), containers with their type, other values with their type."""
    t = type(x)
    if t is list or t is tuple:
        return t, tuple([_key(v) for v in x])
    if isinstance(x, torch.Tensor):
        return x.shape
    return t, x


def flops(formula, args, kwargs, outs) -> int:
    """FLOPs of one call by its flop_counter `formula`; 0 where the formula does not know these arguments."""
    closed = _CLOSED.get(formula)
    if closed is not None:
        try:
            n = closed(args, kwargs, outs)
        except Exception:  # not a form written out here: the formula decides
            n = None
        if n is not None:
            return n
    cached = hasattr(formula, "__wrapped__")
    if cached:
        key = (formula, _key(args), tuple([(k, _key(v)) for k, v in kwargs.items()]), _key(outs))
        try:
            return _FLOPS[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable argument: no caching for this call
            cached = False
    try:
        n = formula(*args, **kwargs, out_val=outs)
    except Exception:  # a formula that does not know this overload's arguments: charge bytes only
        n = 0
    if cached:
        if len(_FLOPS) >= _CACHE_SIZE:
            _FLOPS.clear()
        _FLOPS[key] = n
    return n


def op_cost(formula, args, kwargs, in_leaves, out_leaves, outs) -> float:
    """`formula` is the op's flop_counter formula or None; the leaves are its arguments and outputs."""
    moved = 0
    for x in in_leaves:
        if isinstance(x, torch.Tensor):
            moved += x.numel() * x.element_size()
    for x in out_leaves:
        if isinstance(x, torch.Tensor):
            moved += x.numel() * x.element_size()
    n = 0 if formula is None else flops(formula, args, kwargs, outs)
    return float(moved) + float(n) / FLOPS_PER_BYTE


# ------------------------------------------------------------------------------------------ closed forms
# Each mirrors one flop_counter formula (same name without the leading underscore) on the argument forms the
# dispatcher passes, and returns None for anything else. Products of Python ints are exact in any order.
def _shape(x, ndim: int | None = None):
    if not isinstance(x, torch.Tensor):
        raise TypeError("not a tensor")
    s = x.shape
    if ndim is not None and len(s) != ndim:
        raise ValueError("rank")
    return s


def _mm_flop(args, kwargs, outs):
    if len(args) != 2 or kwargs:
        return None
    (m, k), (k2, n) = _shape(args[0], 2), _shape(args[1], 2)
    return m * n * 2 * k if k == k2 else None


def _addmm_flop(args, kwargs, outs):
    if len(args) != 3 or not kwargs.keys() <= {"beta", "alpha"}:
        return None
    return _mm_flop(args[1:], {}, outs)


def _bmm_flop(args, kwargs, outs):
    if len(args) != 2 or kwargs:
        return None
    (b, m, k), (b2, k2, n) = _shape(args[0], 3), _shape(args[1], 3)
    return b * m * n * 2 * k if b == b2 and k == k2 else None


def _baddbmm_flop(args, kwargs, outs):
    if len(args) != 3 or not kwargs.keys() <= {"beta", "alpha"}:
        return None
    return _bmm_flop(args[1:], {}, outs)


def _conv_flop_count(x_shape, w_shape, out_shape, transposed) -> int:
    conv_shape = (x_shape if transposed else out_shape)[2:]
    if len(w_shape) < 2:
        raise ValueError("weight rank")
    return prod(conv_shape) * prod(w_shape[2:]) * x_shape[0] * w_shape[0] * w_shape[1] * 2


def _conv_flop(args, kwargs, outs):
    if len(args) < 7 or kwargs or isinstance(args[6], torch.Tensor):
        return None
    return _conv_flop_count(_shape(args[0]), _shape(args[1]), _shape(outs), args[6])


def _t(shape):
    return [shape[1], shape[0]] + list(shape[2:])


def _conv_backward_flop(args, kwargs, outs):
    if len(args) != 11 or kwargs or type(outs) is not tuple or isinstance(args[7], torch.Tensor):
        return None
    grad_out, x, w, transposed, mask = _shape(args[0]), _shape(args[1]), _shape(args[2]), args[7], args[10]
    if type(mask) not in (list, tuple):
        return None
    n = 0
    if mask[0]:
        n += _conv_flop_count(grad_out, w, _shape(outs[0]), not transposed)
    if mask[1]:
        grad_w = _shape(outs[1])
        if transposed:
            n += _conv_flop_count(_t(grad_out), _t(x), _t(grad_w), False)
        else:
            n += _conv_flop_count(_t(x), _t(grad_out), _t(grad_w), False)
    return n


def _sdpa_flop(args, kwargs, outs):
    if len(args) < 3 or not kwargs.keys() <= {"scale"}:
        return None
    (b, h_q, s_q, d_q), (b2, h_kv, s_k, d2), (b3, h3, s3, d_v) = (_shape(a, 4) for a in args[:3])
    if not (b == b2 == b3 and h_kv == h3 and d_q == d2 and s_k == s3) or h_kv <= 0 or h_q < h_kv or h_q % h_kv:
        return None
    bh = b * h_q
    return bh * s_q * s_k * 2 * d_q + bh * s_q * d_v * 2 * s_k


def _sdpa_backward_flop(args, kwargs, outs):
    if len(args) < 4 or not kwargs.keys() <= {"scale"}:
        return None
    (b4, h4, s4, d4), (b, h_q, s_q, d_q), (b2, h_kv, s_k, d2), (b3, h3, s3, d_v) = (_shape(a, 4) for a in args[:4])
    if not (b == b2 == b3 == b4 and h_kv == h3 and h_q == h4) or h_kv <= 0 or h_q < h_kv or h_q % h_kv:
        return None
    if not (d_q == d2 and d_v == d4 and s_k == s3 and s_q == s4):
        return None
    bh = b * h_q
    return (bh * s_q * s_k * 2 * d_q + bh * s_q * s_k * 2 * d_v + bh * s_k * d_v * 2 * s_q
            + bh * s_q * d_q * 2 * s_k + bh * d_q * s_k * 2 * s_q)


_CLOSED = {flop_registry[op]: f for op, f in (
    (aten.mm, _mm_flop), (aten.addmm, _addmm_flop), (aten.bmm, _bmm_flop), (aten.baddbmm, _baddbmm_flop),
    (aten.convolution, _conv_flop), (aten.convolution_backward, _conv_backward_flop),
    (aten._scaled_dot_product_efficient_attention, _sdpa_flop),
    (aten._scaled_dot_product_efficient_attention_backward, _sdpa_backward_flop),
) if op in flop_registry}
