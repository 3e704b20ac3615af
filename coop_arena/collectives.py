"""Collectives: ops whose effects reach other processes (c10d, functional collectives) inside a block.

Rule enforced here (see ../shared DESIGN numbering):
5. An op with effects outside its outputs is never recomputed; its outputs are unevictable. For a collective
   (`ops.info(func).effectful`: the c10d, _c10d_functional, c10d_functional and _dtensor namespaces):
   - every arena storage it touches counts as written, since c10d's schemas mark none of their arguments
     written (`c10d::allreduce_(Tensor[] tensors, ...)`): the storages that read its old value are frozen first
     (Rule 6) and it is unevictable afterwards (its bytes came from other ranks);
   - a fresh output (a functional collective's result) is placed in the arena unevictable, with no recipe;
   - tensors outside the arena that it touches may be written too: the storages that read them are frozen;
   - so no recipe ever holds a collective, and a replay cannot issue one (remat.py checks this);
   - a collective that touches arena memory has completed when the op returns (its Work is waited on, its
     fresh outputs go through wait_tensor), so no transfer writes into a range the arena may hand out again,
     and a later wait on the result is a no-op. One on plain tensors only keeps its asynchrony (DDP's bucket
     all-reduce, overlapped with the rest of backward).
   Arguments nest two levels deep here (`Tensor[][]` in all_gather), so they are walked as a pytree.
A collective that reads nothing from the arena while another engine's bookkeeping runs (bookkeeping.py) runs
outside the arena altogether.

Limitations: conservative by design: an argument a collective only reads (all_gather's input, send's tensor)
becomes unevictable too; a collective that touches the arena loses its overlap with later ops; the public
functional API's AsyncCollectiveTensor result is copied into a storage of its own. An OutOfBudget while
placing a functional collective's result comes after the collective ran: the Budget stays consistent, but the
other ranks took part, so the step cannot be retried on this rank alone (tear the process group down).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .bookkeeping import run_outside
from .cost import op_cost
from .recipe import Recipe
from .tensor import Tensor


def run(dispatch, func, args, kwargs):
    d = dispatch
    flat, spec = tree_flatten((args, kwargs))
    owner = d.owners(flat, func)  # leaf index -> the arena storage it lies in
    if not owner and d.bookkeeping is not None and d.bookkeeping.active():
        return run_outside(d, func, args, kwargs, [x for x in flat if isinstance(x, torch.Tensor)])
    mine = {s.sid: s for s in owner.values()}
    inputs = [mine[sid] for sid in sorted(mine)]
    pins = d.remat.acquire(inputs, str(func))
    placed = []
    try:
        for s in inputs:
            d.remat.freeze_readers(s)
        plain = list(flat)
        for i, x in enumerate(flat):
            if i in owner:
                plain[i] = d.arena_arg(x, owner[i])[0]
            elif isinstance(x, torch.Tensor):
                plain[i] = x.as_plain() if isinstance(x, Tensor) else x
                d._freeze_readers_of_external(plain[i])
        d.memory.may_relocate = False  # the collective holds raw views of its arena arguments
        pargs, pkwargs = tree_unflatten(plain, spec)
        out = func(*pargs, **pkwargs)
        outs, ospec = tree_flatten(out)
        if inputs:
            for o in outs:
                if isinstance(o, torch.ScriptObject) and hasattr(o, "wait"):  # c10d's Work
                    o.wait()
        cost = op_cost(None, (), {}, plain, outs, out)
        d._account(cost)
        for s in inputs:
            d.remat.make_unevictable(s)
        given = {id(p): flat[i] for i, p in enumerate(plain) if isinstance(p, torch.Tensor)}
        res, fresh = list(outs), []
        for j, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                continue
            if id(o) in given:  # an argument handed back (c10d's in-place ops return their tensors)
                res[j] = given[id(o)]
            elif type(o) is torch.Tensor and d.arena.owns(o):
                res[j] = d._wrap_alias(o, inputs, func)
            elif o.device == d.device and o.numel() > 0:
                fresh.append(j)
        d.memory.may_relocate = True  # the raw views are dead: placing the results may move what they read
        recipe = Recipe.make(func, (), {}, None, cost)  # for its cost only: the outputs keep no recipe
        for j in fresh:
            if type(res[j]) is torch.Tensor:  # (a subclass such as AsyncCollectiveTensor waits when copied)
                torch.ops._c10d_functional.wait_tensor(res[j])
            res[j] = d._place_output(res[j], recipe, j, inputs, False, func, placed)
    except BaseException:
        for s in placed:
            d.memory.unpin(s)
            d.lifetime.forget(s)
        raise
    finally:
        d.memory.may_relocate = True
        d.remat.release(pins)
    for s in placed:
        d.memory.unpin(s)
    return tree_unflatten(res, ospec)
