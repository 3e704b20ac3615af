"""What the runtime needs to know about an operator, read once from its schema and tags (never its name).

Also a flat view of an op's arguments: aten arguments nest at most one level (a Tensor[] or int[]), so a
list of leaves plus the shape of the top level is enough, and much cheaper than a general pytree.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten

# Ops whose output bytes are uninitialized: a replay needs only the range, not the op (nor its inputs).
_UNINITIALIZED = {aten.empty_like, aten.empty, aten.new_empty, aten.new_empty_strided, aten.empty_strided}
# Namespaces of ops with effects outside their outputs (collectives): outputs unevictable (Rule 5).
_EFFECTFUL_NAMESPACES = {"_c10d_functional", "c10d", "c10d_functional", "_dtensor"}
# Namespaces of PyTorch's own ops, whose random ones are all tagged nondeterministic_seeded.
_TORCH_NAMESPACES = frozenset({"aten", "prims", "_c10d_functional_autograd", *_EFFECTFUL_NAMESPACES})


@dataclass(frozen=True, slots=True)
class OpInfo:
    inplace_view: bool      # changes a tensor's metadata in place (unsqueeze_, as_strided_)
    written: tuple          # (position, name, kwarg_only, alias sets) of arguments the schema marks written
    returns_alias: bool     # some output aliases an input (a view, or a written argument)
    random: bool | None     # draws from a generator (Rule 4); None: an untagged custom op not yet seen to draw
                            # or not (dispatch.py, Note [Custom ops that draw])
    uninitialized: bool     # output is uninitialized memory
    effectful: bool         # effects outside its outputs (Rule 5)
    tensor_args: tuple      # (position, name, optional) of arguments typed Tensor or Tensor?
    flops: object           # torch.utils.flop_counter formula, or None
    name: str               # str(func), for messages (computed once)
    generator: tuple | None = None  # (position, kwarg_only) of its `generator` argument (positional in poisson)


_CACHE: dict = {}


def info(func) -> OpInfo:
    i = _CACHE.get(func)
    if i is None:
        schema = func._schema
        written, tensor_args, generator = [], [], None
        for pos, a in enumerate(schema.arguments):
            if a.name == "generator":
                generator = (pos, a.kwarg_only)
            if a.alias_info is not None and a.alias_info.is_write:
                written.append((pos, a.name, a.kwarg_only, tuple(a.alias_info.before_set)))
            t = a.type
            optional = isinstance(t, torch.OptionalType)
            if optional:
                t = t.getElementType()
            if isinstance(t, torch.TensorType):
                tensor_args.append((pos, a.name, optional))
        i = _CACHE[func] = OpInfo(
            inplace_view=torch.Tag.inplace_view in func.tags,
            written=tuple(written),
            returns_alias=any(r.alias_info is not None for r in schema.returns),
            random=(True if torch.Tag.nondeterministic_seeded in func.tags
                    else False if func.namespace in _TORCH_NAMESPACES else None),
            uninitialized=func.overloadpacket in _UNINITIALIZED,
            effectful=func.namespace in _EFFECTFUL_NAMESPACES,
            tensor_args=tuple(tensor_args),
            flops=flop_registry.get(func.overloadpacket),
            name=str(func),
            generator=generator)
    return i


def settle_random(func, drew: bool) -> None:
    """Whether untagged custom op `func` drew random numbers on its first call (dispatch.py, Note [Custom ops that
    draw])."""
    _CACHE[func] = dataclasses.replace(info(func), random=drew)


def arg(args, kwargs, pos: int, name: str, kwarg_only: bool):
    """The value given for schema argument `pos`, or None when it was left at its default."""
    if pos < len(args) and not kwarg_only:
        return args[pos]
    return kwargs.get(name)


def flatten(args: tuple, kwargs: dict):
    """(leaves, spec) of an op's arguments; lists and tuples one level deep are opened."""
    leaves, shape = [], []
    for a in args:
        if type(a) in (list, tuple):
            shape.append((type(a), len(a)))
            leaves.extend(a)
        else:
            shape.append(None)
            leaves.append(a)
    kshape = []
    for k, v in kwargs.items():
        if type(v) in (list, tuple):
            kshape.append((k, type(v), len(v)))
            leaves.extend(v)
        else:
            kshape.append((k, None, 1))
            leaves.append(v)
    return leaves, (shape, kshape)


def unflatten(leaves: list, spec):
    shape, kshape = spec
    args, i = [], 0
    for s in shape:
        if s is None:
            args.append(leaves[i])
            i += 1
        else:
            kind, n = s
            args.append(kind(leaves[i : i + n]))
            i += n
    kwargs = {}
    for k, kind, n in kshape:
        if kind is None:
            kwargs[k] = leaves[i]
            i += 1
        else:
            kwargs[k] = kind(leaves[i : i + n])
            i += n
    return tuple(args), kwargs


_SPARSE_PARTS = {
    torch.sparse_coo: lambda t: [t._indices(), t._values()],
    torch.sparse_csr: lambda t: [t.crow_indices(), t.col_indices(), t.values()],
    torch.sparse_bsr: lambda t: [t.crow_indices(), t.col_indices(), t.values()],
    torch.sparse_csc: lambda t: [t.ccol_indices(), t.row_indices(), t.values()],
    torch.sparse_bsc: lambda t: [t.ccol_indices(), t.row_indices(), t.values()],
}


def sparse_parts(t: torch.Tensor) -> list | None:
    """The strided tensors a sparse tensor is made of (indices, then values), or None for another layout. A
    sparse tensor has no storage of its own: it is read, probed and written through these."""
    parts = _SPARSE_PARTS.get(t.layout)
    return parts(t) if parts is not None else None


def storage_key(t: torch.Tensor) -> int:
    """An identity of the memory `t` reads: its storage's, or for a sparse tensor its values' (what an in-place
    op on it writes)."""
    if t.layout is torch.strided:
        return t.untyped_storage()._cdata
    parts = sparse_parts(t)
    return parts[-1].untyped_storage()._cdata if parts is not None else id(t)
