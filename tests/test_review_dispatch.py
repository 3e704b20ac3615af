"""Regressions found by trying the per-op path (dispatch, placement, recipes) as a new user would."""

from __future__ import annotations

import torch

import coop_arena


def _inside(fn, nbytes=1 << 20):
    with coop_arena.Budget(nbytes, device="cpu"):
        out = fn()
    return out


def test_an_int_scalar_and_a_float_scalar_give_their_own_output_dtypes():
    """1 == 1.0 == True in Python, but an op's output dtype can depend on which was passed (pow(int, 2) is int64,
    pow(int, 2.0) float32): the per-configuration plan must tell them apart."""
    x = torch.arange(1, 7)
    for exponent in (2.0, 2, True):
        want = torch.pow(x, exponent)
        got = _inside(lambda: torch.pow(x, exponent))
        assert got.dtype == want.dtype and torch.equal(got, want), (exponent, got, want)
