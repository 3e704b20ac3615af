"""Copies inside the arena: `arena_move` (memmove of a byte range) and `copy_into` (strided elementwise copy).

Note [Overlap-safe arena_move]
  Rationale: compaction slides a live block to a lower (or higher) address, often by less than its own size,
  and the memory budget leaves no room for a temporary of the block's size.
  Approach: the programs of one launch run in no particular order, so one launch may only copy a range whose
  source and destination do not intersect. With distance d = |dst - src| (`_move_plan`):
  - d >= nbytes: the ranges are disjoint; one parallel launch.
  - MIN_PARALLEL_CHUNK <= d < nbytes: a sequence of parallel launches of d-byte chunks, walked away from the
    side being written: lowest chunk first when moving down (dst < src), highest first when moving up. A chunk
    of at most d bytes never intersects its own destination, and writing it only clobbers source bytes that
    earlier launches have already copied. Launches on one stream run in order.
  - d < MIN_PARALLEL_CHUNK: that would be too many launches, so one program walks the tiles in the same order
    (`_move_serial_kernel`): it loads a whole tile, waits at a barrier so every thread has its bytes, then
    stores. A memmove walked this way never reads a byte after writing it, so only the load-before-store order
    inside a tile needs the barrier.
  Limitations: the serial path uses one program (one SM), so a large move by a small distance runs at a
  fraction of the bandwidth. MIN_PARALLEL_CHUNK is a guess at the break-even point of launch overhead against
  single-program bandwidth, not yet measured on a GPU: with launches at about 5 us and one program at a few
  GB/s, chunks pay off from some tens of KiB (64 KiB: a 1 GiB block slid by 64 KiB takes 16,384 launches, some
  80 ms, where one program would take a few tenths of a second). bench/test_kernels_bench.py and the kernels
  part of bench/gpu_check.py measure both sides. Copies are byte-wide.

Note [copy_into]
  One launch: program p handles flat indices [p*BLOCK, (p+1)*BLOCK) of the (collapsed, at most 4-D) shape,
  turns them into per-dimension indices and gathers from `src` / scatters to `dst` with their own strides.
  Elements are moved as same-width integers, so every bit pattern (NaN payloads, -0.0) arrives unchanged.
  `src` and `dst` must not share bytes (checked, conservatively by byte span), and `dst` must not write one
  element twice (a stride-0 dimension is rejected; other self-overlapping layouts are not detected).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _util  # before triton: fixes INTERPRET, see Note [Where kernels run]
from ._util import as_int, device_guard, require_kernels, require_tensor

import triton
import triton.language as tl

MOVE_BLOCK = 1024  # bytes per program in `_copy_bytes_kernel`
SERIAL_BLOCK = 4096  # bytes per tile in `_move_serial_kernel`
MIN_PARALLEL_CHUNK = 64 << 10  # overlapping moves by a smaller distance run serially; Note [Overlap-safe arena_move]
COPY_BLOCK = 1024  # elements per program in `_strided_copy_kernel`
MAX_DIMS = 4  # dimensions `_strided_copy_kernel` indexes after collapsing

# Elements are copied as integers of the same width (Note [copy_into]).
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---------------------------------------------------------------------------------------------------- kernels


@triton.jit
def _copy_bytes_kernel(
    src_ptr,  # *uint8: first byte to read (a view into the arena)
    dst_ptr,  # *uint8: first byte to write; [dst, dst+n) must not intersect [src, src+n) (programs run unordered)
    n,  # int: number of bytes to copy
    BLOCK: tl.constexpr,  # bytes per program
):
    pid = tl.program_id(axis=0).to(tl.int64)  # int64: a move may exceed 2 GiB
    offsets = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n  # the last program may be partial
    data = tl.load(src_ptr + offsets, mask=mask)
    tl.store(dst_ptr + offsets, data, mask=mask)


@triton.jit
def _num_tiles(n, BLOCK: tl.constexpr):
    """Tiles of BLOCK bytes that cover n bytes. n is widened first: Triton passes an n below 2**31 as int32, in which
    n + BLOCK - 1 wraps negative for the last BLOCK - 1 values (a move of just under 2 GiB would copy nothing). An n
    of 1 arrives as a constexpr (Triton specialises int arguments equal to 1), which has no `.to`; `tl.full` takes
    either (tl.to_tensor would too, but Triton 3.6 has none)."""
    return tl.cdiv(tl.full((), n, tl.int64), BLOCK)


@triton.jit
def _move_serial_kernel(
    src_ptr,  # *uint8: first byte to read (a view into the arena)
    dst_ptr,  # *uint8: first byte to write (same arena); the ranges may overlap in either direction
    n,  # int: number of bytes to move
    FORWARD: tl.constexpr,  # True when dst < src: walk tiles from the lowest up, else from the highest down
    BLOCK: tl.constexpr,  # bytes per tile
):
    # Launched with one program; see Note [Overlap-safe arena_move] for why this order is safe.
    num_tiles = _num_tiles(n, BLOCK)
    for step in range(0, num_tiles):
        if FORWARD:
            tile = step
        else:
            tile = num_tiles - 1 - step
        # tile * BLOCK < n fits n's type; the lanes past it are widened first so masked ones cannot wrap
        offsets = tl.arange(0, BLOCK).to(tl.int64) + tile * BLOCK
        mask = offsets < n
        data = tl.load(src_ptr + offsets, mask=mask)
        tl.debug_barrier()  # every thread holds its bytes before any thread overwrites this tile's source
        tl.store(dst_ptr + offsets, data, mask=mask)


@triton.jit
def _strided_copy_kernel(
    dst_ptr,  # *intN: first element of the destination view
    src_ptr,  # *intN: first element of the source view (same element width as dst)
    numel,  # int: number of elements
    size1,  # int: size of dim 1 (dim 0's size is implied by numel)
    size2,  # int: size of dim 2
    size3,  # int: size of dim 3 (innermost)
    src_s0, src_s1, src_s2, src_s3,  # int: source strides of dims 0..3, in elements
    dst_s0, dst_s1, dst_s2, dst_s3,  # int: destination strides of dims 0..3, in elements
    BLOCK: tl.constexpr,  # elements per program
):
    pid = tl.program_id(axis=0).to(tl.int64)
    flat = pid * BLOCK + tl.arange(0, BLOCK)  # row-major index over the logical shape
    mask = flat < numel
    i3 = flat % size3
    rest = flat // size3
    i2 = rest % size2
    rest = rest // size2
    i1 = rest % size1
    i0 = rest // size1
    data = tl.load(src_ptr + (i0 * src_s0 + i1 * src_s1 + i2 * src_s2 + i3 * src_s3), mask=mask)
    tl.store(dst_ptr + (i0 * dst_s0 + i1 * dst_s1 + i2 * dst_s2 + i3 * dst_s3), data, mask=mask)


# ---------------------------------------------------------------------------------------------------- arena_move


@dataclass(frozen=True, slots=True)
class MoveStep:
    serial: bool  # True: `_move_serial_kernel` (ranges may overlap); False: one parallel launch (disjoint ranges)
    src: int  # first byte read
    dst: int  # first byte written
    nbytes: int  # bytes moved by this step


def _move_plan(src: int, dst: int, nbytes: int, min_parallel_chunk: int = MIN_PARALLEL_CHUNK) -> list[MoveStep]:
    """The launches that perform memmove(dst, src, nbytes), in order (Note [Overlap-safe arena_move]). Pure."""
    distance = abs(dst - src)
    if distance == 0 or nbytes == 0:
        return []
    if distance >= nbytes:
        return [MoveStep(False, src, dst, nbytes)]
    if distance < min_parallel_chunk:
        return [MoveStep(True, src, dst, nbytes)]
    steps = []
    if dst < src:  # moving down: the lowest chunk first
        for start in range(0, nbytes, distance):
            steps.append(MoveStep(False, src + start, dst + start, min(distance, nbytes - start)))
    else:  # moving up: the highest chunk first
        for end in range(nbytes, 0, -distance):
            start = max(0, end - distance)
            steps.append(MoveStep(False, src + start, dst + start, end - start))
    return steps


def arena_move(buf: torch.Tensor, src: int, dst: int, nbytes: int) -> None:
    """Move `nbytes` bytes of `buf` from offset `src` to offset `dst`, with memmove semantics.

    The ranges may overlap in either direction; the result equals a copy made through a temporary, but no
    temporary is allocated (Note [Overlap-safe arena_move]). `buf` is the arena: a contiguous 1-D uint8 tensor.
    Runs on the current CUDA stream; asynchronous like any kernel launch.
    """
    op = "arena_move"
    buf = require_tensor(buf, "buf", op)
    if buf.dtype != torch.uint8:
        raise TypeError(f"{op}: buf must be the uint8 arena buffer, got dtype {buf.dtype}")
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(
            f"{op}: buf must be a contiguous 1-D uint8 buffer, got shape {tuple(buf.shape)} "
            f"with strides {buf.stride()}"
        )
    src, dst, nbytes = as_int(src, "src", op), as_int(dst, "dst", op), as_int(nbytes, "nbytes", op)
    size = buf.numel()
    asked = f"{op}(src={src}, dst={dst}, nbytes={nbytes}) in a buffer of {size} bytes"
    if nbytes <= 0:
        raise ValueError(f"{asked}: nbytes must be positive")
    if src < 0 or dst < 0:
        raise ValueError(f"{asked}: offsets must not be negative")
    if src + nbytes > size or dst + nbytes > size:
        raise ValueError(f"{asked}: the range [{min(src, dst)}, {max(src, dst) + nbytes}) reaches past the end")
    require_kernels(buf, op)
    with device_guard(buf):
        for step in _move_plan(src, dst, nbytes, MIN_PARALLEL_CHUNK):
            src_view, dst_view = buf[step.src:], buf[step.dst:]  # base pointers; no data is copied
            if step.serial:
                _move_serial_kernel[(1,)](src_view, dst_view, step.nbytes,
                                          FORWARD=step.dst < step.src, BLOCK=SERIAL_BLOCK)
            else:
                grid = (triton.cdiv(step.nbytes, MOVE_BLOCK),)
                _copy_bytes_kernel[grid](src_view, dst_view, step.nbytes, BLOCK=MOVE_BLOCK)


# ---------------------------------------------------------------------------------------------------- copy_into


def _collapse(shape, *strides_of) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dims and merge neighbours that are contiguous with each other in every stride list."""
    dims = [i for i, s in enumerate(shape) if s != 1]
    sizes: list[int] = []
    strides: list[list[int]] = [[] for _ in strides_of]
    for i in dims:
        if sizes and all(st[-1] == s[i] * shape[i] for st, s in zip(strides, strides_of)):
            sizes[-1] *= shape[i]
            for st, s in zip(strides, strides_of):
                st[-1] = s[i]
        else:
            sizes.append(shape[i])
            for st, s in zip(strides, strides_of):
                st.append(s[i])
    return sizes, strides


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Write `src` into `dst` (same shape, dtype and device; any strides) with one kernel.

    `dst` is typically a typed view into the arena and may be non-contiguous. Shapes of any rank are accepted
    as long as they collapse to at most 4 dimensions (Note [copy_into]). `src` and `dst` must not overlap in
    memory, except that copying a view onto itself is a no-op.
    """
    op = "copy_into"
    dst = require_tensor(dst, "dst", op)
    src = require_tensor(src, "src", op)
    if dst.dtype != src.dtype:
        raise TypeError(f"{op}: dtypes differ: dst is {dst.dtype}, src is {src.dtype}")
    for name, t in (("dst", dst), ("src", src)):
        if t.is_conj() or t.is_neg():  # the kernel moves raw bits, in which a lazy conjugation or negation is not
            kind = "conjugate" if t.is_conj() else "negative"
            fix = ("pass src.resolve_conj().resolve_neg()" if name == "src" else
                   "write into the tensor it views, with the source conjugated or negated to match")
            raise TypeError(f"{op}: {name} is a {kind} view, whose bits are not its value; {fix}")
    if dst.element_size() not in _INT_OF_SIZE:
        raise TypeError(f"{op}: elements of {dst.element_size()} bytes ({dst.dtype}) are not supported")
    if dst.shape != src.shape:
        raise ValueError(f"{op}: shapes differ: dst is {tuple(dst.shape)}, src is {tuple(src.shape)}")
    if dst.device != src.device:
        raise ValueError(f"{op}: devices differ: dst is on {dst.device}, src is on {src.device}")
    require_kernels(dst, op)
    if dst.numel() == 0 or _util.same_view(dst, src):
        return
    for size, stride in zip(dst.shape, dst.stride()):
        if stride == 0 and size > 1:
            raise ValueError(
                f"{op}: dst (shape {tuple(dst.shape)}, strides {dst.stride()}) has a stride-0 dimension, so it "
                f"would write some elements more than once"
            )
    if _util.spans_overlap(dst, src):
        raise ValueError(
            f"{op}: dst and src share memory (dst bytes [{_util.byte_span(dst)[0]:#x}, {_util.byte_span(dst)[1]:#x}),"
            f" src bytes [{_util.byte_span(src)[0]:#x}, {_util.byte_span(src)[1]:#x})); an elementwise parallel "
            f"copy would race. Use arena_move for byte ranges, or clone src first."
        )
    sizes, (src_strides, dst_strides) = _collapse(list(dst.shape), list(src.stride()), list(dst.stride()))
    if len(sizes) > MAX_DIMS:
        raise ValueError(
            f"{op}: shape {tuple(dst.shape)} with src strides {src.stride()} and dst strides {dst.stride()} "
            f"collapses to {len(sizes)} dimensions; at most {MAX_DIMS} are supported"
        )
    pad = MAX_DIMS - len(sizes)
    sizes = [1] * pad + sizes
    src_strides = [0] * pad + src_strides
    dst_strides = [0] * pad + dst_strides
    as_int_dtype = _INT_OF_SIZE[dst.element_size()]
    dst_bits, src_bits = dst.view(as_int_dtype), src.view(as_int_dtype)
    numel = dst.numel()
    grid = (triton.cdiv(numel, COPY_BLOCK),)
    with device_guard(dst):
        _strided_copy_kernel[grid](
            dst_bits, src_bits, numel,
            sizes[1], sizes[2], sizes[3],
            *src_strides,
            *dst_strides,
            BLOCK=COPY_BLOCK,
        )
