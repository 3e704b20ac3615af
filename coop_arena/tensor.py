"""coop_arena.Tensor: the wrapper subclass every tensor produced inside a Budget is.

A wrapper carries only view metadata (its own sizes, strides, storage offset and dtype, in elements counted
from the start of its storage) and a `Cell`, shared by all views of one storage, that names the storage
record holding the bytes. Eviction and restoring happen per storage (Rule 2), so a view never holds bytes.

Outside a Budget (after the block ends) a wrapper reads the plain copy its storage was given on exit; any op
on it then runs on that plain tensor and returns plain tensors.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from .errors import TensorLost


class Cell:
    """The storage a wrapper's bytes live in. Shared by a base and its views; re-pointed only by copy-on-write."""

    __slots__ = ("storage", "__weakref__")

    def __init__(self, storage):
        self.storage = storage


class Tensor(torch.Tensor):
    _cell: Cell
    # Methods on a wrapper (size(), stride(), ...) must not go through Python's __torch_function__: every op is
    # handled below autograd, in the Budget's dispatch mode or in __torch_dispatch__ here.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, cell: Cell, size, stride, storage_offset: int, dtype: torch.dtype, device: torch.device):
        t = torch.Tensor._make_wrapper_subclass(cls, size, strides=stride, storage_offset=storage_offset,
                                                dtype=dtype, device=device, requires_grad=False)
        t._cell = cell
        return t

    def __init__(self, *args, **kwargs):  # everything happens in __new__
        super().__init__()

    def __repr__(self, *, tensor_contents=None):
        s = self._cell.storage
        try:
            body = repr(self.as_plain())
        except TensorLost as e:
            body = f"<lost: {e}>"
        return f"coop_arena.Tensor(storage={s.sid}, {s.state.value}, {body})"

    def as_plain(self) -> torch.Tensor:
        """A plain tensor over this tensor's bytes (a Budget's arena inside the block, its own copy after)."""
        return self._cell.storage.payload.plain_view(self)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # Reached only when no Budget is active: the op runs on plain tensors and returns plain tensors.
        unwrap = lambda x: x.as_plain() if isinstance(x, Tensor) else x
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
