"""Shared checks for the kernel launchers: where kernels can run, argument coercion, memory spans.

Note [Where kernels run]
  Rationale: the same launchers serve training on a GPU and the CPU-only test suite.
  Approach: Triton compiles kernels for CUDA tensors. With TRITON_INTERPRET=1 in the environment *before triton
    is imported*, `triton.jit` builds interpreted functions instead, and those also accept CPU tensors. Which of
    the two a kernel became is fixed when its module is imported, so `INTERPRET` is read once, here, at import
    (every kernel module imports this one before it defines a kernel).
  Limitations: setting or clearing TRITON_INTERPRET after triton was imported changes nothing for kernels
    already defined, and `kernels_available` keeps reporting the value seen at import, which is what the
    kernels obey. Devices other than CUDA and CPU are not supported.

This module does not import triton, so `kernels_available` is cheap to call from anywhere.
"""

from __future__ import annotations

import contextlib
import operator
import os

import torch

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"  # fixed at import; see Note [Where kernels run]


def kernels_available(device: torch.device | str | int) -> bool:
    """True if this package's Triton kernels can run on tensors of `device`.

    CUDA devices: when torch sees a CUDA device. CPU: only when TRITON_INTERPRET=1 was set before triton was
    imported (Triton's interpreter then runs the kernels on CPU tensors, slowly; meant for tests).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type == "cpu":
        return INTERPRET
    return False


def require_kernels(t: torch.Tensor, op: str) -> None:
    """Raise RuntimeError (saying what to do) unless kernels can run on `t`'s device."""
    if kernels_available(t.device):
        return
    if t.device.type == "cpu":
        raise RuntimeError(
            f"{op} got a CPU tensor, but Triton kernels run on CPU only in Triton's interpreter: set "
            f"TRITON_INTERPRET=1 in the environment before triton is imported (as `make test` does), or pass "
            f"CUDA tensors."
        )
    if t.device.type == "cuda":
        raise RuntimeError(f"{op} got a tensor on {t.device}, but torch.cuda.is_available() is False.")
    raise RuntimeError(f"{op} runs on CUDA tensors (or CPU tensors under TRITON_INTERPRET=1), got {t.device}.")


def device_guard(t: torch.Tensor):
    """Make `t`'s CUDA device current for a launch (Triton launches on the current device and stream)."""
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def as_int(value, name: str, op: str) -> int:
    """`value` as a Python int; TypeError for bools, floats and other non-integers."""
    if isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__} {value!r}") from None


def require_tensor(value, name: str, op: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, end) addresses of the bytes `t` can touch (strides are never negative in torch)."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size())


def spans_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte spans of `a` and `b` intersect (conservative: interleaved views count as overlapping)."""
    if a.device != b.device:
        return False
    a0, a1 = byte_span(a)
    b0, b1 = byte_span(b)
    return a0 < b1 and b0 < a1


def same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` address exactly the same elements in the same order."""
    return (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and all(s == 1 or sa == sb for s, sa, sb in zip(a.shape, a.stride(), b.stride()))
    )
