"""Optimizer steps inside a Budget: they run as without one, on the parameters and state outside the arena.

Rules enforced here (see ../shared DESIGN numbering):
1. Tensors from before the block are read, never moved or counted. An optimizer's state (momentum_buffer,
   exp_avg, exp_avg_sq, step) is model-sized state like the parameters it updates: it is made and kept outside the
   arena even when `step()` runs inside the block, so it comes out as plain tensors.
5. A write into a tensor outside the arena is an effect: what was computed from the old value must not be
   recomputed from the new one. A step writes every parameter; its effect is settled once, before it runs.

Note [Optimizer steps]
Rationale: a step run through the Budget put its state in the arena (counted, evictable, and left behind as
  coop_arena.Tensor wrappers that `torch.save` and `copy.deepcopy` refuse), and each in-place write to a parameter
  froze every arena tensor computed from it: restored (a long chain at a tight budget) and kept resident.
Approach: while a Budget is active, torch.optim's global step hooks mark each `Optimizer.step` in progress by the
  frame that runs it. Before the step, `settle` makes the block independent of the values it will overwrite: of
  the arena storages computed from a parameter, its gradient or the optimizer's state, those a live wrapper still
  uses are made unevictable (restored first if evicted; if that fails they are lost, TensorLost on use, as at the
  end of a block), and those nobody can reach any more are freed. Then each op of the step that reads no tensor of
  this block runs as without a Budget (`plain`), so foreach, fused and single-tensor paths give the bits they give
  outside. A closure passed to `step` (it computes the loss) runs under the Budget again, and what it computed
  is settled when it returns.
  An exception leaving `step` skips the post hook: its mark is dropped by the next op, which finds the frame gone.
Limitations: the step's own memory (state, temporaries) is not counted in the budget. Parameters made inside the
  block live in the arena; ops of a step that read them go through the Budget like any op.
"""

from __future__ import annotations

import sys
import threading

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import ops
from .tensor import Tensor


class Steps:
    """The optimizer steps in progress inside one block, innermost last (None while a closure runs)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.frames: list = []          # frames of the steps in progress; None for a closure under the Budget
        self.thread = threading.get_ident()
        self._handles = [register_optimizer_step_pre_hook(self._before), register_optimizer_step_post_hook(self._after)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.frames.clear()

    def plain(self, args, kwargs) -> bool:
        """True when an op is part of a step in progress and reads no tensor of this block: it runs as without a
        Budget. Called only while `frames` is not empty."""
        frames = self.frames
        while frames:
            top = frames[-1]
            if top is None:
                return False  # a closure: the Budget's own
            if _running(top):
                break
            frames.pop()  # the step raised: its post hook never ran
        else:
            return False
        rt = self.runtime
        for x in ops.flatten(args, kwargs)[0]:
            if isinstance(x, Tensor):
                if x._cell.storage.payload.runtime is rt:
                    return False
            elif isinstance(x, torch.Tensor) and rt.arena.owns(x):
                return False
        return True

    # ---------------------------------------------------------------------------------------------- hooks
    def _before(self, optimizer, args, kwargs):
        if threading.get_ident() != self.thread:
            return None
        self._settle(optimizer)
        self.frames.append(sys._getframe(1))  # the frame of torch.optim's step wrapper, alive while the step runs
        if len(args) > 1 and callable(args[1]):
            return (args[0], self._resumed(args[1], optimizer), *args[2:]), kwargs
        if callable(kwargs.get("closure")):
            return args, {**kwargs, "closure": self._resumed(kwargs["closure"], optimizer)}
        return None

    def _settle(self, optimizer) -> None:
        """Settle what the step is about to overwrite (Runtime.settle); the trace records the step as the cause of
        the memory events that takes."""
        self.runtime.memory.op = f"{type(optimizer).__name__}.step"
        self.runtime.settle(_touched(optimizer))

    def _after(self, optimizer, args, kwargs):
        if threading.get_ident() != self.thread:
            return
        frame = sys._getframe(1)
        while self.frames:
            if self.frames.pop() is frame:
                break

    def _resumed(self, closure, optimizer):
        """`closure` run under the Budget; what it computed from the parameters is settled before the step goes on
        to overwrite them."""
        def under_budget(*a, **k):
            self.frames.append(None)
            try:
                loss = closure(*a, **k)
            finally:
                self.frames.pop()
            self._settle(optimizer)
            return loss
        return under_budget


def _running(frame) -> bool:
    f = sys._getframe(1)
    while f is not None:
        if f is frame:
            return True
        f = f.f_back
    return False


def _touched(optimizer) -> list:
    """Every plain tensor a step of `optimizer` may write: parameters, their gradients, its state."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            out.append(p)
            if p.grad is not None:
                out.append(p.grad)
    for st in optimizer.state.values():
        out.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return [t for t in _inner(out) if not isinstance(t, Tensor) and t.layout == torch.strided]


def _inner(tensors) -> list:
    """`tensors` with each tensor subclass that keeps its data in inner tensors (FSDP2's DTensor parameters,
    gradients and state: a local shard) replaced by those: the step writes them, not the subclass's own storage."""
    out = []
    for t in tensors:
        if isinstance(t, Tensor) or not hasattr(t, "__tensor_flatten__"):
            out.append(t)
        else:
            inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])  # (DTensor's names its mesh too)
            out.extend(_inner([x for x in inner if isinstance(x, torch.Tensor)]))
    return out
