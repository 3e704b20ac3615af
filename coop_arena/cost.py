"""The analytic cost model: deterministic, the same on cpu, cuda and meta (Rule 8).

cost(op) = bytes moved (inputs read + outputs written) + FLOPs / FLOPS_PER_BYTE

FLOPs come from torch.utils.flop_counter's formulas where it knows the op (matmuls, convolutions, attention
and their backward); every other op is charged the bytes it moves. FLOPS_PER_BYTE is a machine balance: a
FLOP costs this fraction of moving one byte. It makes a matmul with a long inner dimension expensive per
byte and a pointwise op cheap, which is what cheap tensor partitioning needs. Costs are in byte-equivalents.
"""

from __future__ import annotations

import torch

FLOPS_PER_BYTE = 16.0


def op_cost(formula, args, kwargs, in_leaves, out_leaves, outs) -> float:
    """`formula` is the op's flop_counter formula or None; the leaves are its arguments and outputs."""
    moved = 0
    for x in in_leaves:
        if isinstance(x, torch.Tensor):
            moved += x.numel() * x.element_size()
    for x in out_leaves:
        if isinstance(x, torch.Tensor):
            moved += x.numel() * x.element_size()
    flops = 0
    if formula is not None:
        try:
            flops = formula(*args, **kwargs, out_val=outs)
        except Exception:  # a formula that does not know this overload's arguments: charge bytes only
            flops = 0
    return float(moved) + float(flops) / FLOPS_PER_BYTE
