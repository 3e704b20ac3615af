"""Tensors that escape a Budget."""

from __future__ import annotations

import pytest
import torch

import coop_arena

X = torch.arange(4096, dtype=torch.float32).reshape(64, 64) / 7  # 16 KiB


def test_output_of_a_failed_op_is_lost_and_the_error_is_kept():
    """sort places its values, then cannot place its indices: the values' wrapper, freed with the error but still
    held by its traceback, ends the block as lost, and the OutOfBudget is what leaves the block."""
    budget = coop_arena.Budget(48 << 10, device="cpu")
    with pytest.raises(coop_arena.OutOfBudget) as err:
        with budget:
            torch.sort(X.flatten() * 1)  # 16 KiB in, 16 KiB values placed, 32 KiB indices do not fit
    assert budget.stats.dropped == 1
    held, tb = [], err.value.__traceback__
    while tb is not None:
        held += [v for vs in list(tb.tb_frame.f_locals.values()) if isinstance(vs, list)
                 for v in vs if isinstance(v, coop_arena.Tensor)]
        tb = tb.tb_next
    lost = [t for t in held if t._cell.storage.payload.lost is not None]
    assert len(lost) == 1 and lost[0].shape == (4096,) and lost[0].dtype == torch.float32
    with pytest.raises(coop_arena.TensorLost, match="was freed when the op that made it failed"):
        lost[0].as_plain()
