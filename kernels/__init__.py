"""Triton kernels for coop_arena (installed as coop_arena.kernels)."""
