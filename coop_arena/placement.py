"""Placement: where a functional op's outputs are written, and what the op costs, learned once per configuration.

Note [Direct placement]
Rationale: computing an output into a temporary from PyTorch's allocator and copying it into the arena puts the
  temporary outside the budget (hundreds of MiB for a large output on a GPU) and doubles the output traffic.
Approach:
  - Per configuration of a functional op (the op, its tensors' dtypes, sizes and strides, its other arguments),
    one run on the `meta` device gives the outputs' sizes, strides and dtypes, whether an output aliases an input,
    and the op's analytic cost (cost.py). The result is cached: later calls of the same configuration pay a dict
    lookup.
  - An op whose every output aliases an input is a view (the runtime wraps it; nothing is placed), whatever its
    schema says (`_unsafe_view`, `unsafe_split`). One whose outputs alias inputs only in part (cuDNN's RNN
    returns the flat weight buffer it was given beside its fresh outputs) takes the temporary path: the fresh
    outputs are placed, the others returned as they are.
  - The op's out= variant (found by its schema: the same arguments plus one written keyword-only tensor per
    return) is used when it writes straight into `out`: it has a kernel of its own for the device (structured
    kernels: add, mm, addmm, native_batch_norm, ...), or it is composite and a probe on `meta` shows that it
    calls no op that allocates a fresh tensor (zeros.out, stack.out). The runtime then places the outputs first,
    with exactly the strides the functional op would give them, and runs the out= variant on arena views.
  - An op with no kernel of its own for the device but a composite one (masked_fill, embedding, _to_copy,
    _safe_softmax), no FLOP formula and no randomness runs as the ops its composite kernel calls, each through
    the runtime (`decomposes`): the same kernels compute the same bits, and the parts take direct placement where
    they can. A few that models call often have an out= variant written here instead (`_OUT_BY_HAND`), which
    runs their composite kernel's own last op into the arena view, so that they take one pass through the
    runtime, not two or three: clone (empty_like, then copy_: `out.copy_(self)`), mul.Scalar (mul.Tensor with
    the scalar wrapped: `mul.out`, whose Python binding wraps it the same way), zeros and zeros_like (empty,
    then zero_), ones and ones_like (empty, then fill_(1)). Their first calls are checked against the
    functional op like any out= variant's (below).
  - Otherwise (no out= variant, or one that computes into a temporary and copies: convolution, layer norm,
    dropout, embedding_dense_backward) the op runs into temporaries that are copied in and counted
    (stats.temporary_bytes, temporary_peak).
  - Some out= kernels resize `out` on the way (huber_loss.out and binary_cross_entropy.out with a reduction compute
    the elementwise loss into it first, then shrink it to the reduced shape): on an arena view that would write
    past the output's range. The first call of a configuration on a device with memory therefore writes into
    views whose storage is exactly the outputs' ranges and cannot grow; if the kernel tries, nothing has been
    written, the plan drops its out= variant (`without_out`) and the op takes the temporary path. The losses
    known to do so (`_OUT_RESIZES`) take the temporary path from the start: PyTorch warns the user about the
    resize of a non-empty `out` before it fails, where plain PyTorch would not.
  - Some out= kernels compute wrong values for inputs laid out differently from what they assume: PyTorch's CPU
    native_batch_norm.out reads a non-contiguous input (a slice, a transpose) wrongly, output, saved and running
    statistics alike, while the functional op handles it. Such ops (`_OUT_NEEDS_CONTIGUOUS`) take their out=
    variant only when every tensor input is contiguous (in some memory format); otherwise the temporary path.
    Others write wrong values into any view with a storage offset, as an arena view has: linalg_qr.out leaves
    part of R unwritten (what the arena held there stays). Those (`_OUT_WRONG`) always take the temporary path.
  - The meta kernel's strides are not always the device kernel's, and some out= kernels compute wrong values
    into an `out` laid out otherwise than the functional op would lay it: rfftn and _fft_c2r follow their
    input's permutation on the CPU; binary ops with operands in different layouts; reflection and replication
    padding and max_unpool2d make a channels_last input's output channels_last where meta plans it contiguous
    (their out= kernels re-stride `out` to it); log_softmax's backward follows a channels_last or transposed
    gradient on meta while the CPU returns it contiguous and its out= kernel writes wrong values into such an
    `out`. Placing an output with other strides than plain PyTorch gives it changes the order of later
    reductions, so their bits. So the first call of a configuration on the device runs as the functional op
    (the temporary path) and compares, unless every tensor input and planned output is contiguous in the
    default format, or the op is a matmul, whose output is always planned and made contiguous (`learns_layout`).
    The same layout confirms the plan; another one drops its out= variant (`without_out`), and the
    configuration keeps taking the temporary path, with the device kernel's own strides. For the rest, the
    first call's out= run also checks that the kernel left its views as placed; one that re-strided them within
    their ranges has written them so, and the plan takes that layout (`relaid`) rather than run the op again (a
    random op would draw twice); any other change falls back as a resize does.
  - Nor does an out= kernel always compute the functional op's bits, or meta plan the device's layout even for
    default layouts: `linear.out` (seen whole under inference_mode) on a 3-D input may reduce in another order
    than `linear`; linalg_eig's eigenvectors are column-major on the CPU, row-major on meta; a batch norm in
    eval mode saves statistics of shape (C,) on meta, (0,) on the CPU. So that first out= run is followed by the
    functional op, and the configuration keeps its out= variant only when both gave the same sizes, the same
    strides (where a dimension has more than one element) and the same bits (dispatch.py, `_as_functional`);
    otherwise it takes the temporary path from then on, that call included. An op that draws random numbers or
    writes an argument (a batch norm's running statistics in training) is not run twice: it keeps its out=
    variant on the layout check alone.
  - A dry run cannot learn: there a convolution's output is planned as the devices lay it out, channels_last
    (channels_last_3d) when its input or weight suggests that format (`_device_conv_layout`; meta's kernel makes
    it contiguous), so that a channels_last model's later ops see the same layouts, and take the same paths, as
    on the device.
Limitations: ops whose output shape depends on data (nonzero, masked_select) cannot run on `meta`: they take the
  temporary path and pay their cost model's call each time. A dry run on `meta` takes the CPU's choices, so its
  statistics match a CPU run, except for convolutions: their rule is cuDNN's and oneDNN's (float64 stays
  contiguous), not the CPU's fallback kernels', which make a float64 2-D convolution's output channels_last and
  leave a 3-D one contiguous in float16, and in float32 with a batch of one.

Note [Shapes that change]
Rationale: a configuration's plan costs a run on `meta`, whose kernels for most ops are Python decompositions:
  0.1-3.6 ms of host time per op (layer norm's backward the slowest), where the rest of an op's host time is
  30-100 us. With shapes that change from step to step (dynamic padding: each batch its own sequence length)
  every op of every step is a new configuration: a small transformer's steps took 35 % longer than at a fixed
  shape, and on a GPU the host time is the step's.
Approach: each plan made on `meta` for a device is also kept under its op's shape-free key (`_shape_free`: the
  dtypes, ranks and contiguity of its tensors, its other arguments as they are). From a Budget's second block on
  (the first plans as a dry run does, so that their statistics agree), a new configuration of such an op is not
  run on `meta` when its shape-free plan says what to do at any shape (`_sizes_from_device`):
  - a view stays a view, and an op run as its parts stays so (each part is planned as an op of its own);
  - an op that takes the temporary path (no out= variant), or whose plan is plain (every tensor input and output
    contiguous in the default format), and that meta does not lay out otherwise, runs once on the device into
    temporaries (`Sizing`); the outputs it gave make the configuration's plan (`sized`), with which later calls
    take the temporary path or place directly.
  The kernels that compute are those of a planned call (the functional op, as where a layout is learned), so
  are the bits, and the decisions: the outputs are placed when the op has run, with the same memory around them.
  An in-place op (not an out= one) is not checked on `meta` either: its first call per configuration on the
  device is (dispatch.py, Note [In-place ops that resize]).
Limitations: that first call's outputs go through temporaries outside the arena, counted in
  stats.temporary_bytes, as any configuration's first call where its layout is learned; a dry run, with no device
  to ask, plans every shape on `meta`. Other arguments are part of the shape-free key: an op given a size
  (`_unsafe_view`, `expand`, `select_backward`) is planned on `meta` at each new size.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:
    from torch._prims_common import suggest_memory_format as _suggest
except ImportError:
    _suggest = None

from . import ops
from .cost import op_cost
from .errors import UnsupportedOp
from .recipe import whole
from .tensor import Tensor

_BACKEND_KEY = {"cpu": "CPU", "cuda": "CUDA", "meta": "CPU"}


@dataclass(frozen=True, slots=True)
class OutSpec:
    """One tensor output: how it is laid out and how many bytes its range needs."""

    size: tuple
    stride: tuple
    dtype: torch.dtype
    nbytes: int


@dataclass(frozen=True, slots=True)
class OpPlan:
    outputs: tuple        # OutSpec per output of the functional op (None where it is not a tensor)
    aliases: bool         # some output aliases an input: the op is a view
    decomposes: bool      # runs as the ops its composite kernel calls (`decomposes`)
    out_op: object        # the out= variant that writes into arena views, or None (temporary path)
    out_names: tuple      # its written keyword arguments, one per output
    cost: float           # the op's analytic cost (cost.py)
    hidden: dict = field(default_factory=dict)  # external argument positions -> those it writes although its
                                                # schema does not say so (dispatch.py, Rule 5); filled there
    checked: list = field(default_factory=list)  # [True] once a run showed its out= variant keeps its outputs'
                                                 # ranges (dispatch.py, Note [Direct placement]); filled there
    learned: list = field(default_factory=list)  # [True] once a run on the device gave the layout planned on meta
                                                 # (`learns_layout`; dispatch.py); filled there
    plain: bool = True  # every tensor input and planned output is contiguous in the default format (`learns_layout`)


_OUT_NEEDS_CONTIGUOUS = {torch.ops.aten.native_batch_norm.default,  # see Note [Direct placement]
                         torch.ops.aten._native_batch_norm_legit.no_stats}  # (the same CPU out= kernel)


def _clone_into(self, *, memory_format=None, out):
    return out.copy_(self)  # clone's composite kernel: empty_like(self, memory_format), then copy_


def _mul_scalar_into(self, other, *, out):
    return torch.mul(self, other, out=out)  # mul.Scalar's composite kernel: mul.Tensor with `other` wrapped


def _zeros_into(*args, out, **kwargs):
    return out.zero_()  # zeros' and zeros_like's composite kernels: empty (laid out as planned), then zero_


def _ones_into(*args, out, **kwargs):
    return out.fill_(1)  # ones' and ones_like's composite kernels: empty (laid out as planned), then fill_(1)


# out= variants written here for composite ops whose own out= variant allocates, or that have none that takes all
# of their arguments (Note [Direct placement])
_OUT_BY_HAND = {torch.ops.aten.clone.default: _clone_into, torch.ops.aten.mul.Scalar: _mul_scalar_into,
                torch.ops.aten.zeros.default: _zeros_into, torch.ops.aten.zeros_like.default: _zeros_into,
                torch.ops.aten.ones.default: _ones_into, torch.ops.aten.ones_like.default: _ones_into}

_OUT_WRONG = {torch.ops.aten.linalg_qr.default}  # out= kernels that write wrong values into an arena view (ibid.)
# out= kernels known to resize a reduced loss's `out` on the way (ibid.): found on the first call too, but PyTorch
# warns the user that resizing a non-empty `out` is deprecated before the engine can fall back
_OUT_RESIZES = {getattr(torch.ops.aten, n).default for n in (
    "mse_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "soft_margin_loss")}
# composite kernels that do not always dispatch their parts: scalar_tensor makes a CPU tensor itself (no empty,
# no fill_ reaching the runtime), so decomposed it left the arena on the CPU and was placed as two parts on meta
_STAYS_WHOLE = {torch.ops.aten.scalar_tensor.default}
# structured ops whose outputs every device lays out contiguous whatever their inputs' layout (one meta function
# for all): a Linear's transposed weight does not make its first call learn a layout (`learns_layout`), which
# would compute its output, often a step's largest (a language model's logits), into a temporary outside the arena
_FRESH_CONTIGUOUS = {getattr(torch.ops.aten, n).default for n in ("mm", "addmm", "bmm", "baddbmm")}
# ops whose meta kernel makes a channels_last input's output contiguous where every device keeps channels_last:
# a dry run plans them as the devices lay them out (`_device_conv_layout`)
_CONVOLUTIONS = {torch.ops.aten.convolution.default}
_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}  # by dimensions
_PLANS: dict = {}
_PLANS_MAX = 1 << 14  # configurations kept; the cache starts over when full (shapes or scalars that change every
                      # step would otherwise grow it without end)
made = [0]  # configurations planned in this process (a Budget observes the block after one that made any: headroom.py)
_SHAPE_FREE: dict = {}  # shape-free key -> a plan its device may size new shapes of (Note [Shapes that change])
_UNSIZED: set = set()   # configurations their device's run could not plan (laid out otherwise): planned on meta
_DECOMPOSES: dict = {}
_OUT_VARIANTS: dict = {}
_WRITES_IN_PLACE: dict = {}


class Sizing:
    """What `plan_for` gives a new configuration (its cache `key`) whose shape-free plan is `like` (Note [Shapes
    that change]): run the op on the device into temporaries, then hand its outputs to `sized`."""

    __slots__ = ("key", "like")

    def __init__(self, key: tuple, like: OpPlan):
        self.key, self.like = key, like


def plan_for(func, op, args, kwargs, device_type: str, sizing: bool = False, flat=None) -> OpPlan | Sizing | None:
    """The plan of a functional op called with plain `args`/`kwargs`, or None when it cannot run on meta. With
    `sizing`, a new configuration that the device can size instead of `meta` gives a `Sizing`. `flat`: the
    arguments' (leaves, spec) when the caller has them (ops.flatten)."""
    leaves, spec = flat if flat is not None else ops.flatten(args, kwargs)
    key = _plan_key(func, leaves, spec, device_type)
    if key is None:
        return _make_plan(func, op, leaves, spec, device_type)
    try:
        return _PLANS[key]
    except KeyError:
        pass
    except TypeError:  # an unhashable argument: no cache for this call
        return _make_plan(func, op, leaves, spec, device_type)
    free = _shape_free(key) if device_type != "meta" else None  # (a dry run plans every shape on meta)
    if sizing and free is not None and key not in _UNSIZED:
        like = _SHAPE_FREE.get(free)
        if like is not None:
            return like if like.aliases or like.decomposes else Sizing(key, like)  # (a view, or parts, at any shape)
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
        _SHAPE_FREE.clear()
        _UNSIZED.clear()
    p = _PLANS[key] = _make_plan(func, op, leaves, spec, device_type)
    made[0] += 1
    if free is not None and _sizes_from_device(func, p):
        _SHAPE_FREE[free] = p
    return p


def sized(sizing: Sizing, outs, cost: float) -> None:
    """Keep the plan of `sizing`'s configuration made from the outputs `outs` its run on the device gave (wrapped
    as placed): always for an op that takes the temporary path anyway (no out= variant); for one placed directly,
    when they are contiguous in the default format, as its shape-free plan's (else it is planned on `meta` from
    then on: _UNSIZED). See Note [Shapes that change]."""
    like, specs = sizing.like, []
    for o in outs:
        if not isinstance(o, torch.Tensor):
            specs.append(None)
            continue
        size, stride = tuple(o.size()), tuple(o.stride())
        if like.out_op is not None and (not _default_contiguous(size, stride) or o.storage_offset()):
            _UNSIZED.add(sizing.key)
            return
        specs.append(OutSpec(size, stride, o.dtype, span_bytes(size, stride, o.element_size())))
    if len(specs) != len(like.outputs) or any((a is None) != (b is None) for a, b in zip(specs, like.outputs)):
        _UNSIZED.add(sizing.key)
        return
    _PLANS[sizing.key] = dataclasses.replace(like, outputs=tuple(specs), cost=cost, checked=[], learned=[])
    made[0] += 1


def _shape_free(key: tuple) -> tuple:
    """A configuration's key with each tensor's sizes and strides replaced by its rank and whether it is
    contiguous."""
    func, device_type, dtype, leaves, shape, kshape = key
    return (func, device_type, dtype, tuple(
        (x[0], len(x[1]), x[2] == contiguous_strides(x[1])) if type(x) is _TensorKey else x for x in leaves),
        shape, kshape)


def _sizes_from_device(func, p: OpPlan | None) -> bool:
    """Whether a new configuration of the op of plan `p` may be sized by its run on the device (Note [Shapes
    that change])."""
    return (p is not None and (p.aliases or p.decomposes or p.out_op is None or p.plain)
            and func not in _CONVOLUTIONS)


def without_out(func, args, kwargs, device_type: str, plan: OpPlan) -> OpPlan:
    """The plan of this configuration from now on without its out= variant (it resizes its outputs on the way)."""
    p = dataclasses.replace(plan, out_op=None, out_names=(), hidden={}, checked=[], learned=[])
    return _store(func, args, kwargs, device_type, p)


def relaid(func, args, kwargs, device_type: str, plan: OpPlan, outs) -> OpPlan | None:
    """The plan of this configuration from now on with the layouts its out= kernel gave `outs` (the views of a
    first call, made with the planned layouts), when the kernel re-strided some in place within their ranges
    and wrote them so: the outputs are wrapped with that layout, and the op is not run again (Note [Direct
    placement]). None when a view changed otherwise (its size, its offset, or a layout that does not fill its
    range exactly)."""
    specs = []
    for o, spec in zip(outs, plan.outputs):
        if spec is None or not spec.nbytes:
            specs.append(spec)
            continue
        size, stride = tuple(o.size()), tuple(o.stride())
        if (size != spec.size or o.storage_offset() != 0 or not keeps_layout(size, stride)
                or span_bytes(size, stride, o.element_size()) != spec.nbytes):
            return None
        specs.append(OutSpec(size, stride, spec.dtype, spec.nbytes))
    p = dataclasses.replace(plan, outputs=tuple(specs), checked=[True])
    return _store(func, args, kwargs, device_type, p)


def _store(func, args, kwargs, device_type: str, p: OpPlan) -> OpPlan:
    """`p` as this configuration's plan from now on."""
    leaves, spec = ops.flatten(args, kwargs)
    key = _plan_key(func, leaves, spec, device_type)
    try:
        if key is not None:
            _PLANS[key] = p
    except TypeError:  # an unhashable argument: nothing was cached
        pass
    return p


def learns_layout(plan: OpPlan, device_type: str) -> bool:
    """Whether this call must run as the functional op, to learn the layout the device's kernel gives its outputs:
    some tensor input or planned output is not contiguous in the default format (there meta and the device may
    lay outputs out differently), and no run on the device has confirmed the plan yet. See Note [Direct
    placement]."""
    return plan.out_op is not None and not plan.plain and not plan.learned and device_type != "meta"


def same_layout(plan: OpPlan, outs) -> bool:
    """Whether the outputs the device's kernel gave have the sizes, strides and dtypes the plan would place."""
    return len(outs) == len(plan.outputs) and all(
        s is None or (isinstance(o, torch.Tensor) and o.dtype == s.dtype and tuple(o.size()) == s.size
                      and tuple(o.stride()) == s.stride) for o, s in zip(outs, plan.outputs))


def _plan_key(func, leaves, spec, device_type: str) -> tuple | None:
    """The key of an op configuration in the plan cache, or None for no cache (see _key). Factory ops reach aten
    with dtype=None and take the default dtype when they run: it is part of the key."""
    k = _key(leaves)
    if k is None:
        return None
    return (func, device_type, torch.get_default_dtype(), k, tuple(spec[0]), tuple(spec[1]))


class _TensorKey(tuple):
    """(dtype, sizes, strides) of a tensor argument in a configuration's key."""

    __slots__ = ()


def _key(leaves) -> tuple | None:
    """The cache key of an op's arguments, or None for no cache: a script object (the handle of
    `record_function`, which wraps every optimizer step) is new at each call and hashes by identity, so caching it
    would keep one plan and one handle per step for good."""
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            meta = x._meta if type(x) is Tensor else None  # as made (Note [Views kept] in tensor.py)
            if meta is None and x.layout is not torch.strided:  # (sparse: no strides; no plan, see _make_plan)
                out.append((x.layout, x.dtype, tuple(x.size())))
                continue
            out.append(_TensorKey(meta[:3] if meta is not None else (x.dtype, tuple(x.size()), tuple(x.stride()))))
        elif isinstance(x, torch.ScriptObject):
            return None
        elif isinstance(x, list):
            out.append(tuple(x))
        else:  # with its type: 2 == 2.0 == True, yet pow(int64, 2) is int64 and pow(int64, 2.0) float32
            out.append((type(x), x))
    return tuple(out)


def span_bytes(size, stride, itemsize: int) -> int:
    if any(n == 0 for n in size):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(size, stride))) * itemsize


def keeps_layout(size, stride) -> bool:
    """True when no two elements share an address (the layout can be written as it is)."""
    dims = sorted((st, n) for n, st in zip(size, stride) if n != 1)
    reach = 0
    for st, n in dims:
        if n == 0:
            return True
        if st <= reach:
            return False
        reach += st * (n - 1)
    return True


@functools.lru_cache(maxsize=4096)
def layout(size: tuple, stride: tuple) -> tuple:
    """The strides an output is placed with: its own, unless two of its elements share an address."""
    return stride if keeps_layout(size, stride) else contiguous_strides(size)


def contiguous_strides(size) -> tuple:
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


_META = torch.device("meta")


def _meta(x):
    """The argument of the meta run: tensors and devices (factory ops) moved to `meta`, nothing allocated."""
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, torch.device):
        return _META
    return x


def _make_plan(func, op, leaves, spec, device_type) -> OpPlan | None:
    if any(isinstance(x, torch.Tensor) and x.layout is not torch.strided for x in leaves):
        return None  # a sparse tensor (COO, CSR, ...): the temporary path, which leaves sparse outputs as they are
    mleaves = [_meta(x) for x in leaves]
    margs, mkwargs = ops.unflatten(mleaves, spec)
    rng = torch.random.get_rng_state()
    try:
        with whole(torch.utils._python_dispatch._disable_current_modes()):
            out = func(*margs, **mkwargs)
    except Exception:  # data-dependent shapes, or no meta kernel: the temporary path
        return None
    finally:
        torch.random.set_rng_state(rng)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    check_strided(func, outs)
    in_storages = {x.untyped_storage()._cdata for x in mleaves if isinstance(x, torch.Tensor)}
    shared = [o.untyped_storage()._cdata in in_storages for o in outs if isinstance(o, torch.Tensor)]
    aliases = bool(shared) and all(shared)
    partly = any(shared) and not aliases  # cuDNN's RNN returns its flat weight buffer beside fresh outputs
    if device_type == "meta" and func in _CONVOLUTIONS:
        outs[0] = _device_conv_layout(margs[0], margs[1], outs[0])
    specs = []
    for o in outs:
        if isinstance(o, torch.Tensor):
            size, stride = tuple(o.size()), tuple(o.stride())
            stride = layout(size, stride)
            specs.append(OutSpec(size, stride, o.dtype, span_bytes(size, stride, o.element_size())))
        else:
            specs.append(None)
    cost = op_cost(op.flops, margs, mkwargs, mleaves, outs, out)
    out_op, names = None, ()
    if (not aliases and not partly and func not in _OUT_WRONG and func not in _OUT_RESIZES
            and (func not in _OUT_NEEDS_CONTIGUOUS or all(_contiguous(x) for x in mleaves))):
        variant = out_variant(func)
        if variant is not None and all(s is not None for s in specs):
            candidate, names = variant
            mouts = {n: torch.empty_strided(s.size, s.stride, dtype=s.dtype, device="meta") for n, s in zip(names, specs)}
            if writes_in_place(candidate, device_type, margs, {**mkwargs, **mouts}):
                out_op = candidate
        if out_op is None and func in _OUT_BY_HAND and len(specs) == 1 and specs[0] is not None:
            out_op, names = _OUT_BY_HAND[func], ("out",)
    parts = (out_op is None and not aliases and not partly and not op.uninitialized
             and decomposes(func, op, device_type)
             and _parts_make_outputs(func, device_type, margs, mkwargs))
    plain = (all(s is None or _default_contiguous(s.size, s.stride) for s in specs)
             and (func in _FRESH_CONTIGUOUS or all(not isinstance(x, torch.Tensor) or x.is_contiguous()
                                                   for x in mleaves)))
    return OpPlan(tuple(specs), aliases, parts, out_op, names if out_op is not None else (), cost, plain=plain)


def _device_conv_layout(x, weight, out):
    """A convolution's output as the CPU's and CUDA's kernels lay it out (meta's kernel makes it contiguous):
    channels_last (channels_last_3d for 5-D) when the input or the weight suggests that format, as PyTorch's
    backends decide (cuDNN, oneDNN and the CPU's own convolution alike)."""
    fmt = _CHANNELS_LAST.get(out.dim())
    if (fmt is None or not isinstance(weight, torch.Tensor) or torch.float64 in (x.dtype, weight.dtype)
            or fmt not in (_suggest_format(x), _suggest_format(weight))):
        return out  # (cuDNN and oneDNN leave float64 contiguous)
    return torch.empty(out.size(), dtype=out.dtype, device=_META, memory_format=fmt)


def as_planned(o, spec):
    """Meta output `o` laid out as planned where the plan lays it out as the devices do (`_device_conv_layout`)."""
    if isinstance(o, torch.Tensor) and spec is not None and tuple(o.stride()) != spec.stride:
        return torch.empty_strided(spec.size, spec.stride, dtype=o.dtype, device=o.device)
    return o


def _suggest_format(x) -> torch.memory_format:
    """Tensor.suggest_memory_format(), which C++ kernels read but Python does not expose (PyTorch's own Python
    copy where this version has it)."""
    if _suggest is not None:
        return _suggest(x)
    fmt = _CHANNELS_LAST.get(x.dim())
    if fmt is not None and x.is_contiguous(memory_format=fmt) and not x.is_contiguous():
        return fmt
    return torch.contiguous_format


def check_strided(func, outs) -> None:
    """An output that is not a strided tensor (sparse, nested) has no byte range an arena could hold: refused."""
    for o in outs:
        if isinstance(o, torch.Tensor) and o.layout != torch.strided:
            raise UnsupportedOp(func, f"it makes a tensor of layout {o.layout}, which has no byte range an arena can "
                                      f"hold; only strided (dense) tensors are placed. Run it outside the Budget's "
                                      f"block (for a sparse embedding: nn.Embedding(sparse=False) inside it)")


def _default_contiguous(size, stride) -> bool:
    return torch.empty_strided(size, stride, device="meta").is_contiguous()


def _contiguous(x) -> bool:
    return not isinstance(x, torch.Tensor) or any(
        x.is_contiguous(memory_format=f) for f in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d))


def decomposes(func, op, device_type: str) -> bool:
    """True when a functional op is better run as the ops its composite kernel calls: it has no kernel of its own
    for the device, only a CompositeExplicitAutograd one (mul.Scalar, clone, masked_fill, embedding, zeros_like,
    _to_copy, ...), it has no FLOP formula (its parts are then costed as fully as it is) and it is not random.
    Its parts then take direct placement where they can; the kernels that compute are the same, so the bits are.
    Only aten ops: a custom op (torch.library) is recorded and recomputed as the unit its author defined."""
    key = (func, device_type)
    known = _DECOMPOSES.get(key)
    if known is None:
        name = func.name()
        known = _DECOMPOSES[key] = (
            func.namespace == "aten" and op.flops is None and not op.random and not op.effectful
            and func not in _STAYS_WHOLE
            and not torch._C._dispatch_has_kernel_for_dispatch_key(name, _BACKEND_KEY[device_type])
            and torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd"))
    return known


def backend_keyset(device_type: str):
    """The key whose kernel a decomposed op runs: on `meta` the CPU's (its composite kernel, on meta tensors), so
    a dry run calls the same parts as a CPU run."""
    return torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _BACKEND_KEY[device_type]))


def out_variant(func):
    """(overload, names of its written keyword arguments) of the out= variant of a functional op, or None."""
    try:
        return _OUT_VARIANTS[func]
    except KeyError:
        pass
    schema = func._schema
    want = [(a.name, str(a.type)) for a in schema.arguments]
    found = None
    if schema.returns and all(str(r.type) == "Tensor" and r.alias_info is None for r in schema.returns):
        packet = func.overloadpacket
        for name in packet.overloads():
            o = getattr(packet, name)
            s = o._schema
            outs = [a for a in s.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
            rest = [(a.name, str(a.type)) for a in s.arguments
                    if not (a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)]
            if len(outs) == len(schema.returns) and rest == want and len(s.returns) == len(outs) and all(
                    r.alias_info is not None and set(r.alias_info.before_set) == set(a.alias_info.before_set)
                    for r, a in zip(s.returns, outs)):
                found = (o, tuple(a.name for a in outs))
                break
    _OUT_VARIANTS[func] = found
    return found


class _Made(TorchDispatchMode):
    """Records the tensors the ops called under it return (on meta), and whether any is made elsewhere."""

    def __init__(self):
        super().__init__()
        self.made: dict = {}  # id -> shape it was made with
        self.seen: list = []  # the tensors themselves: an id stays theirs while the probe runs
        self.off_meta = False  # some op made a tensor off meta: the kernel computes on the host (it reads the data)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(o, torch.Tensor) and id(o) not in self.made:
                self.made[id(o)] = tuple(o.shape)
                self.seen.append(o)
                self.off_meta = self.off_meta or o.device != _META
        return out


def _parts_make_outputs(func, device_type: str, margs, mkwargs) -> bool:
    """True when every tensor a composite kernel returns is made, at its final shape, by an op it calls through
    the dispatcher (so the Budget places it), checked on meta. arange's kernel makes an empty tensor and resizes
    it: not so. Nor a kernel that makes tensors off meta (repeat builds its permutation in CPU tensors and reads
    their data by pointer, which a wrapper has none of)."""
    probe = _Made()
    try:
        with whole(torch.utils._python_dispatch._disable_current_modes()), probe:
            out = func.redispatch(backend_keyset(device_type), *margs, **mkwargs)
    except Exception:
        return False
    outs = out if isinstance(out, (tuple, list)) else [out]
    return not probe.off_meta and all(probe.made.get(id(o)) == tuple(o.shape)
                                      for o in outs if isinstance(o, torch.Tensor))


class _Probe(TorchDispatchMode):
    """Records whether an out= variant's kernel calls an op that allocates a fresh tensor."""

    def __init__(self):
        super().__init__()
        self.allocates = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(r.alias_info is None and str(r.type) == "Tensor" for r in func._schema.returns):
            self.allocates = True
        return func(*args, **(kwargs or {}))


def writes_in_place(out_op, device_type: str, margs, mkwargs) -> bool:
    """True when `out_op` writes its outputs straight into its out= tensors on this kind of device."""
    key = (out_op, device_type)
    known = _WRITES_IN_PLACE.get(key)
    if known is not None:
        return known
    name = out_op.name()
    backend = _BACKEND_KEY[device_type]
    if torch._C._dispatch_has_kernel_for_dispatch_key(name, backend):
        verdict = True
    elif torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd"):
        probe = _Probe()
        try:
            with whole(torch.utils._python_dispatch._disable_current_modes()), probe:
                out_op.redispatch(torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, backend)), *margs, **mkwargs)
            verdict = not probe.allocates
        except Exception:
            verdict = False
    else:
        verdict = False
    _WRITES_IN_PLACE[key] = verdict
    return verdict
