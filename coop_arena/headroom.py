"""Headroom: the part of a Budget's `nbytes` kept outside the arena for what ops allocate outside it.

Note [Headroom]
Rationale: a step under `Budget(nbytes)` adds to the device the arena plus whatever is allocated outside it while
  the block runs: the outputs of ops with no in-place kernel, computed into temporaries before they are copied in
  (convolution, layer norm, embedding's backward), and the scratch kernels allocate for themselves (a convolution's
  backward makes its gradient contiguous first). The engine sees the former, not the latter. With an arena of the
  whole `nbytes`, the footprint a user measures with the profiler was up to 1.6x the budget on a CNN.
Approach:
  - The cap covers both: arena bytes + bytes alive outside the arena <= nbytes, model state excepted (parameters,
    the gradients of leaves, optimizer state: Rule 1). The arena is `nbytes - headroom`.
  - `headroom=None` (the default) learns it. A block that runs while nothing else profiles is observed: it runs
    under `torch.profiler` with memory events (`Observer`), and its outside peak is the most bytes alive at once in
    allocations the block made and also freed (footprint.transient_peak). What the block allocates and keeps
    (optimizer state, a new parameter, outputs copied out at exit) is model state or the step's result, not a
    temporary, and is left out; so are the gradients of leaves copied out of the arena (inside a `MODEL_STATE`
    range: `model_state()`), even when the block itself frees them (`p.grad = None` after an update in it).
    The headroom becomes that peak (rounded up to the alignment), and when that changes it the arena is made
    again at `nbytes - headroom` before the next block (it is empty between blocks), which is observed too.
  - A configuration's first call does work outside the arena that its later calls do not (dispatch.py): the
    functional op its first out= run is compared with (a whole output), the host copies of what it reads from
    outside the arena (the probe for hidden writes), and, for one placed directly from its next call on (a new
    shape sized by the device, a layout learned), its output computed into a temporary. Each runs in a ONE_TIME
    range (`one_time()`) that the observer leaves out: a 64 MiB log-softmax compared in the first block set a
    headroom that kept a GPT's later steps from fitting at 0.55 of its footprint; the probes' copies of an
    encoder's weights (1 MiB of a 4.4 MiB budget) set one that left a shared encoder's second block no room
    (tests/test_leaf_gradients.py). Where a first block still does one-time work outside these ranges, the
    second observed block may lower the headroom again; from the third on it only grows, so the learning ends.
    A block whose peak leaves the headroom as it is ends it: later blocks run unobserved, at no cost, until a
    block plans an op configuration it had not met (new shapes), whose successor is observed. Each change of the
    arena's size restarts step replay (Note [Step replay]).
  - The first block runs with the whole `nbytes` as its arena (nothing is known yet), so its footprint may pass
    `nbytes` by its outside peak: the Budget warns (`FootprintExceeded`) when an observed block's arena plus its
    outside peak went over `nbytes`. `headroom=<bytes>` fixes the headroom from the start (no learning, no
    observation; a block whose temporaries pass it by the engine's own count warns, as below); `headroom=0`
    gives the whole budget to the arena, with temporaries outside it and uncapped.
  - `stats.temporary_peak` is the observed outside peak when the block was observed (`stats.footprint_observed`),
    else the larger of the peak observed last at this arena size and the engine's own count of its temporaries;
    `stats.footprint_peak` is the arena's bytes plus it.
Limitations: a configuration first met after the headroom is learned (a new shape) runs its first call into
  temporaries and one-time checks outside the arena then, beyond the headroom: that block is not observed (it
  could not be known to need it), its successor is. When the engine's own count of the block's temporaries
  passes the headroom, its stats say so (`footprint_peak` over `cap`) and `FootprintExceeded` warns, at the
  first such block and then where one goes further over, with the headroom that holds it (`headroom=<bytes>`);
  the count leaves out the one-time checks' host copies of the tensors from outside the arena that an op reads
  (its weights), which on a small model are most of the excess: an MLP at a new batch size went 1.49x over its
  budget while the count saw 12 KiB (the warning gives that figure), and 1.07x at the next new size untold
  (tests/test_footprint.py: shapes that change from step to step). Memory
  a kernel allocates without PyTorch's allocators (some cuDNN / oneDNN workspaces, CUDA's
  context) is not seen, by the observer or by a user's profiler. The profiler slows the blocks it observes (two or
  three). A block that runs while another profiler is active (a user's `torch.profiler`) is not
  observed. A dry run (`meta`) allocates nothing: its headroom stays as given (0 when learned), and
  `temporary_peak` is the engine's count. On CUDA the observer reads the caching allocator's events the same way
  (not yet run on a GPU).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .footprint import allocations, transient_peak

_ONE = threading.Lock()  # the profiler is the process's: one block observed at a time, whichever thread runs it
MODEL_STATE = "coop_arena::model_state"  # the range around an allocation of model state (a gradient's copy out)
ONE_TIME = "coop_arena::one_time"  # the range around a configuration's one-time check outside the arena
_NULL = contextlib.nullcontext()


def model_state():
    """A context around an allocation of model state made inside a block (a leaf's gradient copied out of the
    arena): the observer leaves it out, even when it is freed before the block ends (`p.grad = None` in it)."""
    return torch._C._profiler._RecordFunctionFast(MODEL_STATE) if _ONE.locked() else _NULL


def one_time():
    """A context around work outside the arena that the engine does once per op configuration, not at every step
    (the functional op a first out= run is compared with: dispatch.py, `_as_functional`): the observer leaves it
    out, so that it does not set the headroom of every later step."""
    return torch._C._profiler._RecordFunctionFast(ONE_TIME) if _ONE.locked() else _NULL


class Observer:
    """One block's allocations outside the arena, from PyTorch's allocator events (Note [Headroom])."""

    def __init__(self, device: torch.device):
        self.device = device
        self._prof = None

    def start(self) -> bool:
        """Start observing; False (nothing started) where a profiler is already active or none can start."""
        if self.device.type == "meta" or torch.autograd._profiler_enabled() or not _ONE.acquire(blocking=False):
            return False
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        prof = profile(activities=activities, profile_memory=True)
        try:
            prof.__enter__()
        except Exception:  # another torch, or no profiler on this build: the headroom comes from the engine's count
            _ONE.release()
            return False
        self._prof = prof
        return True

    def stop(self) -> int | None:
        """Stop; the block's peak of bytes alive in allocations it also freed, or None where nothing was observed."""
        prof, self._prof = self._prof, None
        if prof is None:
            return None
        try:
            prof.__exit__(None, None, None)
            return transient_peak(allocations(prof, self.device.type, skip_range=(MODEL_STATE, ONE_TIME)))
        except Exception:
            return None
        finally:
            _ONE.release()
