"""The analytic cost model: deterministic, the same on cpu, cuda and meta (Rule 8).

cost(op) = bytes moved (inputs read + outputs written) + FLOPs / FLOPS_PER_BYTE

FLOPs come from torch.utils.flop_counter's formulas where it knows the op (matmuls, convolutions, attention
and their backward); every other op is charged the bytes it moves. FLOPS_PER_BYTE is a machine balance: a
FLOP costs this fraction of moving one byte. It makes a matmul with a long inner dimension expensive per
byte and a pointwise op cheap, which is what cheap tensor partitioning needs. Costs are in byte-equivalents.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

FLOPS_PER_BYTE = 16.0


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def op_cost(func, args, kwargs, outs) -> float:
    moved = 0
    for x in tree_leaves((args, kwargs)):
        if isinstance(x, torch.Tensor):
            moved += tensor_bytes(x)
    for x in tree_leaves(outs):
        if isinstance(x, torch.Tensor):
            moved += tensor_bytes(x)
    flops = 0
    formula = flop_registry.get(func.overloadpacket)
    if formula is not None:
        try:
            flops = formula(*args, **kwargs, out_val=outs)
        except Exception:  # a formula that does not know this overload's arguments: charge bytes only
            flops = 0
    return float(moved) + float(flops) / FLOPS_PER_BYTE
