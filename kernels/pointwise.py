"""Fused pointwise kernels for recomputation: `bias_gelu` and `seeded_dropout`.

Both write into a caller-given `out` (e.g. a typed view of an arena range) so that rematerializing a tensor
allocates nothing, and both read and write flat contiguous memory: element i of the output depends on element
i of the input (and, for bias_gelu, on bias[i % bias.numel()]) and nothing else, so `out` may be `x` itself.

Note [Replayable dropout] (after Triton tutorial 04, low-memory dropout)
  Rationale: a recomputed dropout must drop exactly the elements the first run dropped, and storing the mask
  would cost the memory that eviction saved.
  Approach: the keep/drop decision for flat element i is `tl.rand(seed, i) >= p`, a counter-based Philox draw:
  it depends only on (seed, i), not on the block size, the grid, the device or what ran before. Replaying with
  the same seed is bit-identical; the backward of dropout is the same call on the gradient.
  Limitations: the mask follows the flat (contiguous) index, so `x` must be contiguous; the stream of numbers
  differs from torch's dropout, so results match torch in distribution only.
"""

from __future__ import annotations

import torch

from . import _util  # before triton: fixes INTERPRET, see Note [Where kernels run]
from ._util import as_int, device_guard, require_kernels, require_tensor

import triton
import triton.language as tl

BLOCK = 1024  # elements per program, both kernels
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SQRT1_2 = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2), for the exact (erf) gelu
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi), for the tanh approximation
_KAPPA = tl.constexpr(0.044715)  # cubic coefficient of the tanh approximation
_APPROXIMATIONS = ("none", "tanh")  # the values torch.nn.functional.gelu accepts for `approximate`


# ---------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _bias_gelu_kernel(
    x_ptr,  # *float: input, contiguous, `numel` elements
    bias_ptr,  # *float: bias, `n_cols` elements `bias_stride` apart; element i of x uses bias[i % n_cols]
    out_ptr,  # *float: output, contiguous, same dtype as x; may be x_ptr itself
    numel,  # int: number of elements of x and out
    n_cols,  # int: size of the last dimension of x (= number of bias elements)
    bias_stride,  # int: stride of bias, in elements
    APPROX_TANH: tl.constexpr,  # False: 0.5 s (1 + erf(s / sqrt 2)); True: the tanh approximation
    BLOCK: tl.constexpr,  # elements per program
):
    pid = tl.program_id(axis=0).to(tl.int64)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    x = tl.load(x_ptr + offsets, mask=mask)
    b = tl.load(bias_ptr + (offsets % n_cols) * bias_stride, mask=mask)
    # x + bias in float32, rounded to x's dtype (as torch's `x + bias` is), then gelu in float32. Converting
    # first also keeps the interpreter right for bfloat16, which it stores as raw uint16 bits.
    s = (x.to(tl.float32) + b.to(tl.float32)).to(x.dtype).to(tl.float32)
    if APPROX_TANH:
        # 0.5 s (1 + tanh(u)) == s * sigmoid(2u): no cancellation where tanh(u) is near -1.
        u = _SQRT_2_OVER_PI * (s + _KAPPA * s * s * s)
        u = tl.where(u < -40.0, -40.0, u)  # exp(80) is finite in float32; the result there is 0 either way
        y = s / (1.0 + tl.exp(-2.0 * u))
    else:
        y = 0.5 * s * (1.0 + tl.math.erf(s * _SQRT1_2))
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])  # one compiled kernel for every seed
def _seeded_dropout_kernel(
    x_ptr,  # *float: input, contiguous, `numel` elements
    out_ptr,  # *float: output, contiguous, same dtype as x; may be x_ptr itself
    numel,  # int: number of elements
    p,  # float: probability of dropping an element, 0 <= p < 1
    scale,  # float: 1 / (1 - p), applied to the kept elements
    seed,  # int: Philox seed; with the flat index it fully determines the mask (Note [Replayable dropout])
    BLOCK: tl.constexpr,  # elements per program
):
    pid = tl.program_id(axis=0).to(tl.int64)
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < numel
    x = tl.load(x_ptr + offsets, mask=mask)
    keep = tl.rand(seed, offsets) >= p  # a uniform float32 draw per flat index: kept with probability 1 - p
    y = tl.where(keep, x.to(tl.float32) * scale, 0.0)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------- launchers


def _check_float(t: torch.Tensor, name: str, op: str) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_out(out, x: torch.Tensor, op: str, *others: torch.Tensor) -> torch.Tensor:
    """`out` if given and compatible with `x`, else a new tensor like `x`."""
    if out is None:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    out = require_tensor(out, "out", op)
    if out.dtype != x.dtype:
        raise TypeError(f"{op}: out has dtype {out.dtype}, x has {x.dtype}")
    if out.shape != x.shape:
        raise ValueError(f"{op}: out has shape {tuple(out.shape)}, x has {tuple(x.shape)}")
    if out.device != x.device:
        raise ValueError(f"{op}: out is on {out.device}, x is on {x.device}")
    if not out.is_contiguous():
        raise ValueError(f"{op}: out must be contiguous, got strides {out.stride()} for shape {tuple(out.shape)}")
    if not _util.same_view(out, x) and _util.spans_overlap(out, x):
        raise ValueError(f"{op}: out partially overlaps x (writing into x itself is allowed: pass out=x)")
    for other in others:
        if _util.spans_overlap(out, other):
            raise ValueError(f"{op}: out overlaps an input it would overwrite while reading")
    return out


def _check_x(x, op: str) -> torch.Tensor:
    x = require_tensor(x, "x", op)
    _check_float(x, "x", op)
    if not x.is_contiguous():
        raise ValueError(
            f"{op}: x must be contiguous (the kernel walks flat memory), got strides {x.stride()} for shape "
            f"{tuple(x.shape)}"
        )
    require_kernels(x, op)
    return x


def bias_gelu(
    x: torch.Tensor, bias: torch.Tensor, out: torch.Tensor | None = None, *, approximate: str = "none"
) -> torch.Tensor:
    """gelu(x + bias) in one kernel, written into `out` (allocated if None); returns `out`.

    Matches `torch.nn.functional.gelu(x + bias, approximate=approximate)` ("none": exact erf form, "tanh": the
    tanh approximation), computed in float32. `x` is contiguous with at least one dimension; `bias` is 1-D
    with x.shape[-1] elements and x's dtype. `out` may be `x` (in place).
    """
    op = "bias_gelu"
    x = _check_x(x, op)
    bias = require_tensor(bias, "bias", op)
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"{op}: approximate must be one of {_APPROXIMATIONS}, got {approximate!r}")
    if bias.dtype != x.dtype:
        raise TypeError(f"{op}: bias has dtype {bias.dtype}, x has {x.dtype}")
    if x.dim() == 0 or bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{op}: bias must be 1-D with x.shape[-1] elements; got x of shape {tuple(x.shape)} and bias of "
            f"shape {tuple(bias.shape)}"
        )
    if bias.device != x.device:
        raise ValueError(f"{op}: bias is on {bias.device}, x is on {x.device}")
    out = _check_out(out, x, op, bias)
    numel = x.numel()
    if numel == 0:
        return out
    grid = (triton.cdiv(numel, BLOCK),)
    with device_guard(x):
        _bias_gelu_kernel[grid](
            x, bias, out, numel, x.shape[-1], bias.stride(0),
            APPROX_TANH=approximate == "tanh", BLOCK=BLOCK,
        )
    return out


def seeded_dropout(x: torch.Tensor, p: float, seed: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dropout with a mask regenerated from `seed` (Note [Replayable dropout]); returns `out`.

    Each element of the contiguous `x` is zeroed with probability `p` and the rest are scaled by 1 / (1 - p).
    The same (x, p, seed) gives a bit-identical result on every call; p == 1 gives zeros. `seed` is an int in
    [0, 2**63). `out` may be `x` (in place).
    """
    op = "seeded_dropout"
    x = _check_x(x, op)
    if isinstance(p, bool) or not isinstance(p, (int, float)):
        raise TypeError(f"{op}: p must be a float, got {type(p).__name__} {p!r}")
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{op}: p must be in [0, 1], got {p}")
    seed = as_int(seed, "seed", op)
    if not 0 <= seed < 2**63:
        raise ValueError(f"{op}: seed must be in [0, 2**63), got {seed}")
    out = _check_out(out, x, op)
    numel = x.numel()
    if numel == 0:
        return out
    if p == 1.0:
        return out.zero_()  # everything dropped, whatever the draws
    grid = (triton.cdiv(numel, BLOCK),)
    with device_guard(x):
        _seeded_dropout_kernel[grid](x, out, numel, p, 1.0 / (1.0 - p), seed, BLOCK=BLOCK)
    return out
