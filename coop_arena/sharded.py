"""FSDP2 (`fully_shard`) under a Budget: FSDP's own work runs outside the arena, and a reshard settles first.

Rules enforced here (see ../shared DESIGN numbering):
1. FSDP's all-gather buffers, unsharded parameters and sharded gradients are model-sized state that another
   engine makes inside the block and keeps across steps: they are made outside the arena (bookkeeping.py).
5. A reshard frees an unsharded parameter's storage (`UntypedStorage.resize_(0)`, which no dispatch mode
   sees), so a recomputation recorded against it would read freed memory: what read it is settled first.

Note [FSDP2 under a Budget]
Rationale: `fully_shard` keeps each module's parameters sharded. Its hooks all-gather a module's parameters
  before its forward and before its backward, into buffers made at the first all-gather and reused every
  step; free the unsharded storage after the forward (`reshard_after_forward=True`, the default) and after
  the backward; and reduce-scatter the gradients into the sharded parameters' `.grad`. Made inside the arena
  the buffers would be wrappers that FSDP cannot resize, and the gradients would be arena memory kept after
  the block.
Approach: while a Budget is open, the methods of FSDP's parameter groups that do that work (lazy init,
  pre/post forward, pre/post backward, unshard, wait, reshard, finalize) and the root state's pre-forward run
  inside a bookkeeping window: an op in it that reads nothing from the arena runs on plain tensors (Rule 1);
  one that reads the arena (the module's own inputs) is the step's as usual. Before `free_unsharded_param`
  frees a parameter, `Runtime.settle(refilled=True)` makes the block independent of it: walking forward from
  what read the parameter, the first storages a wrapper holds are restored if evicted and made unevictable,
  and what is computed from them stays evictable, since its replays stop there (Rule 5). After the
  backward's all-gather refills the parameter, new readers are evictable again until the next reshard. The
  methods are replaced on their classes while a Budget is open, for its thread only (patches.py), which
  reaches modules sharded before it.
Limitations: the storages kept at a reshard (a block's first held activations: a linear layer's output that
  an activation function saves, a LayerNorm's output) stay resident to the block's end, so FSDP2 reaches less
  deep budgets than DDP (tests/test_distributed.py: 75 % of the peak for its residual MLP, where DDP trains
  its models at 30 %; with `reshard_after_forward=False` nothing is kept before the backward, and it fits at
  50 %). Keeping a copy of the unsharded parameter in the arena instead, and replaying from it,
  would trade parameter bytes for those activations; not built. This is FSDP's private API of the installed
  torch; a torch without these methods gets a BudgetUsageError when an FSDP module runs inside a Budget.
  FSDP1 (which needs an accelerator), mixed precision, CPU offload, HSDP, `reshard_after_forward` as an int,
  and CUDA streams are not tested.
"""

from __future__ import annotations

import functools
import sys

from . import patches

_GROUP = ("lazy_init", "pre_forward", "post_forward", "pre_backward", "post_backward", "unshard",
          "wait_for_unshard", "reshard", "finalize_backward")
_STATE = ("_root_pre_forward",)


def classes():
    """(FSDPParamGroup, FSDPState, FSDPParam) of the installed torch, or None where FSDP2 is not imported or
    lacks a method this module wraps."""
    mods = [sys.modules.get(f"torch.distributed.fsdp._fully_shard.{m}")
            for m in ("_fsdp_param_group", "_fsdp_state", "_fsdp_param")]
    if any(m is None for m in mods):
        return None
    group = getattr(mods[0], "FSDPParamGroup", None)
    state = getattr(mods[1], "FSDPState", None)
    param = getattr(mods[2], "FSDPParam", None)
    if group is None or state is None or param is None:
        return None
    if not all(n in group.__dict__ for n in _GROUP) or not all(n in state.__dict__ for n in _STATE) \
            or "free_unsharded_param" not in param.__dict__:
        return None
    return group, state, param


def supported() -> bool:
    return classes() is not None


def replacements() -> list:
    """(class, method name, wrap) for patches.open: empty where FSDP2 is not imported or not supported."""
    found = classes()
    if found is None:
        return []
    group, state, param = found
    return [*((group, n, _window) for n in _GROUP), *((state, n, _window) for n in _STATE),
            (param, "free_unsharded_param", _settling)]


def _window(original):
    @functools.wraps(original)
    def run(*args, **kwargs):
        bk = patches.current()
        if bk is None:
            return original(*args, **kwargs)
        bk.sharded_depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            bk.sharded_depth -= 1
    return run


def _settling(original):
    @functools.wraps(original)
    def run(fsdp_param, *args, **kwargs):
        bk = patches.current()
        if bk is not None and bk.settle is not None:
            tensors = [*getattr(fsdp_param, "all_gather_outputs", ()),
                       *getattr(fsdp_param, "_unsharded_inner_tensors", ())]
            bk.settle([t for t in tensors if t.untyped_storage().nbytes() > 0], refilled=True)
        return original(fsdp_param, *args, **kwargs)
    return run
