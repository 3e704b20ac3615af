"""Per-call cost of the memory core's common operations and of the cost model, on the public interfaces only
(so the same file times any version of the code).

- BlockTable at 1,000 and 10,000 blocks (every other block free, sizes 1-8 units): a `place` that splits a free
  block followed by the `release` that merges it back (one round leaves the table as it was), `best_fit`,
  `index_of`, and the address-ordered columns right after a mutation (`offsets`, `sizes`, `owners`).
- Memory at 1,000 and 10,000 resident storages: an `allocate` that needs no eviction followed by its `free`.
- `op_cost` per call for mm, addmm, convolution, convolution_backward and a pointwise add, on meta tensors of a
  fixed shape (the runtime calls it once per op with the plain arguments and outputs).

Run: `.venv/bin/python -m pytest bench/test_core_ops.py --benchmark-only --benchmark-json=bench/results/core_ops.json`
"""

from __future__ import annotations

import functools

import pytest
import torch

from coop_arena import Memory
from coop_arena import ops
from coop_arena.blocks import BlockTable
from coop_arena.cost import op_cost

U = 512
COUNTS = (1_000, 10_000)
aten = torch.ops.aten


@functools.cache
def table(count: int) -> BlockTable:
    """`count` blocks in address order, alternately owned and free, of 1-8 units."""
    sizes = [U * (1 + (i * 7) % 8) for i in range(count)]
    t = BlockTable(sum(sizes))
    at = 0
    for i, size in enumerate(sizes):
        if i % 2 == 0:
            t.place_at(at, size, i + 1)
        at += size
    t.check_invariants()
    assert len(t) == count
    return t


def _split_point(t: BlockTable) -> tuple[int, int]:
    """(offset, bytes) of a free block near the middle that holds at least two units."""
    for b in t.snapshot()[len(t) // 2 :]:
        if b["owner"] is None and b["size"] >= 2 * U:
            return b["offset"], b["size"]
    raise AssertionError("no free block of two units")


@pytest.mark.parametrize("count", COUNTS)
def test_place_release(benchmark, count):
    t = table(count)
    off, size = _split_point(t)
    owner = 10 * count

    def place_release():
        at = t.place(off, U, owner, high=False)
        t.release(at)

    before = t.snapshot()
    benchmark(place_release)
    assert t.snapshot() == before


@pytest.mark.parametrize("count", COUNTS)
def test_best_fit(benchmark, count):
    t = table(count)
    assert benchmark(t.best_fit, 5 * U) is not None


@pytest.mark.parametrize("count", COUNTS)
def test_index_of(benchmark, count):
    t = table(count)
    off, _ = _split_point(t)
    assert benchmark(t.index_of, off) >= 0


@pytest.mark.parametrize("count", COUNTS)
def test_columns_after_a_mutation(benchmark, count):
    """What a search pays to read the blocks in address order when the table changed since the last read."""
    t = table(count)
    off, _ = _split_point(t)
    owner = 10 * count

    def columns():
        at = t.place(off, U, owner, high=False)
        t.release(at)
        return t.offsets, t.sizes, t.owners

    o, s, w = benchmark(columns)
    assert len(o) == len(s) == len(w) == count


@functools.cache
def memory(count: int) -> Memory:
    m = Memory((2 * count + 64) * 4 * U, trace_len=16)
    for i in range(2 * count):
        m.allocate(U * (1 + i % 4), float(i % 5) * U)
        m.advance(1.0)
    for s in m.resident()[::2]:
        m.free(s)
    assert len(m.resident()) == count
    return m


@pytest.mark.parametrize("count", COUNTS)
def test_memory_allocate_free(benchmark, count):
    m = memory(count)
    assert m.fits(3 * U)

    def allocate_free():
        m.free(m.allocate(3 * U - 100, 100.0))

    benchmark(allocate_free)
    m.check_invariants()


def _call(func, *args, **kwargs):
    out = func(*args, **kwargs)
    leaves, _ = ops.flatten(args, kwargs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return ops.info(func).flops, args, kwargs, leaves, outs, out


def _meta(*shape):
    return torch.randn(*shape, device="meta")


CALLS = {
    "mm": lambda: _call(aten.mm.default, _meta(64, 128), _meta(128, 256)),
    "addmm": lambda: _call(aten.addmm.default, _meta(256), _meta(64, 128), _meta(128, 256)),
    "convolution": lambda: _call(aten.convolution.default, _meta(8, 16, 32, 32), _meta(32, 16, 3, 3), None,
                                 [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
    "convolution_backward": lambda: _call(aten.convolution_backward.default, _meta(8, 32, 32, 32),
                                          _meta(8, 16, 32, 32), _meta(32, 16, 3, 3), [32], [1, 1], [1, 1], [1, 1],
                                          False, [0, 0], 1, [True, True, False]),
    "add": lambda: _call(aten.add.Tensor, _meta(64, 128), _meta(64, 128)),
}


@pytest.mark.parametrize("op", list(CALLS))
def test_op_cost(benchmark, op):
    call = CALLS[op]()
    want = op_cost(*call)
    assert benchmark(op_cost, *call) == want
    if op != "add":
        assert want > sum(x.numel() * x.element_size() for x in call[3] + call[4] if isinstance(x, torch.Tensor))
