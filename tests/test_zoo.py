"""A few `transformers` models of the zoo smoke layer (bench/zoo.py; the whole list with timm is `make zoo`), built
from configs, trained two steps under Budgets at 0.5 of their peak with coop and dtr: parameters, buffers and loss
bitwise plain PyTorch's, with tensors evicted and recomputed."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the zoo's language models come from transformers (in the test extra)")

from bench import zoo  # noqa: E402


@pytest.mark.parametrize("name", zoo.TEST_MODELS)
def test_a_zoo_model_trains_exactly_at_half_its_peak(name):
    rows = zoo.run_model(name, runs=(("coop", 0.5), ("dtr", 0.5)))
    assert [r["outcome"] for r in rows] == ["exact"] * 3, rows
    assert all(r["evictions"] > 0 and r["rematerializations"] > 0 for r in rows[1:]), rows
