"""Direct placement (Note [Direct placement] in placement.py): outputs written straight into the arena where the op
has an out= kernel that does so, views kept as views, composite ops run as their parts, and the rest counted."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import coop_arena
from coop_arena import placement
from coop_arena.ops import info
from training import train

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------ decisions by schema
def test_out_variants_are_found_by_schema():
    op, names = placement.out_variant(aten.threshold_backward.default)
    assert op is aten.threshold_backward.grad_input and names == ("grad_input",)
    op, names = placement.out_variant(aten.native_batch_norm.default)
    assert op is aten.native_batch_norm.out and names == ("out", "save_mean", "save_invstd")
    assert placement.out_variant(aten.sum.dim_IntList)[0] is aten.sum.IntList_out
    assert placement.out_variant(aten.split_with_sizes.default) is None  # returns views, no out= variant


def _meta(*size):
    return torch.empty(*size, device="meta")


@pytest.mark.parametrize("out_op,args,outs,expected", [
    (aten.add.out, (_meta(4, 4), _meta(4, 4)), {"out": _meta(4, 4)}, True),    # a structured CPU kernel
    (aten.convolution.out, (_meta(1, 3, 8, 8), _meta(4, 3, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1),
     {"out": _meta(1, 4, 8, 8)}, False),                                      # composite: convolution, then copy
    (aten.stack.out, ([_meta(4), _meta(4)],), {"out": _meta(2, 4)}, True),     # composite over cat.out: no temporary
])
def test_an_out_variant_is_used_only_when_it_writes_in_place(out_op, args, outs, expected):
    assert placement.writes_in_place(out_op, "cpu", args, outs) is expected


def test_composite_aten_ops_run_as_their_parts_but_custom_ops_stay_whole():
    assert placement.decomposes(aten.mul.Scalar, info(aten.mul.Scalar), "cpu")
    assert placement.decomposes(aten.clone.default, info(aten.clone.default), "cpu")
    assert not placement.decomposes(aten.convolution.default, info(aten.convolution.default), "cpu")  # FLOPs
    assert not placement.decomposes(aten.mm.default, info(aten.mm.default), "cpu")  # a kernel of its own

    @torch.library.custom_op("coop_arena_test::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    twice.register_fake(lambda x: torch.empty_like(x))
    f = torch.ops.coop_arena_test.twice.default
    assert not placement.decomposes(f, info(f), "cpu")


def test_composite_ops_with_out_variants_written_for_them_write_straight_into_the_arena_and_stay_exact(monkeypatch):
    """clone (a transpose made contiguous, a plain clone), mul.Scalar, zeros, zeros_like, ones and ones_like take
    the out= variants written for them (Note [Direct placement]): one op each through the runtime instead of their
    composite kernels' parts, with the same bits under a budget that evicts and recomputes them; without those
    variants, the same step runs more ops (the parts), to the same bits."""
    torch.manual_seed(0)
    ws = [torch.randn(64, 64, requires_grad=True) for _ in range(12)]
    x = torch.randn(64, 64)

    def step():
        h = x
        for w in ws:
            h = torch.ops.aten.mul.Scalar((h @ w).t().contiguous(), 0.5)  # (as composite kernels call it)
            h = h.t().clone().tanh() + torch.ones_like(h) - torch.zeros(64, 64)
            h = h * torch.ones(64, 1) + torch.zeros_like(h)
        h.sum().backward()
        grads = [w.grad for w in ws]
        for w in ws:
            w.grad = None
        return grads

    want = step()
    ops = []
    for by_hand in (True, False):
        monkeypatch.setattr(placement, "_PLANS", {})  # plans made with or without the variants
        if not by_hand:
            monkeypatch.setattr(placement, "_OUT_BY_HAND", {})
        ample = coop_arena.Budget(1 << 30, device="cpu", headroom=0)
        with ample:
            step()
        budget = coop_arena.Budget(int(0.4 * ample.stats.peak_bytes), device="cpu", headroom=0)
        with budget:
            got = step()
        st = budget.stats
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert st.evictions > 0 and st.rematerializations > 0 and st.temporary_bytes == 0
        ops.append(ample.stats.ops)
        if by_hand:  # each took its variant, and its first call gave the functional op's bits
            took = {key[0] for key, plan in placement._PLANS.items() if isinstance(plan, placement.OpPlan)
                    and plan.out_op is placement._OUT_BY_HAND.get(key[0]) and plan.checked == [True]}
            assert took == set(placement._OUT_BY_HAND), took
    assert ops[0] < ops[1], ops


# ---------------------------------------------------------------------------------------------------- views
def test_ops_returning_views_of_their_input_stay_views():
    x = torch.randn(6, 8)
    budget = coop_arena.Budget(1 << 20, device="cpu")
    with budget:
        y = x * 2
        parts = aten.unsafe_split.Tensor(y, 2, 1)  # its schema marks no alias, yet it returns views
        flat = aten._unsafe_view.default(y, [48])
        assert all(p._cell.storage is y._cell.storage for p in parts)
        assert flat._cell.storage is y._cell.storage
        assert [p.stride() for p in parts] == [(8, 1)] * 4  # the strides the op produced, not contiguous ones
        assert budget.stats.placed_bytes == 6 * 8 * 4       # only y was placed
    assert torch.equal(parts[1].as_plain(), (x * 2)[:, 2:4])


def _cell_loop(cell_cls, lstm: bool):
    def run(budget):
        torch.manual_seed(0)
        cell = cell_cls(32, 48)
        xs = torch.randn(48, 8, 32)  # long enough for half the peak to lie well above the lower bound
        with budget if budget is not None else contextlib.nullcontext():
            h = torch.zeros(8, 48)
            state = (h, torch.zeros(8, 48)) if lstm else h
            outs = []
            for x in xs:
                state = cell(x, state)
                outs.append(state[0] if lstm else state)
            torch.stack(outs).square().sum().backward()
        return [p.grad.clone() for p in cell.parameters()]
    return run


def _gru(budget):
    torch.manual_seed(0)
    gru = nn.GRU(32, 48, batch_first=True)
    x = torch.randn(8, 24, 32)
    with budget if budget is not None else contextlib.nullcontext():
        out, _ = gru(x)
        out.square().sum().backward()
    return [p.grad.clone() for p in gru.parameters()]


@pytest.mark.parametrize("run", [_gru, _cell_loop(nn.GRUCell, False), _cell_loop(nn.LSTMCell, True)],
                         ids=["GRU", "GRUCell", "LSTMCell"])
def test_recurrent_cells_are_bitwise_at_full_and_half_budget(run):
    reference = run(None)
    probe = coop_arena.Budget(1 << 28, device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(reference, run(probe)))
    assert probe.stats.evictions == 0
    # half the peak; nn.GRU projects the whole sequence at once, so its lower bound is about 0.7 of its peak:
    # it takes the first tenth above half that lies above its lower bound and fits
    for fraction in (0.5, 0.6, 0.7, 0.8, 0.9):
        if fraction * probe.stats.peak_bytes > probe.stats.lower_bound:
            tight = coop_arena.Budget(int(fraction * probe.stats.peak_bytes), device="cpu")
            try:
                grads = run(tight)
                break
            except coop_arena.OutOfBudget:
                assert run is _gru, f"{run} does not fit half its peak"
    assert all(torch.equal(a, b) for a, b in zip(reference, grads))
    assert tight.stats.evictions > 0 and tight.stats.rematerializations > 0


# ------------------------------------------------------------------------------------------------ accounting
def _stats(name, fraction=None):
    probe = coop_arena.Budget(1 << 28, device="cpu", headroom=0)
    train(name, probe, steps=1)
    if fraction is None:
        return probe.stats
    b = coop_arena.Budget(int(fraction * probe.stats.peak_bytes), device="cpu", headroom=0)
    train(name, b, steps=1)
    return b.stats


@pytest.mark.parametrize("name,fraction", [("mlp", None), ("mlp", 0.5), ("gpt", None), ("gpt", 0.5)])
def test_most_output_bytes_are_written_straight_into_the_arena(name, fraction):
    st = _stats(name, fraction)
    direct = (st.placed_bytes - st.temporary_bytes) / st.placed_bytes
    assert direct >= 0.8, f"{name}: {direct:.2f} of {st.placed_bytes} output bytes placed directly"
    if fraction is not None:
        assert st.rematerializations > 0  # replays placed too


def test_temporaries_are_counted_and_bounded_by_one_ops_outputs():
    """The CNN's convolutions and the backward of its BatchNorm have no out= kernel that writes in place: their
    outputs go through temporaries, counted, and never more at once than one op's outputs. (After a first step,
    which also runs each op configuration with an input laid out otherwise than default once into a temporary to
    learn its layout: Note [Direct placement].) With headroom=0 nothing is observed: `temporary_peak` is the
    engine's own count."""
    _stats("cnn", 0.5), _stats("mlp", 0.5)
    outputs = []
    orig = coop_arena.dispatch.Dispatch._run_temporary

    def spy(self, call, plan, **kw):
        before = self.counters.temporary_bytes
        res = orig(self, call, plan, **kw)
        outputs.append((str(call.func), self.counters.temporary_bytes - before))
        return res

    coop_arena.dispatch.Dispatch._run_temporary = spy
    try:
        st = _stats("cnn", 0.5)
    finally:
        coop_arena.dispatch.Dispatch._run_temporary = orig
    assert st.temporary_bytes > 0 and 0 < st.temporary_peak <= max(n for _, n in outputs)
    assert {f for f, n in outputs if n} <= {"aten.convolution.default", "aten.convolution_backward.default",
                                            "aten.native_batch_norm_backward.default"}
    assert st.placed_bytes > st.temporary_bytes
    assert _stats("mlp", 0.5).temporary_bytes == 0


# ------------------------------------------------ layouts the meta kernel does not share with the device's
def _both(step):
    """`step(ctx)` run plainly and under a fresh ample Budget on the CPU."""
    return step(contextlib.nullcontext()), step(coop_arena.Budget(1 << 24, device="cpu"))


def test_log_softmax_backward_of_a_transposed_gradient_is_exact():
    """The meta kernel plans the backward of log_softmax for a transposed gradient with transposed strides, the CPU
    kernel makes it contiguous, and the CPU's out= kernel computes wrong values into the non-contiguous view: the
    input's gradient differed at every budget (by up to 4.5 here), and so did F.ctc_loss's, which reads its
    log-probabilities through a transpose. The first call now learns the device's layout (Note [Direct
    placement])."""
    g = torch.Generator().manual_seed(0)
    x0, w = torch.randn(4, 10, 16, generator=g), torch.randn(10, 4, 16, generator=g)
    targets, lengths = torch.randint(1, 16, (4, 5), generator=g), torch.full((4,), 10)

    def step(ctx):
        x = x0.clone().requires_grad_()
        with ctx:
            lp = x.log_softmax(-1)
            loss = (lp.transpose(0, 1) * w).sum() + F.ctc_loss(lp.transpose(0, 1), targets, lengths,
                                                               torch.full((4,), 5))
            loss.backward()
        return loss.detach(), x.grad

    (want_loss, want), (loss, got) = _both(step)
    assert torch.equal(want_loss, loss) and torch.equal(want, got)


def test_outputs_take_the_devices_strides_so_later_reductions_keep_their_bits():
    """rfftn's meta kernel gives its output other strides than the CPU kernel does; placed with those, the same
    values were summed in another order later. The output now has plain PyTorch's strides, and the sum its bits."""
    y = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))

    def step(ctx):
        with ctx:
            f = torch.fft.rfftn(y * 1)
            s = f.abs().sum(0)
        return f.stride(), s

    (want_stride, want), (stride, got) = _both(step)
    assert stride == want_stride and torch.equal(want, got)


def test_linalg_qr_is_exact_in_later_blocks():
    """linalg_qr.out leaves part of R unwritten when R has a storage offset, as every arena view but the first
    call's has: R kept what the arena held there (here NaNs of a freed tensor) from the second block on, or
    PyTorch's own internal assert fired. qr now takes the temporary path."""
    g = torch.Generator().manual_seed(0)
    for shape in [(5, 5), (20, 12)]:
        a = torch.randn(*shape, generator=g)
        want = torch.linalg.qr(a)
        budget = coop_arena.Budget(1 << 20, device="cpu")
        for _ in range(2):
            with budget:
                h = torch.full((250_000,), float("nan"))
                del h
                q, r = torch.linalg.qr(a * 1)
            assert torch.equal(want[0], q) and torch.equal(want[1], r), shape


def test_the_plan_cache_is_bounded(monkeypatch):
    """A scalar that changes every step (an annealing weight) or shapes that do make a new configuration each
    time: the cache of plans starts over when full instead of growing without end."""
    from coop_arena import placement
    monkeypatch.setattr(placement, "_PLANS_MAX", 64)
    x = torch.randn(8, 8)
    with coop_arena.Budget(1 << 20, device="cpu"):
        for i in range(200):
            y = x * (1.0 / (i + 1)) + i
    assert len(placement._PLANS) <= 64 and torch.equal(y.as_plain(), x * (1.0 / 200) + 199)


def _varlen_steps(budget, lengths, dropout, after_first=lambda: None):
    """A small transformer trained on batches of another sequence length each (dynamic padding)."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=dropout, batch_first=True)
    model = nn.Sequential(nn.Embedding(50, 32), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, n in enumerate(lengths):
        torch.manual_seed(10 + i)
        ids = torch.randint(0, 50, (3, n))
        with budget if budget is not None else contextlib.nullcontext():
            model(ids).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if i == 0:
            after_first()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_new_shapes_in_later_blocks_are_sized_by_the_device_and_stay_exact(monkeypatch, dropout):
    """Note [Shapes that change]: from a Budget's second block on, a new sequence length's ops are not planned on
    meta; the device's run sizes them, and the step stays bitwise plain PyTorch's, evictions included."""
    lengths = [11, 17, 11, 23, 17, 29]
    expected = _varlen_steps(None, lengths, dropout)
    made, sized = [], []
    monkeypatch.setattr(placement, "_make_plan", lambda *a, f=placement._make_plan: made.append(1) or f(*a))
    monkeypatch.setattr(placement, "sized", lambda *a, f=placement.sized: sized.append(1) or f(*a))
    probe = coop_arena.Budget(1 << 24)
    _varlen_steps(probe, [max(lengths)], dropout)
    budget = coop_arena.Budget(int(probe.stats.peak_bytes * 0.6))
    got = _varlen_steps(budget, lengths, dropout, after_first=lambda: (made.clear(), sized.clear()))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert budget.stats.evictions > 0 and budget.stats.rematerializations > 0
    assert len(sized) >= 20, (len(made), len(sized))  # (3 new lengths; the rest of their ops are views or parts)


@pytest.mark.parametrize("policy", ["coop", "dtr", "dte"])
def test_a_new_shape_in_a_later_block_makes_the_decisions_of_a_dry_run(policy):
    """Note [Shapes that change]: a new shape sized by the device places its outputs once the op has run; a dry run
    places them before. The clock must not move by the op's cost in between, or staleness, and so the victims,
    differ from the dry run's (28 evictions on the CPU against 31 on meta under dtr, before)."""
    def run(nbytes, device, lengths):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(64, 64).to(device) for _ in range(8)]
        budget = coop_arena.Budget(nbytes, device=device, policy=policy, partition=False, headroom=0)
        blocks = []
        for n in lengths:
            x = torch.randn(n, 64).to(device)
            with budget:
                h = x
                for layer in layers:
                    h = torch.tanh(layer(h))
                h.sum().backward()
            stats = budget.stats.as_dict()
            stats.pop("search_seconds"), stats.pop("search_seconds_per_event")
            stats.pop("temporary_bytes", None), stats.pop("temporary_peak", None)
            blocks.append((stats["evictions"], stats["rematerializations"], stats["compute_overhead"],
                           [e[:1] + e[2:] for e in map(tuple, budget.trace) if e[0] in ("evict", "restore")]))
        return blocks

    nbytes = _plain_peak_of_mlp() // 2
    cpu, meta = run(nbytes, "cpu", [48, 40]), run(nbytes, "meta", [48, 40])
    assert cpu[1][0] > 0
    assert cpu == meta


def _plain_peak_of_mlp() -> int:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 64).to("meta") for _ in range(8)]
    budget = coop_arena.Budget(1 << 26, device="meta")
    with budget:
        h = torch.randn(48, 64).to("meta")
        for layer in layers:
            h = torch.tanh(layer(h))
        h.sum().backward()
    return budget.stats.peak_bytes


def test_a_random_op_sized_by_the_device_that_does_not_fit_leaves_the_generator_as_it_was(monkeypatch):
    """Rule 7: a sized call (Note [Shapes that change]) draws before its outputs are placed; when they do not fit,
    the generator goes back, as in plain PyTorch, which allocates first (and as with direct placement)."""
    budget = coop_arena.Budget(1 << 14, device="cpu")
    small, large = torch.ones(4, 10), torch.ones(2000, 10)
    with budget:
        torch.multinomial(small, 3)  # its configuration's plan, and its shape-free one
    made = []
    monkeypatch.setattr(placement, "_make_plan", lambda *a, f=placement._make_plan: made.append(1) or f(*a))
    before = torch.get_rng_state()
    with pytest.raises(coop_arena.OutOfBudget):
        with budget:
            torch.multinomial(large, 3)  # a new shape: run on the device (it draws), then too large to place
    assert torch.equal(torch.get_rng_state(), before) and not made
    with budget:  # still usable
        torch.multinomial(small, 3)


@pytest.mark.parametrize("policy", ["coop", "dtr"])
def test_a_layout_learned_at_a_new_shape_in_a_later_block_makes_the_decisions_of_a_dry_run(policy):
    """The backward of `.square().mean()` divides an expanded gradient: its first call at each new shape learns its
    layout on the CPU (Note [Direct placement]). That call placed its output after the clock had moved by its cost,
    where a dry run places it before: at a new batch size the CPU made 24 evictions where the dry run made 20."""
    def run(nbytes, device):
        torch.manual_seed(0)
        model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.Tanh())]).to(device)
        budget = coop_arena.Budget(nbytes, device=device, policy=policy, partition=policy == "coop", headroom=0)
        blocks = []
        for n in [48, 40]:
            x = torch.randn(n, 64).to(device)
            with budget:
                model(x).square().mean().backward()
            for p in model.parameters():
                p.grad = None
            s = budget.stats
            blocks.append((s.evictions, s.rematerializations, s.compute_overhead,
                           [e[:1] + e[2:] for e in map(tuple, budget.trace)]))
        return blocks

    cpu, meta = run(60000, "cpu"), run(60000, "meta")
    assert cpu[1][0] > 0
    assert cpu == meta
