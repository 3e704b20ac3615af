"""DDP and FSDP2 under a Budget: 2 CPU ranks (gloo), one Budget per rank, DDP / fully_shard and the loop unchanged.

Both ranks are this file run as a script (`python tests/test_distributed.py RANK STORE OUT`), started once for
the module by the `ranks` fixture. They run every scenario below, plain DDP (or FSDP2) first, then under Budgets at
fractions of each rank's own plain peak (measured by the same engine with a large budget), and write what they
saw to OUT: parameters and buffers, per block the Budget's stats, the collectives that ran (counted by a
dispatch mode below the Budget's, so a collective issued by a recomputation would be counted too), the
wrappers and arena views still alive after the block, and whether every `.grad` is a plain tensor outside
the arena. The tests compare. The last scenario has rank 1 run out of budget and shows the teardown: the
failing rank destroys its process group, and the other rank's pending collective fails at once instead of
waiting out the group's timeout. Every Budget here keeps its arena at the whole budget (`headroom=0`): these
scenarios check the distributed protocol at fractions of the arena's peak; the footprint with a learned headroom
is tests/test_footprint.py's.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import coop_arena
from coop_arena.examples import CNN, GPT, batch, loss_fn
from training import bitwise_equal

WORLD = 2
TIMEOUT_S = 300  # both ranks, every scenario: about a minute on 2 shared cores
POLICIES = ["coop", "dtr"]
FRACTIONS = [0.5, 0.3]


# ============================================================================================== the models
class Branchy(nn.Module):
    """A trunk, a head only rank 0 uses (locally unused on rank 1, globally used: DDP's finalize gives rank 1
    its averaged gradient through a clone), and a layer no rank uses (its gradient stays None)."""

    def __init__(self, width=64, depth=16):
        super().__init__()
        self.trunk = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])
        self.head = nn.Linear(width, 10)
        self.extra = nn.Linear(10, 10)
        self.unused = nn.Linear(10, 10)

    def forward(self, x, use_extra: bool):
        out = self.head(self.trunk(x))
        return out + self.extra(out) if use_extra else out


class Synced(nn.Module):
    """Shares activation statistics across ranks in its forward, as SyncBatchNorm does: a c10d all-gather into
    tensors made in the arena, an in-place c10d all-reduce of an arena tensor, and a functional all-reduce
    (waited on at first use). Later ops read all three results, in forward and backward, so evicting those
    readers makes recomputations that must not issue the collectives again."""

    def __init__(self, width=64, depth=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for layer in self.layers:
            h = layer(x).relu()
            parts = [torch.empty(1, h.shape[1]) for _ in range(WORLD)]
            dist.all_gather(parts, h.detach().mean(0, keepdim=True))
            sq = h.detach().pow(2).mean()
            dist.all_reduce(sq)
            peak = funcol.all_reduce(h.detach().abs().amax(), "max", dist.group.WORLD)
            x = (h - torch.cat(parts).mean(0)) / (sq / WORLD + peak).sqrt()
        return self.head(x)


def _tokens(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)


def _vectors(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)


# name -> (build, batch(rank, step), loss(model, x, y, rank), DDP keyword arguments)
CONFIGS = {
    # several buckets, rebuilt at step 2 in gradient-ready order
    "gpt": (lambda: GPT(layers=6), _tokens, lambda m, x, y, r: loss_fn("gpt", m(x), y), dict(bucket_cap_mb=0.05)),
    # gradients are views of DDP's buckets
    "cnn": (CNN, lambda r, i: batch("cnn", 1000 * r + i), lambda m, x, y, r: loss_fn("cnn", m(x), y),
            dict(gradient_as_bucket_view=True)),
    "branchy": (Branchy, _vectors, lambda m, x, y, r: F.cross_entropy(m(x, r == 0), y),
                dict(find_unused_parameters=True)),
    "synced": (Synced, _vectors, lambda m, x, y, r: F.cross_entropy(m(x), y), {}),
}


# ============================================================================================= rank side
class CollectiveCalls(TorchDispatchMode):
    """Counts every collective that runs. Entered before a Budget, it sits below the Budget's mode, so it sees
    what the Budget executes, replays included. Waits are not counted: a Budget waits for a functional
    collective before it copies the result into the arena, so the program's own wait has nothing left to do."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional") and func is not torch.ops._c10d_functional.wait_tensor.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _alive(budget) -> dict:
    """What is left after a block: live wrappers, and plain tensors over the arena's bytes (its own aside)."""
    gc.collect()
    arena = budget.arena
    # the arena's own: its buffer, its typed views and the engine's shared views (Arena.shared, never handed out)
    own = {id(arena.buffer), id(arena._usable), *map(id, arena._typed.values()), *map(id, arena._shared.values())}
    wrappers = views = 0
    for o in gc.get_objects():
        if type(o) is coop_arena.Tensor:
            wrappers += 1
        elif type(o) is torch.Tensor and id(o) not in own and o.layout == torch.strided:
            views += arena.owns(o)
    return dict(wrappers=wrappers, arena_views=views)


def _grads(budget, params) -> dict:
    """Gradients that are not plain tensors or lie in the arena, and how many storages the gradients share
    (fewer than the gradients when they are views of DDP's buckets)."""
    grads = [p.grad for p in params if p.grad is not None]
    arena = budget.arena if budget is not None else None
    bad = [type(g).__name__ for g in grads if type(g) is not torch.Tensor or (arena is not None and arena.owns(g))]
    return dict(bad_grads=bad, grads=len(grads), grad_storages=len({g.untyped_storage().data_ptr() for g in grads}))


def _record(budget, calls: int, grads: dict) -> dict:
    """One block's record: the collectives it ran, its gradients (from _grads), the Budget's stats."""
    return dict(calls=calls, **grads, **(budget.stats.as_dict() if budget is not None else {}))


class _Stress:
    """A Budget that evicts every storage it may after every op (so nearly every read is a recompute)."""

    def __init__(self, budget):
        from test_exactness import EvictAll
        self.budget, self.ctx = budget, EvictAll(budget)

    def __enter__(self):
        return self.ctx.__enter__()

    def __exit__(self, *exc):
        return self.ctx.__exit__(*exc)


def train(name, rank, budget=None, steps=3, accumulate=1, stress=False, search=True) -> dict:
    """`steps` optimizer steps of DDP, each over `accumulate` blocks (all but the last under `no_sync()`).
    Returns the parameters, the buffers and one record per block; what outlives the block is searched for
    after the last one (a search of every object takes about half a second)."""
    build, data, loss, ddp_kwargs = CONFIGS[name]
    torch.manual_seed(0)
    model = build()
    ddp = DDP(model, **ddp_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    calls = CollectiveCalls()
    log = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x, y = data(rank, step * accumulate + micro)
            torch.manual_seed(100 + 10 * step + micro)  # dropout draws the same bits in every run
            sync = micro == accumulate - 1
            block = budget if budget is None or not stress else _Stress(budget)
            before = calls.n
            with contextlib.nullcontext() if sync else ddp.no_sync(), calls, block or contextlib.nullcontext():
                out = loss(ddp, x, y, rank)
                out.backward()
            del out
            log.append(_record(budget, calls.n - before, _grads(budget, model.parameters())))
        opt.step()
    if budget is not None and search:
        log[-1].update(_alive(budget))
    return dict(params=[p.detach().clone() for p in model.parameters()],
                buffers=[b.clone() for b in model.buffers()], log=log)


def peak(name, rank) -> int:
    budget = coop_arena.Budget(1 << 28, device="cpu", headroom=0)
    train(name, rank, budget, steps=1, search=False)
    return budget.stats.peak_bytes


def scenarios(rank):
    """(key, thunk) in the order both ranks run them."""
    for name in ["gpt", "cnn"]:
        yield ("plain", name), lambda name=name: train(name, rank)
        yield ("peak", name), lambda name=name: peak(name, rank)
        for policy in POLICIES:
            for f in FRACTIONS:
                yield ("budget", name, policy, f), lambda name=name, policy=policy, f=f: train(
                    name, rank, coop_arena.Budget(int(f * results[("peak", name)]), device="cpu", policy=policy, headroom=0))
    yield ("plain", "branchy"), lambda: train("branchy", rank)
    yield ("peak", "branchy"), lambda: peak("branchy", rank)
    yield ("budget", "branchy", "coop", 0.3), lambda: train(
        "branchy", rank, coop_arena.Budget(int(0.3 * results[("peak", "branchy")]), device="cpu", headroom=0))
    yield ("plain", "no_sync"), lambda: train("cnn", rank, steps=1, accumulate=3)
    yield ("budget", "no_sync", "coop", 0.3), lambda: train(
        "cnn", rank, coop_arena.Budget(int(0.3 * results[("peak", "cnn")]), device="cpu", headroom=0), steps=1, accumulate=3)
    yield ("plain", "synced"), lambda: train("synced", rank)
    yield ("peak", "synced"), lambda: peak("synced", rank)
    yield ("budget", "synced", "coop", 0.3), lambda: train(
        "synced", rank, coop_arena.Budget(int(0.3 * results[("peak", "synced")]), device="cpu", headroom=0))
    yield ("stress", "synced"), lambda: train("synced", rank, coop_arena.Budget(1 << 24, device="cpu", headroom=0),
                                              steps=1, stress=True)
    yield ("plain", "fsdp2"), lambda: train_fsdp2(rank)
    yield ("peak", "fsdp2"), lambda: peak_fsdp2(rank)
    for policy in POLICIES:
        yield ("budget", "fsdp2", policy, FSDP2_FRACTION), lambda policy=policy: train_fsdp2(
            rank, coop_arena.Budget(int(FSDP2_FRACTION * results[("peak", "fsdp2")]), device="cpu", policy=policy, headroom=0))
    yield ("plain", "fsdp2-keep"), lambda: train_fsdp2(rank, reshard=False)
    yield ("peak", "fsdp2-keep"), lambda: peak_fsdp2(rank, reshard=False)
    yield ("budget", "fsdp2-keep", "coop", FSDP2_KEEP_FRACTION), lambda: train_fsdp2(
        rank, coop_arena.Budget(int(FSDP2_KEEP_FRACTION * results[("peak", "fsdp2-keep")]), device="cpu", headroom=0),
        reshard=False)
    yield ("plain", "fsdp2", 2), lambda: train_fsdp2(rank, steps=2)
    yield ("stress", "fsdp2"), lambda: train_fsdp2(rank, coop_arena.Budget(1 << 24, device="cpu", headroom=0), steps=2,
                                                   stress=True)
    yield ("out_of_budget",), lambda: out_of_budget(rank)


class Residual(nn.Module):
    """Blocks of Linear, Tanh, Linear, ReLU with a residual add, each block its own FSDP2 unit: the linear
    layers read sharded parameters (resident from their reshard to the block's end), the rest is evictable."""

    def __init__(self, width=64, depth=8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width),
                                                  nn.ReLU()) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x) + x
        return self.head(x)


def _sharded_grads(budget, params) -> dict:
    """As _grads, for FSDP2's DTensor gradients: their local shards must be plain tensors outside the arena."""
    grads = [p.grad.to_local() for p in params if p.grad is not None]
    arena = budget.arena if budget is not None else None
    bad = [type(g).__name__ for g in grads if type(g) is not torch.Tensor or (arena is not None and arena.owns(g))]
    return dict(bad_grads=bad, grads=len(grads))


def train_fsdp2(rank, budget=None, steps=3, stress=False, search=True, reshard=True) -> dict:
    """`steps` SGD steps of a model sharded with fully_shard (each block, then the root), as train() does for
    DDP; parameters are returned as each rank's local shards. `reshard`: reshard_after_forward."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = Residual()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    calls = CollectiveCalls()
    log = []
    for step in range(steps):
        opt.zero_grad()
        x, y = _vectors(rank, step)
        block = budget if budget is None or not stress else _Stress(budget)
        before = calls.n
        with calls, block or contextlib.nullcontext():
            F.cross_entropy(model(x), y).backward()
        log.append(_record(budget, calls.n - before, _sharded_grads(budget, model.parameters())))
        opt.step()
    if budget is not None and search:
        log[-1].update(_alive(budget))
    return dict(params=[p.detach().to_local().clone() for p in model.parameters()], buffers=[], log=log)


def peak_fsdp2(rank, reshard=True) -> int:
    budget = coop_arena.Budget(1 << 28, device="cpu", headroom=0)
    train_fsdp2(rank, budget, steps=1, search=False, reshard=reshard)
    return budget.stats.peak_bytes


FSDP2_FRACTION = 0.75  # what a reshard keeps stays resident (sharded.py): this model does not fit at 0.7
FSDP2_KEEP_FRACTION = 0.5  # reshard_after_forward=False: parameters are freed only after their backward


def out_of_budget(rank) -> dict:
    """Rank 1's budget cannot hold the first op's output. The pattern of examples/ddp_budget.py: whichever
    rank fails (out of budget, or a collective that lost its peer) destroys its process group and leaves."""
    build, data, loss, ddp_kwargs = CONFIGS["gpt"]
    torch.manual_seed(0)
    ddp = DDP(build(), **ddp_kwargs)
    budget = coop_arena.Budget(1 << 26 if rank == 0 else 1024, device="cpu", headroom=0)
    x, y = data(rank, 0)
    start = time.monotonic()
    try:
        with budget:
            loss(ddp, x, y, rank).backward()
    except Exception as e:
        dist.destroy_process_group()  # a peer waiting in a collective with this rank fails at once
        return dict(error=type(e).__name__, message=str(e), seconds=time.monotonic() - start)
    return dict(error=None, seconds=time.monotonic() - start)


results: dict = {}


def main(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=60))  # bounds a wait on a rank that hangs
    try:
        for key, run in scenarios(rank):
            start = time.monotonic()
            results[key] = run()
            results[("seconds",) + key] = time.monotonic() - start
            torch.save(results, out)  # what is done survives a later failure
    except BaseException:
        results["error"] = traceback.format_exc()
        torch.save(results, out)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


# ============================================================================================= test side
@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' results: [rank 0's, rank 1's]. The processes are killed if they outlive TIMEOUT_S."""
    d = tmp_path_factory.mktemp("ddp")
    logs = [open(d / f"rank{r}.log", "w+") for r in range(WORLD)]
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(d / "store"), str(d / f"rank{r}.pt")],
                              stdout=logs[r], stderr=subprocess.STDOUT, start_new_session=True)
             for r in range(WORLD)]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = []
    for r, f in enumerate(logs):
        f.seek(0)
        text.append(f"--- rank {r} (exit {procs[r].returncode}) ---\n{f.read()[-4000:]}")
        f.close()
    out = [torch.load(d / f"rank{r}.pt", weights_only=False) if (d / f"rank{r}.pt").exists() else {}
           for r in range(WORLD)]
    if any(p.returncode != 0 for p in procs) or any("error" in o for o in out):
        pytest.fail("the ranks failed or timed out:\n" + "\n".join(text))
    return out


def _pairs(ranks, plain, budget):
    """(rank, plain DDP's run, the Budget's run) for each rank."""
    return [(rank, r[plain], r[budget]) for rank, r in enumerate(ranks)]


def _exact(ref, got) -> bool:
    return bitwise_equal(ref["params"] + ref["buffers"], got["params"] + got["buffers"])


def _evicted(log) -> bool:
    return sum(b["evictions"] for b in log) > 0 and sum(b["rematerializations"] for b in log) > 0


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["gpt", "cnn"])
def test_ddp_under_a_budget_is_exact(ranks, name, policy, fraction):
    key = ("budget", name, policy, fraction)
    for rank, ref, got in _pairs(ranks, ("plain", name), key):
        assert _exact(ref, got), f"rank {rank}: {name} under {policy} at {fraction} differs from plain DDP"
        assert all(b["peak_bytes"] <= b["budget"] for b in got["log"])
        assert _evicted(got["log"]), got["log"]
        assert [b["calls"] for b in got["log"]] == [b["calls"] for b in ref["log"]]
    # DDP keeps the parameters equal across ranks (buffers are each rank's: broadcast before forward, then updated)
    assert bitwise_equal(ranks[0][key]["params"], ranks[1][key]["params"])


def test_nothing_outlives_a_block(ranks):
    """After every block every `.grad` is a plain tensor outside the arena; after each run's last block no
    wrapper is alive and no plain tensor lies on the arena's bytes (DDP's buckets, views and futures are not
    in the arena). With gradient_as_bucket_view=True the gradients are views of DDP's buckets."""
    for r in ranks:
        for key, run in r.items():
            if key[0] in ("budget", "stress"):
                assert all(b["bad_grads"] == [] for b in run["log"]), (key, run["log"])
                assert (run["log"][-1]["wrappers"], run["log"][-1]["arena_views"]) == (0, 0), (key, run["log"][-1])
        assert all(b["grad_storages"] < b["grads"] for b in r[("budget", "cnn", "coop", 0.3)]["log"])


def test_unused_parameters_are_exact(ranks):
    for rank, ref, got in _pairs(ranks, ("plain", "branchy"), ("budget", "branchy", "coop", 0.3)):
        assert _exact(ref, got), f"rank {rank}"
        assert _evicted(got["log"]), got["log"]
        # `extra` has gradients on both ranks (rank 1's from DDP's finalize), `unused` on neither
        assert all(b["grads"] == len(got["params"]) - 2 for b in got["log"]), got["log"]


def test_no_sync_accumulation_over_blocks_is_exact(ranks):
    for rank, ref, got in _pairs(ranks, ("plain", "no_sync"), ("budget", "no_sync", "coop", 0.3)):
        assert _exact(ref, got), f"rank {rank}"
        assert len(got["log"]) == 3 and _evicted(got["log"]), got["log"]
        calls = [b["calls"] for b in got["log"]]  # buffer broadcasts in the first forward; one bucket all-reduce
        assert calls == [b["calls"] for b in ref["log"]] and calls[1] == 0 < calls[2], calls


def test_collectives_are_never_recomputed(ranks):
    """The same collectives run, block by block, with no eviction, under a tight budget, and when every
    evictable storage is evicted after every op; the readers of their results were recomputed many times."""
    for rank, r in enumerate(ranks):
        ref, tight, stress = r[("plain", "synced")], r[("budget", "synced", "coop", 0.3)], r[("stress", "synced")]
        assert _exact(ref, tight), f"rank {rank}"
        assert _evicted(tight["log"]), tight["log"]
        per_block = [b["calls"] for b in ref["log"]]
        assert per_block[0] > 8 * 3, per_block  # 8 layers x (allgather_, allreduce_, all_reduce, ...) + 1 bucket
        assert [b["calls"] for b in tight["log"]] == per_block
        assert [b["calls"] for b in stress["log"]] == per_block[:1]
        assert all(b["rematerializations"] > 50 and b["unevictable_bytes"] > 0 for b in stress["log"]), stress


@pytest.mark.parametrize("name, policy, fraction", [("fsdp2", p, FSDP2_FRACTION) for p in POLICIES] +
                         [("fsdp2-keep", "coop", FSDP2_KEEP_FRACTION)])
def test_fsdp2_under_a_budget_is_exact(ranks, name, policy, fraction):
    """fully_shard under a Budget: each rank's shards equal plain FSDP2's bit for bit, the same collectives run
    (FSDP's all-gathers and reduce-scatters, none from a recomputation), and the budget held while evicting;
    without resharding after forward ("fsdp2-keep") at a lower budget."""
    key = ("budget", name, policy, fraction)
    for rank, ref, got in _pairs(ranks, ("plain", name), key):
        assert _exact(ref, got), f"rank {rank}: FSDP2 under {policy} differs from plain FSDP2"
        assert all(b["peak_bytes"] <= b["budget"] for b in got["log"])
        assert _evicted(got["log"]), got["log"]
        per_block = [b["calls"] for b in ref["log"]]
        assert per_block[0] >= 2 * 9, per_block  # an all-gather and a reduce-scatter per unit at least
        assert [b["calls"] for b in got["log"]] == per_block
        assert all(b["grads"] == len(got["params"]) for b in got["log"]), got["log"]


def test_fsdp2_with_everything_evicted_after_every_op(ranks):
    """The stress pattern under FSDP2: recomputations everywhere, no extra collective, same shards."""
    for rank, r in enumerate(ranks):
        ref, stress = r[("plain", "fsdp2", 2)], r[("stress", "fsdp2")]
        assert _exact(ref, stress), f"rank {rank}"
        assert [b["calls"] for b in stress["log"]] == [b["calls"] for b in ref["log"]]
        assert all(b["rematerializations"] > 50 and b["bad_grads"] == [] for b in stress["log"]), stress["log"]
def test_a_rank_out_of_budget_fails_both_ranks_promptly(ranks):
    failed, other = ranks[1][("out_of_budget",)], ranks[0][("out_of_budget",)]
    assert failed["error"] == "OutOfBudget" and "cannot place" in failed["message"], failed
    assert other["error"] == "RuntimeError" and "Connection closed by peer" in other["message"], other
    assert other["seconds"] < 30, other  # the process group's timeout is 60 s


def test_state_made_in_gradient_hooks_stays_outside_the_arena():
    """The same rule without DDP: an optimizer run from post-accumulate-grad hooks (optimizer in backward)
    creates its state inside the block, in the autograd engine's accumulation hooks; it is plain state like
    the parameters, and training stays exact."""

    def run(budget):
        torch.manual_seed(0)
        model = CNN()
        opts = {p: torch.optim.Adam([p], lr=1e-3) for p in model.parameters()}

        def step(p):
            opts[p].step()
            opts[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)
        for i in range(2):
            x, y = batch("cnn", i)
            with budget or contextlib.nullcontext():
                loss_fn("cnn", model(x), y).backward()
        kinds = {type(v) for o in opts.values() for st in o.state.values() for v in st.values()}
        return [p.detach() for p in model.parameters()], kinds

    ref, _ = run(None)
    budget = coop_arena.Budget(1 << 22, device="cpu", headroom=0)
    got, kinds = run(budget)
    assert kinds == {torch.Tensor} and bitwise_equal(ref, got)


def test_the_torchrun_example_stops_every_rank_when_one_runs_out_of_budget():
    """The example of docs/distributed.md under torchrun: both ranks measure their peak, then rank 1 gets 1 KiB;
    it reports OutOfBudget and tears its process group down, and torchrun stops the job with an error, within
    seconds."""
    example = Path(__file__).resolve().parent.parent / "examples" / "ddp_budget.py"
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(example), "--steps", "2", "--starve-rank", "1"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"torchrun did not finish within 120 s:\n{out[-4000:]}")
    assert p.returncode != 0, out[-4000:]
    assert "rank 1: step 0 failed: OutOfBudget: cannot place" in out, out[-4000:]


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3])
