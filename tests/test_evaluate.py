"""`coop-arena evaluate`, the model suite and the thrashing limit, end to end on small models."""

import io
import json

import matplotlib.image
import pytest
import torch
from rich.console import Console

import coop_arena
from coop_arena import suite
from coop_arena.cli import main
from coop_arena.evaluate import CONFIGS, Sweep, check_targets, evaluate, run_once, sweep_model
from coop_arena.plan import load, plan, step

from training import bitwise_equal, state, train

QUIET = Console(file=io.StringIO())


def broken(batch):
    """A model whose step the engine refuses (a shape change beyond the tensor's storage)."""
    class Broken(torch.nn.Module):
        def forward(self, x):
            return (x * 2).as_strided_((10 * x.numel(),), (1,))
    return Broken(), (torch.empty(batch, 4),)


def test_evaluate_quick_end_to_end(tmp_path):
    out = tmp_path / "ev"
    assert main(["evaluate", "--quick", "--models", "mlp", "cnn", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["command"].startswith("coop-arena evaluate --quick")
    assert set(results["models"]) == {"mlp", "cnn"}
    for name, m in results["models"].items():
        assert 0 < m["lower_bound"] < m["plain_peak"]
        assert set(m["runs"]) == set(CONFIGS)
        for config, data in m["runs"].items():
            ratios = [r["ratio"] for r in data["runs"]]
            assert ratios == sorted(ratios, reverse=True) and ratios[0] == 1.0
            fits = [r for r in data["runs"] if r["fits"]]
            # the sweep went below the ratio where the step fits, and stopped at the first failure
            assert data["smallest_ratio"] == min(r["ratio"] for r in fits)
            assert data["first_failure"] is not None and not data["runs"][-1]["fits"]
            assert "OutOfBudget" in data["runs"][-1]["error"] or "Thrashing" in data["runs"][-1]["error"]
            # tensors were evicted and recomputed on the way down
            assert any(r["evictions"] > 0 and r["rematerializations"] > 0 and r["compute_overhead"] > 1.0
                       for r in fits)
            # (copies into free holes instead of evictions cost 2 x their bytes, Note [Relocation])
            assert all(r["compute_overhead"] == 1.0 for r in fits
                       if r["rematerializations"] == 0 and r["relocated_bytes"] == 0)
            assert all(r["compute_overhead"] > 1.0 for r in fits if r["relocated_bytes"] > 0)
            assert all(r["peak_bytes"] <= r["budget"] for r in fits)
    assert [t["target"] for t in results["targets"]][0].startswith("coop's overhead <= min(dtr, dte)")
    summary = (out / "summary.md").read_text()
    assert "| mlp | 8 |" in summary and "Targets:" in summary
    for fig in ("overhead.png", "search_fragmentation.png"):
        img = matplotlib.image.imread(out / fig)
        assert img.shape[0] > 200 and img.shape[1] > 200
        assert (img[..., :3] < 0.5).any(), f"{fig} has no dark pixels: nothing was drawn"


def test_a_model_that_cannot_run_is_reported_and_the_sweep_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(suite.SUITE, "needs_missing_lib",
                        suite.Workload(suite.unet, 1, "cnn", "no_such_library_for_coop_arena"))
    sweep = Sweep(step=0.25, refine=0, configs=("coop",))
    results = evaluate(["needs_missing_lib", "test_evaluate:broken", "mlp"], sweep, out=tmp_path,
                       console=QUIET)
    models = results["models"]
    assert "no_such_library_for_coop_arena" in models["needs_missing_lib"]["error"]
    assert "UnsupportedOp" in models["test_evaluate:broken"]["error"]
    assert models["mlp"]["runs"]["coop"]["smallest_ratio"] is not None
    assert "error: " in (tmp_path / "summary.md").read_text()
    assert (tmp_path / "overhead.png").stat().st_size > 0


def test_budget_below_the_lower_bound_is_reported_not_raised():
    model, inputs = load("cnn", 8)
    probe = coop_arena.Budget(1 << 40, device="meta")
    step(model, inputs, probe)
    r = run_once(model, inputs, probe.stats.lower_bound // 2, "coop")
    assert r["fits"] is False and "OutOfBudget" in r["error"] and "Raise the budget" in r["error"]


def test_refinement_bisects_the_edge():
    res = sweep_model("cnn", 8, Sweep(step=0.1, refine=3, configs=("coop",)))
    runs = res["runs"]["coop"]
    good, bad = runs["smallest_ratio"], runs["first_failure"]
    assert 0 < bad < good and good - bad <= 0.1 / 2**3 + 1e-9
    grid = Sweep(step=0.1).grid()
    assert len([r for r in runs["runs"] if r["ratio"] not in grid]) == 3


def test_targets_are_decided_by_the_numbers():
    def model(kind, lb, **configs):
        runs = {}
        for name, pts in configs.items():
            rs = [{"ratio": r, "fits": o is not None, "compute_overhead": o} for r, o in pts]
            runs[name] = {"runs": rs, "smallest_ratio": min((r for r, o in pts if o is not None), default=None)}
        return {"kind": kind, "lower_bound_ratio": lb, "runs": runs}
    results = {"sweep": {"configs": ["coop", "dtr", "dte"], "step": 0.1}, "models": {
        "a": model("cnn", 0.1, coop=[(1.0, 1.0), (0.5, 1.04), (0.4, 1.1), (0.3, 1.2), (0.2, 1.9), (0.1, None),
                                     (0.15, 3.0), (0.125, None)],
                   dtr=[(1.0, 1.0), (0.5, 1.3), (0.4, None)], dte=[(1.0, 1.0), (0.5, 1.03), (0.45, 1.05), (0.4, None)]),
        "b": model("rnn", 0.1, coop=[(1.0, 1.0), (0.5, 1.5), (0.3, None)], dtr=[(1.0, 1.0), (0.5, 1.4), (0.3, None)],
                   dte=[(1.0, 1.0), (0.3, None)]),
        "c": model("cnn", 0.1, coop=[(1.0, 1.0), (0.5, None)], dtr=[(1.0, 1.0), (0.5, 1.02), (0.4, None)],
                   dte=[(1.0, 1.0), (0.4, 1.3)])}}
    targets = check_targets(results)
    assert [x["met"] for x in targets] == [False, False, False, False, False]
    t = {x["target"].split(" at every")[0].split(" on every")[0].split(":")[0]: x["detail"] for x in targets}
    # a@0.45 was not run for coop but lies between ratios where it fits: not a miss; b is 7 % worse
    assert t["coop's overhead <= min(dtr, dte) + 2%"] == ("b@0.5: coop 1.500x > 1.400x; "
                                                         "c@0.5: coop does not fit, best baseline 1.020x; "
                                                         "c@0.4: coop does not fit, best baseline 1.300x")
    # a@0.15 was added by the refinement: nothing was run at 0.25, so its partner is 0.2, the nearest below that
    assert t["no cliff"] == "a@0.2: 1.900x vs 1.200x at +0.1; a@0.15: 3.000x vs 1.900x at 0.2"
    assert t["coop's smallest feasible ratio <= dte's"] == "c: coop 1.0 vs dte 0.4"
    assert t["coop's smallest feasible ratio within 2x of the lower bound"] == (
        "b: 0.5 vs lower bound 0.100; c: 1.0 vs lower bound 0.100")
    assert t["coop's overhead at ratio 0.5 <= 1.10x"] == "c: does not fit"  # a fits at 1.04x; b is no CNN


# ------------------------------------------------------------------------------------------------ thrashing
def test_max_overhead_stops_a_thrashing_step_and_leaves_the_budget_usable():
    probe = coop_arena.Budget(1 << 26, device="cpu")
    train("mlp", probe, steps=1)
    nbytes = int(0.7 * probe.stats.peak_bytes)
    unlimited = coop_arena.Budget(nbytes, device="cpu")
    train("mlp", unlimited, steps=1)
    overhead = unlimited.stats.compute_overhead
    assert unlimited.stats.rematerializations > 0 and overhead > 1.05
    limited = coop_arena.Budget(nbytes, device="cpu", max_overhead=1.0 + (overhead - 1.0) / 4)
    with pytest.raises(coop_arena.Thrashing, match="max_overhead=1.*raise the budget") as err:
        train("mlp", limited, steps=1)
    assert err.value.recompute_cost > (err.value.max_overhead - 1) * err.value.compute_cost
    reached = (err.value.compute_cost + err.value.recompute_cost) / err.value.compute_cost  # the overhead, not
    assert f"overhead has reached {reached:.2f}x" in str(err.value)  # recompute / compute, is what the limit is on
    assert err.value.budget == limited.memory.budget and f"({limited.memory.budget} bytes)" in str(err.value)
    assert limited.memory.used_bytes == 0
    limited.max_overhead = None  # the same Budget, no limit: the step runs and matches plain PyTorch
    assert bitwise_equal(state(train("mlp")), state(train("mlp", limited, steps=3)))
    assert limited.stats.rematerializations > 0


def test_the_thrashing_warning_never_suggests_a_budget_at_or_below_its_own():
    """The suggestion is twice the lower bound seen so far, which early in a step can be below the budget that
    already thrashes (ResNet-50 at 0.20 of its peak was told to try 0.19): it is at least the next 0.05 above."""
    from types import SimpleNamespace
    budget = coop_arena.Budget(20 << 20, device="meta")
    budget.memory.stats.eviction_events = 1
    held = 100 << 20  # the budget is 0.20 of what the step has held so far, its lower bound so far 0.095
    budget._runtime = SimpleNamespace(counters=SimpleNamespace(live_peak=held, working_set_peak=held * 95 // 1000,
                                                               unevictable_peak=0))
    assert "--budget 0.25" in budget._explain_thrashing()
    budget._runtime.counters.working_set_peak = held * 2 // 10  # twice this lower bound is the larger
    assert "--budget 0.40" in budget._explain_thrashing()


@pytest.mark.parametrize("value", [1.0, 0.5, -3, True, "10"])
def test_max_overhead_is_validated(value):
    with pytest.raises(ValueError, match="max_overhead must be None"):
        coop_arena.Budget(1 << 20, max_overhead=value)


# ------------------------------------------------------------------------------------------------ the suite
@pytest.mark.parametrize("name,batch", [("unet", 2), ("bilstm", 16)])
def test_hand_written_suite_models_plan_under_half_their_peak(name, batch):
    r = plan(name, batch, "0.5", QUIET)
    assert r["batch"] == batch and r["lower_bound"] < r["budget"] < r["plain_peak"]
    coop = r["policies"]["coop"]
    assert coop["fits"] and coop["evictions"] > 0 and coop["compute_overhead"] > 1.0


def test_unet_keeps_odd_sizes():
    model, (x,) = suite.SUITE["unet"].build(5)
    assert tuple(x.shape) == (5, 3, 460, 608)
    assert tuple(model(x).shape) == (5, 2, 460, 608)


def test_suite_lists_the_papers_workloads():
    assert {n: w.batch for n, w in suite.SUITE.items()} == {
        "resnet50": 115, "resnet152": 55, "inception_v3": 96, "densenet121": 70, "unet": 5, "swin_t": 40,
        "bert_large": 4, "bilstm": 2048, "gpt2": 8}


def test_library_models_build_on_meta_or_say_why_not():
    for name, w in suite.SUITE.items():
        why = suite.available(name)
        if w.needs is None:
            assert why is None
        elif why is not None:
            assert w.needs in why and "coop-arena[models]" in why
            with pytest.raises(ValueError, match=w.needs):
                load(name, 1)


def test_gpt2_from_transformers_dry_run():
    if suite.available("gpt2"):
        pytest.skip(suite.available("gpt2"))
    r = plan("gpt2", 1, "0.5", QUIET)
    assert r["plain_peak"] > 100 << 20  # the logits alone: 512 x 50257 floats
    assert r["policies"]["coop"]["fits"] and r["policies"]["coop"]["evictions"] > 0


def _without_timings(results):
    timing = {"seconds", "search_seconds", "search_seconds_per_event"}
    return {n: {c: [{k: v for k, v in r.items() if k not in timing} for r in d["runs"]]
                for c, d in m["runs"].items()} for n, m in results["models"].items()}


def test_parallel_sweep_gives_the_same_numbers():
    sweep = Sweep(step=0.25, refine=1, configs=("coop", "dtr"))
    one = evaluate(["mlp", "cnn"], sweep, console=QUIET)
    two = evaluate(["mlp", "cnn"], sweep, console=QUIET, jobs=2)
    assert list(two["models"]) == ["mlp", "cnn"]
    assert _without_timings(one) == _without_timings(two)
    with pytest.raises(ValueError, match="jobs must be a positive int"):
        evaluate(["mlp"], sweep, console=QUIET, jobs=0)


def test_step_time_report_is_the_whole_results_file():
    """`make bench` rewrites bench/results/step_time.md from the JSON alone: the committed file is exactly what the
    report makes of the committed JSON (command, table, targets with met or missed)."""
    import pathlib
    import sys
    root = pathlib.Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "bench"))
    try:
        import report
    finally:
        sys.path.remove(str(root / "bench"))
    text = report.step_time(str(root / "bench/results/step_time.json"))
    assert text + "\n" == (root / "bench/results/step_time.md").read_text()  # as printed by `report.py`
    assert "## Targets" in text and "<= 1.10x plain" in text and "<= 1.35x plain" in text
