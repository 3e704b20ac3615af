"""Arena: one buffer of exactly `nbytes`, allocated once on its device and never grown.

It hands out typed, strided views of byte ranges. Views are built from one cached typed alias of the whole
buffer per dtype, so a view costs one `as_strided`. Offsets handed in are block offsets (aligned), so they are
multiples of every dtype's item size. On `meta` nothing is allocated: a dry run has shapes but no data.
"""

from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda", "meta")


def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)} (or 'cuda:N')") from e
    if dev.type not in DEVICES:
        raise ValueError(f"unsupported device {device!r}; expected one of {', '.join(DEVICES)} (or 'cuda:N')")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available here; use 'cpu' or 'meta'")
    return dev


class Arena:
    def __init__(self, nbytes: int, device: torch.device, usable: int):
        self.nbytes = nbytes
        self.device = device
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._usable = self.buffer[:usable]
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self.key = self.buffer.untyped_storage()._cdata  # identity of the arena's storage (works on meta too)

    def owns(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata == self.key

    def view(self, byte_offset: int, dtype: torch.dtype, size, stride, storage_offset: int) -> torch.Tensor:
        """A tensor over the arena at `byte_offset`, with `storage_offset` counted in elements from there."""
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self._usable.view(dtype)
        return typed.as_strided(size, stride, byte_offset // typed.element_size() + storage_offset)

    def bytes(self, byte_offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[byte_offset : byte_offset + nbytes]
