"""Footprint: what a step adds to the device's memory, measured by PyTorch's profiler, not by the engine's counters.

Note [Measured footprint]
Rationale: `Budget(nbytes)` promises that a step adds at most `nbytes` to the device besides the model's own state
  (parameters, their gradients, optimizer state). The engine's counters (`stats.footprint_peak`) are its own view of
  that; a user checks it with the profiler or `torch.cuda.max_memory_allocated()`, so the tests and the benchmarks
  check it the same way, independently of the engine.
Approach: `measure(fn, keep=...)` runs `fn()` under `torch.profiler.profile(profile_memory=True)` and replays the
  allocator's events in time order (each with its address and signed size). Only what `fn` allocates counts:
  memory that existed before it (parameters, the arena of a Budget made before, gradients kept from an earlier
  step) has no event. Allocations still alive when `fn` returns at the addresses of the tensors in `keep` (the
  gradients and optimizer state `fn` made, model state) are left out at every instant of the replay, so `excess`
  is the step's own peak: activations, temporaries, the arena when made inside `fn`, kernels' scratch.
Limitations: the profiler sees what goes through PyTorch's allocators; a kernel's workspace that it allocates
  itself (some cuDNN/oneDNN scratch, CUDA's own context) has no event. On CUDA, `device="cuda"` selects the CUDA
  allocator's events (a CUDA activity is profiled); `torch.cuda.max_memory_allocated()` gives the same figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Footprint:
    """What one call added to a device's memory, from the profiler's allocation events (bytes)."""

    peak: int         # most bytes alive at once that the call allocated, model state (`keep`) included
    excess: int       # the same without the allocations still alive at `keep`'s addresses when the call ended
    kept: int         # bytes of those allocations (gradients, optimizer state the call made)
    allocations: int  # allocation events seen
    largest: int      # the largest single allocation that is not kept


def allocations(prof, device_type: str, skip_range: str | tuple = ()) -> list:
    """The profiler's allocation events on `device_type`, in time order: (ns, id, address, signed bytes).
    Allocations made inside a range (record_function) named `skip_range` (or one of them) are left out, and so
    their frees."""
    from torch._C._profiler import _EventType

    skip = {skip_range} if isinstance(skip_range, str) else set(skip_range)
    out, work = [], [(n, False) for n in prof.profiler.kineto_results.experimental_event_tree()]
    while work:
        node, skipped = work.pop()
        skipped = skipped or node.name in skip
        work.extend((c, skipped) for c in node.children)
        if node.typed[0] == _EventType.Allocation and not (skipped and node.typed[1].alloc_size > 0):
            a = node.typed[1]
            if a.device.type == device_type:
                out.append((node.start_time_ns, a.id, a.ptr, a.alloc_size))
    out.sort(key=lambda e: (e[0], e[1]))
    return out


def _open_at_end(events) -> dict:
    """Address -> index in `events` of the allocation still alive there when the events end."""
    open_ = {}
    for i, (_, _, ptr, size) in enumerate(events):
        if size > 0:
            open_[ptr] = i
        else:
            open_.pop(ptr, None)
    return open_


def _peak(events, left_out=frozenset()) -> int:
    """The most bytes alive at once in the allocations of `events` whose indices are not in `left_out` (frees of
    memory allocated before the events, or left out, change nothing)."""
    live = peak = 0
    sizes: dict = {}
    for i, (_, _, ptr, size) in enumerate(events):
        if size > 0:
            if i not in left_out:
                sizes[ptr] = size
                live += size
                peak = max(peak, live)
        elif ptr in sizes:
            live -= sizes.pop(ptr)
    return peak


def transient_peak(events) -> int:
    """The most bytes alive at once in allocations that are freed before `events` end: what a call allocated for
    itself and gave back (temporaries, scratch), leaving out what it made to keep (model state, results)."""
    return _peak(events, set(_open_at_end(events).values()))


def _storages(keep) -> set:
    ptrs = set()
    for t in keep:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type != "meta":
            ptrs.add(t.untyped_storage().data_ptr())
    return ptrs


def profiler(device="cpu"):
    """A `torch.profiler.profile` set up as `measure` runs it (allocation events on `device`'s type), for a call
    that is not one function (a trainer's hooks start and stop it): use it as a context manager, or `start()` and
    `stop()` it, then read it with `of_profile`."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    return profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []), profile_memory=True)


def of_profile(prof, *, keep=(), device="cpu") -> Footprint:
    """What the calls `prof` (from `profiler`) ran allocated on `device`: a Footprint, `keep` as for `measure`."""
    device_type = torch.device(device).type
    kept_ptrs = _storages(keep() if callable(keep) else keep)
    events = allocations(prof, device_type)
    # an allocation is kept if it is still alive at a kept address when the call ends
    kept_index = {i for ptr, i in _open_at_end(events).items() if ptr in kept_ptrs}
    allocated = [(i, e[3]) for i, e in enumerate(events) if e[3] > 0]
    return Footprint(peak=_peak(events), excess=_peak(events, kept_index),
                     kept=sum(events[i][3] for i in kept_index), allocations=len(allocated),
                     largest=max((n for i, n in allocated if i not in kept_index), default=0))


def measure(fn, *, keep=(), device="cpu") -> Footprint:
    """Run `fn()` once under the profiler and return what it allocated on `device` (a Footprint).

    keep: tensors, or a function returning tensors, whose memory is model state once `fn` has run (the parameters'
    `.grad`, optimizer state): their allocations are not counted in `excess`. A function is called after `fn`."""
    with profiler(device) as prof:
        fn()
    return of_profile(prof, keep=keep, device=device)
