"""Dispatch: what a Budget does with each op: unwrap, make inputs resident, run, place outputs, wrap, record.

One generic path (functional ops) plus three special ones read off the op's schema (ops.py): views, writes
(in-place and out= ops) and in-place metadata changes.

Rules enforced here (see ../shared DESIGN numbering):
1. Tensors that existed before the block (plain tensors, or coop tensors from an earlier block) are read, never
   moved, evicted or counted.
5. An op with effects outside its outputs is never recomputed; its outputs are unevictable. A write into a tensor
   outside the arena is such an effect. An op that wrote an external tensor its schema does not mark (BatchNorm's
   running statistics) is recorded with that argument set to None (the update happens once, in the original step;
   its outputs in training do not read them); any other op that writes an external tensor unmarked keeps its
   outputs unevictable (found by a probe, Note [Probing for hidden writes]: a replay could not see the value the
   op read).
6. An in-place op keeps the tensor's address; the storage's recipe becomes its producer followed by every write
   since (recomputable in-place). Readers of the old value are frozen first (remat.py). With
   recomputable_inplace=False a write goes to a fresh copy instead (copy-on-write, the ablation).
7. A request that cannot be met raises OutOfBudget; every pin taken for the op is released and outputs already
   placed for it are freed, so the Budget stays usable.
8. Decisions depend only on the program, budget and policy: costs are analytic (cost.py), not timed.

Outputs are computed by the op into a temporary and copied into their arena range at once (the temporary is then
dropped); ops whose output is uninitialized memory (the empty family) are recorded as such and replay as nothing.
"""

from __future__ import annotations

import contextlib
import math
import weakref

import numpy as np
import torch

from . import collectives, headroom, ops, placement
from .arena import grew
from .bookkeeping import run_outside
from .cost import op_cost
from .errors import BudgetUsageError, UnsupportedOp, _internal_assert
from .recipe import ArgRef, Data, Recipe, capture_rng, dead_ref, plain_dispatch, rewind
from .storage import State, Storage
from .tensor import Tensor, with_bits

GradientEdge = torch.autograd.graph.GradientEdge

aten = torch.ops.aten

# (op, its non-tensor arguments) -> positions of external tensor arguments it writes although its schema does
# not say so (native_batch_norm's running statistics). Found by comparing the arguments around the first call.
_UNMARKED_WRITES: dict = {}

# op -> positions of outputs that stay plain host tensors outside the arena in every block, as they do in a block
# on CUDA (an exception to Rule 1): the `batch_sizes` of a packed sequence, an int64 tensor of one entry per time
# step that the packed RNNs' composite C++ kernels read by pointer before any op reaches the Budget, where a
# wrapper has no data. Later ops read it as a tensor from outside the arena.
_HOST_OUTPUTS = {aten._pack_padded_sequence.default: frozenset({1})}

# RNN ops that draw their dropout masks from an engine state buffer of their own (cuDNN's, MIOpen's), which they
# advance in place and a C++ cache keeps across steps, rather than only from the generator a recipe captures: a
# replay could not draw the same bits (Rule 4). With dropout in training their outputs are kept (unevictable,
# never replayed), and the state buffer itself (`_cudnn_init_dropout_state`) stays outside the arena, where no
# eviction can reset it.
_OWN_DROPOUT_STATE = (aten._cudnn_rnn.default, aten.miopen_rnn.default)
_DROPOUT_STATE_MAKERS = (aten._cudnn_init_dropout_state.default,)


# Batch norms in training write their running statistics although their schema does not mark them. Outside the
# arena that is Rule 5's effect, found by the probe (_hidden_writes). In the arena (statistics made inside the
# block, or InstanceNorm's repeated copy of them) the op is a write into those storages as well as a producer:
# their readers are frozen before it, they are kept after it (unevictable: nothing replays the update), and the
# op is recorded without them, so a replay of its outputs does not update them again.
_STATS_WRITES = (aten.native_batch_norm.default, aten.cudnn_batch_norm.default, aten.miopen_batch_norm.default)
_STATS = ("running_mean", "running_var")

# cuDNN's and MIOpen's RNN backward write into the forward's reserve space (cuDNN's backward-data pass mutates
# it), which their schema does not mark either. When the reserve is in the arena, the op is a write into it as
# well: its readers are frozen before it, the reserve is kept after it (a replay of the forward would not give
# the bytes the write left), and the backward's outputs are kept too (their recipe read the reserve before it).
_RESERVE_WRITES = (aten._cudnn_rnn_backward.default, aten.miopen_rnn_backward.default)

# Arguments a kernel does not read in the configuration it is called with, recorded as None (its replay gives the
# same bits without them): a batch norm's backward in training reads the saved batch statistics, not the running
# ones. Recorded, it was taken for a reader of the running statistics, so that the next forward's update of them
# kept every gradient computed since (Rule 5): an adversarial-training step, whose input follows the gradient of
# earlier forwards, filled its budget with them. cuDNN's and MIOpen's batch-norm backward are training-only (their
# kernels take the saved statistics alone; PyTorch's decomposition of cuDNN's calls the native one with train=True).
_UNREAD_IN_TRAINING = {  # op -> (unread positions, the position of its `train` flag, or None: always)
    aten.native_batch_norm_backward.default: ((3, 4), 7),
    aten.cudnn_batch_norm_backward.default: ((3, 4), None),
    aten.miopen_batch_norm_backward.default: ((3, 4), None),
}

# Ops that take a storage offset counting from the start of their tensor's storage, which in a Budget is the
# arena's (its value would also have to follow the tensor when it is restored elsewhere): an explicit one is
# refused, not translated; left out (None), the kernel takes the tensor's own, which is right.
_OFFSET_IN_STORAGE = {aten.as_strided_scatter.default: 4, aten.as_strided_copy.default: 3}


def _refuse_storage_offset(func, args, kwargs) -> None:
    if ops.arg(args, kwargs, _OFFSET_IN_STORAGE[func], "storage_offset", False) is not None:
        raise UnsupportedOp(func, "its storage_offset counts from the start of the tensor's storage, which inside a "
                                  "Budget is the arena's, so it would read or write other tensors' bytes; leave "
                                  "storage_offset out (the tensor's own is used), or call it on a tensor from "
                                  "outside the block")


# Note [Gradients of leaves]
# Rationale: a leaf's gradient is model state (Rule 1): it lives outside the arena once autograd has accumulated it.
#   Placed in the arena first and copied out, the largest weight gradient (a 392 MiB classifier weight) set the
#   step's lower bound, though its bytes are not the step's, and its copy doubled the traffic.
# Approach: an op run by the autograd engine in backward, with grad mode off (no create_graph), whose node feeds a
#   leaf's AccumulateGrad directly or through nodes with one edge each (a `t()` or view of the result), and whose
#   fresh output has that leaf's dtype and number of elements while the leaf has no gradient yet (autograd then
#   takes the tensor itself as `.grad`), computes that output as a plain tensor outside the arena, like the
#   gradient it becomes (`_leaf_gradients`). Each leaf is claimed once per node run; a tuple output (convolution's
#   backward) is matched to the node's edges by position when their numbers agree. At a new shape sized by the
#   device (Note [Shapes that change]) the outputs are matched once the op has run: a dry run, which has a plan
#   there, leaves the same ones outside, so the CPU and meta make the same decisions.
#   An op that reads the leaf itself (or a view of it) is not taken to make its gradient: a square Linear's input
#   gradient (`grad @ weight`, at a batch equal to its width) has the weight's size, and came first.
# Limitations: the match is by dtype and size, so an activation gradient of the same size computed first in the
#   same node by an op that does not read the leaf may be the one left outside: it stays correct, outside the
#   arena and seen by the footprint's headroom (a temporary there), not counted in the arena. A gradient an op
#   computes from the leaf itself (`w * w`) goes in the arena and is copied out, as before. A leaf that
#   already has a gradient accumulates into it: the new one is a temporary of the step and goes in the arena.
#   A leaf that receives several gradients in one backward (a weight tied to two uses, an encoder applied to two
#   inputs) sums them before it accumulates: none of them becomes `.grad` as it is, so they go in the arena, and
#   so does their sum (copied out as `.grad`). Such a leaf is found the first time a backward meets it, once per
#   leaf, so that every step decides the same (step replay), by counting the edges into its AccumulateGrad:
#   from the roots the backward runs from (`_uses_below_roots`, walked once per graph task that meets a new
#   leaf). Both `backward()` and `autograd.grad()`, with their gradients implicit or given, hand their outputs to
#   the autograd engine through `torch.autograd._engine_run_backward`, which the Budget replaces while it is open
#   (bookkeeping.py) to tell `rooted` the roots: their nodes are held for the call only, so that a block running
#   many steps keeps no step's graph alive. Where a backward starts otherwise (a direct call into the engine),
#   the edges are counted below the node that first meets the leaf (`_uses_below`). Walked from that node alone,
#   the second use of a shared encoder (the other branch of the loss, not below it) was not found: its gradients
#   were made outside the arena and summed there, uncounted, and the step's footprint was 1.4-1.8x its budget.
#   (Catching it at the second gradient made the second step decide otherwise than the first, which step replay
#   does not allow.) A backward restricted to some `inputs=` counts every edge below its roots, including those
#   it does not run: a leaf may be taken to sum gradients it does not receive (correct, at the cost of a copy).
#   The op runs inside `headroom.model_state()`, so that the headroom's observer leaves the gradient out even
#   when the block frees it (`p.grad = None` after an update in it), as it leaves out a gradient copied out of
#   the arena; the op's other outputs (convolution's input gradient), temporaries copied into the arena, are
#   then left out of the observed peak too.
_ACCUMULATE = "torch::autograd::AccumulateGrad"
_SHARED: dict = {}  # id(leaf) -> (weakref of a leaf met in backward, whether it sums several gradients)


def _grad_sinks(node) -> list:
    """The leaves (tensors) whose AccumulateGrad `node` feeds, per edge (None where an edge feeds none): directly,
    or through a chain of nodes with one edge each (Note [Gradients of leaves])."""
    out = []
    for f, _ in node.next_functions:
        for _ in range(4):
            if f is None or f.name() == _ACCUMULATE:
                break
            edges = [g for g, _ in f.next_functions if g is not None]
            f = edges[0] if len(edges) == 1 else None
        var = getattr(f, "variable", None) if f is not None and f.name() == _ACCUMULATE else None
        out.append(var if var is not None and var.grad is None else None)
    return out


def _uses_below(node, v) -> int:
    """How many edges of the autograd graph below `node` (itself included) lead into the leaf `v`'s
    AccumulateGrad."""
    seen, stack, uses = {id(node)}, [node], 0
    while stack:
        for f, _ in stack.pop().next_functions:
            if f is None or id(f) in seen:
                continue
            if f.name() == _ACCUMULATE:
                uses += getattr(f, "variable", None) is v
                continue
            seen.add(id(f))
            stack.append(f)
    return uses


def _uses_below_roots(roots) -> dict:
    """id(leaf) -> how many edges of the autograd graph below `roots` (themselves included) lead into that leaf's
    AccumulateGrad."""
    seen, stack, uses = {id(r) for r in roots}, list(roots), {}
    while stack:
        for f, _ in stack.pop().next_functions:
            if f is None:
                continue
            if f.name() == _ACCUMULATE:
                var = getattr(f, "variable", None)
                if var is not None:
                    uses[id(var)] = uses.get(id(var), 0) + 1
                continue
            if id(f) not in seen:
                seen.add(id(f))
                stack.append(f)
    return uses


def _feeds_leaves() -> bool:
    """Whether the autograd node running now feeds a leaf that has no gradient yet (Note [Gradients of leaves])."""
    node = torch._C._current_autograd_node()
    return node is not None and node.name() != _ACCUMULATE and any(v is not None for v in _grad_sinks(node))


def _reads_leaf(call, v) -> bool:
    """Whether the op reads the leaf `v` (or a view of it): then its output of v's size is taken for another
    gradient (Note [Gradients of leaves]), as a square Linear's input gradient, `grad @ weight`, is."""
    if isinstance(v, Tensor):
        s = v._cell.storage
        return any(x is s for x in call.inputs)
    return any(a is v or (isinstance(a, torch.Tensor) and a._base is v) for a in call.leaves)


# Ops whose output shape, or a Python value they return, depends on tensor values (Dispatch._call_op)
_DATA_DEPENDENT = {torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}


def _named(call: _Call, name: str) -> tuple:
    """(position, value) of the op's schema argument `name` in this call (None where left at its default)."""
    pos = next(i for i, a in enumerate(call.func._schema.arguments) if a.name == name)
    return pos, ops.arg(call.args, call.kwargs, pos, name, False)


def _stats_written(call: _Call, externals) -> frozenset:
    """The positions among `externals` a batch norm (_STATS_WRITES) writes although its schema does not mark them:
    its running statistics, in training. Known from the op, not probed: a first call whose update leaves a
    statistic's bytes as they were (a batch of zeros, whose mean is the running mean's initial 0) would have them
    recorded as never written, for good, and a dry run on meta, which cannot probe, settles them as the device does."""
    if not _named(call, "training")[1]:
        return frozenset()
    stats = {_named(call, name)[0] for name in _STATS}
    return frozenset(pos for pos, _ in externals if pos in stats)


def _keeps_outputs(call: _Call) -> bool:
    """Whether the op draws from an engine's own dropout state in training (_OWN_DROPOUT_STATE), or wrote the
    reserve space in the arena (_RESERVE_WRITES): its outputs are kept."""
    if call.func in _RESERVE_WRITES:
        return bool(call.stats)
    return (call.func in _OWN_DROPOUT_STATE and bool(_named(call, "train")[1])
            and bool(_named(call, "dropout")[1]))


# Note [Custom ops that draw]
# A custom op (torch.library) that draws random numbers inside its kernel should carry the nondeterministic_seeded
# tag, as PyTorch's random ops do; its draws are otherwise invisible to the runtime, and a rebuild would draw new
# numbers. The first call of an untagged custom op therefore also captures its generator's state and compares
# it afterwards: if the op drew, it is random from then on (its recipe keeps the state it ran with, and later
# calls capture it as for a tagged op). Only the device's default generator (or a `generator` argument) is seen.
# Until then its OpInfo says random=None (ops.py).
def _drew(call: _Call, rng) -> object:
    """After the first call of an untagged custom op (`call.op.random is None`): `rng` when it drew random
    numbers (it is random from then on), else None. On meta there is no generator to watch: nothing is settled."""
    if rng is None:
        return None
    drew = not torch.equal(rng[0].get_state(), rng[1] if isinstance(rng[1], torch.Tensor) else rng[1].get_state())
    ops.settle_random(call.func, drew)
    return rng if drew else None


_RRELU = torch.ops.aten.rrelu_with_noise.default
_LIFT_FRESH, _AS_STRIDED, _DETACH, _COPY = (aten.lift_fresh.default, aten.as_strided.default, aten.detach.default,
                                           aten.copy_.default)


def _rrelu_in_eval(args, kwargs):
    """rrelu_with_noise out of training writes nothing: its kernel is leaky_relu with the slope (lower + upper) / 2
    (computed in double, as here), and `noise` is left as it is. Run as that, it is an ordinary functional op; in
    training it stays an op that writes `noise` and returns a fresh tensor, placed unevictable (_results_of_write)."""
    names = [a.name for a in _RRELU._schema.arguments]
    defaults = {a.name: a.default_value for a in _RRELU._schema.arguments if a.has_default_value()}
    bound = {**defaults, **dict(zip(names, args)), **kwargs}
    if bound["training"]:
        return _RRELU, args, kwargs
    slope = (float(bound["lower"]) + float(bound["upper"])) / 2
    return torch.ops.aten.leaky_relu.default, (bound["self"], slope), {}


# Note [Probing for hidden writes]
# The first call of an op configuration with tensor arguments from outside the arena compares them before and after
# the op: a write that its schema does not mark (native_batch_norm's running statistics, an untagged custom op) is
# an effect (Rule 5). A small argument (at most PROBE_COPY_MAX bytes) is copied to host memory and compared byte for
# byte. A larger one (a weight, a language model's embedding of hundreds of MB) is compared by a fingerprint that
# allocates nothing of its size: the XOR of its elements widened to 64 bits (torch.hash_tensor) and, for a
# contiguous argument, the wrapping sum of its bytes as int64 words. Its copies, on the CPU, were the step's largest
# allocations outside the arena (two copies of a 32 MiB classifier weight), over the cap a user measures. A write
# that leaves both the XOR and the sum as they were (values swapped in place) goes unseen for a large argument.
# Without torch.hash_tensor (torch < 2.9) every argument is copied. First step only: the result is kept per
# configuration.
PROBE_COPY_MAX = 1 << 20


def _probe(externals) -> list:
    """(position, tensor, version, host copy or fingerprint) of the op's tensor arguments from outside the arena."""
    return [(pos, t, _version(t), _fingerprint(t)) for pos, t in externals]


def _probed_writes(probe) -> frozenset:
    """The positions among `probe` that the op wrote (torch.equal on raw bytes: a NaN is equal to itself)."""
    return frozenset(pos for pos, t, v, before in probe if _version(t) != v or _changed(t, before))


def _changed(t: torch.Tensor, before) -> bool:
    return _differs(_fingerprint(t), before)


def _differs(after, before) -> bool:
    if isinstance(before, torch.Tensor):
        return not torch.equal(after, before)
    if isinstance(before, list):  # a sparse tensor's parts
        return len(after) != len(before) or any(_differs(a, b) for a, b in zip(after, before))
    return after != before


def _fingerprint(t: torch.Tensor):
    """A host copy of a small tensor's bytes, or a fingerprint of a large one (Note [Probing for hidden writes]);
    a sparse tensor's is its parts' (indices and values), in a list."""
    if t.layout is not torch.strided:
        parts = ops.sparse_parts(t)
        return [_fingerprint(p) for p in parts] if parts is not None else (t.layout, tuple(t.size()))
    if t.numel() * t.element_size() <= PROBE_COPY_MAX or not hasattr(torch, "hash_tensor") or t.is_complex():
        return _host_bytes(t)
    t = t.resolve_conj().resolve_neg()
    words = None
    if t.is_contiguous() and t.numel() * t.element_size() % 8 == 0 and t.storage_offset() * t.element_size() % 8 == 0:
        words = t.reshape(-1).view(torch.uint8).view(torch.int64)
    return (int(torch.hash_tensor(words if words is not None else t).view(torch.int64)),
            int(words.sum()) if words is not None else None)


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a, b) -> bool:
    """Whether tensors `a` and `b` have the same size, strides, dtype and bits (a NaN equals itself, 0.0 is not
    -0.0)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a == b
    if a.dtype != b.dtype or a.size() != b.size() or any(
            n > 1 and x != y for n, x, y in zip(a.size(), a.stride(), b.stride())):
        return False
    a, b = a.resolve_conj().resolve_neg(), b.resolve_conj().resolve_neg()
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    ints = _INTS.get(a.element_size()) if a.dtype != torch.bool and not a.is_quantized else None
    return torch.equal(a.view(ints), b.view(ints)) if ints is not None else torch.equal(a, b)


def _version(t: torch.Tensor):
    """`t._version`, or None for an inference tensor (made under torch.inference_mode), which has no counter."""
    return None if t.is_inference() else t._version


def _host_bytes(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous copy of `t`'s bytes in host memory, made at once (contiguous() would keep a one-element
    tensor's stride, which may not be 1)."""
    t = t.resolve_conj().resolve_neg()
    return t.to("cpu", memory_format=torch.contiguous_format, copy=True).view(-1).view(torch.uint8)


# Note [In-place ops that resize]
# Rationale: a few in-place kernels resize `self` when it broadcasts to the result (`x.addbmm_(b1, b2)` with `x` of
#   shape (1,) or (): PyTorch's kernel computes into `self` as into an out= tensor, and resizes it to (5, 10)).
#   An arena tensor cannot change its size in place: through a view of the whole arena the kernel wrote past its
#   range into its neighbours' bytes, and the user's tensor kept its old shape, silently wrong. `meta` cannot say
#   it beforehand: its decompositions refuse such a call, where the CPU's and CUDA's kernels resize.
# Approach: the first call of each configuration of an in-place op (its key as a plan's, placement._plan_key) on a
#   device with memory runs on a view of `self` over a storage that is exactly its range and cannot grow
#   (Arena.fixed_view, as out= arguments get: _fix_out_args): a kernel that grows it raises before writing, and one
#   that re-shapes it within its range is seen afterwards. Either refuses the op with UnsupportedOp, which names
#   the functional op to call instead. A configuration that kept `self` is remembered (`_KEEPS_SELF`): later calls
#   pay the lookup of its key.
# Limitations: a re-shape within the range is found once the kernel has written (the tensor was made in the block,
#   and the block ends with the error). A dry run on `meta` fails as `meta` does (its decomposition's error).
_KEEPS_SELF: set = set()


def _resizes_self(call: _Call, guarded, to: str) -> UnsupportedOp:
    name = call.func._schema.name.split("::")[-1].rstrip("_")
    return UnsupportedOp(call.func, f"it resizes `self` in place, from shape {list(guarded[0])} to {to} (PyTorch "
                                    f"does so when `self` broadcasts to the result), and a tensor in the arena cannot "
                                    f"change its size in place; call the out-of-place op instead: "
                                    f"`x = torch.{name}(x, ...)`")


class _Grows(Exception):
    """An out= kernel tried to resize a view whose storage cannot grow (Dispatch._fixed_view)."""


class _Call:
    """One op call in progress: its arguments as given, as plain tensors, and as recorded for a recipe."""

    __slots__ = ("func", "op", "args", "kwargs", "leaves", "spec", "inputs", "plain", "recorded", "pargs", "pkwargs",
                 "stats", "cost", "trimmed", "external")

    def __init__(self, func, op, args, kwargs, leaves, spec):
        self.func, self.op, self.args, self.kwargs, self.leaves, self.spec = func, op, args, kwargs, leaves, spec
        self.inputs: list[Storage] = []
        self.stats = ()  # (position, storage) of what it writes in the arena unmarked (_STATS_WRITES, _RESERVE_WRITES)
        self.trimmed = False  # its recipe records arguments as None that `recorded` has (Dispatch._hidden_writes)


class Dispatch:
    def __init__(self, runtime, *, recomputable_inplace: bool):
        self.runtime = runtime
        self.memory = runtime.memory
        self.arena = runtime.arena
        self.device = runtime.arena.device
        self.counters = runtime.counters
        self.remat = runtime.remat
        self.lifetime = runtime.lifetime
        self.recomputable_inplace = recomputable_inplace
        self.bookkeeping = runtime.bookkeeping         # other engines' work, run outside the arena (or None)
        self._ext_readers: dict[int, list] = {}     # external storage key -> weakrefs of storages reading it
        self._ext_refs = self._ext_kept = 0          # weakrefs in _ext_readers now / after the last prune
        self._claimed = (None, set())                # (autograd node, ids of the leaves it already gave a gradient)
        self._roots: list[list] = []                 # the root nodes of each backward running now, innermost last
        self._task = (None, {})                      # (a graph task, id(leaf) -> edges into the leaf below its roots)

    # ============================================================================================ dispatch
    def run(self, func, args, kwargs):
        lifetime, memory = self.lifetime, self.memory
        if lifetime.dead:
            lifetime.drain()
        if func is _RRELU:
            func, args, kwargs = _rrelu_in_eval(args, kwargs)
        elif func in _OFFSET_IN_STORAGE and isinstance(args[0], Tensor):
            _refuse_storage_offset(func, args, kwargs)
        elif (func is _LIFT_FRESH and not isinstance(args[0], Tensor) and args[0].device == self.device
              and not (self.bookkeeping is not None and self.bookkeeping.active())):  # (an optimizer's state: not)
            return self._lifted(args[0])
        op = ops.info(func)
        memory.op = op.name  # what the memory events from here on were for (Note [Memory snapshots])
        if op.effectful:  # See Rule 5: collectives.py
            return collectives.run(self, func, args, kwargs)
        if op.inplace_view:
            return self._run_inplace_view(func, args, kwargs)
        leaves, spec = ops.flatten(args, kwargs)
        call = _Call(func, op, args, kwargs, leaves, spec)
        pins = []
        try:
            owner = self.owners(leaves, func)
            mine = {s.sid: s for s in owner.values()}
            engines = not mine and self.bookkeeping is not None and self.bookkeeping.active()  # See bookkeeping.py
            if not mine and (engines or self._off_arena(leaves, kwargs)):
                memory.note_op(func, ())
                if not engines:
                    self._count_off_arena(leaves)
                written = [v for _, value in self._written(call, args, kwargs)
                           for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None]
                return run_outside(self, func, args, kwargs, written)
            call.inputs = inputs = [mine[sid] for sid in sorted(mine)] if len(mine) > 1 else list(mine.values())
            memory.note_op(func, inputs)  # Note [Step replay]
            if op.returns_alias and not op.written and all(s.state is State.RESIDENT for s in inputs):
                pass  # a view places nothing, so nothing is evicted while it runs: no pins (they matter to plans only)
            else:
                pins = self.remat.acquire(inputs, op.name)
            for s in inputs:
                memory.touch(s)
            if op.written:
                self._bind(call, owner, fresh=True)
                return self._run_write(call)
            if op.returns_alias:
                self._bind(call, owner, record=False)  # (a view records no recipe)
                return self._run_view(call)
            return self._run_functional(call, owner)
        finally:
            memory.may_relocate = True
            self.remat.release(pins)
            if lifetime.dead:
                lifetime.drain()

    def _bind(self, call: _Call, owner: dict, fresh: bool = False, record: bool = True) -> None:
        """Plain tensors for the op to run on (arena views of its inputs) and, unless not `record`, the arguments
        its recipe records. From here until the op has run, the inputs' views are live: nothing may move (Note
        [Relocation]). `fresh`: new views, for an op that writes its arguments (Note [Views kept] in tensor.py)."""
        self.memory.may_relocate = False
        leaves = call.leaves
        plain = list(leaves)
        recorded = list(leaves) if record else None
        call.external = False  # whether it reads a tensor from outside the arena (Dispatch._externals)
        for i, x in enumerate(leaves):
            if i in owner:
                if record:
                    plain[i], recorded[i] = self.arena_arg(x, owner[i], fresh)
                else:
                    plain[i] = self.arena_view(x, owner[i])
            elif isinstance(x, torch.Tensor):  # See Rule 1: read, never moved
                if isinstance(x, Tensor):
                    x._check_thread(call.func)  # another Budget's block, running on another thread
                p = x.as_plain() if isinstance(x, Tensor) else x
                if (p.device != self.device and p.dim() > 0 and (p.is_floating_point() or p.is_complex())
                        and not (call.func is _COPY and i == 1)):
                    # (integer and bool tensors on the CPU are indices, masks and lengths, which PyTorch's
                    # kernels take with tensors on the device: `x[cpu_index]`, pack_padded_sequence's lengths;
                    # and a copy into the arena may read any device: `model(x.cuda())` inside the block)
                    raise BudgetUsageError(
                        f"{call.func} got a tensor on {p.device}, but this Budget's arena is on {self.device}; "
                        f"move the model and its inputs to {self.device} before entering the Budget")
                plain[i] = p
                if record:
                    recorded[i] = p
                call.external = True
                self.lifetime.watch_leaf(x)
        call.plain, call.recorded = plain, recorded
        call.pargs, call.pkwargs = ops.unflatten(plain, call.spec)

    def _execute(self, call: _Call):
        """Run an op that writes its arguments on plain tensors; returns (outputs, output leaves, recipe)."""
        rng = capture_rng(self.device, call.op, call.pargs, call.pkwargs)
        out = self._call_op(call)
        if call.op.random is None:  # Note [Custom ops that draw]
            rng = _drew(call, rng)
        out_leaves = list(out) if isinstance(out, (tuple, list)) else [out]
        cost = op_cost(call.op.flops, call.pargs, call.pkwargs, call.plain, out_leaves, out)
        self._account(cost)
        rargs, rkwargs = ops.unflatten(call.recorded, call.spec)
        recipe = Recipe.make(call.func, rargs, rkwargs, rng, cost, uninitialized=call.op.uninitialized,
                             grad_mode=torch.is_grad_enabled(), leaves=call.recorded)
        return out, out_leaves, recipe

    def _call_op(self, call: _Call):
        """Run the op on its plain arguments. In a dry run, an op whose outputs' shapes or values depend on the data
        (nonzero, masked_select, unique, boolean indexing, .item()) has nothing to compute them from: that is said
        with a typed error instead of the meta kernel's NotImplementedError."""
        try:
            return call.func(*call.pargs, **call.pkwargs)
        except (NotImplementedError, RuntimeError) as e:
            if (self.device.type == "meta" and _DATA_DEPENDENT & set(call.func.tags)
                    and (isinstance(e, NotImplementedError) or "meta" in str(e))):  # (not the user's shape error)
                raise UnsupportedOp(call.func, "a dry run on meta has no data, and this op's output depends on it "
                                               "(its shape, or a Python value read from a tensor). Plan such a step "
                                               "with a real run on the CPU, or make the op static (nonzero_static, "
                                               "repeat_interleave with output_size, dense dispatch masks)") from e
            raise

    def _account(self, cost: float) -> None:
        c = self.counters
        c.ops += 1
        c.compute_cost += cost
        if self.memory.following:  # every decision for it so far was the recorded block's (Note [Step replay])
            c.replayed_ops += 1
        self.memory.advance(cost)

    # ---------------------------------------------------------------------------------------- functional
    def _run_functional(self, call: _Call, owner: dict):
        """See Note [Direct placement] in placement.py."""
        if call.func in _STATS_WRITES or call.func in _RESERVE_WRITES:
            call.stats = self._arena_writes(call, owner)
            for _, s in call.stats:
                self.remat.freeze_readers(s)
        host = not call.inputs and (call.func in _DROPOUT_STATE_MAKERS or self._host_index(call))
        if host or self._elsewhere(call.kwargs.get("device")):  # `x.cpu()`, `zeros(device="cpu")` on CUDA
            self._bind(call, owner)
            return self._run_temporary(call, None, host=host)  # its outputs are returned as they are
        plan = placement.plan_for(call.func, call.op, call.args, call.kwargs, self.device.type,
                                  sizing=self.runtime.sizing and not call.op.uninitialized,
                                  flat=(call.leaves, call.spec))
        if (not torch.is_grad_enabled() and plan is not None and not isinstance(plan, placement.Sizing)
                and not plan.aliases):
            leaf_outputs = self._leaf_gradients(call, [None if o is None else (o.dtype, math.prod(o.size))
                                                       for o in plan.outputs])
            if leaf_outputs:  # Note [Gradients of leaves]
                self._bind(call, owner)
                return self._run_temporary(call, plan, plain_outputs=leaf_outputs)
        if isinstance(plan, placement.Sizing):  # a new shape, sized by the device: Note [Shapes that change]
            self._bind(call, owner)  # (its outputs are known once it has run: so are the leaves' gradients)
            result = self._run_temporary(call, None, direct=plan.like.out_op is not None or call.op.uninitialized,
                                         leaf_gradients=not torch.is_grad_enabled())
            placement.sized(plan, list(result) if isinstance(result, (tuple, list)) else [result], call.cost)
            return result
        if plan is not None and plan.aliases:
            self._bind(call, owner)
            return self._run_view(call)
        if plan is not None and placement.learns_layout(plan, self.device.type):  # See Note [Direct placement]
            self._bind(call, owner)
            result = self._run_temporary(call, plan, direct=True)  # (a dry run places this call directly)
            if placement.same_layout(plan, list(result) if isinstance(result, (tuple, list)) else [result]):
                plan.learned.append(True)
            else:
                placement.without_out(call.func, call.args, call.kwargs, self.device.type, plan)
            return result
        if plan is not None and (plan.out_op is not None or call.op.uninitialized):
            try:
                return self._run_direct(call, owner, plan)
            except _Grows:  # its out= variant resizes its outputs on the way: see Note [Direct placement]
                plan = placement.without_out(call.func, call.args, call.kwargs, self.device.type, plan)
        if plan is not None and plan.decomposes and self.runtime.mode is not None:
            return self._run_decomposed(call)
        self._bind(call, owner)
        return self._run_temporary(call, plan)

    def _leaf_gradients(self, call: _Call, outs: list) -> dict:
        """The positions of this op's outputs (`outs`: (dtype, number of elements) of each, None where not a
        tensor) that become a leaf's gradient and so are computed outside the arena, each with its leaf (Note
        [Gradients of leaves]); empty for most ops."""
        node = torch._C._current_autograd_node()
        if node is None or not outs or node.name() == _ACCUMULATE:
            return {}
        sinks = _grad_sinks(node)
        if not any(v is not None for v in sinks):
            return {}
        if self._claimed[0] is not node:
            self._claimed = (node, set())
        claimed = self._claimed[1]
        by_position = len(outs) > 1 and len(outs) == len(sinks)
        found = {}
        for j, spec in enumerate(outs):
            if spec is None:
                continue
            dtype, numel = spec
            for k in ([j] if by_position else range(len(sinks))):
                v = sinks[k]
                if (v is not None and id(v) not in claimed and v.dtype == dtype and v.numel() == numel
                        and v.device.type == self.device.type and not _reads_leaf(call, v)
                        and not self._sums_gradients(node, v)):
                    claimed.add(id(v))
                    found[j] = v
                    break
        return found

    def _sums_gradients(self, node, v) -> bool:
        """Whether the leaf `v` receives several gradients in one backward (a weight tied to two uses): autograd
        sums them before it accumulates, so none of them becomes `.grad`. Found by a walk of the graph below
        `node` the first time the leaf is met, and kept (Note [Gradients of leaves])."""
        r = _SHARED.get(id(v))
        if r is None or r[0]() is not v:
            if len(_SHARED) > 4096:  # (leaves gone since)
                for k in [k for k, w in _SHARED.items() if w[0]() is None]:
                    del _SHARED[k]
            r = _SHARED[id(v)] = (weakref.ref(v), self._uses(node, v) > 1)
        return r[1]

    @contextlib.contextmanager
    def rooted(self, outputs):
        """While the autograd engine runs a backward from `outputs` (tensors or GradientEdges): its roots are known
        (Note [Gradients of leaves]). Nested backwards (a reentrant checkpoint's) stack."""
        nodes = [o.node if isinstance(o, GradientEdge) else o.grad_fn for o in outputs]
        self._roots.append([n for n in nodes if n is not None])
        try:
            yield
        finally:
            self._roots.pop()
            self._task = (None, {})

    def _uses(self, node, v) -> int:
        """How many edges of this backward's graph lead into the leaf `v`'s AccumulateGrad: counted from the roots
        of the innermost backward running (`rooted`, once per graph task), or, where there are none or `v` is not
        below them, from `node` down (Note [Gradients of leaves])."""
        task = torch._C._current_graph_task_id()
        if self._task[0] != task:
            self._task = (task, _uses_below_roots(self._roots[-1]) if self._roots else {})
        return self._task[1].get(id(v), 0) or _uses_below(node, v)

    def _lifted(self, t: torch.Tensor):
        """`torch.tensor(data)`, `as_tensor(list)`, `t.new_tensor(data)` in the block: PyTorch makes the tensor from
        Python data outside any dispatch, then lifts it (`lift_fresh`), the only op a mode sees. It was left outside
        the arena, uncounted (a batch's `torch.tensor(list)` escaped the budget). Its bytes are copied into the
        arena, where they stay unevictable: nothing can recompute data that came from Python."""
        if not t.numel():  # nothing to place (transformers' key-value cache starts as torch.tensor([]))
            return t
        if not t.untyped_storage().resizable():  # memory it shares with its maker (from_numpy, as_tensor(ndarray),
            return t                              # frombuffer): a copy would no longer see, or make, their writes
        out = self.run(aten.clone.default, (t,), {})
        s = out._cell.storage
        if s.state is State.EVICTED:  # (its copy is replayable while `t` lives)
            self.remat.restore(s)
        self.remat.make_unevictable(s)
        return out

    def _off_arena(self, leaves, kwargs) -> bool:
        """Whether every tensor an op reads lives on another device than the arena's, and it asks for none (a CPU
        constant or index computed on in a CUDA block): it runs there, as without a Budget."""
        if kwargs.get("device") is not None and not self._elsewhere(kwargs["device"]):
            return False
        devices = [x.device for x in leaves if isinstance(x, torch.Tensor)]
        return bool(devices) and all(d != self.device for d in devices)

    def _count_off_arena(self, leaves) -> None:
        """An op that ran on another device than the arena's: a block whose ops all did is told at its end."""
        c = self.counters
        if not c.off_arena:
            c.off_arena_device = str(next(x.device for x in leaves if isinstance(x, torch.Tensor)))
        c.off_arena += 1

    def _host_index(self, call: _Call) -> bool:
        """Whether a factory op asks for an integer or bool tensor on the CPU by name in a dry run on meta: it stays
        a plain CPU tensor outside the arena, as in a block on CUDA (an exception to Rule 1). Such tensors are
        host-side bookkeeping that C++ kernels may read by pointer (the lengths _pad_packed_sequence makes with its
        batch sizes' options), which a wrapper has no data for. Not in a block on the CPU, where a model's own
        tensors are asked for on the CPU by name too (`device=x.device`): there they stay in the arena and count."""
        device, dtype = call.kwargs.get("device"), call.kwargs.get("dtype")
        return (device is not None and dtype is not None and not call.inputs and self.device.type == "meta"
                and torch.device(device).type == "cpu" and not (dtype.is_floating_point or dtype.is_complex)
                and not any(isinstance(x, torch.Tensor) for x in call.leaves))

    def _elsewhere(self, device) -> bool:
        """Whether an op's `device=` argument puts its outputs on another device than the arena's. A dry run on
        meta keeps every output in its arena."""
        if device is None or device == self.device or self.device.type == "meta":
            return False
        device = torch.device(device)
        if device.type != self.device.type:
            return True
        index = torch.cuda.current_device() if device.type == "cuda" and device.index is None else device.index
        return device.type == "cuda" and index != self.device.index

    def _run_decomposed(self, call: _Call):
        """Run the op's composite kernel with this Budget's mode active again, so each op it calls is placed,
        recorded and recomputed on its own (placement.decomposes). Below autograd, as the op itself runs."""
        with self.runtime.mode, torch._C._AutoDispatchBelowADInplaceOrView():
            return call.func.redispatch(placement.backend_keyset(self.device.type), *call.args, **call.kwargs)

    def _externals(self, call: _Call, plan):
        """(position, tensor) of the op's tensor arguments that live outside the arena, the key under which what
        it writes among them is remembered, and those positions (None before the first call of this op
        configuration with these arguments external)."""
        if not call.external:  # (most ops: every tensor it reads is in the arena)
            return [], None, frozenset()
        externals = [(pos, t) for pos, name, _ in call.op.tensor_args
                     if isinstance(t := ops.arg(call.pargs, call.pkwargs, pos, name, False), torch.Tensor)
                     and not self.arena.owns(t)]
        if externals and call.func in _STATS_WRITES:  # known without a probe, on every device (a dry run too)
            return externals, None, _stats_written(call, externals)
        if not externals or self.device.type == "meta":
            return externals, None, frozenset()
        where = tuple(pos for pos, _ in externals)
        if plan is not None:  # one configuration: the plan's own table
            return externals, (plan.hidden, where), plan.hidden.get(where)
        key = (call.func, where, repr([a for a in call.plain if not isinstance(a, torch.Tensor)]))
        if len(_UNMARKED_WRITES) >= placement._PLANS_MAX:  # bounded like the plan cache (a scalar changing each step)
            _UNMARKED_WRITES.clear()
        return externals, (_UNMARKED_WRITES, key), _UNMARKED_WRITES.get(key)

    def _arena_writes(self, call: _Call, owner: dict) -> list:
        """(position, storage) of what in this block's arena the op is about to write although its schema does not
        say so: a batch norm's running statistics in training (_STATS_WRITES), an RNN backward's reserve space
        (_RESERVE_WRITES)."""
        if call.func in _RESERVE_WRITES:
            names = ("reserve",)
        elif _named(call, "training")[1]:
            names = _STATS
        else:
            return []
        out = []
        for pos, t in (_named(call, name) for name in names):
            s = next((owner[i] for i, x in enumerate(call.leaves) if x is t and i in owner), None)
            if s is not None:
                out.append((pos, s))
        return out

    def _before_hidden_writes(self, externals, written):
        """See Rule 5: before an op writes external tensors its schema does not mark, what was computed from their
        old values is settled, while they still hold them (a storage evicted then would otherwise be restored from
        the values the op leaves). The first call of a configuration, whose writes are not known yet, probes them
        instead (Note [Probing for hidden writes]): returns the probe, for `_after_probe`."""
        if written is None:
            with headroom.one_time():  # (its host copies: once per configuration, Note [Headroom])
                return _probe(externals)
        self.runtime.settle([t for pos, t in externals if pos in written])
        return None

    def _after_probe(self, probe, key, probed: frozenset | None = None) -> frozenset:
        """The writes a first call's probe found (`probed`, where the caller has them already): remembered under
        `key`, and settled (_settle_probed)."""
        written = key[0][key[1]] = _probed_writes(probe) if probed is None else probed
        self._settle_probed(probe, written)
        return written

    def _settle_probed(self, probe, written) -> None:
        """The first call of a configuration found its hidden writes only once they were done: what read the old
        values is settled with the old bytes (the probe's host copies) put back for the time of it, all of them at
        once (a batch norm's replay reads both statistics)."""
        swapped = [(t, before) for pos, t, _, before in probe if pos in written]
        if not any(self._ext_readers.get(ops.storage_key(t)) for t, _ in swapped):
            return
        with plain_dispatch(), torch.no_grad():
            now = []
            try:
                for t, before in swapped:
                    d = t.detach()
                    now.append((d, _version(d), d.clone()))
                    d.copy_(before.to(d.device).view(d.dtype).reshape(d.shape))
                self.runtime.settle([t for t, _ in swapped])
            finally:
                for d, version, new in now:
                    d.copy_(new)
                    if version is not None:
                        torch._C._autograd._unsafe_set_version_counter((d,), (version,))

    def _hidden_writes(self, call: _Call, recipe: Recipe, externals, written) -> bool:
        """See Rule 5: writes into external tensors the schema does not mark; and unmarked writes in the arena
        (_STATS_WRITES, _RESERVE_WRITES). Returns whether the outputs stay evictable. Arguments the kernel did
        not read are dropped from the recipe first (_UNREAD_IN_TRAINING)."""
        unread, train = _UNREAD_IN_TRAINING.get(call.func, ((), None))
        args = recipe.args
        if train is None or len(recipe.args) > train and recipe.args[train] is True:
            for pos in unread:
                recipe.without_arg(pos)
        for pos, s in call.stats:
            self.remat.make_unevictable(s)
            if pos < len(recipe.args) and call.func not in _RESERVE_WRITES:  # (whose outputs are kept: no replay)
                recipe.without_arg(pos)
        evictable = not call.op.effectful
        for pos, t in externals:
            if pos in written:  # (settled before the op ran, or by its probe: _before_hidden_writes, _after_probe)
                if call.func in _STATS_WRITES and pos < len(recipe.args):  # outputs that do not read it in training
                    recipe.without_arg(pos)
                else:  # (a custom op's output may read what it wrote: replayed without it, its bits would differ)
                    evictable = False
        call.trimmed = call.trimmed or recipe.args is not args
        return evictable

    def _run_direct(self, call: _Call, owner: dict, plan):
        """Outputs placed first, then the op's out= variant writes into them (or, for uninitialized memory,
        nothing does)."""
        func, memory = call.func, self.memory
        placed = []
        try:
            for spec in plan.outputs:
                placed.append(memory.allocate(spec.nbytes, plan.cost, evictable=not call.op.effectful,
                                              inputs=call.inputs, pinned=True, op=call.op.name) if spec.nbytes else None)
            self._bind(call, owner)
            externals, key, written = self._externals(call, plan)
            probe = self._before_hidden_writes(externals, written)
            guard = plan.out_op is not None and not plan.checked and self.device.type != "meta"
            views = [(self._fixed_view if guard else self.arena.shared)(s.offset, o.dtype, o.size, o.stride, 0)
                     if s is not None else torch.empty(o.size, dtype=o.dtype, device=self.device)
                     for s, o in zip(placed, plan.outputs)]
            rng = capture_rng(self.device, call.op, call.pargs, call.pkwargs)
            probed = None  # what the probe found the op to write (computed once: _as_functional, _after_probe)
            if plan.out_op is not None:  # else uninitialized memory (the empty family): nothing to write
                try:
                    plan.out_op(*call.pargs, **call.pkwargs, **dict(zip(plan.out_names, views)))
                except RuntimeError as e:
                    if guard and grew(e):
                        raise _Grows from e
                    raise
                if call.op.random is None:  # Note [Custom ops that draw]
                    rng = _drew(call, rng)
                if probe is not None:
                    probed = _probed_writes(probe)
                if guard:
                    if not placement.same_layout(plan, views):  # re-strided in place: Note [Direct placement]
                        plan = placement.relaid(func, call.args, call.kwargs, self.device.type, plan, views)
                        if plan is None:
                            raise _Grows
                    if not self._as_functional(call, views, probed, written, rng):  # Note [Direct placement]
                        raise _Grows
                    plan.checked.append(True)
            memory.may_relocate = True
            self._account(plan.cost)
            if probe is not None:
                written = self._after_probe(probe, key, probed)
            rargs, rkwargs = ops.unflatten(call.recorded, call.spec)
            recipe = Recipe.make(func, rargs, rkwargs, rng, plan.cost, uninitialized=call.op.uninitialized,
                                 grad_mode=torch.is_grad_enabled(), direct=plan, leaves=call.recorded)
            evictable = self._hidden_writes(call, recipe, externals, written) and not _keeps_outputs(call)
            results = []
            for j, (s, o, v) in enumerate(zip(placed, plan.outputs, views)):
                if s is None:
                    results.append(v)
                    continue
                s.payload = Data(self.runtime, dead_ref, recipe, j)
                if not s.evictable:
                    self.counters.count_unevictable(memory.table.round_up(s.nbytes), +1)
                    s.payload.recipe = None
                elif not evictable:
                    self.remat.make_unevictable(s)
                results.append(self.lifetime.wrap(s, o.dtype, o.size, o.stride, 0, view=None if guard else v))
            self.counters.count_placed(sum(o.nbytes for o in plan.outputs), 0, 0)
        except BaseException:
            self._unplace(placed)
            raise
        placed = [s for s in placed if s is not None]
        self._placed(call, placed, recipe)
        return tuple(results) if len(plan.outputs) > 1 else results[0]

    def _as_functional(self, call: _Call, views, probed, written, rng) -> bool:
        """Whether the out= variant wrote what the functional op computes, bit for bit and with its layout: the
        first call of a configuration on the device runs the functional op too and compares (Note [Direct
        placement]). Not for an op that draws random numbers or writes what it reads (its second run would see
        other inputs): those keep the out= variant."""
        if call.op.random or rng is not None or call.stats or written or probed:
            return True
        with headroom.one_time():  # (once per configuration: not a temporary of every step, Note [Headroom])
            ref = call.func(*call.pargs, **call.pkwargs)
        refs = list(ref) if isinstance(ref, (tuple, list)) else [ref]
        return len(refs) == len(views) and all(_same_bits(r, v) for r, v in zip(refs, views))

    def _fixed_view(self, byte_offset: int, dtype, size, stride, storage_offset: int) -> torch.Tensor:
        """An arena view like Arena.view, over a storage of its own that is exactly its range and cannot grow:
        an out= kernel that resizes it raises before writing (Note [Direct placement])."""
        return self.arena.fixed_view(byte_offset, placement.span_bytes(size, stride, dtype.itemsize), dtype, size,
                                     stride, storage_offset)

    def _unplace(self, placed) -> None:
        """The outputs an op had placed (None where it placed none) when it failed: unpinned and forgotten."""
        for s in placed:
            if s is not None:
                self.memory.unpin(s)
                self.lifetime.forget(s)

    def _placed(self, call: _Call, placed, recipe: Recipe) -> None:
        memory = self.memory
        round_up = memory.table.round_up
        ws = 0
        for s in placed:
            memory.unpin(s)
            ws += round_up(s.nbytes)
        for s in call.inputs:
            ws += round_up(s.nbytes)
        if ws > self.counters.working_set_peak:
            self.counters.working_set_peak = ws
        # What the recipe reads, not what the op did: a batch norm's recipe leaves out the running statistics it
        # updates (Rule 5), and its outputs taken for their readers made every later update keep them, and what
        # was computed from them, for good.
        if placed and any(isinstance(a, torch.Tensor) for a in call.recorded):
            self._note_external_reads(ops.flatten(recipe.args, recipe.kwargs)[0] if call.trimmed else call.recorded,
                                      [s for s in placed if s.payload.recipe is not None])

    def _run_temporary(self, call: _Call, plan, host: bool = False, direct: bool = False,
                       plain_outputs: dict | None = None, leaf_gradients: bool = False):
        """The op computes its outputs into temporaries; each is copied into its own range at once, except those
        left outside the arena (`host`: all of them, see _host_index; _HOST_OUTPUTS; `plain_outputs`: those that
        become a leaf's gradient, or with `leaf_gradients` those found to, Note [Gradients of leaves]). `direct`:
        a dry run places this call's outputs directly (_run_direct), before the clock moves by its cost: so are
        they here, so that the decisions agree (Note [Shapes that change] in placement.py)."""
        func = call.func
        externals, key, written = self._externals(call, plan)
        probe = self._before_hidden_writes(externals, written)
        rng = capture_rng(self.device, call.op, call.pargs, call.pkwargs)
        if plain_outputs or (leaf_gradients and _feeds_leaves()):
            with headroom.model_state():  # a leaf's gradient is model state: Note [Headroom]
                out = self._call_op(call)
        elif direct:  # a configuration's first call, placed directly from the next on: its temporaries are one-time
            with headroom.one_time():
                out = self._call_op(call)
        else:
            out = self._call_op(call)
        if call.op.random is None:  # Note [Custom ops that draw]
            rng = _drew(call, rng)
        out_leaves = list(out) if isinstance(out, (tuple, list)) else [out]
        if leaf_gradients:
            plain_outputs = self._leaf_gradients(call, [(o.dtype, o.numel()) if isinstance(o, torch.Tensor) else None
                                                        for o in out_leaves])
        plain_outputs = plain_outputs or {}
        placement.check_strided(func, out_leaves)
        if plan is not None and self.device.type == "meta" and not plan.aliases:
            out_leaves = [placement.as_planned(o, spec) for o, spec in zip(out_leaves, plan.outputs)]
        cost = call.cost = plan.cost if plan is not None else op_cost(call.op.flops, call.pargs, call.pkwargs,
                                                                      call.plain, out_leaves, out)
        if not direct:
            self._account(cost)
        self.memory.may_relocate = True  # the op has run: its inputs' views are dead, they may move
        if probe is not None:
            written = self._after_probe(probe, key)
        rargs, rkwargs = ops.unflatten(call.recorded, call.spec)
        recipe = Recipe.make(func, rargs, rkwargs, rng, cost, uninitialized=call.op.uninitialized,
                             grad_mode=torch.is_grad_enabled(), leaves=call.recorded)
        evictable = self._hidden_writes(call, recipe, externals, written) and not _keeps_outputs(call)
        placed, temporary, alive = [], 0, 0
        outside = {t.untyped_storage()._cdata for _, t in externals  # (placement: outputs that alias inputs)
                   if t.layout is torch.strided}
        try:
            for j, o in enumerate(out_leaves):
                if isinstance(o, torch.Tensor) and self.arena.owns(o):  # it aliases an input: a view
                    out_leaves[j] = self._wrap_alias(o, call.inputs, func)
                elif (isinstance(o, torch.Tensor) and o.device == self.device and o.numel() > 0
                      and not host and j not in _HOST_OUTPUTS.get(func, ())
                      and (j not in plain_outputs or o._is_zerotensor())  # (no memory to leave outside)
                      and o.untyped_storage()._cdata not in outside):
                    alive += o.numel() * o.element_size()
                    out_leaves[j] = self._place_output(o, recipe, j, call.inputs, evictable, func, placed)
                    temporary += o.numel() * o.element_size()
        except BaseException:
            self._unplace(placed)
            rewind(rng)
            raise
        if direct:
            self._account(cost)
        self.counters.count_placed(temporary, temporary, alive)
        self._placed(call, placed, recipe)
        return tuple(out_leaves) if isinstance(out, tuple) else (out_leaves if isinstance(out, list) else out_leaves[0])

    def _place_output(self, o, recipe, index, inputs, evictable, func, placed):
        size = tuple(o.size())
        stride = placement.layout(size, o.stride())
        nbytes = placement.span_bytes(size, stride, o.element_size())
        s = self.memory.allocate(nbytes, recipe.cost, evictable=evictable, inputs=inputs, pinned=True, op=ops.info(func).name)
        placed.append(s)
        s.payload = Data(self.runtime, dead_ref, recipe if evictable else None, index)
        if not evictable:
            self.counters.count_unevictable(self.memory.table.round_up(s.nbytes), +1)
        view = self.arena.shared(s.offset, o.dtype, size, stride, 0)
        if self.device.type != "meta":
            view.copy_(o)
        return self.lifetime.wrap(s, o.dtype, size, stride, 0, view=view)

    # ---------------------------------------------------------------------------------------------- views
    def _run_view(self, call: _Call):
        if call.func is _AS_STRIDED and isinstance(call.args[0], Tensor):
            # its storage offset counts from the start of the tensor's storage; the plain view's storage is the
            # whole arena, so the offset moves by where the storage lies in it
            t, plain = call.args[0], call.pargs[0]
            rest = list(call.pargs[1:])
            given = rest[2] if len(rest) > 2 else call.pkwargs.get("storage_offset")
            given = t.storage_offset() if given is None else given
            with plain_dispatch():  # PyTorch's bounds check against the tensor's storage, not the whole arena (on
                # meta only the in-place as_strided_ checks)
                torch.empty(t._cell.storage.nbytes // t.element_size(), dtype=t.dtype, device="meta").as_strided_(
                    rest[0], rest[1], given)
            offset = given + plain.storage_offset() - t.storage_offset()
            out = aten.as_strided.default(plain, rest[0], rest[1], offset)
            return self._wrap_alias(out, call.inputs, call.func)
        out = call.func(*call.pargs, **call.pkwargs)
        self.memory.may_relocate = True
        if call.func is _DETACH:  # detach keeps its input's kind
            x = call.args[0]
            if not isinstance(x, Tensor):
                return out  # a raw view's stays raw: C++ readers (numpy()) detach it, then read the pointer
            if not x._inside():
                return x._alias()  # an escaped tensor's stays a coop_arena.Tensor, as outside a block
        if isinstance(out, torch.Tensor):
            return self._wrap_alias(out, call.inputs, call.func) if self.arena.owns(out) else out
        return type(out)(self._wrap_alias(o, call.inputs, call.func)
                         if isinstance(o, torch.Tensor) and self.arena.owns(o) else o for o in out)

    def _wrap_alias(self, o, inputs, func):
        s = self._input_holding(o, inputs, func, "returned a view of")
        rel = o.storage_offset() * o.element_size() - s.offset
        if rel % o.element_size():  # (the message is formatted only on failure: this runs for every view op)
            _internal_assert(False, f"{func}: view offset {rel} not a multiple of its item size")
        return self.lifetime.wrap(s, o.dtype, o.size(), o.stride(), rel // o.element_size(), o.is_conj(), o.is_neg(),
                                  view=o)

    def _run_inplace_view(self, func, args, kwargs):
        """An op that changes a tensor's shape in place (unsqueeze_, as_strided_): the new metadata is computed
        on a meta view of the same storage (which checks it stays inside), then set on the wrapper itself.
        No bytes move and nothing is recorded: later ops read the wrapper's metadata when they run."""
        t = args[0] if args else None
        if not isinstance(t, Tensor):  # a tensor from before the Budget: its metadata is its owner's business
            if isinstance(t, torch.Tensor) and self.arena.owns(t):
                raise UnsupportedOp(func, "it changes in place the shape of a raw view of the arena")
            if any(isinstance(x, Tensor) and x._inside() or isinstance(x, torch.Tensor) and self.arena.owns(x)
                   for x in ops.flatten(args[1:], kwargs)[0]):
                raise UnsupportedOp(func, "it would give a tensor from before the block the arena bytes of a tensor "
                                          "made inside it, which the next op may evict or move and a later block "
                                          "overwrites; copy the values instead (`with torch.no_grad(): t.copy_(u)`)")
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                # Recipes read an external tensor as the object itself (Rule 1): a replay after this change would
                # see its new shape or storage. What read it is settled first, as before a write (Rule 5).
                self.runtime.settle([t])
            with plain_dispatch():
                return func(*args, **kwargs)
        if t._cell.storage.payload.runtime is not self.runtime:
            raise UnsupportedOp(func, "it changes in place the shape of a tensor from another Budget block")
        s = t._cell.storage
        try:
            with plain_dispatch():
                base = torch.empty(s.nbytes // t.element_size(), dtype=t.dtype, device="meta")
                v = base.as_strided(t.size(), t.stride(), t.storage_offset())
                func(v, *args[1:], **kwargs)
        except RuntimeError as e:
            raise UnsupportedOp(func, f"the new shape does not fit the tensor's storage: {e}") from e
        with torch._C._DisableTorchDispatch():
            torch.Tensor.as_strided_(t, v.size(), v.stride(), v.storage_offset())
        t._forget_view()
        return t

    # ---------------------------------------------------------------------------------------------- writes
    def _written(self, call: _Call, args, kwargs):
        """(alias sets, value) of each argument the schema marks written, from `args`/`kwargs`."""
        return [(sets, ops.arg(args, kwargs, pos, name, kw_only)) for pos, name, kw_only, sets in call.op.written]

    def _run_write(self, call: _Call):
        func = call.func
        targets = []  # arena storages written
        outside = False  # it also writes a tensor outside the arena
        for _, value in self._written(call, call.pargs, call.pkwargs):
            for v in (value if isinstance(value, (list, tuple)) else [value]):
                if v is None:
                    continue
                if self.arena.owns(v):
                    s = self._input_holding(v, call.inputs, func, "writes")
                    if not any(s is t for t in targets):
                        targets.append(s)
                else:  # See Rule 5: a write outside the arena is an effect; what read the old value is frozen
                    self._freeze_readers_of_external(v)
                    outside = True
        if targets:
            self._check_not_resized(call)
        # One arena storage written by an op with no effect outside it replays the write; otherwise (several
        # storages at once, or a write outside too, which a replay would repeat: Rule 5) they are kept.
        replayable = len(targets) == 1 and not outside
        if not self.recomputable_inplace and targets and not outside:
            return self._run_write_cow(call, targets)
        for s in targets:  # See Rule 6
            if replayable:
                self.remat.before_write(s)
            else:
                self.remat.freeze_readers(s)
        fixed = self._fix_out_args(call) if targets and self.device.type != "meta" else False
        guarded = self._guard_self(call) if targets and self.device.type != "meta" else None
        try:
            out, _, recipe = self._execute(call)
        except RuntimeError as e:
            if fixed and grew(e):
                raise UnsupportedOp(call.func, "its kernel resizes its out= argument on the way (beyond its final "
                                               "shape), which a tensor in the arena cannot be; call the op without "
                                               "out=") from e
            if guarded is not None and grew(e):
                raise _resizes_self(call, guarded, "a larger shape") from e
            raise
        if fixed:
            self._follow_resized_outs(call, fixed)
        if guarded is not None:
            self._check_self_kept(call, guarded)
        for s in targets:
            if replayable and s.payload.recipe is not None:
                s.payload.mutations.append(recipe)
                self.lifetime.written[s.sid] = s
                self.memory.add_write(s, recipe.cost, call.inputs)
            else:
                self.remat.make_unevictable(s)
        self._note_external_reads(call.recorded, targets)
        return self._results_of_write(call, out, call.inputs, recipe)

    def _check_not_resized(self, call: _Call) -> None:
        """PyTorch resizes an out= tensor of the wrong shape (with a warning). An arena view grown in place would
        write past its storage into its neighbours': refused before the op runs. The shapes come from the op's plan
        (its run on meta, which resizes the meta out= tensors as the real run would). An in-place op that is not a
        view op is checked on the device instead (Note [In-place ops that resize]: meta refuses what the device
        kernels resize)."""
        tags = call.func.tags
        if torch.Tag.inplace in tags and torch.Tag.inplace_view not in tags:
            return
        plan = placement.plan_for(call.func, call.op, call.args, call.kwargs, self.device.type)
        if plan is None:
            return
        written = {n: v for sets, v in self._written(call, call.pargs, call.pkwargs) for n in sets}
        for r, spec in zip(call.func._schema.returns, plan.outputs):
            alias = r.alias_info
            if spec is None or alias is None or not alias.is_write:
                continue
            v = next((written[n] for n in alias.before_set if n in written), None)
            if isinstance(v, torch.Tensor) and self.arena.owns(v) and tuple(v.size()) != spec.size:
                raise UnsupportedOp(call.func, f"its out= argument of shape {list(v.size())} would be resized to "
                                               f"{list(spec.size)} in place, which a tensor in the arena cannot be; "
                                               f"pass an out= tensor of shape {list(spec.size)}, or call the op "
                                               f"without out=")

    def _guard_self(self, call: _Call):
        """The first call of an in-place op's configuration writes `self` through a view that cannot grow (Note
        [In-place ops that resize]); returns (its size, its stride, the configuration's key), or None."""
        tags = call.func.tags
        if torch.Tag.inplace not in tags or torch.Tag.inplace_view in tags or not call.pargs:
            return None
        v = call.pargs[0]
        if not isinstance(v, torch.Tensor) or not self.arena.owns(v):
            return None
        try:
            key = placement._plan_key(call.func, call.leaves, call.spec, self.device.type)
            if key is not None and key in _KEEPS_SELF:
                return None
        except TypeError:  # an unhashable argument: checked at every call
            key = None
        view = self._fixed_view(v.storage_offset() * v.element_size(), v.dtype, tuple(v.size()), tuple(v.stride()), 0)
        call.pargs = (with_bits(view, v.is_conj(), v.is_neg()), *call.pargs[1:])
        return tuple(v.size()), tuple(v.stride()), key

    def _check_self_kept(self, call: _Call, guarded) -> None:
        """After the guarded first call (_guard_self): `self` kept its shape, or the op is refused."""
        size, stride, key = guarded
        v = call.pargs[0]
        if tuple(v.size()) != size or tuple(v.stride()) != stride:
            raise _resizes_self(call, guarded, f"shape {list(v.size())}")
        if key is not None:
            if len(_KEEPS_SELF) >= placement._PLANS_MAX:
                _KEEPS_SELF.clear()
            _KEEPS_SELF.add(key)

    def _fix_out_args(self, call: _Call) -> list:
        """Give the op its out= arguments in the arena as views that cannot grow (_fixed_view): a kernel that
        resizes one on the way raises before writing. Returns their names."""
        fixed = []
        for _, name, kw_only, _ in call.op.written:
            v = call.pkwargs.get(name) if kw_only else None
            if isinstance(v, torch.Tensor) and self.arena.owns(v):
                view = self._fixed_view(v.storage_offset() * v.element_size(), v.dtype, tuple(v.size()),
                                        tuple(v.stride()), 0)
                call.pkwargs[name] = with_bits(view, v.is_conj(), v.is_neg())
                fixed.append(name)
        return fixed

    def _follow_resized_outs(self, call: _Call, fixed: list) -> None:
        """An out= kernel may shrink its `out` to a shape only the data decides (nonzero.out, masked_select.out: no
        plan knew it). Its view cannot grow (_fix_out_args gave the `fixed` ones), so the new shape lies inside the
        storage: the wrapper takes it, as PyTorch's resize of `out` does; a replay of the write resizes its own
        view alike."""
        for name in fixed:
            t, v = call.kwargs.get(name), call.pkwargs[name]
            if isinstance(t, Tensor) and (t.size() != v.size() or t.stride() != v.stride()):
                with torch._C._DisableTorchDispatch():
                    torch.Tensor.as_strided_(t, v.size(), v.stride(), t.storage_offset())
                t._forget_view()

    def _results_of_write(self, call: _Call, out, inputs, recipe: Recipe):
        """An output aliasing a written argument is that argument's original object (autograd expects `self`). A
        fresh output (`_native_batch_norm_legit` and `_batch_norm_with_update` in training, `rrelu_with_noise`'s) is
        copied into the arena, unevictable: its replay would write the arguments again."""
        written = {}
        for sets, v in self._written(call, call.args, call.kwargs):
            for name in sets:
                written[name] = v
        returns = call.func._schema.returns
        if not returns:
            return out
        outs = out if len(returns) > 1 else (out,)
        res, placed, fresh = [], [], 0
        try:
            for j, (r, o) in enumerate(zip(returns, outs)):
                alias = r.alias_info
                if alias is not None and alias.is_write and any(n in written for n in alias.before_set):
                    res.append(written[next(n for n in alias.before_set if n in written)])
                elif isinstance(o, torch.Tensor) and self.arena.owns(o):
                    res.append(self._wrap_alias(o, inputs, call.func))
                elif isinstance(o, torch.Tensor) and o.device == self.device and o.numel() > 0:
                    placement.check_strided(call.func, [o])
                    fresh += o.numel() * o.element_size()
                    res.append(self._place_output(o, recipe, j, inputs, False, call.func, placed))
                else:
                    res.append(o)
        except BaseException:
            self._unplace(placed)
            raise
        if placed:
            self.counters.count_placed(fresh, fresh, fresh)
            self._placed(call, placed, recipe)
        return tuple(res) if len(returns) > 1 else res[0]

    def _run_write_cow(self, call: _Call, targets):
        """Copy-on-write (the ablation of Rule 6): the written storage is copied to a fresh one, the write goes
        there, and every wrapper of the old storage moves to the new one; the old value keeps its recipe."""
        if len(targets) > 1:
            raise UnsupportedOp(call.func, "copy-on-write of a write to several storages")
        old = targets[0]
        new = self._clone_storage(old, call.func)
        for i, a in enumerate(call.recorded):  # the op now reads and writes the copy
            if isinstance(a, ArgRef) and a.storage is old:
                call.recorded[i] = ArgRef(new, 0, a.dtype, a.size, a.stride, a.offset, a.conj, a.neg)
                view = self.arena.view(new.offset, a.dtype, a.size, a.stride, a.offset)
                call.plain[i] = with_bits(view, a.conj, a.neg)
        call.pargs, call.pkwargs = ops.unflatten(call.plain, call.spec)
        self.memory.pin(new)
        try:
            out, _, recipe = self._execute(call)
        finally:
            self.memory.unpin(new)
        new.payload.mutations.append(recipe)
        self.lifetime.written[new.sid] = new
        self.memory.add_write(new, recipe.cost, [b for b in call.inputs if b is not old])
        self._note_external_reads(call.recorded, [new])
        return self._results_of_write(call, out, [new], recipe)

    def _clone_storage(self, old: Storage, func) -> Storage:
        cost = float(old.nbytes) * 2
        new = self.memory.allocate(old.nbytes, cost, inputs=(old,), pinned=True, op=str(func))
        try:
            self.runtime.copy_bytes(old.offset, new.offset, old.nbytes)
        finally:
            self.memory.unpin(new)
        self._account(cost)
        ref = ArgRef(old, old.payload.version, torch.uint8, (old.nbytes,), (1,), 0)
        recipe = Recipe.make(aten.clone.default, (ref,), {}, None, cost)
        cell = old.payload.cell(old)
        new.payload = Data(self.runtime, weakref.ref(cell), recipe, 0, wrappers=old.payload.wrappers)
        cell.storage = new
        if old.sid in self.lifetime.live:
            self.lifetime.live[new.sid] = new
        self.lifetime.orphan(old)
        return new

    # ------------------------------------------------------------------------------------ external writes
    def _freeze_readers_of_external(self, t: torch.Tensor) -> None:
        """See Rule 5: before (or, for a write the schema hides, right after) a write into `t` outside the arena."""
        self.runtime.settle([t])

    def _note_external_reads(self, recorded: list, storages) -> None:
        if not storages:
            return
        for a in recorded:
            if isinstance(a, torch.Tensor):
                lst = self._ext_readers.setdefault(ops.storage_key(a), [])
                lst.extend(weakref.ref(s) for s in storages)
                self._ext_refs += len(storages)
        if self._ext_refs > 2 * self._ext_kept + 1024:  # amortized: a long block reads its inputs at every step
            self._prune_external_readers()

    def _prune_external_readers(self) -> None:
        """Drop the readers that are gone or freed (settle skips them), and external storages left with none."""
        readers = self._ext_readers
        for key in list(readers):
            readers[key] = [r for r in readers[key] if (s := r()) is not None and s.state is not State.FREED]
            if not readers[key]:
                del readers[key]
        self._ext_refs = self._ext_kept = sum(len(v) for v in readers.values())

    # ------------------------------------------------------------------------------------------- lookups
    def owners(self, leaves, func) -> dict:
        """Leaf index -> the storage of this block it reads (a wrapper, or a raw view from as_plain/pinned)."""
        owner = {}
        for i, x in enumerate(leaves):
            if isinstance(x, Tensor):
                if x._cell.storage.payload.runtime is self.runtime:
                    owner[i] = x._cell.storage
            elif isinstance(x, torch.Tensor):
                if self.arena.owns(x):
                    owner[i] = self._storage_at(x, func)
                elif (x.layout == torch.strided and x.data_ptr() == 0 and x.numel() and x.device.type != "meta"
                      and not x._is_zerotensor()):  # (a zero tensor of autograd's has no memory, by design)
                    raise BudgetUsageError(  # reading its bytes would crash the interpreter
                        f"{func} got a tensor of shape {list(x.shape)} with no memory: a tensor from before the "
                        f"Budget whose data was replaced by a tensor made inside it (`p.data = t`, or module.to(), "
                        f".double(), .half(), a lazy module's first call inside the block), which gives it the "
                        f"wrapper's memory, none. Its bytes are gone; convert or reassign parameters outside the block")
        return owner

    def arena_view(self, x, s: Storage):
        """The plain view of the arena for argument `x`, which lies in storage `s` (arena_arg without the ArgRef)."""
        if isinstance(x, Tensor):
            view = x._kept
            if view is not None and x._kept_at == s.offset:
                return view
        return self.arena_arg(x, s)[0]

    def arena_arg(self, x, s: Storage, fresh: bool = False):
        """(plain view of the arena, ArgRef) for argument `x`, which lies in storage `s`. A wrapper's kept view is
        used unless `fresh` (Note [Views kept] in tensor.py)."""
        if isinstance(x, Tensor):
            meta = x._meta
            if meta is None:
                meta = x._meta = (x.dtype, tuple(x.size()), tuple(x.stride()), x.storage_offset(), x.is_conj(),
                                  x.is_neg())
            dtype, size, stride, offset, conj, neg = meta
            view = x._kept
            if fresh or view is None or x._kept_at != s.offset:
                if fresh or conj or neg:
                    view = with_bits(self.arena.view(s.offset, dtype, size, stride, offset), conj, neg)
                else:
                    view = self.arena.shared(s.offset, dtype, size, stride, offset)
                if not fresh:
                    x._kept, x._kept_at = view, s.offset
            return view, ArgRef(s, s.payload.version, dtype, size, stride, offset, conj, neg)
        offset = x.storage_offset() - s.offset // x.element_size()  # a raw view: its offset counts from the arena's start
        size, stride, conj, neg = tuple(x.size()), tuple(x.stride()), x.is_conj(), x.is_neg()
        return (with_bits(self.arena.view(s.offset, x.dtype, size, stride, offset), conj, neg),
                ArgRef(s, s.payload.version, x.dtype, size, stride, offset, conj, neg))

    def _storage_at(self, t: torch.Tensor, func) -> Storage:
        """The resident storage holding a raw arena view's first byte."""
        byte = t.storage_offset() * t.element_size()
        table = self.memory.table
        i = int(np.searchsorted(table.offsets, byte, side="right")) - 1
        off, size, owner = table.block(i)
        if owner == 0:
            raise UnsupportedOp(func, f"it reads arena bytes at offset {byte} that no live tensor owns (a raw "
                                      f"view used after its tensor was evicted or freed)")
        return self.memory._slots[owner - 1]

    def _input_holding(self, t: torch.Tensor, inputs, func, what: str) -> Storage:
        """The input storage a plain arena tensor `t` (an op's view or written argument) lies in. An empty view
        holds no bytes and may start anywhere past its base's end (split's empty last chunk of a slice): it goes
        with the input that starts last before it."""
        byte = t.storage_offset() * t.element_size()
        for s in inputs:
            if s.offset <= byte < s.offset + max(s.nbytes, 1):
                return s
        if t.numel() == 0:
            below = [s for s in inputs if s.offset <= byte]
            if below:
                return max(below, key=lambda s: s.offset)
        raise UnsupportedOp(func, f"it {what} arena memory that belongs to none of its inputs")
