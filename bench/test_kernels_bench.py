"""Benchmarks of the Triton kernels against what torch does without them (pytest-benchmark; GPU only).

- arena_move vs a torch copy through a temporary (clone, then copy back), for a disjoint move, an overlapping
  move by a large distance (chunked launches) and by a small one (the serial path). The last two bracket
  MIN_PARALLEL_CHUNK in kernels/copy.py (Note [Overlap-safe arena_move]).
- copy_into vs `dst.copy_(src)` for a contiguous and a transposed source.
- bias_gelu vs torch's two unfused ops `gelu(x + bias)`.
Timing Triton's interpreter says nothing about the kernels, so everything here skips without CUDA (and under
TRITON_INTERPRET=1). Each timed call synchronizes, so the numbers include one launch latency.

Run: `make bench`, or `.venv/bin/python -m pytest -q bench/test_kernels_bench.py --benchmark-only`.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA device"),
    pytest.mark.skipif(INTERPRET, reason="TRITON_INTERPRET=1: timing the interpreter is meaningless"),
]

if CUDA and not INTERPRET:  # the kernel modules import triton; no need for it when everything skips
    from coop_arena.kernels.copy import arena_move, copy_into
    from coop_arena.kernels.pointwise import bias_gelu

MIB = 1 << 20
MOVE_BYTES = 64 * MIB
# (name, src, dst): where the MOVE_BYTES-byte block starts and where it goes
MOVES = [
    ("disjoint", 0, 96 * MIB),
    ("overlap_by_16MiB", 16 * MIB, 0),
    ("overlap_by_4KiB", 4096, 0),
]


def _synced(fn):
    def run():
        fn()
        torch.cuda.synchronize()

    return run


@pytest.fixture(scope="module")
def arena():
    return torch.randint(0, 256, (192 * MIB,), dtype=torch.uint8, device="cuda")


@pytest.mark.parametrize("name, src, dst", MOVES, ids=[m[0] for m in MOVES])
def test_bench_arena_move(benchmark, arena, name, src, dst):
    benchmark.group = f"arena_move {MOVE_BYTES // MIB} MiB {name}"
    benchmark(_synced(lambda: arena_move(arena, src, dst, MOVE_BYTES)))


@pytest.mark.parametrize("name, src, dst", MOVES, ids=[m[0] for m in MOVES])
def test_bench_torch_move_via_temporary(benchmark, arena, name, src, dst):
    benchmark.group = f"arena_move {MOVE_BYTES // MIB} MiB {name}"

    def move():
        arena[dst:dst + MOVE_BYTES].copy_(arena[src:src + MOVE_BYTES].clone())

    benchmark(_synced(move))


COPY_SHAPE = (4096, 4096)


@pytest.fixture(scope="module")
def copy_tensors():
    src = torch.randn(COPY_SHAPE, device="cuda")
    return {"contiguous": src, "transposed": src.t().contiguous().t()}


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_bench_copy_into(benchmark, copy_tensors, layout):
    benchmark.group = f"copy_into {COPY_SHAPE} float32 {layout}"
    src = copy_tensors[layout]
    dst = torch.empty(COPY_SHAPE, device="cuda")
    benchmark(_synced(lambda: copy_into(dst, src)))


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_bench_torch_copy_(benchmark, copy_tensors, layout):
    benchmark.group = f"copy_into {COPY_SHAPE} float32 {layout}"
    src = copy_tensors[layout]
    dst = torch.empty(COPY_SHAPE, device="cuda")
    benchmark(_synced(lambda: dst.copy_(src)))


GELU_SHAPE = (8192, 4096)


@pytest.fixture(scope="module")
def gelu_inputs():
    return torch.randn(GELU_SHAPE, device="cuda"), torch.randn(GELU_SHAPE[-1], device="cuda")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bench_bias_gelu(benchmark, gelu_inputs, approximate):
    benchmark.group = f"bias_gelu {GELU_SHAPE} float32 {approximate}"
    x, bias = gelu_inputs
    out = torch.empty_like(x)
    benchmark(_synced(lambda: bias_gelu(x, bias, out, approximate=approximate)))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bench_torch_unfused_bias_gelu(benchmark, gelu_inputs, approximate):
    benchmark.group = f"bias_gelu {GELU_SHAPE} float32 {approximate}"
    x, bias = gelu_inputs
    benchmark(_synced(lambda: F.gelu(x + bias, approximate=approximate)))
