"""Budget: the user-facing context manager. Inside `with budget:` every op runs through the Runtime.

    budget = coop_arena.Budget(64 << 20)
    with budget:
        loss = model(x).sum()
        loss.backward()
    optimizer.step()

The arena is allocated once per Budget and reused by every later block. Configuration is constructor arguments,
validated here; nothing reads the environment.

While a block runs, the Budget also holds three global hooks, removed when it ends: torch.optim's step pre and
post hooks, so that `optimizer.step()` inside the block runs as without a Budget (optimizer.py, Note [Optimizer
steps]), and a module forward pre-hook that warns once when a compiled module runs inside the block (PyTorch runs
it uncompiled under any dispatch mode, and keeps it uncompiled afterwards until `torch._dynamo.reset()`).
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import (TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode,
                                          _get_current_dispatch_mode_stack, _pop_mode, _push_mode)

from . import patches, placement
from .arena import Arena, check_backend, resolve_device
from .bookkeeping import Bookkeeping
from .blocks import ALIGNMENT
from .errors import (ArenaAllocationError, AutocastNotPlanned, BudgetUsageError, CompileNotApplied,
                     FootprintExceeded, _fmt, _internal_assert, warn)
from .headroom import Observer
from .lifetime import forget_collection_pause, pause_collection, resume_collection
from .memory import Memory
from .ops import flatten
from .optimizer import Steps
from .policy import POLICIES
from .recipe import close_entered, entered, plain_dispatch
from .runtime import Runtime, raise_recursion_limit
from .snapshot import memory_snapshot as _memory_snapshot
from .tensor import Tensor

_active = threading.local()
_claim = threading.Lock()  # makes a Budget's owner check-and-set atomic across threads


@dataclass(frozen=True)
class BudgetStats:
    """What the most recent block did. Plain data."""

    budget: int                # usable arena bytes
    peak_bytes: int            # high-water mark of bytes held in the arena
    ops: int                   # ops the program ran (replays not counted)
    evictions: int             # storages evicted to make room
    eviction_events: int       # placements that needed eviction
    evicted_bytes: int
    excess_bytes: int          # evicted bytes beyond what the requests needed
    rematerializations: int    # storages rebuilt from their recipes
    compute_cost: float        # analytic cost of the program's ops
    recompute_cost: float      # analytic cost of every replay
    compute_overhead: float    # (compute_cost + recompute_cost) / compute_cost
    search_seconds: float      # time spent choosing victims, in total
    search_seconds_per_event: float
    fragmentation: float       # mean free bytes / budget over placements that needed eviction
    unevictable_bytes: int     # peak bytes of unevictable storages
    frozen: int                # storages made unevictable by a later write to what they read
    lower_bound: int           # largest single-op working set (inputs and outputs) plus unevictable bytes
    relocations: int = 0       # blocks copied out of a window instead of evicted (coop)
    relocated_bytes: int = 0   # their bytes; each costs a read and a write in compute_overhead
    compactions: int = 0       # placements that slid blocks together to make room (coop, the last resort)
    exit_rematerializations: int = 0  # replays at block exit, to copy out what the user still holds
    exit_recompute_cost: float = 0.0  # their analytic cost (part of recompute_cost)
    restores_in_turn: int = 0  # ops whose inputs did not fit back at once and were restored one at a time
    dropped: int = 0           # storages given up at exit after an error (TensorLost on use)
    escaped_bytes: int = 0     # bytes copied out of the arena at block exit for the tensors the program still held
                               # (logits, the loss): its results, outside the cap like model state
    placed_bytes: int = 0      # output bytes written into the arena, replays included
    temporary_bytes: int = 0   # of those, bytes computed into a temporary first (no out= kernel) and copied in
    temporary_peak: int = 0    # most bytes alive at once outside the arena, model state excepted: observed from the
                               # allocator's events when footprint_observed; else the peak observed last at this
                               # arena size or the engine's count of its own temporaries, the larger (Note [Headroom])
    replayed_ops: int = 0      # of `ops`, those run while the block followed the previous block's decisions
                               # (replay=True, Note [Step replay]): all of them when the step repeats the last one
    cap: int = 0               # the Budget's nbytes: arena + headroom
    headroom: int = 0          # of it, the bytes kept outside the arena for temporaries (the arena is cap - headroom)
    arena_bytes: int = 0       # the arena this block ran in
    footprint_peak: int = 0    # arena_bytes + temporary_peak: what the block added to the device at most
    footprint_observed: bool = False  # temporary_peak was observed from the allocator's events (Note [Headroom])

    @property
    def exit_overhead(self) -> float:
        """The part of compute_overhead spent in replays at block exit: exit_recompute_cost / compute_cost."""
        return self.exit_recompute_cost / self.compute_cost if self.compute_cost else 0.0

    def as_dict(self) -> dict:
        return asdict(self)


_NO_DISPATCH = torch._C._disabled_torch_dispatch_impl  # torch.Tensor's and nn.Parameter's __torch_dispatch__
_FAKE = torch._C._TorchDispatchModeKey.FAKE


def _leave(mode: "_Mode") -> None:
    """Take a block's mode off this thread's dispatch mode stack. It is on top unless a mode entered inside the
    block is still active: that one stays, the block's goes anyway (left on the stack, a finished block's mode
    would receive every later op of the process), and the user hears of it."""
    above = []
    while _get_current_dispatch_mode() is not mode:
        above.append(_pop_mode())
    mode.__exit__(None, None, None)
    for m in reversed(above):
        _push_mode(m)
    if above:
        warn(f"a block ended while a dispatch mode entered inside it was still active ({above[-1]!r}); "
             f"it stays active after the block", RuntimeWarning)


def _forked() -> None:
    """Note [Fork inside a block]
    Rationale: a process forked while a block runs (a DataLoader's workers, made when `iter(loader)` runs inside
      `with budget:` with num_workers > 0 and the default fork context) inherits the forking thread's dispatch
      mode stack, so the Budget's mode, and its hooks and patches. The workers then ran the dataset's indexing and
      collation through a copy of the block: `default_collate` asks for the storage of what it stacks and failed
      (UnsupportedOp, RawMemoryError), and nothing the child did could reach the parent's arena anyway.
    Approach: after a fork, in the child, the block of the forking thread is closed without finishing it (its
      mode taken off the stack, its hooks and patches removed), and the collector gets its thresholds back, so the
      child runs as without a Budget; the parent's block goes on as it was. The locks a Budget takes are made anew
      (another thread may have held one at the fork).
    Limitations: a tensor of the block that the child reads is read from the child's copy of the arena: an op on
      it gives a plain tensor, as after a block, but its own raw memory (data_ptr, untyped_storage) is refused as
      inside the block (RawMemoryError). Writes in the child reach neither the parent's tensors nor its arena, as
      for any forked process."""
    global _claim
    _claim = threading.Lock()
    patches.after_fork()
    forget_collection_pause()
    budget = getattr(_active, "budget", None)
    if budget is not None:
        try:
            budget._close_hooks()
        finally:
            budget._runtime = None
            budget._owner = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def _autocast_on() -> bool:
    any_on = getattr(torch._C, "_is_any_autocast_enabled", None)  # (every device type; not public)
    return any_on() if any_on is not None else torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


class _DryAttention(torch.overrides.TorchFunctionMode):
    """A dry run's `F.scaled_dot_product_attention` takes the kernel the CPU takes. The op is a composite whose
    backend choice is a per-device stub with no `meta` entry, so on `meta` it always ran the math decomposition
    (the T x T scores materialised, 100 ops instead of one), while the CPU runs
    `_scaled_dot_product_flash_attention_for_cpu` wherever its `_fused_sdp_choice` allows it (no dropout, 4-D
    inputs): a dry run then planned several times the CPU's peak. Here the CPU's choice is asked of stand-ins of
    the same sizes, strides of the last dimension and dtypes (no memory), and the CPU path is replayed as its
    composite kernel runs it: a boolean mask becomes an additive one, then the fused op."""

    # A mode is off while it handles a call, so a function that reaches it first and calls attention inside
    # (F.multi_head_attention_forward, under nn.MultiheadAttention and nn.Transformer*) ran the math path; such
    # functions read F's module attribute, which points at the CPU's choice while any dry run's block is open
    # (`_dry_sdpa`, which calls the original for tensors that are not on meta).
    _open = 0
    _lock = threading.Lock()

    def __enter__(self):
        with _DryAttention._lock:
            if _DryAttention._open == 0:
                F.scaled_dot_product_attention = _dry_sdpa
            _DryAttention._open += 1
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            with _DryAttention._lock:
                _DryAttention._open -= 1
                if _DryAttention._open == 0:
                    F.scaled_dot_product_attention = torch._C._nn.scaled_dot_product_attention

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch._C._nn.scaled_dot_product_attention:  # (bound before the block: F's attribute not read)
            func = _dry_sdpa
        return func(*args, **(kwargs or {}))


def _dry_sdpa(*args, **kwargs):
    """`F.scaled_dot_product_attention` while a dry run's block is open (_DryAttention)."""
    out = _cpu_attention(*args, **kwargs)
    return out if out is not None else torch._C._nn.scaled_dot_product_attention(*args, **kwargs)


def _stand_in(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor with `t`'s sizes, dtype and last-dimension stride, over a single row of memory."""
    step = max(t.stride(-1), 1) if t.dim() else 1
    n = t.shape[-1] if t.dim() else 1
    return torch.empty(max(n * step, 1), dtype=t.dtype)[::step][:n].expand(t.shape)


def _cpu_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
    """The CPU's fused attention on meta tensors, or None where the CPU would take the math path too."""
    if not all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in (query, key, value)):
        return None
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return None
    with _disable_current_modes():  # (the stand-ins and the choice are not the step's)
        choice = torch._fused_sdp_choice(
            _stand_in(query), _stand_in(key), _stand_in(value),
            None if attn_mask is None else torch.empty(1, dtype=attn_mask.dtype).expand(attn_mask.shape),
            dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if choice != int(torch.nn.attention.SDPBackend.FLASH_ATTENTION.value):
        return None
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as the composite kernel converts it
        neg = torch.ops.aten.scalar_tensor(float("-inf"), dtype=query.dtype, device=query.device)
        zero = torch.ops.aten.scalar_tensor(0.0, dtype=query.dtype, layout=torch.strided, device=query.device)
        attn_mask = torch.ops.aten.where.self(attn_mask, zero, neg)
        del zero, neg  # (freed here and in this order, as the kernel's temporaries are)
    extra = {}
    if attn_mask is not None:
        extra["attn_mask"] = attn_mask
    if scale is not None:
        extra["scale"] = scale
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                                       **extra)[0]


try:
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
except ImportError:  # (a build without it: TorchDispatchMode's own wrapper stays, see _Mode)
    _set_eval_frame = None


class _Mode(TorchDispatchMode):
    """Note [Dynamo off in the mode]
    Rationale: TorchDispatchMode wraps a subclass's __torch_dispatch__ in torch._dynamo's `disable`, so that a
      compiled function running around an op never compiles the mode's own frames. Through its two layers of
      Python wrappers that costs about 3 us per op on the 2-core CPU (about 2 % of a block's host time per op).
    Approach: the mode turns Dynamo's frame evaluation off itself around each op (`set_eval_frame(None)`, then the
      previous callback back), which is what `disable` does, and tells TorchDispatchMode not to wrap it
      (`_should_skip_dynamo`). Where this build of torch has no such switch, TorchDispatchMode's wrapper stays.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return _set_eval_frame is None

    def __init__(self, runtime: Runtime):
        super().__init__()
        self.runtime = runtime
        self.arena = runtime.arena
        self.steps = Steps(runtime)  # optimizer steps in progress (optimizer.py)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _set_eval_frame is None:
            return self._dispatch(func, types, args, kwargs)
        prior = _set_eval_frame(None)
        try:
            return self._dispatch(func, types, args, kwargs)
        finally:
            _set_eval_frame(prior)

    def _dispatch(self, func, types, args, kwargs):
        kwargs = kwargs or {}
        if torch._C._get_dispatch_mode(_FAKE) is not None:  # it sits below this mode, yet was entered inside it
            return func(*args, **kwargs)  # a FakeTensorMode's shapes (DTensor's sharding propagation): not the step's
        for t in types:
            if t is not Tensor and t.__torch_dispatch__ is not _NO_DISPATCH:
                for x in flatten(args, kwargs)[0]:  # (a DTensor parameter: its gradient leaves the arena, lifetime.py)
                    if isinstance(x, torch.Tensor) and type(x) in types:
                        self.runtime.lifetime.watch_leaf(x)
                return NotImplemented  # another tensor subclass (FSDP2's DTensor) unwraps first; its ops come back here
        if self.arena.stream is not None and not self._engines_own(args, kwargs):  # CUDA: Note [Streams] in arena.py
            self.arena.check_stream(func)
        if self.steps.frames and self.steps.plain(args, kwargs):
            return func(*args, **kwargs)  # See Rule 1: a step of an optimizer runs as without a Budget
        return self.runtime.run(func, args, kwargs)

    def _engines_own(self, args, kwargs) -> bool:
        """An op of another engine's work that reads nothing from the arena (bookkeeping.py; FSDP2 runs its
        all-gathers and reduce-scatters on streams of its own): it runs outside the arena, so on any stream."""
        bookkeeping = self.runtime.bookkeeping
        return (bookkeeping is not None and bookkeeping.active()
                and not any(isinstance(x, Tensor) for x in flatten(args, kwargs)[0]))


class Budget:
    """A hard memory budget for the ops run inside `with budget:`: the arena and the temporaries of its ops together
    stay within `nbytes` (Note [Headroom]); the arena is allocated here.

        budget = coop_arena.Budget(4 << 30)   # bytes
        with budget:
            model(x).sum().backward()
        print(budget.stats)

    Every tensor an op makes inside the block lives in one arena of `nbytes - headroom` bytes (rounded down to
    `alignment`); what ops allocate outside it for a moment (temporaries, kernels' scratch) lives in the headroom.
    When a new tensor does not fit, tensors are evicted and recomputed later, bit for bit. Tensors from before the
    block (parameters, buffers, inputs, optimizer state) are read, never moved or counted. A step that cannot fit
    raises `OutOfBudget` before anything changes; the Budget stays usable. A Budget runs one block at a time (a
    second thread entering it meanwhile gets `BudgetUsageError`), and Budgets do not nest (`BudgetUsageError`).

    Args:
        nbytes: The budget, a positive int number of bytes, at least `alignment`.
        device (str | torch.device | None): "cpu", "cuda", "cuda:N", "meta" (a dry run: no data, the same
            decisions) or a torch.device; default "cuda" when available, else "cpu".
        policy: "coop" (sliding window over the address-ordered arena), "dtr" (evict the least c/(m*s) one at a
            time) or "dte" (the same with adjacent free bytes counted in m).
        partition: Coop's ablation when False: no cheap/expensive placement.
        recomputable_inplace: Coop's ablation when False: copy-on-write instead of recomputable in-place.
        alignment: The granularity of every placement, a power of two of at least 16 bytes.
        cheap_density: The cost per byte at and above which a storage counts as expensive (a number >= 0).
        trace_len: The memory events kept per block (`trace`), an int >= 0.
        max_overhead: None, or a number > 1: stop a step with `Thrashing` before the replay that would take
            (compute + recompute) / compute past it.
        relocate: Coop's ablation when False: no relocation of pinned blocks, no compaction.
        backend: "torch", or "cupy" to allocate a CUDA arena with CuPy.
        replay: True (default) to let a block that runs the same step as the block before it take that block's
            eviction decisions instead of searching again (Note [Step replay] in replay.py; the same decisions,
            bits and stats); False to search at every block.
        headroom: None (default) to learn the bytes kept outside the arena from the first blocks, observed with
            the profiler (the first block's arena is the whole budget, and `FootprintExceeded` warns if its
            footprint went over); an int from 0 to nbytes - alignment to fix it (0: the arena is the whole budget
            and temporaries are outside the cap, as in a dry run).

    Raises:
        ValueError: An argument has a bad value.
        ArenaAllocationError: The device cannot allocate the arena.

    After a block: `stats` (BudgetStats, plain data), `trace` (its memory events), `snapshot()` (the blocks),
    `memory_snapshot()` (both, in the format of PyTorch's memory viewer).
    """

    def __init__(self, nbytes: int, *, device=None, policy: str = "coop", partition: bool = True,
                 recomputable_inplace: bool = True, alignment: int = ALIGNMENT, cheap_density: float = 4.0,
                 trace_len: int = 10_000, max_overhead: float | None = None, relocate: bool = True,
                 backend: str = "torch", replay: bool = True, headroom: int | None = None):
        # numpy and other integer types count as ints (numbers.Integral); bool does not
        nbytes, trace_len, alignment, headroom = (_integer(v) for v in (nbytes, trace_len, alignment, headroom))
        max_overhead, cheap_density = (float(v) if isinstance(v, numbers.Real) and not isinstance(v, bool) else v
                                       for v in (max_overhead, cheap_density))
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int number of bytes, got {nbytes!r} "
                             f"(for example coop_arena.Budget(4 << 30) for 4 GiB)")
        if nbytes >= 1 << 63:  # the block table keeps offsets as int64
            raise ValueError(f"nbytes must be at most 2**63 - 1 bytes (arena offsets are 64-bit), got {nbytes}")
        if isinstance(trace_len, bool) or not isinstance(trace_len, int) or trace_len < 0:
            raise ValueError(f"trace_len must be an int >= 0 (the memory events kept per block), got {trace_len!r}")
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; accepted: {', '.join(POLICIES)}")
        for name, v in (("partition", partition), ("recomputable_inplace", recomputable_inplace),
                        ("relocate", relocate), ("replay", replay)):
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be True or False, got {v!r}")
        if isinstance(cheap_density, bool):
            raise ValueError(f"cheap_density must be a finite number >= 0 (a cost per byte), got {cheap_density!r}")
        if max_overhead is not None and (isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float))
                                         or not max_overhead > 1.0):
            raise ValueError(f"max_overhead must be None (no limit) or a number > 1, got {max_overhead!r} (for "
                             f"example 10: stop with Thrashing once recomputation costs 9x the ops run so far)")
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 16 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two of at least 16 bytes (the largest element size, so "
                             f"that every tensor starts on a multiple of its own), got {alignment!r}; the default "
                             f"is {ALIGNMENT}")
        if headroom is not None and (isinstance(headroom, bool) or not isinstance(headroom, int) or headroom < 0
                                     or headroom > nbytes - alignment):
            raise ValueError(f"headroom must be None (learned from the first blocks) or an int number of bytes from 0 "
                             f"to nbytes - alignment = {nbytes - alignment}, got {headroom!r}: the bytes of nbytes "
                             f"kept outside the arena for temporaries (Note [Headroom])")
        check_backend(backend)
        other = getattr(_active, "budget", None)
        if other is not None:  # its arena would be made by an op of that block, as one of its tensors
            raise BudgetUsageError(f"a Budget cannot be made inside the block of {other!r} (Budgets do not nest): "
                                   f"make it before entering that block or after leaving it")
        self.nbytes = nbytes
        self.backend = backend
        self._learns = headroom is None  # Note [Headroom]
        self.headroom = 0 if headroom is None else _aligned_up(headroom, alignment)
        self._observe = self._learns
        self._observer: Observer | None = None
        self._outside: int | None = None  # the last block's observed outside peak
        self._settled: int | None = None  # the outside peak observed last at the present arena size
        self._warned_footprint = False
        self._worst_later = 0  # the largest footprint over nbytes that a later block warned of (Note [Headroom])
        self._observed = 0  # blocks observed so far
        self._made = 0  # placement.made when the block opened
        self.max_overhead = None if max_overhead is None else float(max_overhead)
        self.device = resolve_device(device)
        self.policy = policy
        self.recomputable_inplace = recomputable_inplace
        self.replay = replay
        self._recording = None  # the stream of the last block that ended normally (Note [Step replay])
        self._memory_args = dict(policy=policy, partition=partition, alignment=alignment, cheap_density=cheap_density,
                                 trace_len=trace_len, relocate=relocate)
        self._make_arena()
        self._runtime: Runtime | None = None
        self._mode: _Mode | None = None
        self._module_hook = None
        self._attention: _DryAttention | None = None  # a dry run's attention kernels, while a block is open
        self._blocks = 0  # blocks opened: from the second on, new shapes are sized by the device (placement.py)
        self._compile_warned = False  # warned once per Budget
        self._autocast_warned = self.device.type != "meta"  # (only a dry run warns about autocast)
        self._bookkeeping: Bookkeeping | None = None
        self._stats: BudgetStats | None = None
        self._trace: list = []
        self._traced_at = self.arena.buffer.data_ptr()  # the arena the block of `_trace` ran in (the next block
        # may get another: Note [Headroom])
        self._owner: int | None = None  # the thread whose block is open; __enter__ and the end of __exit__ only
        self._entered = 0  # the thread's `whole`s open when the block opened (recipe.close_entered)

    def __repr__(self) -> str:
        return f"Budget({self.nbytes} bytes, device={self.device}, policy={self.policy!r})"

    def _warn_later(self, outside: int | None, counted: int | None) -> None:
        """A block whose footprint went over `nbytes` after the headroom was set (learned after the first
        observed block over it, which `_learn_headroom` tells of, or fixed above 0): most often one that met op
        configurations it had not met (new shapes, whose first calls run into temporaries outside the arena: Note
        [Shapes that change] in placement.py). Told when it goes over by more than any block before it did."""
        seen = outside if outside is not None else counted
        if seen is None or (not self._learns and not self.headroom):
            return  # (headroom=0 leaves the temporaries outside the cap by choice)
        total = self.arena.nbytes + seen
        if total <= max(self.nbytes, self._worst_later):
            return
        self._worst_later = total
        how = "observed with the profiler" if outside is not None else "by the engine's own count"
        what = ("the temporaries of op configurations it met for the first time (new shapes, as when shapes change "
                "from step to step), whose first calls compute into temporaries" if placement.made[0] != self._made
                else "its temporaries")
        then = "is learned again from the next block on" if self._learns else "is fixed"
        need = _fmt(_aligned_up(seen, self.memory.table.alignment))
        warn(f"a block of {self!r} allocated {_fmt(seen)} outside its arena of "
             f"{_fmt(self.arena.nbytes)} ({how}): {_fmt(total)} in all, over the budget. Beyond the headroom of "
             f"{_fmt(self.headroom)} are {what}; the headroom {then}. To keep every block within the budget, pass "
             f"headroom=<bytes> of at least {need}", FootprintExceeded)

    def _make_arena(self) -> None:
        """The arena (and its block table) of `nbytes - headroom` bytes, made again when the headroom grows (between
        blocks, when the arena is empty: Note [Headroom])."""
        size = self.nbytes - self.headroom
        self.memory = Memory(size, **self._memory_args)
        self.arena = None  # (the old buffer goes back first: the two are never held at once)
        try:
            self.arena = Arena(size, self.device, self.memory.table.usable, backend=self.backend)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            raise ArenaAllocationError(size, str(self.device), str(e).strip().splitlines()[0]) from e

    def _learn_headroom(self, outside: int | None, counted: int | None) -> None:
        """After a block that ended normally: its observed outside peak (None: not observed) sets the headroom, or
        ends the learning (Note [Headroom]). Warns once when the first block's footprint went over `nbytes`, and
        when a later one's did by more than any before it (observed, or by the engine's own count `counted`)."""
        align = self.memory.table.alignment
        learned = None
        if self._learns and outside is not None:
            learned = min(_aligned_up(outside, align), self.nbytes - align)
            if self._observed >= 2:  # after the first two observed blocks it only grows: the learning ends
                learned = max(learned, self.headroom)
            self._observed += 1
        change = learned is not None and learned != self.headroom
        if outside is not None and self.arena.nbytes + outside > self.nbytes and not self._warned_footprint:
            self._warned_footprint = True
            need = self._stats.lower_bound if self._stats is not None else 0
            then = (f"; from the next block on, the arena is {_fmt(self.nbytes - learned)} and the rest of the "
                    f"budget is kept for them (headroom=<bytes> sets it from the start)" if change else
                    f": pass a headroom of at least {_fmt(_aligned_up(outside, align))}, or headroom=None to learn it")
            if change and self.nbytes - learned < need:
                then += (f". That arena is below this step's lower bound of {_fmt(need)} (its largest op's working "
                         f"set plus unevictable bytes): the next block will raise OutOfBudget; a budget of at least "
                         f"{_fmt(need + learned)} holds both")
            warn(f"this block of {self!r} allocated {_fmt(outside)} outside its arena of "
                 f"{_fmt(self.arena.nbytes)} (temporaries of ops without an in-place kernel, kernels' "
                 f"scratch): {_fmt(self.arena.nbytes + outside)} in all, over the budget{then}",
                 FootprintExceeded)
        else:
            self._warn_later(outside, counted)
        if not self._learns:
            return
        if outside is None:  # not observed (settled, another profiler was on, or the block failed)
            if placement.made[0] != self._made:
                self._observe = True  # it met new op configurations (shapes): observe the next block
            return
        if not change:
            self._settled = max(outside, self._settled or 0)
            self._observe = False  # settled: later blocks run unobserved
            return
        self.headroom = learned
        self._recording = None  # decisions taken in another arena are not this one's (Note [Step replay])
        self._settled = None
        self._make_arena()
        self._observe = True

    # --------------------------------------------------------------------------------------------- context
    def __enter__(self) -> "Budget":
        other = getattr(_active, "budget", None)
        if other is not None:
            raise BudgetUsageError(f"{other!r} is already active; Budgets do not nest. Leave it before entering "
                                   f"{self!r}, or use one Budget for the whole step")
        me = threading.get_ident()
        with _claim:  # active in another thread: entering would reset the arena under that block's tensors
            if self._owner not in (None, me):
                raise BudgetUsageError(f"{self!r} is already active in another thread; a Budget runs one block at a "
                                       f"time. Give each thread a Budget of its own, or wait for that block to end")
            self._owner = me
        try:
            self._open()
        except BaseException:  # an error, or an interrupt part way: undo what was opened (Note [Interrupts])
            self._runtime = None
            self._owner = None
            raise
        return self

    def _open(self) -> None:
        raise_recursion_limit()
        self._entered = len(entered())
        self.arena.bind_stream()
        self.memory.reset()
        if self.replay:
            self.memory.start_replay(self._recording)
        self._bookkeeping = Bookkeeping()
        self._runtime = Runtime(self.memory, self.arena, recomputable_inplace=self.recomputable_inplace,
                                max_overhead=self.max_overhead, explain=self._explain_thrashing,
                                bookkeeping=self._bookkeeping, sizing=self._blocks > 0)
        self._blocks += 1
        self._bookkeeping.settle = self._runtime.settle
        self._bookkeeping.rooted = self._runtime.dispatch.rooted
        try:
            self._mode = self._runtime.mode = _Mode(self._runtime)
            self._module_hook = torch.nn.modules.module.register_module_forward_pre_hook(_warn_if_compiled)
            self._mode.__enter__()
            if self.device.type == "meta":  # (a dry run takes the CPU's attention kernel: _DryAttention)
                self._attention = _DryAttention()
                self._attention.__enter__()
            self._bookkeeping.open()
            _active.budget = self
        except BaseException:
            self._close_hooks()
            raise
        self._made = placement.made[0]
        if self._observe and self.device.type != "meta":
            observer = Observer(self.device)
            if observer.start():
                self._observer = observer
        pause_collection()  # the last step of opening: nothing after it can fail (Note [Cyclic collection])

    def _close_hooks(self) -> None:
        """Take the block's mode off the dispatch mode stack and remove its hooks and patches, each even when an
        interrupt stops the one before, and whatever part of them `_open` got to (Note [Interrupts])."""
        mode, hook, self._mode, self._module_hook = self._mode, self._module_hook, None, None
        attention, self._attention = self._attention, None
        try:
            if attention is not None:
                attention.__exit__(None, None, None)
        finally:
            try:
                if mode is not None and mode in _get_current_dispatch_mode_stack():
                    _leave(mode)
            finally:
                try:
                    self._bookkeeping.close()
                finally:
                    try:
                        if getattr(_active, "budget", None) is self:
                            _active.budget = None
                    finally:
                        try:
                            if mode is not None:
                                mode.steps.remove()
                        finally:
                            if hook is not None:
                                hook.remove()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._mode is None or self._owner != threading.get_ident():
            raise BudgetUsageError(f"{self!r} is not active in this thread: __exit__ was called without a matching "
                                   f"__enter__ (or twice, or from another thread); use `with budget:` around the step")
        rt = self._runtime
        try:
            try:  # the way out of a `with` of the engine that an interrupt stopped: undone first (Note [Interrupts]
                close_entered(self._entered)  # in recipe.py), so that the mode is on the stack to be taken off
            finally:
                self._close_hooks()
        finally:
            grad = torch.is_grad_enabled()
            try:
                with torch._C._PreserveDispatchKeyGuard():  # (a C++ guard: no moment an interrupt leaves it half done)
                    rt.finish(failed=exc_type is not None)
            finally:
                observer, self._observer = self._observer, None
                self._outside = observer.stop() if observer is not None else None
                try:  # an interrupt as one of the exit's own `with`s ended (the copy-out's replays): the same undoing
                    close_entered(self._entered)
                finally:
                    torch._C._set_grad_enabled(grad)
                try:
                    self._stats = self._collect(rt)
                    if exc_type is None and not rt.counters.ops and rt.counters.off_arena:
                        warn(
                            f"none of this block's ops ran in {self!r}: all {rt.counters.off_arena} read only tensors "
                            f"on {rt.counters.off_arena_device} and ran there, outside the arena, so nothing was "
                            f"counted or capped. Put the model and its inputs on {self.device} (a dry run: "
                            f"model.to('meta')), or make the Budget with device='{rt.counters.off_arena_device}'",
                            RuntimeWarning)
                    self._trace = list(self.memory.trace.events)
                    self._traced_at = self.arena.buffer.data_ptr()
                    recording = self.memory.take_recording()
                    if recording is not None and exc_type is None:  # (a failed block's stream is no step to follow)
                        self._recording = recording
                    rt.close()
                    self._bookkeeping.settle = self._bookkeeping.rooted = None
                    self.memory.reset()
                    self._runtime = None
                    self._learn_headroom(self._outside if exc_type is None else None,
                                         self._stats.temporary_peak if exc_type is None else None)
                    self._owner = None
                finally:
                    resume_collection()  # even after an interrupt above (Note [Cyclic collection])
        return False

    def _explain_thrashing(self) -> str:
        """What a thrashing step's RuntimeWarning tells its user (Remat warns once per block)."""
        if not self.memory.stats.eviction_events:
            return (f"No placement in the budget of {_fmt(self.memory.budget)} has needed an eviction: the tensors "
                    f"recomputed were evicted by hand (Memory.evict).")
        stop = (f"max_overhead={self.max_overhead:g} stops it with coop_arena.Thrashing at that overhead"
                if self.max_overhead is not None else
                "pass max_overhead (for example max_overhead=10) to stop such a step with coop_arena.Thrashing "
                "instead of letting it run on")
        c = self._runtime.counters
        held = max(c.live_peak, 1)
        # twice the lower bound seen so far, and never a budget at or below this one, which already thrashes
        suggest = min(1.0, max(2.0 * (c.working_set_peak + c.unevictable_peak) / held,
                               math.ceil(round((self.memory.budget / held + 0.05) * 20, 6)) / 20))
        return (f"The budget of {_fmt(self.memory.budget)} is {self.memory.budget / held:.2f} of the "
                f"{_fmt(c.live_peak)} this step has held in tensors so far, too small to run your model without "
                f"recomputing much of it. A step usually runs at low overhead from about twice its lower bound (its "
                f"largest op's working set plus unevictable bytes): for your model so far, a ratio of about "
                f"{suggest:.2f}. To check a budget in a dry run on meta, without running the step, write a function "
                f"make_model(batch) in your_module.py that returns (model, example_inputs) and run "
                f"`coop-arena plan your_module:make_model --batch <your batch size> --budget {suggest:.2f}` "
                f"(the documentation's \"Dry runs\" page; `coop-arena plan --help`). Or raise the budget, use a "
                f"smaller batch, or {stop}.")

    def _collect(self, rt: Runtime) -> BudgetStats:
        m, c = self.memory.stats, rt.counters
        outside = self._outside  # this block's observed outside peak, or None (Note [Headroom])
        observed = outside is not None
        if not observed:  # the last observed block's peak at this arena size, or the engine's count if larger
            outside = max(c.temporary_peak, self._settled if self._settled is not None else 0)
        return BudgetStats(
            budget=self.memory.budget, peak_bytes=m.peak_bytes, ops=c.ops, evictions=m.evictions,
            eviction_events=m.eviction_events, evicted_bytes=m.evicted_bytes, excess_bytes=m.excess_bytes,
            rematerializations=c.rematerializations, compute_cost=c.compute_cost, recompute_cost=c.recompute_cost,
            compute_overhead=((c.compute_cost + c.recompute_cost + 2.0 * m.relocated_bytes) / c.compute_cost
                              if c.compute_cost else 1.0),
            search_seconds=m.search_seconds, search_seconds_per_event=m.search_seconds_per_event,
            fragmentation=m.fragmentation, unevictable_bytes=c.unevictable_peak, frozen=c.frozen,
            lower_bound=c.working_set_peak + c.unevictable_peak, relocations=m.relocations,
            relocated_bytes=m.relocated_bytes, compactions=m.compactions,
            exit_rematerializations=c.exit_rematerializations, exit_recompute_cost=c.exit_recompute_cost,
            restores_in_turn=c.restores_in_turn, dropped=c.dropped, escaped_bytes=c.escaped_bytes,
            placed_bytes=c.placed_bytes, temporary_bytes=c.temporary_bytes,
            temporary_peak=outside, replayed_ops=c.replayed_ops, cap=self.nbytes, headroom=self.headroom,
            arena_bytes=self.arena.nbytes, footprint_peak=self.arena.nbytes + outside,
            footprint_observed=observed)

    # ----------------------------------------------------------------------------------------- observability
    @property
    def stats(self) -> BudgetStats | None:
        """Stats of the block in progress, or of the most recent one."""
        return self._collect(self._runtime) if self._runtime is not None else self._stats

    def snapshot(self) -> list[dict]:
        """The arena's blocks in address order as plain data (empty arena outside a block)."""
        return self.memory.snapshot()

    @property
    def trace(self) -> list:
        """The memory events (alloc, evict, restore, free, move) of the block in progress or of the most recent
        one, oldest first, at most `trace_len` of them; each names the op the runtime was running (`Event.op`)."""
        return list(self.memory.trace.events) if self._runtime is not None else self._trace

    def memory_snapshot(self) -> dict:
        """The memory events of the block in progress or of the most recent one, and the arena's blocks, as
        `torch.cuda.memory._snapshot()` returns a snapshot (Note [Memory snapshots] in snapshot.py): pickle it
        (`coop_arena.snapshot.write(s, "step.pickle")`) and open it at pytorch.org/memory_viz, or pass it to the
        functions of `torch.cuda._memory_viz`. Warns when the trace may have lost the block's first events (more
        than `trace_len` of them)."""
        live = self._runtime is not None
        events = self.trace
        if len(events) >= self.memory.trace_len:
            warn(f"the trace of {self!r} holds {len(events)} memory events, as many as trace_len keeps: any "
                 f"before them are missing from the snapshot, and with them the blocks and frees of the "
                 f"storages they placed. Make the Budget with a larger trace_len to keep a whole step",
                 RuntimeWarning)
        return _memory_snapshot(events, capacity=self.memory.budget if live or self._stats is None else
                                self._stats.budget, alignment=self.memory.table.alignment,
                                address=self.arena.buffer.data_ptr() if live else self._traced_at,
                                device=self.device.index or 0, blocks=self.memory.snapshot() if live else None)

    def check_invariants(self) -> None:
        """The block table's invariants, and the split of `nbytes` (Note [Headroom]): the arena and the headroom
        make up the budget, the headroom a multiple of the alignment that leaves the arena at least one unit."""
        self.memory.check_invariants()
        align = self.memory.table.alignment
        _internal_assert(self.arena.nbytes + self.headroom == self.nbytes and self.memory.budget <= self.arena.nbytes
                         and self.headroom % align == 0 and 0 <= self.headroom <= self.nbytes - align,
                         f"the budget of {self.nbytes} bytes is not split into an arena of {self.arena.nbytes} and a "
                         f"headroom of {self.headroom}")


def _aligned_up(n: int, alignment: int) -> int:
    """`n` bytes rounded up to a multiple of `alignment` (0 stays 0, unlike BlockTable.round_up)."""
    return -(-n // alignment) * alignment


def _integer(v):
    """`v` as a Python int when it is an integer of another type (numpy's), else unchanged."""
    return int(v) if isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)) else v


def _warn_if_compiled(module, args) -> None:
    """Global module forward pre-hook while a Budget is active: a compiled module runs uncompiled in a Budget, and
    autocast has no effect in a dry run on meta."""
    budget = getattr(_active, "budget", None)
    if budget is None:
        return
    if not budget._autocast_warned and _autocast_on():
        budget._autocast_warned = True
        warn(
            f"torch.autocast is on in a dry run on meta ({budget!r}), where it has no effect: meta tensors have no "
            f"autocast dispatch key, so {type(module).__name__} and what follows run in the dtypes their tensors "
            f"have (float32 where autocast on the device would compute in float16 or bfloat16). The plan's peak, "
            f"evictions and overhead are those of the step without autocast, an overestimate. To plan a "
            f"mixed-precision step, give the model the dtypes autocast would use (for example "
            f"model.to(torch.bfloat16)), or run the Budget on the device itself", AutocastNotPlanned)
    if budget._compile_warned:
        return
    frames = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing can have been compiled
    if (frames is not None and isinstance(module, frames.OptimizedModule)) or getattr(
            module, "_compiled_call_impl", None) is not None:
        budget._compile_warned = True
        warn(
            f"{type(module).__name__} is compiled (torch.compile), but runs uncompiled inside {budget!r}: PyTorch "
            f"does not apply torch.compile while a dispatch mode is active, and a model first called inside a Budget "
            f"stays uncompiled afterwards until torch._dynamo.reset(). The step still runs exactly, eagerly, under "
            f"the budget.", CompileNotApplied)


@contextmanager
def pinned(t: Tensor, *, readonly: bool = False):
    """A plain tensor over `t`'s arena bytes that cannot be evicted while the `with` lasts, for launching a
    Triton or CuPy kernel by hand. A kernel may write through it; since such a write is invisible to the
    recipe, the storage becomes unevictable afterwards unless `readonly=True` promises it only read."""
    if not isinstance(t, Tensor):
        raise TypeError(f"pinned() takes a coop_arena.Tensor made inside a Budget, got {type(t).__name__}")
    s = t._cell.storage
    rt = s.payload.runtime
    if rt is None:
        yield t.as_plain()
        return
    rt.arena.check_stream("coop_arena.pinned")  # Note [Streams] in arena.py
    with plain_dispatch():
        rt.memory.op = "coop_arena.pinned"  # the cause of the restores it needs, in the trace
        rt.remat.acquire([s], "coop_arena.pinned")
        rt.memory.fix(s)  # the raw view must stay valid: never relocated either
        raw = rt.arena.view(s.offset, t.dtype, t.size(), t.stride(), t.storage_offset())
    try:
        yield raw
    finally:
        rt.memory.unfix(s)
        rt.memory.unpin(s)
        if not readonly and s.payload.runtime is rt:
            with plain_dispatch():
                rt.remat.freeze_readers(s)
                rt.remat.make_unevictable(s)
