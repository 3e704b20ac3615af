"""Triton kernels for coop_arena (installed as coop_arena.kernels).

Submodules (each imports triton): `copy` (arena_move, copy_into), `pointwise` (bias_gelu, seeded_dropout).
This package itself does not import triton; `kernels_available(device)` says whether the kernels can run there.
"""

from ._util import kernels_available

__all__ = ["kernels_available"]
