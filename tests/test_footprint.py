"""The budget is the step's real footprint (Note [Headroom] in coop_arena/headroom.py): the arena plus what the
step allocates outside it, model state excepted, measured with the profiler (coop_arena.footprint, Note [Measured
footprint]), not with the engine's counters."""

from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch

import coop_arena
from coop_arena import footprint
from training import bitwise_equal, build, state, train
from coop_arena.examples import batch, loss_fn

MODELS = ["mlp", "cnn", "gpt", "lstm"]
STEPS = 4


def run(name, budget, steps=STEPS, measure_from=1):
    """Train `steps` steps; (model, [(Footprint or None, stats)] per step). Steps from `measure_from` (0-based) run
    under the profiler (footprint.measure), the gradients left out as model state, except those the Budget
    observes itself while it learns its headroom (a profiler cannot run inside another)."""
    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    out = []
    for i in range(steps):
        x, y = batch(name, i)
        torch.manual_seed(100 + i)
        opt.zero_grad()

        def step():
            with budget if budget is not None else contextlib.nullcontext():
                loss_fn(name, model(x), y).backward()

        if i >= measure_from and (budget is None or not budget._observe):
            fp = footprint.measure(step, keep=lambda: [p.grad for p in model.parameters()])
        else:
            fp = step()
        out.append((fp, None if budget is None else budget.stats))
        opt.step()
    return model, out


@functools.cache
def plain_footprint(name) -> int:
    """Plain PyTorch's measured peak of one step (a later step: the first also allocates the gradients' memory)."""
    _, out = run(name, None, steps=3, measure_from=1)
    return max(fp.excess for fp, _ in out[1:])


@functools.cache
def smallest_learned(name) -> int:
    """The smallest budget (to 5 % of plain's footprint) at which STEPS steps run with the learned headroom."""
    peak = plain_footprint(name)
    lo, hi = int(0.05 * peak), int(1.0 * peak)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", coop_arena.FootprintExceeded)
        while hi - lo > 0.05 * peak:
            mid = (lo + hi) // 2
            try:
                run(name, coop_arena.Budget(mid, device="cpu"), measure_from=STEPS)
                hi = mid
            except coop_arena.OutOfBudget:
                lo = mid
    return hi


def check_footprint(name, nbytes):
    """Every step after the first stays within the budget, bit for bit the same as plain PyTorch."""
    budget = coop_arena.Budget(nbytes, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", coop_arena.FootprintExceeded)  # the first block's, asserted elsewhere
        model, out = run(name, budget)
    assert bitwise_equal(state(train(name, steps=STEPS)), state(model))
    for i, (fp, st) in enumerate(out[1:], 1):
        if fp is None:  # observed by the Budget itself: its figure is the profiler's
            assert st.footprint_observed
            measured = st.temporary_peak
        else:
            assert not st.footprint_observed  # settled: no observation, the last observed peak stands
            measured = fp.excess
            # the Budget's figures agree with the profiler's within 2 %
            assert abs(st.temporary_peak - measured) <= 0.02 * measured, (i, st.temporary_peak, measured)
            assert abs(st.footprint_peak - (st.arena_bytes + measured)) <= 0.02 * (st.arena_bytes + measured)
        assert st.arena_bytes + measured <= 1.02 * nbytes, (name, nbytes, i, st.arena_bytes, measured)
        assert st.arena_bytes + st.headroom == st.cap == nbytes
    budget.check_invariants()
    return out


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("name", MODELS)
def test_every_step_after_the_first_fits_the_budget_by_the_profiler(name, fraction):
    nbytes = int(fraction * plain_footprint(name))
    try:
        out = check_footprint(name, nbytes)
    except coop_arena.OutOfBudget:
        # only where a step cannot fit with its temporaries at all: the smallest workable budget is above it
        assert nbytes < smallest_learned(name), (name, fraction)
        pytest.skip(f"{name} needs more than {fraction} of plain's footprint ({smallest_learned(name)} bytes)")
    if fraction == 0.5:
        assert any(st.evictions > 0 and st.rematerializations > 0 for _, st in out[1:])


@pytest.mark.parametrize("name", MODELS)
def test_the_smallest_budget_that_runs_fits_it_by_the_profiler(name):
    nbytes = smallest_learned(name)
    assert nbytes < plain_footprint(name)
    out = check_footprint(name, nbytes)
    assert all(st.evictions > 0 and st.rematerializations > 0 for _, st in out[1:])


def test_tensors_held_at_the_blocks_exit_are_copied_out_and_counted_apart():
    """What the program still holds when a block ends (its logits, its loss) is copied out of the arena at the
    exit: the step's results, the program's after it like model state, outside the cap. `stats.escaped_bytes`
    counts them, and with them the profiler's figure is accounted for."""
    nbytes = int(0.5 * plain_footprint("gpt"))
    budget = coop_arena.Budget(nbytes, device="cpu")
    model = build("gpt")
    held = []
    for i in range(STEPS):
        x, y = batch("gpt", i)
        torch.manual_seed(100 + i)

        def step():
            with budget:
                logits = model(x)
                loss = loss_fn("gpt", logits, y)
                loss.backward()
                many = [logits.detach() * k for k in range(5)]  # (more than the step's temporaries)
            held[:] = [logits, loss, *many]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", coop_arena.FootprintExceeded)  # the first block's
            fp = step() if budget._observe else footprint.measure(step, keep=lambda: [p.grad for p in
                                                                                         model.parameters()])
        st = budget.stats
        assert st.escaped_bytes == sum(t.untyped_storage().nbytes() for t in held)
        assert type(held[0]) is coop_arena.Tensor and held[0].shape == (4, 16, 64)
        if fp is not None:
            assert st.evictions > 0 and st.rematerializations > 0
            # the copies are what the profiler sees beyond the temporaries, alongside what the block kept outside
            # the arena until its exit (the generator states its dropouts replay with): within the two together
            assert st.escaped_bytes > st.temporary_peak
            assert 1.02 * st.temporary_peak < fp.excess <= 1.02 * (st.temporary_peak + st.escaped_bytes), (fp, st)
            assert st.arena_bytes + st.temporary_peak <= nbytes
        model.zero_grad()
    assert fp is not None  # (the last steps were measured)


def test_a_later_block_over_the_budget_at_new_shapes_warns_and_says_so_in_its_stats():
    """Shapes that change from step to step: a block that meets op configurations for the first time (a shorter
    sequence) computes their first calls into temporaries outside the arena, beyond the headroom learned at the
    first shape (here the vocabulary's logits: Note [Shapes that change] in placement.py). Such a block is not
    silent: its stats put its footprint over the cap, and FootprintExceeded says by how much and what headroom
    would hold it. The same arena with a fixed headroom of the largest figure keeps every block within its
    budget."""
    from coop_arena.examples import GPT

    lengths = [24, 24, 24, 24, 20, 24, 17]
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 512, (4, t), generator=g), torch.randint(0, 512, (4, t), generator=g)) for t in lengths]

    def run(budget):
        torch.manual_seed(0)
        model = GPT(vocab=512, d=32, heads=2, layers=2, seq=32)
        out = []
        for i, (x, y) in enumerate(data):
            torch.manual_seed(100 + i)

            def step():
                with budget if budget is not None else torch.enable_grad():
                    loss_fn("gpt", model(x), y).backward()

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", coop_arena.FootprintExceeded)
                fp = step() if budget is not None and budget._observe else footprint.measure(
                    step, keep=lambda: [p.grad for p in model.parameters()])
            out.append((fp, budget and budget.stats, [str(w.message) for w in caught
                                                       if w.category is coop_arena.FootprintExceeded]))
            model.zero_grad()
        return out

    nbytes = int(0.6 * max(fp.excess for fp, _, _ in run(None)))
    out = run(coop_arena.Budget(nbytes, device="cpu"))
    over = [(t, fp, st, said) for t, (fp, st, said) in zip(lengths, out)
            if fp is not None and st.arena_bytes + fp.excess > 1.02 * nbytes]
    assert over and all(t != 24 for t, *_ in over)  # (the steps at the learned shape stay within it)
    assert all(st.footprint_peak > st.cap for _, _, st, _ in over), over  # (their stats say so)
    said = over[0][3]  # warned at the first, and then where a block goes further over (not every step)
    assert len(said) == 1 and said[0].startswith("a block of") and "first time" in said[0]
    assert "headroom=<bytes> of at least" in said[0]
    assert all(st.evictions > 0 and st.rematerializations > 0 for _, st, _ in out[1:])
    need = max(fp.excess for fp, _, _ in out if fp is not None)  # the same arena, and that headroom beside it:
    fixed = coop_arena.Budget(out[-1][1].arena_bytes + need, device="cpu", headroom=need)
    assert all(not said and st.arena_bytes + fp.excess <= 1.02 * fixed.nbytes for fp, st, said in run(fixed))


def test_a_model_without_temporaries_keeps_its_whole_budget_as_the_arena():
    """The MLP's ops all write into the arena directly: nothing is kept outside it and its decisions are those of
    an arena of the whole budget."""
    nbytes = int(0.5 * plain_footprint("mlp"))
    learned, fixed = coop_arena.Budget(nbytes, device="cpu"), coop_arena.Budget(nbytes, device="cpu", headroom=0)
    _, a = run("mlp", learned, measure_from=STEPS)
    _, b = run("mlp", fixed, measure_from=STEPS)
    assert learned.headroom == 0 and learned.arena.nbytes == nbytes
    assert [st.evictions for _, st in a] == [st.evictions for _, st in b] and a[-1][1].evictions > 0
    assert list(learned.trace) == list(fixed.trace)


def test_the_first_block_over_the_budget_warns_once_and_the_next_fits():
    nbytes = int(0.6 * plain_footprint("cnn"))
    budget = coop_arena.Budget(nbytes, device="cpu")
    with pytest.warns(coop_arena.FootprintExceeded, match="outside its arena") as caught:
        _, out = run("cnn", budget, measure_from=STEPS)
    assert len([w for w in caught if w.category is coop_arena.FootprintExceeded]) == 1
    first, second = out[0][1], out[1][1]
    assert first.arena_bytes == nbytes and first.arena_bytes + first.temporary_peak > nbytes
    assert second.arena_bytes == nbytes - budget.headroom and second.arena_bytes + second.temporary_peak <= nbytes
    assert second.headroom >= first.temporary_peak > 0


@pytest.mark.parametrize("name", ["cnn", "lstm"])
def test_the_first_blocks_one_time_work_does_not_set_the_headroom(name):
    """A configuration's first call does work outside the arena that its later calls do not: host copies of what
    it reads from outside the arena (the probe for hidden writes) and, for one placed directly from its next call
    on, its output computed into a temporary. Left out of what the first block observes (Note [Headroom]), the
    headroom learned from the first block is the one later blocks keep, on models whose temporaries recur."""
    budget = coop_arena.Budget(int(1.5 * plain_footprint(name)), device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", coop_arena.FootprintExceeded)  # the first block's, asserted elsewhere
        _, out = run(name, budget, measure_from=STEPS)
    learned = [st.headroom for _, st in out]  # the headroom each block ran with: the first, none
    assert learned[0] == 0 and learned[1] > 0 and learned[1:] == [learned[1]] * (STEPS - 1), learned


def test_a_fixed_headroom_is_kept_and_not_observed():
    nbytes = int(0.6 * plain_footprint("cnn"))
    budget = coop_arena.Budget(nbytes, device="cpu", headroom=300_000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", coop_arena.FootprintExceeded)  # nothing observed, nothing to warn about
        run("cnn", budget, steps=2, measure_from=2)
    assert budget.headroom == -(-300_000 // 512) * 512 and budget.arena.nbytes == nbytes - budget.headroom
    assert not budget.stats.footprint_observed


def test_a_fixed_headroom_too_small_for_the_temporaries_warns_by_the_engines_count():
    """A fixed headroom is not observed, so the engine's own count of its temporaries is what can tell that a
    block went over the budget: it warns once (no block goes further over), with the headroom that holds them;
    `headroom=0` leaves the temporaries outside the cap by choice and warns of nothing."""
    nbytes = int(0.6 * plain_footprint("cnn"))
    small = coop_arena.Budget(nbytes, device="cpu", headroom=512)
    with pytest.warns(coop_arena.FootprintExceeded, match="the headroom is fixed") as caught:
        run("cnn", small, steps=3, measure_from=3)
    assert len([w for w in caught if w.category is coop_arena.FootprintExceeded]) == 1
    assert small.stats.footprint_peak > small.stats.cap
    with warnings.catch_warnings():
        warnings.simplefilter("error", coop_arena.FootprintExceeded)
        run("cnn", coop_arena.Budget(nbytes, device="cpu", headroom=0), steps=2, measure_from=2)


@pytest.mark.parametrize("headroom", [-1, 1 << 40, 1.5, True, "64"])
def test_a_bad_headroom_is_a_value_error_that_says_the_range(headroom):
    with pytest.raises(ValueError, match="headroom must be None"):
        coop_arena.Budget(1 << 20, device="cpu", headroom=headroom)


def test_a_block_run_under_the_users_profiler_is_not_observed():
    budget = coop_arena.Budget(1 << 24, device="cpu")
    model = build("cnn")
    x, y = batch("cnn", 0)
    with torch.profiler.profile():
        with budget:
            loss_fn("cnn", model(x), y).backward()
    assert not budget.stats.footprint_observed and budget.headroom == 0


def test_a_block_over_the_budget_that_was_not_observed_warns_by_the_engines_count():
    """A first block run under the user's own profiler is not observed (profilers do not nest), yet it runs with
    the whole budget as its arena and its temporaries outside it: the engine's own count tells that it went over,
    and the Budget warns of it as of any block over the budget."""
    budget = coop_arena.Budget(int(0.6 * plain_footprint("cnn")), device="cpu")
    model = build("cnn")
    x, y = batch("cnn", 0)
    with pytest.warns(coop_arena.FootprintExceeded, match="by the engine's own count"):
        with torch.profiler.profile():
            with budget:
                loss_fn("cnn", model(x), y).backward()
    st = budget.stats
    assert not st.footprint_observed and st.footprint_peak > st.cap and st.temporary_peak > 0


def test_measure_leaves_out_what_is_kept_and_counts_what_is_freed():
    def f():
        tmp = torch.empty(1 << 20, dtype=torch.uint8)
        keep.append(torch.empty(1 << 18, dtype=torch.uint8))
        del tmp

    keep = []
    fp = footprint.measure(f, keep=lambda: keep)
    assert fp.excess == 1 << 20 and fp.kept == 1 << 18 and fp.peak == (1 << 20) + (1 << 18)


@pytest.mark.parametrize("numel", [1 << 10, 1 << 20])  # 4 KiB: copied to the host; 4 MiB: fingerprinted
def test_a_write_no_schema_marks_is_found_in_an_argument_of_any_size(numel):
    """The first call of an op configuration compares its arguments from outside the arena before and after it
    (Note [Probing for hidden writes] in dispatch.py); a large one by a fingerprint that allocates nothing of its
    size, so the probe adds nothing outside the arena that the budget would not cover."""
    from coop_arena.dispatch import PROBE_COPY_MAX, _probe, _probed_writes
    t = torch.randn(numel)
    probe = _probe([(0, t)])
    assert _probed_writes(probe) == frozenset()
    t.data[numel // 2] += 1  # a write that leaves the version counter alone, like an untagged custom op's
    assert _probed_writes(probe) == {0}
    if numel * 4 > PROBE_COPY_MAX:
        fp = footprint.measure(lambda: _probed_writes(_probe([(0, t)])))
        assert fp.peak < numel * 4 // 8  # no copy of the argument


def test_moves_inside_the_arena_allocate_nothing_outside_it():
    """A GRU at half its peak slides blocks by less than their size (relocations and compactions). Those moves copy
    inside the arena (one memmove on the CPU: Note [Overlapping moves] in arena.py), so the step allocates nothing
    outside it and its learned headroom stays 0: through a bounce buffer outside the arena the headroom became
    64 KiB, which the arena lost, and the next block no longer fitted."""
    torch.manual_seed(0)
    model = torch.nn.GRU(32, 64, num_layers=2, batch_first=True)
    x = torch.randn(8, 25, 32, generator=torch.Generator().manual_seed(0))

    def step(ctx):
        with ctx:
            model(x)[0].sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        return grads

    want = step(contextlib.nullcontext())
    probe = coop_arena.Budget(1 << 30, device="cpu")
    step(probe)
    nbytes = probe.stats.peak_bytes // 2
    budget = coop_arena.Budget(nbytes, device="cpu")
    for _ in range(3):
        assert bitwise_equal(step(budget), want)
        st = budget.stats
        assert st.relocated_bytes > 0 and st.evictions > 0 and st.rematerializations > 0
    assert budget.headroom == 0 and st.arena_bytes == nbytes and st.temporary_peak == 0
