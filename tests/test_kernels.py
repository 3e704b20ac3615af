"""Reference checks of the Triton kernels against torch (coop_arena.kernels.copy / .pointwise).

Two layers run the same checks:
- the default layer, small sizes: on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1, which
  `make test` sets where there is no GPU), or on CUDA when there is a device and the interpreter is off;
- the GPU layer (`@pytest.mark.gpu`): larger sizes on CUDA with compiled kernels.
The interpreter runs a launch's programs one after another, so it cannot expose races between programs;
`test_move_plan_is_race_free` checks the launch plan of arena_move for that instead, in plain numpy.
"""

from __future__ import annotations

import contextlib
import os
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
CUDA = torch.cuda.is_available()
if not (INTERPRET or CUDA):
    pytest.skip(
        "the Triton kernels need a CUDA device, or TRITON_INTERPRET=1 set before triton is imported to run on "
        "CPU (`make test` sets it)",
        allow_module_level=True,
    )

from coop_arena.kernels import kernels_available  # noqa: E402
from coop_arena.kernels import copy as kcopy  # noqa: E402
from coop_arena.kernels.copy import _move_plan, arena_move, copy_into  # noqa: E402
from coop_arena.kernels.pointwise import bias_gelu, seeded_dropout  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"  # the default layer's device
pytestmark = pytest.mark.kernels  # bench/gpu_check.py selects "gpu or kernels"

# The GPU layer: compiled kernels at GPU sizes (far too slow for the interpreter).
_GPU_SKIP = "needs a CUDA device" if not CUDA else "TRITON_INTERPRET=1 is set: the GPU layer needs compiled kernels"


def _gpu(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA or INTERPRET, reason=_GPU_SKIP)(fn))


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------------- arena_move


def _reference_move(buf: torch.Tensor, src: int, dst: int, n: int) -> torch.Tensor:
    ref = buf.clone()
    ref[dst:dst + n] = buf[src:src + n].clone()  # through a temporary
    return ref


def _check_moves(device: str, cases, arena_bytes: int) -> None:
    buf = torch.randint(0, 256, (arena_bytes,), dtype=torch.uint8, generator=_gen(1)).to(device)
    for src, dst, n in cases:
        ref = _reference_move(buf, src, dst, n)
        arena_move(buf, src, dst, n)
        assert torch.equal(buf, ref), f"arena_move(src={src}, dst={dst}, nbytes={n}) differs from a memmove"


# (src, dst, nbytes): overlapping down, overlapping up, by one byte, disjoint, adjacent, tiny, odd sizes
MOVE_CASES = [
    (1000, 700, 3001),
    (700, 1000, 3001),
    (10, 11, 4099),
    (4099, 4098, 1025),
    (0, 5000, 3333),
    (5000, 0, 3333),
    (100, 1123, 1023),
    (3, 4, 1),
    (9000, 9000, 57),  # no-op
    (0, 1, 9999),
]


def test_arena_move_serial_path():
    # every overlapping case is closer than MIN_PARALLEL_CHUNK: one program walks the tiles
    _check_moves(DEVICE, MOVE_CASES, 10_000)


def test_arena_move_chunked_path(monkeypatch):
    # small chunk threshold: overlapping moves become sequences of parallel launches of |dst - src| bytes
    monkeypatch.setattr(kcopy, "MIN_PARALLEL_CHUNK", 200)
    monkeypatch.setattr(kcopy, "MOVE_BLOCK", 128)
    _check_moves(DEVICE, MOVE_CASES + [(0, 1499, 8000), (1499, 0, 8000)], 10_000)


def test_arena_move_in_a_view_of_a_larger_buffer():
    big = torch.randint(0, 256, (6000,), dtype=torch.uint8, generator=_gen(2)).to(DEVICE)
    before = big.clone()
    arena = big[1000:5000]
    arena_move(arena, 10, 5, 3000)
    expected = before.clone()
    expected[1005:4005] = before[1010:4010]
    assert torch.equal(big, expected)


def _simulate(plan, mem: np.ndarray, tile: int, rng: random.Random) -> None:
    """Run a plan the way a GPU may: a parallel step's tiles in a random order, each tile load-then-store."""
    for step in plan:
        n = step.nbytes
        starts = list(range(0, n, tile))
        if step.serial:
            if step.dst > step.src:
                starts.reverse()
        else:
            assert step.src + n <= step.dst or step.dst + n <= step.src, f"parallel step {step} overlaps itself"
            rng.shuffle(starts)
        for s in starts:
            e = min(s + tile, n)
            data = mem[step.src + s:step.src + e].copy()
            mem[step.dst + s:step.dst + e] = data


def test_move_plan_is_race_free():
    rng = random.Random(0)
    for _ in range(2000):
        size = rng.randint(1, 600)
        n = rng.randint(1, size)
        src, dst = rng.randint(0, size - n), rng.randint(0, size - n)
        min_chunk = rng.choice([1, 3, 16, 64, 1 << 20])
        mem = np.random.default_rng(rng.randint(0, 1 << 30)).integers(0, 256, size, dtype=np.uint8)
        expected = mem.copy()
        expected[dst:dst + n] = mem[src:src + n].copy()
        _simulate(_move_plan(src, dst, n, min_chunk), mem, rng.choice([1, 7, 32]), rng)
        assert np.array_equal(mem, expected), (src, dst, n, min_chunk)


@pytest.mark.parametrize(
    "args, exc, words",
    [
        ((0, 10, 0), ValueError, "nbytes must be positive"),
        ((0, 10, -5), ValueError, "nbytes must be positive"),
        ((-1, 10, 5), ValueError, "negative"),
        ((0, 96, 5), ValueError, "buffer of 100 bytes"),
        ((97, 0, 5), ValueError, "past the end"),
        ((0, 10, True), TypeError, "bool"),
        ((0.0, 10, 5), TypeError, "float"),
    ],
)
def test_arena_move_rejects_bad_ranges(args, exc, words):
    buf = torch.zeros(100, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(exc, match=words):
        arena_move(buf, *args)
    assert not buf.any()


def test_arena_move_rejects_bad_buffers():
    with pytest.raises(TypeError, match="uint8"):
        arena_move(torch.zeros(100, dtype=torch.int8, device=DEVICE), 0, 10, 5)
    with pytest.raises(ValueError, match="1-D"):
        arena_move(torch.zeros(10, 10, dtype=torch.uint8, device=DEVICE), 0, 10, 5)
    with pytest.raises(ValueError, match="contiguous"):
        arena_move(torch.zeros(200, dtype=torch.uint8, device=DEVICE)[::2], 0, 10, 5)
    with pytest.raises(TypeError, match="torch.Tensor"):
        arena_move(bytearray(100), 0, 10, 5)


# ---------------------------------------------------------------------------------------------------- copy_into


def _arena_view(arena: torch.Tensor, offset: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return arena[offset:offset + numel * itemsize].view(dtype)


def _random(shape, dtype, gen) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(1 << 40), 1 << 40, shape, generator=gen).to(dtype)


def _layouts(dtype: torch.dtype, scale: int):
    """(name, make_src(gen), make_dst(arena)) for each layout pair, sizes grown by `scale`."""
    r, c = 13 * scale, 21 * scale
    yield ("contiguous", lambda g: _random((r, c), dtype, g), lambda a: _arena_view(a, 64, dtype, r * c).view(r, c))
    yield ("transposed src", lambda g: _random((c, r), dtype, g).t(),
           lambda a: _arena_view(a, 64, dtype, r * c).view(r, c))
    yield ("transposed dst", lambda g: _random((r, c), dtype, g),
           lambda a: _arena_view(a, 64, dtype, r * c).view(c, r).t())
    yield ("sliced src, strided dst", lambda g: _random((2 * r + 1, 3 * c), dtype, g)[1::2, ::3],
           lambda a: _arena_view(a, 64, dtype, 2 * r * c).view(r, 2 * c)[:, 1::2])
    yield ("4-D permuted", lambda g: _random((3, 5, 2 * scale, 7), dtype, g).permute(2, 0, 3, 1),
           lambda a: _arena_view(a, 64, dtype, 3 * 5 * 2 * scale * 7).view(3, 7, 2 * scale, 5).permute(2, 0, 1, 3))
    yield ("5-D that collapses", lambda g: _random((2, 3, 4, 5, 6 * scale), dtype, g),
           lambda a: _arena_view(a, 64, dtype, 720 * scale).view(2, 3, 4, 5, 6 * scale))
    yield ("1-D strided", lambda g: _random((3 * r,), dtype, g)[::3],
           lambda a: _arena_view(a, 64, dtype, 2 * r)[::2])


def _check_copy_into(device: str, dtype: torch.dtype, scale: int) -> None:
    for name, make_src, make_dst in _layouts(dtype, scale):
        src = make_src(_gen(3)).to(device)
        arena = torch.full((64 * scale * scale * 1024 + 4096,), 0xA5, dtype=torch.uint8, device=device)
        dst = make_dst(arena)
        untouched = arena.clone()
        copy_into(dst, src)
        assert torch.equal(dst, src), f"copy_into, {name}, {dtype}: values differ"
        # every byte outside dst keeps its value
        untouched_view = make_dst(untouched)
        untouched_view.copy_(src)
        assert torch.equal(arena, untouched), f"copy_into, {name}, {dtype}: wrote outside dst"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_copy_into_layouts(dtype):
    _check_copy_into(DEVICE, dtype, scale=1)


def test_copy_into_keeps_bit_patterns_and_odd_dtypes():
    nan_payload = torch.tensor([0x7FC00123, -0x80000000, 0x7F800000], dtype=torch.int32).view(torch.float32)
    dst = torch.zeros(3, dtype=torch.float32, device=DEVICE)
    copy_into(dst, nan_payload.to(DEVICE))
    assert torch.equal(dst.view(torch.int32).cpu(), nan_payload.view(torch.int32))
    for dtype in (torch.bool, torch.bfloat16, torch.uint8):
        src = (torch.randn(5, 6, generator=_gen(4)) > 0).to(dtype).to(DEVICE).t()
        dst = torch.zeros(6, 5, dtype=dtype, device=DEVICE)
        copy_into(dst, src)
        assert torch.equal(dst, src)
    arena = torch.arange(4096, device=DEVICE).to(torch.uint8)
    before = arena.clone()
    src, dst = arena[:1024].view(torch.float32).view(16, 16), arena[2048:3072].view(torch.float32).view(16, 16)
    copy_into(dst.t(), src)  # two disjoint ranges of one arena (the bytes make NaNs: compare bits)
    expected = before.clone()
    expected[2048:3072].view(torch.float32).view(16, 16).t().copy_(before[:1024].view(torch.float32).view(16, 16))
    assert torch.equal(arena, expected)
    scalar = torch.zeros((), device=DEVICE)
    copy_into(scalar, torch.tensor(3.5, device=DEVICE))
    assert scalar.item() == 3.5
    copy_into(torch.zeros(0, 4, device=DEVICE), torch.zeros(0, 4, device=DEVICE))  # nothing to do


def test_copy_into_rejects_bad_arguments():
    a = torch.zeros(4, 5, device=DEVICE)
    with pytest.raises(ValueError, match="shapes differ"):
        copy_into(a, torch.zeros(5, 4, device=DEVICE))
    with pytest.raises(TypeError, match="dtypes differ"):
        copy_into(a, torch.zeros(4, 5, dtype=torch.float64, device=DEVICE))
    with pytest.raises(TypeError, match="torch.Tensor"):
        copy_into(a, np.zeros((4, 5), dtype=np.float32))
    with pytest.raises(TypeError, match="not supported"):
        copy_into(torch.zeros(2, dtype=torch.complex128, device=DEVICE), torch.zeros(2, dtype=torch.complex128,
                                                                                      device=DEVICE))
    z = torch.randn(2, 3, dtype=torch.complex64, generator=_gen(10)).to(DEVICE)
    for dst, src, words in [(torch.zeros_like(z), z.conj(), "src is a conjugate view"),
                            (torch.zeros_like(z), torch._neg_view(z), "src is a negative view"),
                            (torch.zeros_like(z).conj(), z, "dst is a conjugate view")]:
        with pytest.raises(TypeError, match=words):  # the kernel copies bits; the lazy bit would be lost
            copy_into(dst, src)
    with pytest.raises(ValueError, match="stride-0"):
        copy_into(torch.zeros(1, 5, device=DEVICE).expand(4, 5), torch.ones(4, 5, device=DEVICE))
    with pytest.raises(ValueError, match="share memory"):
        copy_into(a[:, 1:], a[:, :-1])
    wide = torch.zeros(2, 3, 4, 5, 6, device=DEVICE).permute(4, 2, 0, 3, 1)  # no two dims merge
    with pytest.raises(ValueError, match="at most 4"):
        copy_into(wide, torch.ones(wide.shape, device=DEVICE))
    b = torch.arange(20.0, device=DEVICE).view(4, 5)
    copy_into(b, b)  # a view onto itself: nothing to do
    assert torch.equal(b, torch.arange(20.0, device=DEVICE).view(4, 5))


# ---------------------------------------------------------------------------------------------------- bias_gelu


def _check_bias_gelu(device: str, rows: int, cols: int, atol: float) -> None:
    gen = _gen(5)
    x = (torch.randn(rows, cols, generator=gen) * 4).to(device)
    bias = torch.randn(cols, generator=gen).to(device)
    for approximate in ("none", "tanh"):
        expected = F.gelu(x + bias, approximate=approximate)
        torch.testing.assert_close(bias_gelu(x, bias, approximate=approximate), expected, atol=atol, rtol=atol)
        arena = torch.zeros(x.numel() * 4 + 512, dtype=torch.uint8, device=device)
        out = arena[256:256 + x.numel() * 4].view(torch.float32).view(rows, cols)
        assert bias_gelu(x, bias, out, approximate=approximate) is out
        torch.testing.assert_close(out, expected, atol=atol, rtol=atol)
        assert not arena[:256].any() and not arena[256 + x.numel() * 4:].any()
        inplace = x.clone()
        bias_gelu(inplace, bias, inplace, approximate=approximate)
        torch.testing.assert_close(inplace, expected, atol=atol, rtol=atol)
    for dtype in (torch.float16, torch.bfloat16):
        xh, bh = x.to(dtype), bias.to(dtype)
        for approximate in ("none", "tanh"):
            expected = F.gelu(xh + bh, approximate=approximate)
            got = bias_gelu(xh, bh, approximate=approximate)
            assert got.dtype == dtype
            # computed in float32 and rounded to dtype, as torch does: a rounding step apart at most. Triton's
            # interpreter truncates float32 -> bfloat16 instead of rounding to nearest: two steps there.
            rtol = 3e-2 if (dtype == torch.bfloat16 and INTERPRET) else 1.6e-2
            torch.testing.assert_close(got, expected, atol=1e-3, rtol=rtol)


def test_bias_gelu_matches_torch():
    _check_bias_gelu(DEVICE, rows=7, cols=37, atol=1e-6)


def test_bias_gelu_edges():
    x = torch.tensor([[-1e4, -50.0, -1e-30, 0.0, 1e-30, 50.0, 1e4, float("nan")]], device=DEVICE)
    bias = torch.zeros(8, device=DEVICE)
    for approximate in ("none", "tanh"):
        torch.testing.assert_close(bias_gelu(x, bias, approximate=approximate),
                                   F.gelu(x, approximate=approximate), atol=1e-6, rtol=1e-6, equal_nan=True)
    x3 = torch.randn(2, 3, 5, generator=_gen(6)).to(DEVICE)
    strided_bias = torch.randn(10, generator=_gen(7)).to(DEVICE)[::2]
    torch.testing.assert_close(bias_gelu(x3, strided_bias), F.gelu(x3 + strided_bias), atol=1e-6, rtol=1e-6)


def test_bias_gelu_rejects_bad_arguments():
    x = torch.zeros(4, 5, device=DEVICE)
    bias = torch.zeros(5, device=DEVICE)
    with pytest.raises(ValueError, match="approximate"):
        bias_gelu(x, bias, approximate="erf")
    with pytest.raises(ValueError, match="bias must be 1-D"):
        bias_gelu(x, torch.zeros(4, device=DEVICE))
    with pytest.raises(TypeError, match="bias has dtype"):
        bias_gelu(x, bias.half())
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        bias_gelu(x.double(), bias.double())
    with pytest.raises(ValueError, match="contiguous"):
        bias_gelu(torch.zeros(5, 4, device=DEVICE).t(), bias)
    with pytest.raises(ValueError, match="out has shape"):
        bias_gelu(x, bias, torch.zeros(20, device=DEVICE))
    with pytest.raises(TypeError, match="out has dtype"):
        bias_gelu(x, bias, torch.zeros(4, 5, dtype=torch.float16, device=DEVICE))
    big = torch.zeros(30, device=DEVICE)
    with pytest.raises(ValueError, match="partially overlaps"):
        bias_gelu(big[:20].view(4, 5), bias, big[5:25].view(4, 5))


# ---------------------------------------------------------------------------------------------------- seeded_dropout


def _check_dropout(device: str, numel: int, tolerance: float) -> None:
    x = (torch.rand(numel, generator=_gen(8)) + 0.5).to(device)  # no zeros, so zeros in the output were dropped
    for p in (0.1, 0.5, 0.8):
        first = seeded_dropout(x, p, seed=1234)
        replay = seeded_dropout(x, p, seed=1234)
        other = seeded_dropout(x, p, seed=1235)
        assert torch.equal(first, replay), "same seed must replay bit-identically"
        assert not torch.equal(first, other), "another seed must give another mask"
        kept = first != 0
        assert abs(kept.float().mean().item() - (1 - p)) < tolerance
        torch.testing.assert_close(first[kept], x[kept] / (1 - p), atol=0, rtol=1e-6)
        # the backward is the same call on the gradient: the same elements survive
        grad = seeded_dropout(torch.ones_like(x), p, seed=1234)
        assert torch.equal(grad != 0, kept)
        out = torch.empty_like(x)
        assert seeded_dropout(x, p, 1234, out) is out and torch.equal(out, first)
        inplace = x.clone()
        seeded_dropout(inplace, p, 1234, inplace)
        assert torch.equal(inplace, first)
    big_seed = seeded_dropout(x, 0.5, seed=2**62 + 7)
    assert torch.equal(big_seed, seeded_dropout(x, 0.5, seed=2**62 + 7))
    assert torch.equal(seeded_dropout(x, 0.0, seed=5), x)
    assert not seeded_dropout(x, 1.0, seed=5).any()


def test_seeded_dropout():
    _check_dropout(DEVICE, numel=4096, tolerance=0.05)


def test_seeded_dropout_mask_independent_of_dtype_and_shape():
    x = (torch.rand(3000, generator=_gen(9)) + 0.5).to(DEVICE)
    a = seeded_dropout(x, 0.3, seed=77) != 0
    b = seeded_dropout(x.view(30, 100).half(), 0.3, seed=77).view(-1) != 0
    assert torch.equal(a, b)


def test_seeded_dropout_rejects_bad_arguments():
    x = torch.ones(10, device=DEVICE)
    for p in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="p must be in"):
            seeded_dropout(x, p, 0)
    with pytest.raises(TypeError, match="p must be a float"):
        seeded_dropout(x, "0.5", 0)
    with pytest.raises(ValueError, match="seed must be in"):
        seeded_dropout(x, 0.5, -1)
    with pytest.raises(TypeError, match="seed must be an int"):
        seeded_dropout(x, 0.5, 1.5)
    with pytest.raises(ValueError, match="contiguous"):
        seeded_dropout(torch.ones(4, 5, device=DEVICE).t(), 0.5, 0)


# ---------------------------------------------------------------------------------------------------- devices


def test_kernels_available():
    assert kernels_available("cpu") is INTERPRET
    assert kernels_available(torch.device("cuda")) is CUDA
    assert kernels_available("meta") is False


@pytest.mark.skipif(INTERPRET, reason="under TRITON_INTERPRET=1 CPU tensors are accepted")
def test_cpu_tensors_rejected_without_interpreter():
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        arena_move(torch.zeros(100, dtype=torch.uint8), 0, 10, 5)


# ---------------------------------------------------------------------------------------------------- GPU layer


@_gpu
def test_gpu_arena_move():
    mib = 1 << 20
    cases = [(0, 3 * mib + 17, 5 * mib + 3), (3 * mib + 17, 0, 5 * mib + 3),  # chunked (distance >= 1 MiB)
             (4096, 4096 - 513, 7 * mib + 1), (1, 2, 6 * mib),  # serial (small distance)
             (0, 8 * mib, 7 * mib - 5)]  # disjoint
    _check_moves("cuda", cases, 16 * mib)


@_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_gpu_copy_into(dtype):
    _check_copy_into("cuda", dtype, scale=16)


@_gpu
def test_gpu_bias_gelu():
    # fast exp and FMA contraction on the GPU: a few ulps from torch's formula
    _check_bias_gelu("cuda", rows=1024, cols=1031, atol=1e-5)


@_gpu
def test_gpu_seeded_dropout():
    _check_dropout("cuda", numel=(1 << 22) + 3, tolerance=0.005)


def test_serial_move_counts_its_tiles_in_64_bits_just_under_2_gib():
    """Triton passes a size below 2**31 as int32; counting tiles there wrapped negative for the last 4095 sizes
    below 2 GiB, and the serial move of such a block copied nothing (kcopy._num_tiles)."""
    import triton
    import triton.language as tl

    @triton.jit
    def tiles(out, n, BLOCK: tl.constexpr):
        tl.store(out, kcopy._num_tiles(n, BLOCK))

    for n in (1, kcopy.SERIAL_BLOCK, 2**31 - kcopy.SERIAL_BLOCK, 2**31 - 100, 2**31 - 1, 2**31 + 100):
        out = torch.zeros(1, dtype=torch.int64, device=DEVICE)
        tiles[(1,)](out, n, BLOCK=kcopy.SERIAL_BLOCK)
        assert out.item() == -(-n // kcopy.SERIAL_BLOCK), n


def test_a_hand_launched_kernel_through_pinned_views_is_exact():
    """The `pinned()` example of docs/custom-kernels.md, run where this layer runs. Under the interpreter a launch
    copies each argument's whole storage (the arena) through torch ops, which the Budget refuses; the docs say to
    launch inside `_disable_current_modes()` there, and this checks that that is exact. On CUDA it launches as
    written."""
    import triton
    import triton.language as tl
    from torch.utils._python_dispatch import _disable_current_modes
    import coop_arena

    @triton.jit
    def scale_kernel(x_ptr, out_ptr, n, s, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n) * s, mask=i < n)

    torch.manual_seed(0)
    with coop_arena.Budget(1 << 20, device=DEVICE) as budget:
        x = torch.randn(4096, device=DEVICE) * 2
        out = torch.empty_like(x)
        with coop_arena.pinned(x, readonly=True) as raw_x, coop_arena.pinned(out) as raw_out:
            with _disable_current_modes() if INTERPRET else contextlib.nullcontext():
                scale_kernel[(triton.cdiv(4096, 1024),)](raw_x, raw_out, 4096, 3.0, BLOCK=1024)
        y = out.relu()
    assert torch.equal(out, x * 3) and torch.equal(y, (x * 3).relu())
    assert budget.stats.unevictable_bytes >= out.nbytes  # written by the kernel: no recipe can rebuild it
