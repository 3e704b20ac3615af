"""Lifetime: the wrappers a block hands out, the storages they keep alive, and what is left when it ends.

Rules enforced here (see ../shared DESIGN numbering):
1. Tensors that existed before the block are read, never moved, evicted or counted. Everything produced inside
   lives in the arena and counts, with two exceptions: a leaf's gradient leaves the arena as soon as autograd has
   accumulated it (a post-accumulate-grad hook), since it is model-sized state like the parameter itself and is
   final from then on; and host-side integer tensors (a packed sequence's batch sizes; in a dry run on meta,
   integer tensors asked for on the CPU) stay plain CPU tensors (dispatch.py: `_HOST_OUTPUTS`, `_host_index`),
   as they are in a block on CUDA.
2. A storage lives while a wrapper uses it or a recipe that may still be replayed reads it; when neither holds, it
   is freed, and so in turn is every dead storage that only its recipes needed.

Note [Dead storages]
A storage whose last wrapper died is handled at the next op (never inside one), and only when something died:
- no recipe that may still be replayed reads it: it is freed for good, and so is every dead input that only its
  recipes read (a chain's records go as its last reader goes);
- a restore of an evicted storage that a wrapper still uses would read it (directly or through evicted storages
  only), or it anchors a long run of evicted records (`keeps_dead`; measured: ResNet-50 at 20% of its peak fits
  at 1.35x with the anchor rule and does not fit without it): it stays as it is (resident storages stay resident and evictable), so
  the policy, not its death, decides when it goes; dropping it would lengthen that recompute;
- otherwise (only resident readers): it is evicted at once and its record kept, so that a later recompute of a
  reader can rebuild it (DTR's eager eviction). A later block that follows a recording (Note [Step replay] in
  replay.py) takes this outcome from it where the recorded block had it, without the walk.
Rolling forward (coop only, `_roll_forward`): before a resident dead storage is kept for evicted storages that
  wrappers use, those are restored, when together they are no larger than it; it is then handled as above (with
  its readers resident it is usually evicted at once).
  Rationale: what the step still holds at its end (the model's output) is small and read by nothing in the
  backward pass, so a policy evicts it cheaply; then the storages its rebuild reads die one by one, each kept
  only for it and then evicted at the price of its own recompute, until the copy-out at the block's exit replays
  the whole forward pass (0.23-0.29 of the step's compute on ResNet-152 at 10 %, DenseNet-121 at 12.5 % and
  Swin-T at 16.25 % of their peaks; 132 replays on the 100-layer chain at 20 %). Restoring it when its anchor
  dies costs what its restore would cost then anyway, holds no more bytes than keeping the anchor, and leaves
  it priced at its full recompute (its ancestors are evicted records now), so it stays. A restore that does
  not fit changes nothing: the anchor stays. Measured with DTR and DTE too, where it raised smallest ratios
  (DTE: ResNet-50 0.1875 -> 0.2, ResNet-152 0.1125 -> 0.1375, DenseNet-121 0.125 -> 0.1625; DTR: DenseNet-121
  0.125 -> 0.15, U-Net 0.275 -> 0.3375): the baselines stay the published algorithms.

Note [Block exit]
Rationale: after backward, most wrappers are held only by the finished autograd graph or by nothing at all;
  restoring every evicted storage that still has a wrapper, to copy it out, replays work nobody will read.
Approach: storages whose wrappers are gone are dropped first (a cycle collection runs first when an evicted storage
  still has wrappers, since reference cycles are what keeps finished graphs alive); what the user still holds is
  copied out of the arena, resident storages first, and each live wrapper takes its copy as its real storage (Note
  [Escaped tensors] in tensor.py); evicted ones are replayed (counted in `exit_rematerializations`) only when the
  block ends normally; one that cannot be restored within the budget then makes the exit raise its error
  (OutOfBudget), once everything else is copied out, rather than hand back a tensor that was dropped (one lost
  earlier in the block, when a write outside the arena overwrote what it was computed from, stays lost). When an
  exception leaves the block, nothing is replayed: evicted storages are dropped and
  raise TensorLost on use, so the block ends at once. So do the outputs an op had placed before it failed (freed
  with the error, but their wrappers may live on in its traceback). Nor is anything freed then: the arena is reset
  right after, and an interrupt (Ctrl-C) may have stopped a block-table update halfway, which a free would trip over.

Note [Cyclic collection]
Rationale: a block keeps a few Python objects per op alive for the whole step (records, recipes, wrappers, weak
  references). Surviving two young collections, they count towards Python's full collection, which then ran
  every few steps and walked every object of the process (torch and a model library: about 330,000); and the
  records of a step died only in those collections, since a storage written in place is in a reference cycle
  (its write's recipe reads it), as were the runtime's parts, which reach every record. Measured on the
  host-overhead workloads on the CPU (ample budget, mean time per step over ten steps): MLP 189 -> 134 ms, the
  2,000-op add chain 168 -> 104 ms, the GPT-2 layout 187 -> 120 ms, the ResNet-50 layout 86 -> 64 ms. The
  minimum over rounds, which skips the steps that collect, moved little.
Approach:
  - From the start of the first block that runs in the process (any thread) to the end of the last
    (`pause_collection` / `resume_collection`, counted), Python collects its youngest generation as usual but
    never the older two: objects that survive a young collection wait in the middle generation and are not
    promoted, so nothing a block allocates counts towards a full collection. The thresholds are then put back.
    Young reference cycles die as before. (Turning the collector off instead held, in the first step of a
    process, the frames of a forward pass that a cycle made by a lazy import of PyTorch kept alive, and with
    them a BatchNorm output: a higher peak in that step only.)
  - The exit (Note [Block exit]) collects the two younger generations, which hold what the block made, not the
    whole process; only if an evicted storage still has wrappers after that does a full collection run, as
    before.
  - No record is left in a cycle: a storage freed inside the block, and every storage written in place at the
    end, drop their recipes (never replayed again), and the runtime drops the references between its parts
    (`Runtime.close`). A step's records die by reference counting; the host-overhead workloads leave no
    cyclic garbage.
  Decisions changed only where a dead record used to linger: the anchor rule of Note [Dead storages] counted
  records that nothing could replay any more, as long as Python had not collected them. On the suite that is
  Swin-T alone (coop's smallest ratio 0.15 -> 0.1625, DTR's 0.2 -> 0.225; a Swin-T point now gives the same
  numbers in a sweep and in a run of its own, which it did not); the traces of the host-overhead workloads and
  the other eight models' runs are identical.
Limitations: reference cycles that outlive a young collection inside a block (user objects included) wait for
  the block's end. Where blocks of several threads overlap without a gap, no full collection runs on its own
  until they stop. A program that changes the collector's thresholds while a block runs gets them back as they
  were when the first block began.
"""

from __future__ import annotations

import gc
import threading
import weakref

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass, transform_subclass

from . import headroom
from .errors import CoopArenaError, OutOfBudget, _fmt, _internal_assert
from .recipe import dead_ref, plain_dispatch
from .storage import State, Storage, prune
from .tensor import Tensor, adopt, with_bits


class _WrapperRef(weakref.ref):
    """A weak reference to a wrapper that knows its Cell, so its death can be counted on the storage."""

    __slots__ = ("cell",)


class Lifetime:
    def __init__(self, memory, arena, counters, remat):
        self.memory = memory
        self.remat = remat                          # restores for rolling forward and for the copy-out at exit
        self._rolling = False
        self.arena = arena
        self.device = arena.device
        self.counters = counters
        self.live: dict[int, Storage] = {}          # storages with live wrappers
        self.dead: list[Storage] = []               # storages whose last wrapper died, handled at the next op
        self.written: dict[int, Storage] = {}       # storages written in place and not freed (their recipes read
                                                    # them: a cycle, broken at the end, Note [Cyclic collection])
        self._refs: dict[int, _WrapperRef] = {}     # id(ref) -> weak reference of every live wrapper
        self._externals: dict[int, weakref.ref] = {}  # leaves from before the block that ops read (for .grad)
        self._hooks: dict[int, object] = {}           # their post-accumulate-grad hooks, by the same key

    # ============================================================================================ wrappers
    def wrap(self, s: Storage, dtype, size, stride, offset: int, conj: bool = False, neg: bool = False,
             view: torch.Tensor | None = None) -> Tensor:
        """A wrapper over `s`; `view`, when given, is a plain arena view with the same metadata (Note [Views kept]
        in tensor.py)."""
        cell = s.payload.cell(s)
        t = Tensor.__new__(Tensor, cell, size, stride, offset, dtype, self.device)  # (its __init__ does nothing)
        size, stride = tuple(size), tuple(stride)
        if conj or neg:
            with_bits(t, conj, neg)
        t._meta = (dtype, size, stride, offset, conj, neg)
        if view is not None:
            t._kept, t._kept_at = view, s.offset
        s.payload.wrappers += 1
        if s.payload.wrappers == 1:
            self.counters.count_live(s.nbytes)
        self.live[s.sid] = s
        ref = _WrapperRef(t, self._died)
        ref.cell = cell
        self._refs[id(ref)] = ref
        return t

    def _died(self, ref: _WrapperRef) -> None:
        self._refs.pop(id(ref), None)
        s = ref.cell.storage
        d = s.payload
        d.wrappers -= 1
        if d.wrappers == 0 and d.runtime is not None:
            self.counters.count_live(-s.nbytes)
            self.dead.append(s)

    def rebind(self, t: Tensor, cell) -> None:
        """`t.data = new` inside the block (tensor.py): wrapper `t` uses `cell`'s storage from now on, and no
        longer its old one, which may die with it (Note [Dead storages])."""
        ref = next((r for r in weakref.getweakrefs(t) if isinstance(r, _WrapperRef) and id(r) in self._refs), None)
        _internal_assert(ref is not None, "a wrapper of this block that Lifetime does not know")
        old, s = ref.cell.storage, cell.storage
        if old is s:
            t._cell = cell
            return
        s.payload.wrappers += 1
        if s.payload.wrappers == 1:
            self.counters.count_live(s.nbytes)
        self.live[s.sid] = s
        ref.cell = cell
        t._cell = cell
        old.payload.wrappers -= 1
        if old.payload.wrappers == 0:
            self.counters.count_live(-old.nbytes)
            self.dead.append(old)

    def watch_leaf(self, x: torch.Tensor) -> None:
        """A leaf from before the block that an op read: its gradient leaves the arena when accumulated."""
        key = id(x)
        if x.requires_grad and x.is_leaf and key not in self._externals:
            # forgotten when `x` dies: backward reads a new view of a parameter per op, so a long block would
            # otherwise keep a record and a hook handle per step
            self._externals[key] = weakref.ref(x, lambda _, key=key: self._unwatch(key))
            self._hooks[key] = x.register_post_accumulate_grad_hook(_grad_leaves_arena)

    def _unwatch(self, key: int) -> None:
        self._externals.pop(key, None)
        self._hooks.pop(key, None)

    # =============================================================================================== dead
    def drain(self) -> None:
        """See Note [Dead storages]."""
        dead, self.dead = self.dead, []
        memory = self.memory
        pressure = memory.stats.evictions > 0  # (before the block's first eviction, keeps_dead keeps nothing)
        if pressure:
            memory.note_deaths(dead)
        for s in dead:
            if s.payload.wrappers > 0 or s.state is State.FREED:
                continue
            if s.pins:
                self.dead.append(s)
                continue
            self.live.pop(s.sid, None)
            if not _has_readers(s):
                self.forget(s)
            elif s.payload.recipe is None:
                continue  # unevictable: it stays until its readers go (they will find it resident)
            elif s.state is State.RESIDENT:
                if pressure:
                    self._decide(s)
                else:
                    memory.evict(s)

    def _decide(self, s: Storage) -> None:
        """Dead resident `s`, read by recipes that may be replayed, under pressure: kept or dropped (evicted at
        once), with the outcome in the stream of Note [Step replay], which a following block takes it from."""
        memory = self.memory
        recorded = memory.recorded_outcome(s)
        if recorded == "drop":
            memory.drop(s)
        elif recorded == "keep":
            memory.keep(s)
        elif not keeps_dead(s, memory):
            memory.drop(s)
        else:
            self._roll_forward(s)  # what it is kept for may come back now; then it need not stay
            if s.state is not State.RESIDENT:
                return
            if keeps_dead(s, memory):
                memory.keep(s)
            else:
                memory.drop(s)

    def _roll_forward(self, s: Storage) -> None:
        """See Note [Dead storages]: the evicted storages a wrapper uses whose restore would read dead `s` (which
        `keeps_dead` keeps for them) are restored now, when together they are no larger than `s`."""
        if self._rolling or self.memory.policy != "coop":
            return
        need = _held_readers(s)
        if not need or sum(x.nbytes for x in need) > s.nbytes:
            return
        self._rolling = True
        try:
            for x in need:
                if x.state is State.EVICTED:
                    self.remat.restore(x)
        except OutOfBudget:
            pass  # they stay evicted, and `s` stays for them
        finally:
            self._rolling = False

    def forget(self, s: Storage) -> None:
        """Free `s` for good, then every dead storage that only its recipes still needed (Rule 2)."""
        work = [s]
        while work:
            s = work.pop()
            if s.state is State.FREED:
                continue
            inputs = s.payload.reads(s) if s.payload is not None else []
            if s.state is State.RESIDENT and not s.evictable:
                self.counters.count_unevictable(self.memory.table.round_up(s.nbytes), -1)
            self.memory.free(s)
            if s.payload is not None:  # never replayed now; a write's recipe reads `s` itself, a cycle to break
                s.payload.drop_recipe()
                self.written.pop(s.sid, None)
            for p in inputs:
                if p.payload.wrappers == 0 and p.pins == 0 and p.state is not State.FREED and not _has_readers(p):
                    self.live.pop(p.sid, None)
                    work.append(p)

    def orphan(self, s: Storage) -> None:
        """A storage whose wrappers moved to another one (copy-on-write): it is dead from now on."""
        s.payload.cell_ref = dead_ref
        s.payload.wrappers = 0
        self.live.pop(s.sid, None)
        self.dead.append(s)

    # =============================================================================================== exit
    def finish(self, failed: bool) -> None:
        """End of the block (Note [Block exit]): every storage a live wrapper uses gets a plain copy outside the
        arena; then nothing references the arena."""
        with plain_dispatch():
            self._finish(failed)

    def _finish(self, failed: bool) -> None:
        self.memory.op = "block exit"  # the cause the trace records for the events from here on
        self._rolling = True  # no rolling forward: the exit copies out what is still held itself, and counts it
        if failed:  # the arena is reset next: free nothing, since an interrupt may have stopped a table update halfway
            for s in self.dead:
                if s.payload.wrappers == 0 and s.state is not State.FREED:
                    self.live.pop(s.sid, None)
            self.dead = []
        else:
            # Wrappers kept alive only by reference cycles (finished graphs) die here: first those among the
            # objects the block made, always (Note [Cyclic collection]), then the whole process's if that leaves an
            # evicted storage in use.
            self.drain()
            gc.collect(1)
            self.drain()
            if any(s.state is State.EVICTED for s in self.live.values()):
                gc.collect()
                self.drain()
        live = sorted(self.live.values(), key=lambda s: (s.state is not State.RESIDENT, s.sid))
        unrestored = []  # (storage, error) of what a normal exit could not restore: raised below
        for s in live:
            d = s.payload
            lost_before = d.lost is not None  # (in the block, before an external write: Rule 5)
            try:
                if s.state is State.FREED:  # an output of an op that failed, still held by the error's traceback
                    raise _Dropped("was freed when the op that made it failed")
                if s.state is State.EVICTED:
                    if failed:
                        raise _Dropped(f"of {_fmt(s.nbytes)} had been evicted to make room, and the block ended with "
                                       f"an error before it could be copied out (a failed block replays nothing), so "
                                       f"its value is gone. Run the step again to recompute it, or read what you need "
                                       f"from it inside the block (t.item(), t.tolist()) before the error")
                    before, cost = self.counters.rematerializations, self.counters.recompute_cost
                    self.remat.restore(s)
                    self.counters.exit_rematerializations += self.counters.rematerializations - before
                    self.counters.exit_recompute_cost += self.counters.recompute_cost - cost
                d.detached = self.arena.bytes(s.offset, s.nbytes).clone()
                self.counters.escaped_bytes += s.nbytes
            except (CoopArenaError, _Dropped) as e:
                if not failed and isinstance(e, CoopArenaError) and not lost_before:
                    unrestored.append((s, e))
                self.counters.dropped += 1
                d.lost = f"storage {s.sid} " + (str(e) if isinstance(e, _Dropped) else
                                                f"was evicted when its Budget ended and it could not be restored: {e}")
        copies = {s.sid: s.payload.detached.untyped_storage() for s in live if s.payload.detached is not None}
        adopt([(t, copies[ref.cell.storage.sid]) for ref in list(self._refs.values())  # Note [Escaped tensors]
               if ref.cell.storage.sid in copies and (t := ref()) is not None])
        for s in live:
            s.payload.runtime = None
        for s in live + list(self.written.values()):
            s.payload.drop_recipe()
            s.inputs, s.consumers = [], []  # nothing is replayed after the block: an escaped tensor held for good
            # (a logged loss) must not keep every record it came from, and the step's inputs, alive with it
        self.written = {}
        for h in list(self._hooks.values()):
            h.remove()
        for ref in list(self._externals.values()):
            t = ref()
            if t is not None and isinstance(t.grad, Tensor) and not t.grad.requires_grad:
                g = t.grad
                with torch.no_grad():
                    t.grad = g.as_plain()
        self.live.clear()
        self._refs.clear()
        self._externals.clear()
        if unrestored:  # a normal exit never hands back a tensor it dropped: Note [Block exit]
            s, e = unrestored[0]
            sizes = ", ".join(_fmt(t.nbytes) for t, _ in unrestored)
            e.add_note(f"The block ended normally, but {len(unrestored)} evicted tensor(s) you still hold ({sizes}) "
                       f"could not be restored to be copied out of the arena (the error above says why); they raise "
                       f"TensorLost if used, and everything else you hold was copied out. "
                       + ("Raise the budget, or let " if isinstance(e, OutOfBudget) else "Let ")
                       + "go of what you do not need before the block ends (del, or read it inside the block).")
            raise e


_collector = threading.Lock()
_paused: list = [0, None]  # [blocks running, the collector's thresholds when the first began]
_NEVER = 1 << 30           # a threshold no count reaches


def pause_collection() -> None:
    """A block begins: only young collections from now on (Note [Cyclic collection])."""
    with _collector:
        if _paused[0] == 0:
            _paused[1] = gc.get_threshold()
            gc.set_threshold(_paused[1][0], _NEVER, _NEVER)
        _paused[0] += 1


def resume_collection() -> None:
    """A block ended: the last one running puts the collector's thresholds back."""
    with _collector:
        _paused[0] -= 1
        if _paused[0] == 0:
            gc.set_threshold(*_paused[1])


def forget_collection_pause() -> None:
    """In a process forked while blocks ran (Note [Fork inside a block] in budget.py): none runs in it, so its
    collector gets its thresholds back now. (The lock is made anew: another thread may have held it at the fork.)"""
    global _collector
    _collector = threading.Lock()
    if _paused[0]:
        gc.set_threshold(*_paused[1])
    _paused[0], _paused[1] = 0, None


ANCHOR = 256  # a dead storage that this many evicted storages read (transitively) is kept resident too


def keeps_dead(s: Storage, memory) -> bool:
    """See Note [Dead storages]: True when a restore of some evicted storage that a wrapper still uses would read
    `s` (directly, or through evicted storages only), or when `s` anchors a long run of evicted records (ANCHOR
    of them reach it through evicted readers): evicting it would lengthen those recomputes. Never before the
    block's first eviction under pressure, so that an ample budget holds what plain PyTorch holds.
    (The walk is `_evicted_readers` written out: it runs for most storages that die under pressure, and most
    walks go to the end, so it was a tenth of the host time per op at 60 % of the peak.)"""
    if memory.stats.evictions == 0:
        return False
    evicted = State.EVICTED
    seen = {s.sid}
    work = [s]
    n = 0
    while work:
        for ref in work.pop().consumers:
            r = ref()
            if r is None or r.state is not evicted or r.sid in seen or r.payload.recipe is None:
                continue
            n += 1
            if r.payload.wrappers or n >= ANCHOR:
                return True
            seen.add(r.sid)
            work.append(r)
    return False


def _held_readers(s: Storage) -> list:
    """The evicted storages that a wrapper uses and whose restore would read `s` (directly, or through evicted
    storages only)."""
    return [r for r in _evicted_readers(s) if r.payload.wrappers]


def _evicted_readers(s: Storage):
    """Each evicted storage whose restore would read `s`, directly or through evicted storages only, once."""
    seen = {s.sid}
    work = [s]
    while work:
        for r in _readers(work.pop()):
            if r.state is State.EVICTED and r.sid not in seen:
                seen.add(r.sid)
                work.append(r)
                yield r


def _has_readers(s: Storage) -> bool:
    """`bool(_readers(s))`, stopping at the first reader, and dropping the gone or freed ones it passed
    (storage.prune): asked at each death of one of `s`'s readers, a full walk was O(readers) per op."""
    freed = State.FREED
    for i, ref in enumerate(s.consumers):
        r = ref()
        if r is not None and r is not s and r.state is not freed and _replayable(r):
            if i:
                prune(s, i)
            return True
    prune(s)
    return False


def _replayable(r: Storage) -> bool:
    """Whether `r` has a recipe, or is an output of the op now running (placed, not recorded yet: no payload)."""
    return r.payload is None or r.payload.recipe is not None


def _readers(s: Storage) -> list:
    """The storages whose recipes read `s` and may still be replayed (_replayable)."""
    out = []
    for ref in s.consumers:
        r = ref()
        if r is not None and r is not s and r.state is not State.FREED and _replayable(r):
            out.append(r)
    return out


class _Dropped(Exception):
    """Internal: an evicted storage is not replayed at exit after an error."""


def _grad_leaves_arena(leaf: torch.Tensor) -> None:
    """A leaf's gradient is final once autograd has accumulated it: it moves out of the arena at once, like the
    parameter it belongs to (model-sized state, not counted), and is never evicted or recomputed. Not one made by
    `backward(create_graph=True)`: a later backward differentiates it, so it stays an activation of the step (a
    plain copy would cut it off its graph)."""
    g = leaf.grad
    if g is not None and g.requires_grad:
        return
    if _in_arena(g):
        plain = g.as_plain()  # (restored first if it was evicted)
        with torch._C._DisableTorchDispatch(), torch._C._AutoDispatchBelowADInplaceOrView(), \
                headroom.model_state():  # Note [Plain ops]; model state, not the step's (Note [Headroom])
            leaf.grad = plain.clone()
    elif is_traceable_wrapper_subclass(g) and any(_in_arena(getattr(g, n)) for n in g.__tensor_flatten__()[0]):
        with plain_dispatch(), headroom.model_state():  # a DTensor parameter's gradient (FSDP2): its local tensor
            leaf.grad = transform_subclass(g, lambda _, t: t.as_plain().clone() if _in_arena(t) else t)


def _in_arena(t) -> bool:
    return isinstance(t, Tensor) and t._inside()
