"""Arena: one buffer of exactly `nbytes`, allocated once on its device and never grown.

It hands out typed, strided views of byte ranges. Views are built from one cached typed alias of the whole
buffer per dtype, so a view costs one `as_strided`. Offsets handed in are block offsets (aligned), so they are
multiples of every dtype's item size. On `meta` nothing is allocated: a dry run has shapes but no data.

Invariants (enforced here):
1. `device` is normalised once (`resolve_device`): the device tensors allocated there report, index included
   (`cpu`, `meta`, `cuda:N`), so comparing a tensor's `.device` with it is exact.
2. Bytes move between arena ranges only through `move` (relocation, copy-on-write): the Triton `arena_move`
   kernel on CUDA, `copy_` on the CPU, nothing on meta. Ranges may overlap (memmove semantics).
3. Every range is reused only on the stream that last used it (Note [Streams]); `check_stream` refuses an op
   on another stream.

Note [Streams]
  Rationale: the arena hands one range to many tensors over a step, and the runtime decides on the host when a
    range is free (a tensor freed or evicted) without waiting for the device. That is safe only if every kernel
    that reads or writes the range runs on one stream: then a later kernel that reuses the range is queued
    after every earlier kernel that touched it, and no host synchronisation is needed (the same reasoning as
    PyTorch's caching allocator, which ties each block to the stream it was allocated on).
  Approach: `bind_stream` records the current stream when a Budget block is entered; every op dispatched in
    the block (and `coop_arena.pinned`) calls `check_stream`, which raises BudgetUsageError if the current
    stream is another one, before anything changes. Autograd runs each backward op on the stream of its
    forward op, so a block entered on stream S stays on S. A block entered on another stream than the previous
    block first makes the new stream wait for the old one (the previous block's last copies may still be
    reading the arena), and `record_stream` tells the caching allocator the buffer was used there.
  Limitations: work that does not go through the dispatcher is not seen. A kernel launched by hand on a side
    stream through a `pinned()` view must be ordered with the Budget's stream on both ends: the side stream
    waits for the Budget's stream before it reads (`side.wait_stream(torch.cuda.current_stream())`), and the
    Budget's stream waits for the side stream before the `with pinned(...)` ends
    (`torch.cuda.current_stream().wait_stream(side)`). Collectives run on their own communication stream:
    a blocking call (`async_op=False`) makes the current stream wait for it, as does `work.wait()`; an
    asynchronous collective on arena tensors must be waited on before those tensors are freed or the block
    ends. CUDA graph capture is not supported.

Note [Overlapping moves]
  Rationale: a relocation or a compaction slides a block by less than its size (a 64 MiB logits block moved by a
    few KiB). Through a temporary of the block's size, the move alone put a block-sized allocation outside the
    arena, over the cap a user measures; through a bounce buffer of 1/256 of the arena (at least 64 KiB), a small
    arena's moves still did (a GRU's 490 KiB arena at half its peak: 64 KiB outside it, which the headroom then
    took from the arena, and the next block no longer fitted).
  Approach: on the CPU (`_move_torch`) the move is one `memmove` of the buffer's bytes (ctypes), which copies
    overlapping ranges correctly and allocates nothing. On CUDA the Triton `arena_move` kernel is overlap-safe by
    itself and allocates nothing. Without it (no Triton on a CUDA machine, `copy_kernel=False`) the move goes
    chunk by chunk with `copy_` (`_move_chunked`), from the low end when moving down and from the high end when
    moving up, so that a chunk's destination only overwrites bytes already read: chunks as long as the distance
    moved copy directly, a shorter distance goes through one bounce buffer of 1/256 of the arena (at least
    64 KiB).
  Limitations: on CUDA without the Triton kernel, a move by a short distance allocates that bounce buffer outside
    the arena and copies its bytes twice.
"""

from __future__ import annotations

import ctypes

import torch

from .errors import BudgetUsageError, _internal_assert, warn

DEVICES = ("cpu", "cuda", "meta")
SHARED_MAX = 1 << 14  # Arena.shared views kept (a step's outputs at their offsets); it starts over when full
BOUNCE_MIN = 1 << 16  # the smallest bounce buffer of a chunked overlapping move (Note [Overlapping moves])
BACKENDS = ("torch", "cupy")  # who allocates the buffer (cupy: CuPy, shared with torch through DLPack)


def check_backend(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; accepted: {', '.join(BACKENDS)} (cupy: the arena is "
                         f"allocated by CuPy and shared with torch through DLPack, pip install 'coop-arena[cupy]')")


def resolve_device(device) -> torch.device:
    """The device an arena for `device` lives on, normalised (invariant 1): None means `cuda:<current>` when CUDA
    is available, else `cpu`; `cuda` means `cuda:<current>`; `cpu:0` means `cpu`."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r}; expected one of {', '.join(DEVICES)} (or 'cuda:N')") from e
    if dev.type not in DEVICES:
        raise ValueError(f"unsupported device {device!r}; expected one of {', '.join(DEVICES)} (or 'cuda:N')")
    if dev.type != "cuda":
        return torch.device(dev.type)  # CPU and meta tensors report no index, whatever index was asked for
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but CUDA is not available here; use 'cpu' or 'meta'")
    index = torch.cuda.current_device() if dev.index is None else dev.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(f"device {device!r} was asked for but this machine has {count} CUDA device(s) "
                         f"(cuda:0 to cuda:{count - 1})")
    return torch.device("cuda", index)


# ----------------------------------------------------------------------------------------------------- streams
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # present in CUDA builds: no Stream object


def _current_stream(device: torch.device):
    """The current stream of `device` as a torch.cuda.Stream, or None where there are no streams."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _stream_id(device: torch.device):
    """The raw handle of `device`'s current stream (cheap: called once per op), or None off CUDA."""
    if device.type != "cuda":
        return None
    if _raw_stream is not None:
        return _raw_stream(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def _show(stream_id) -> str:
    return f"{stream_id:#x}" if isinstance(stream_id, int) else repr(stream_id)


# ----------------------------------------------------------------------------------------------------- buffers
def _torch_buffer(nbytes: int, device: torch.device):
    return torch.empty(nbytes, dtype=torch.uint8, device=device), None


def _cupy_buffer(nbytes: int, device: torch.device):
    """The buffer allocated by CuPy (cudaMalloc, outside CuPy's memory pool, so it goes back to the device when
    the arena dies) and shared with torch through DLPack without a copy. Returns (tensor, the CuPy array that
    owns the memory: kept alive as long as the arena)."""
    if device.type != "cuda":
        raise ValueError(f"backend='cupy' allocates the arena with CuPy on a CUDA device, but the device is "
                         f"{device}; use backend='torch' there (or device='cuda' on a machine with a GPU)")
    try:
        import cupy
    except ImportError as e:
        raise ImportError(f"backend='cupy' needs CuPy, which does not import here ({e}); install it with "
                          f"pip install 'coop-arena[cupy]', or use backend='torch'") from e
    with cupy.cuda.Device(device.index):
        memory = cupy.cuda.Memory(nbytes)
        array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        buffer = torch.from_dlpack(array)
    _internal_assert(buffer.device == device and buffer.dtype == torch.uint8 and buffer.numel() == nbytes
                     and buffer.data_ptr() == array.data.ptr,
                     f"the CuPy buffer came through DLPack as {buffer.dtype}[{buffer.numel()}] on {buffer.device}")
    return buffer, array


class Arena:
    def __init__(self, nbytes: int, device: torch.device, usable: int, *, backend: str = "torch",
                 copy_kernel: bool | None = None):
        """`device` as normalised by `resolve_device`. `copy_kernel` chooses how `move` copies: None, the
        Triton kernel on CUDA and `copy_` on the CPU; True, the Triton kernel wherever it can run (on CPU
        tensors only in Triton's interpreter: tests); False, `copy_` everywhere."""
        check_backend(backend)
        self.nbytes = nbytes
        self.device = device
        self.backend = backend
        make = _cupy_buffer if backend == "cupy" else _torch_buffer
        self.buffer, self._owner = make(nbytes, device)  # _owner: CuPy's array, alive as long as the arena
        self._usable = self.buffer[:usable]
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._shared: dict[tuple, torch.Tensor] = {}  # `shared` views by their arguments
        self.key = self.buffer.untyped_storage()._cdata  # identity of the arena's storage (works on meta too)
        self._move = None if device.type == "meta" else self._pick_mover(copy_kernel)
        self.stream = None  # raw id of the stream of the block in progress (Note [Streams])
        self._last_stream = _current_stream(device)  # the stream that last used the buffer (allocation, a block)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether `t` is a view of the arena (a sparse or other non-strided tensor has no storage: never)."""
        return t.layout is torch.strided and t.untyped_storage()._cdata == self.key

    def view(self, byte_offset: int, dtype: torch.dtype, size, stride, storage_offset: int) -> torch.Tensor:
        """A tensor over the arena at `byte_offset`, with `storage_offset` counted in elements from there."""
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self._usable.view(dtype)
        return typed.as_strided(size, stride, byte_offset // typed.element_size() + storage_offset)

    def shared(self, byte_offset: int, dtype: torch.dtype, size: tuple, stride: tuple,
               storage_offset: int) -> torch.Tensor:
        """`view` made once per set of arguments and shared by every caller: a training step places the same
        outputs at the same offsets at every step, so the engine's own views (an op's inputs and out= outputs)
        come from here. A shared view is never changed (its metadata, bits or requires_grad) nor handed out:
        callers that may change theirs, and views for the user, take `view`. `size` and `stride` are tuples."""
        key = (byte_offset, dtype, size, stride, storage_offset)
        v = self._shared.get(key)
        if v is None:
            if len(self._shared) >= SHARED_MAX:
                self._shared.clear()
            v = self._shared[key] = self.view(byte_offset, dtype, size, stride, storage_offset)
        return v

    def bytes(self, byte_offset: int, nbytes: int) -> torch.Tensor:
        return self.buffer[byte_offset : byte_offset + nbytes]

    def fixed_view(self, byte_offset: int, nbytes: int, dtype: torch.dtype, size, stride,
                   storage_offset: int) -> torch.Tensor:
        """Like `view`, over a storage of its own that is exactly the range [byte_offset, byte_offset + nbytes) and
        cannot grow: a kernel that resizes it past the range raises (`grew`) before writing, where a view of the
        whole arena would grow into the next blocks' bytes (or reallocate the arena past its end)."""
        base = self.bytes(byte_offset, nbytes)
        storage = torch._C._construct_storage_from_data_pointer(base.data_ptr(), self.device, nbytes)
        return torch.empty(0, dtype=dtype, device=self.device).set_(storage, storage_offset, size, stride)

    # ------------------------------------------------------------------------------------------------ moves
    def move(self, src: int, dst: int, nbytes: int) -> None:
        """Copy `nbytes` bytes from arena offset `src` to `dst` (invariant 2). The ranges may overlap; the result
        is that of a copy through a temporary. Asynchronous on CUDA, on the current stream."""
        _internal_assert(0 <= min(src, dst) and 0 <= nbytes and max(src, dst) + nbytes <= self.nbytes,
                         f"arena move of {nbytes} bytes from {src} to {dst} in an arena of {self.nbytes}")
        if self._move is not None and nbytes > 0 and src != dst:
            self._move(self, src, dst, nbytes)

    def _pick_mover(self, copy_kernel: bool | None):
        """The function `move` copies with, called with the arena (not bound to it: an arena that refers to itself
        lives on, with its buffer, until a full collection once it is dropped). By default (None) the Triton kernel on CUDA, tried here on a few bytes of
        the fresh buffer (a disjoint copy and overlapping moves both ways, so each kernel has compiled): where Triton
        is missing or cannot build its launcher (no C compiler), the arena warns and uses `copy_`, rather than
        failing at the first relocation in the middle of a step."""
        if copy_kernel is False or (copy_kernel is None and self.device.type != "cuda"):
            return Arena._move_torch
        try:
            from .kernels import kernels_available
            if not kernels_available(self.device):
                raise ValueError(f"copy_kernel=True, but the Triton kernels cannot run on {self.device} here (on "
                                 f"the CPU only in Triton's interpreter, TRITON_INTERPRET=1 before triton is "
                                 f"imported)")
            from .kernels.copy import arena_move
            mover = lambda arena, src, dst, nbytes: arena_move(arena.buffer, src, dst, nbytes)  # noqa: E731
            if copy_kernel is None and self.nbytes >= 1024:
                for src, dst in ((0, 512), (0, 1), (1, 0)):  # the buffer holds nothing yet: real launches of the
                    mover(self, src, dst, 512)                 # disjoint copy and the overlapping moves both ways
        except Exception as e:
            if copy_kernel:
                raise
            warn(f"coop_arena: the Triton copy kernel cannot run on {self.device} ({type(e).__name__}: "
                 f"{str(e)[:200]}); arena moves use torch's copy_ instead", RuntimeWarning)
            return Arena._move_torch
        return mover

    def _move_torch(self, src: int, dst: int, nbytes: int) -> None:
        """A move without the Triton kernel (Note [Overlapping moves]): on the CPU one memmove, which allocates
        nothing; elsewhere `_move_chunked`."""
        if self.device.type == "cpu":
            base = self.buffer.data_ptr()
            ctypes.memmove(base + dst, base + src, nbytes)
        else:
            self._move_chunked(src, dst, nbytes)

    def _move_chunked(self, src: int, dst: int, nbytes: int) -> None:
        """`copy_` in chunks (Note [Overlapping moves]): a chunk no longer than the distance moved is copied
        directly, since its destination overlaps no byte still to be read; a short move goes through one bounce
        buffer of at most `_bounce_bytes`, outside the arena, so no move allocates as much as the block it moves."""
        gap = abs(dst - src)
        if gap >= nbytes:
            self.bytes(dst, nbytes).copy_(self.bytes(src, nbytes))
            return
        chunk = max(gap, min(nbytes, self._bounce_bytes()))
        bounce = None if chunk <= gap else torch.empty(chunk, dtype=torch.uint8, device=self.device)
        starts = range(0, nbytes, chunk) if dst < src else reversed(range(0, nbytes, chunk))
        for i in starts:  # low to high when moving down, high to low when moving up: no unread byte is overwritten
            n = min(chunk, nbytes - i)
            if bounce is None:
                self.bytes(dst + i, n).copy_(self.bytes(src + i, n))
            else:
                bounce[:n].copy_(self.bytes(src + i, n))
                self.bytes(dst + i, n).copy_(bounce[:n])

    def _bounce_bytes(self) -> int:
        """The bounce buffer of an overlapping move: 1/256 of the arena, at least 64 KiB (Note [Overlapping moves])."""
        return max(BOUNCE_MIN, self.nbytes >> 8)

    # ---------------------------------------------------------------------------------------------- streams
    def bind_stream(self) -> None:
        """Start of a Budget block: the current stream becomes the only one the block may use (Note [Streams])."""
        now = _current_stream(self.device)
        if now is not None and self._last_stream is not None and now != self._last_stream:
            now.wait_stream(self._last_stream)  # the previous block's copies out of the arena may still run there
            if self.backend == "torch" and self.device.type == "cuda":
                self.buffer.record_stream(now)  # the caching allocator must not reuse the buffer before `now` ends
        self._last_stream = now
        self.stream = _stream_id(self.device)

    def check_stream(self, what) -> None:
        """Raise BudgetUsageError unless the current stream is the block's (Note [Streams])."""
        now = _stream_id(self.device)
        if now != self.stream:
            raise BudgetUsageError(
                f"{what} was called on CUDA stream {_show(now)}, but this Budget's block runs on stream "
                f"{_show(self.stream)}: every arena range is reused only on the stream that last used it. Run "
                f"the block's ops on the stream it was entered on (enter the Budget inside `with "
                f"torch.cuda.stream(s):` to use stream s), and order side-stream work on pinned() views with "
                f"wait_stream on both ends")


def grew(e: RuntimeError) -> bool:
    """Whether `e` is PyTorch's error for a kernel resizing a storage that cannot grow (Arena.fixed_view)."""
    return "not resizable" in str(e)
