"""FSDP2 and DDP under a Budget, cases found in review: a world of one gloo rank in this process (file:// init),
which runs fully_shard and DistributedDataParallel with their DTensor parameters, hooks and collectives. The
arena is the whole budget (`headroom=0`): the budgets here are fractions of the arena's own peak."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import coop_arena
from test_exactness import EvictAll
from training import bitwise_equal


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A process group of this process alone, for the module's tests."""
    if dist.is_initialized():
        pytest.fail("a process group is already initialized in this process")
    store = tmp_path_factory.mktemp("world") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class Block(nn.Module):
    def __init__(self, width=64):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.b(torch.tanh(self.a(x)))) + x


class Residual(nn.Module):
    def __init__(self, width=64, depth=4):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _vectors(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)


def _sharded(depth=4):
    """Residual with each block, then the root, sharded by fully_shard, and its SGD optimizer."""
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = Residual(depth=depth)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _local(tensors) -> list:
    return [t.detach().to_local().clone() for t in tensors]


def test_fsdp2_state_dict_and_gradient_clipping_inside_a_block(world):
    """Outside their forward, FSDP2's parameters and gradients are DTensors: `model.state_dict()` and
    `clip_grad_norm_` inside the block run on their local shards, as without a Budget, and training stays exact."""

    def run(budget):
        model, opt = _sharded()
        saved, norms, counts = [], [], []
        for step in range(2):
            x, y = _vectors(step)
            with budget or contextlib.nullcontext():
                opt.zero_grad()
                saved.append(_local(model.state_dict().values()))
                F.cross_entropy(model(x), y).backward()
                norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1).full_tensor().clone())
                opt.step()
            if budget is not None:
                counts.append((budget.stats.evictions, budget.stats.rematerializations))
        return _local(model.parameters()) + [t for s in saved for t in s] + norms, counts

    ref, _ = run(None)
    ample = coop_arena.Budget(1 << 26, device="cpu", headroom=0)
    run(ample)
    got, counts = run(coop_arena.Budget(int(0.85 * ample.stats.peak_bytes), device="cpu", headroom=0))
    assert bitwise_equal(ref, got)
    assert all(ev > 0 and remat > 0 for ev, remat in counts), counts


def test_an_optimizer_step_settles_what_read_a_sharded_parameter(world):
    """An optimizer step writes FSDP2's parameters through their DTensor's local shard: a tensor computed from
    that shard before the step and recomputed after it must give the value from before the step."""

    def run(budget):
        model, opt = _sharded(depth=2)
        x, y = _vectors(0)
        with budget or contextlib.nullcontext():
            F.cross_entropy(model(x), y).backward()
            before = model.blocks[0].a.weight.to_local() * 2
            opt.step()
            return before.clone()

    ref = run(None)
    budget = coop_arena.Budget(1 << 24, device="cpu", headroom=0)
    got = run(EvictAll(budget))  # `before` is evicted after every op, and recomputed for the clone
    assert torch.equal(ref, got)
    assert budget.stats.rematerializations > 50


def test_ddp_with_checkpointed_blocks_and_a_failed_no_sync_block(world):
    """DDP over blocks under torch.utils.checkpoint (non-reentrant: their forward is replayed in backward, with
    dropout), each step after a no_sync block that raises after its backward: exact, with evictions."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(Residual):
        def forward(self, x):
            for block in self.blocks:
                x = checkpoint(lambda h, block=block: F.dropout(block(h), 0.2), x, use_reentrant=False)
            return self.head(x)

    def run(budget, steps=2):
        torch.manual_seed(0)
        model = Checkpointed()
        ddp = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        counts = []
        for step in range(steps):
            with pytest.raises(KeyError):
                with ddp.no_sync(), budget or contextlib.nullcontext():
                    x, y = _vectors(50 + step)
                    F.cross_entropy(ddp(x), y).backward()
                    raise KeyError("after backward")
            opt.zero_grad()
            x, y = _vectors(step)
            torch.manual_seed(100 + step)
            with budget or contextlib.nullcontext():
                F.cross_entropy(ddp(x), y).backward()
            if budget is not None:
                counts.append((budget.stats.evictions, budget.stats.rematerializations))
            opt.step()
        return [p.detach().clone() for p in model.parameters()], counts

    ref, _ = run(None)
    ample = coop_arena.Budget(1 << 26, device="cpu", headroom=0)
    run(ample, steps=1)
    got, counts = run(coop_arena.Budget(int(0.85 * ample.stats.peak_bytes), device="cpu", headroom=0))
    assert bitwise_equal(ref, got)
    assert all(ev > 0 and remat > 0 for ev, remat in counts), counts


def test_fsdp2_weight_penalty_over_sharded_parameters(world):
    """A loss that reads FSDP2's DTensor parameters outside their forward (an L2 penalty) inside the block:
    DTensor works out the sharding of an op it has not seen under a FakeTensorMode, whose ops must reach it, not
    the arena (the Budget runs come first, so that DTensor's sharding cache does not already hold these ops);
    the gradient autograd accumulates into a DTensor parameter leaves the arena, as a plain parameter's does."""

    def run(budget):
        model, opt = _sharded()
        counts = []
        for step in range(2):
            x, y = _vectors(step)
            opt.zero_grad()
            with budget or contextlib.nullcontext():
                penalty = sum(p.pow(2).mean().full_tensor() for p in model.parameters())
                (F.cross_entropy(model(x), y) + 1e-3 * penalty).backward()
            if budget is not None:
                counts.append((budget.stats.evictions, budget.stats.rematerializations))
                # the penalty's gradient reached the DTensor parameters through autograd: plain, outside the arena
                grads = [p.grad._local_tensor for p in model.parameters()]
                assert all(type(g) is torch.Tensor and not budget.arena.owns(g) for g in grads), grads
            opt.step()
        return _local(model.parameters()), counts

    ample = coop_arena.Budget(1 << 26, device="cpu", headroom=0)
    run(ample)
    got, counts = run(coop_arena.Budget(int(0.85 * ample.stats.peak_bytes), device="cpu", headroom=0))
    ref, _ = run(None)
    assert bitwise_equal(ref, got)
    assert all(ev > 0 and remat > 0 for ev, remat in counts), counts
