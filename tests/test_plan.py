"""`coop-arena plan`: a dry run that reports whether a step fits, per policy."""

import io
import pytest
import torch
from rich.console import Console

import coop_arena
from coop_arena.cli import main
from coop_arena.plan import parse_budget, plan


@pytest.mark.parametrize("text,expected", [("0.5", ("ratio", 0.5)), ("1", ("ratio", 1.0)), ("8GiB", ("bytes", 8 * 2**30)),
                                           ("512MiB", ("bytes", 512 * 2**20)), ("1e9", ("bytes", 1e9)),
                                           ("300kb", ("bytes", 300e3)), ("2", ("bytes", 2.0)),
                                           ("2.5e-1", ("ratio", 0.25)), ("1E9", ("bytes", 1e9))])
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "5 parsecs", "-1GiB", "0", "1.5", "2.5"])
def test_parse_budget_rejects(text):
    """(1.5 is neither a ratio of the peak nor a whole number of bytes: it was read as one byte)"""
    with pytest.raises(ValueError, match="cannot read budget|less than one byte|neither a ratio"):
        parse_budget(text)


def test_plan_fits_with_eviction_and_reports_bounds():
    r = plan("mlp", 64, "0.5", Console(file=io.StringIO()))
    assert 0 < r["lower_bound"] <= r["budget"] < r["plain_peak"]
    for policy, row in r["policies"].items():
        assert row["fits"], policy
        assert row["evictions"] > 0 and row["compute_overhead"] > 1.0
        assert row["peak_bytes"] <= r["budget"]


def test_plan_reports_a_step_that_cannot_fit():
    r = plan("cnn", 8, "64KiB", Console(file=io.StringIO()))
    assert r["budget"] < r["lower_bound"]
    assert all(not row["fits"] and "Raise the budget" in row["error"] for row in r["policies"].values())


def test_cli_plan_and_errors(capsys):
    assert main(["plan", "gpt", "--batch", "4", "--budget", "0.6"]) == 0
    assert "coop" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "nosuchmodel"])
    with pytest.raises(SystemExit):
        main(["plan", "mlp", "--budget", "lots"])


def test_plan_runs_the_baselines_the_evaluation_runs():
    """`coop-arena plan` and the demo ran dtr and dte with coop's partitioned placement (`Budget(policy=...)`),
    which the evaluation calls coop-no-window: their rows did not match the README's tables."""
    import coop_arena
    from coop_arena.evaluate import CONFIGS
    from coop_arena.plan import load, step
    r = plan("gpt", 4, "0.5", Console(file=io.StringIO()))
    for policy in ("dtr", "dte"):
        model, inputs = load("gpt", 4)
        b = coop_arena.Budget(r["budget"], device="meta", **CONFIGS[policy])
        step(model, inputs, b)
        assert b.stats.evictions > 0
        assert r["policies"][policy]["compute_overhead"] == b.stats.compute_overhead, policy


def test_plan_imports_a_factory_from_the_current_directory(tmp_path, monkeypatch):
    """The installed `coop-arena` script does not put the current directory on sys.path, as `python -m` does."""
    import sys
    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def build(batch):\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), (torch.randn(batch, 8),)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mymodels", raising=False)
    assert main(["plan", "mymodels:build", "--batch", "4", "--budget", "1"]) == 0


def test_cli_evaluate_refuses_an_unknown_model(capsys, tmp_path):
    with pytest.raises(SystemExit):
        main(["evaluate", "--models", "resnet5O", "--out", str(tmp_path / "out")])
    assert "unknown model 'resnet5O'" in capsys.readouterr().err


def test_plan_of_a_model_a_dry_run_cannot_run_is_one_line(tmp_path, monkeypatch, capsys):
    """A step with an op whose output shape depends on the data (a mixture of experts' token dispatch) cannot run
    on meta: `coop-arena plan` printed the traceback."""
    (tmp_path / "routed.py").write_text(
        "import torch\n"
        "class Routed(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return self.lin(x[x[:, 0] > 0])\n"
        "def build(batch):\n"
        "    return Routed(), (torch.randn(batch, 8),)\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["plan", "routed:build"])
    err = capsys.readouterr().err
    assert "cannot be planned in a dry run" in err and "a dry run on meta has no data" in err


def test_a_dry_run_of_a_tied_model_keeps_it_tied_and_matches_the_cpu_run():
    """`Module.to("meta")` makes a new Parameter per module for a CPU parameter, which untied the GPT example's
    embedding and head: its plan was of another step (one op fewer, other evictions) and said that dte fits at
    0.25 of the peak, where the CPU run of the tied model is OutOfBudget."""
    import coop_arena
    from coop_arena import examples
    from coop_arena.evaluate import CONFIGS
    from coop_arena.plan import load, plan, step
    model, _ = load("gpt", 8)
    assert model.head.weight is model.tok.weight
    result = plan("gpt", None, "0.25", console=Console(file=io.StringIO()))
    for policy, row in result["policies"].items():
        cpu_model, inputs = examples.example("gpt", 8)
        budget = coop_arena.Budget(max(result["budget"], 512), device="cpu", **CONFIGS[policy])
        try:
            step(cpu_model, inputs, budget)
            fits = True
        except coop_arena.OutOfBudget:
            fits = False
        assert fits == row["fits"], policy
        if fits:
            st = budget.stats
            assert (st.evictions, st.compute_overhead) == (row["evictions"], row["compute_overhead"])


def test_plan_of_a_factory_takes_a_mapping_output_and_says_what_a_bad_factory_returned(tmp_path, monkeypatch, capsys):
    """A model returning a mapping (transformers' ModelOutput) is planned from its first field; a factory that is
    not function(batch), returns no (model, inputs) pair or a model with nothing to train is one line, not a
    traceback."""
    (tmp_path / "factories.py").write_text(
        "import torch\n"
        "class Named(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        return {'logits': self.lin(x).tanh(), 'hidden': x}\n"
        "def named(batch):\n"
        "    return Named(), (torch.randn(batch, 8),)\n"
        "def no_batch():\n"
        "    return Named(), (torch.randn(2, 8),)\n"
        "def alone(batch):\n"
        "    return Named()\n"
        "def frozen(batch):\n"
        "    return torch.nn.Linear(8, 8).requires_grad_(False), (torch.randn(batch, 8),)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "factories:named", "--budget", "0.5"]) == 0
    assert "coop" in capsys.readouterr().out
    for spec, said in [("no_batch", "failed: no_batch() takes 0 positional arguments"),
                       ("alone", "returned Named, not (model, example_inputs)"),
                       ("frozen", "(Tensor with no grad) has nothing to train")]:
        with pytest.raises(SystemExit):
            main(["plan", f"factories:{spec}"])
        assert said in capsys.readouterr().err, spec


def test_a_dry_run_of_multihead_attention_takes_the_cpus_attention_kernel():
    """nn.MultiheadAttention calls attention from F.multi_head_attention_forward, which reaches a torch-function
    mode first: the mode is off while it handles a call, so the dry run took the math path (68 ops, a quarter more
    peak) where the CPU runs its fused kernel (60 ops)."""
    def step(device, nbytes):
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).to(device)
        x = torch.randn(4, 16, 32).to(device)
        mask = (torch.arange(16)[None] >= torch.tensor([16, 9, 12, 5])[:, None]).to(device)
        budget = coop_arena.Budget(nbytes, device=device)
        with budget:
            layer(x, src_key_padding_mask=mask).square().mean().backward()
        s = budget.stats
        return s.ops, s.peak_bytes, s.evictions, s.rematerializations, s.compute_overhead

    peak = step("cpu", 1 << 24)[1]
    for nbytes in (1 << 24, int(peak * 0.75)):
        assert step("cpu", nbytes) == step("meta", nbytes)
    assert step("cpu", int(peak * 0.75))[2] > 0
    assert torch.nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
