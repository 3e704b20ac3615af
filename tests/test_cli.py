"""What a new user meets first: the CLI's answers to wrong input (one line, exit code 2, no traceback) and the
public API's documentation (`help(coop_arena.Budget)`)."""

import inspect
import io
import warnings

import pytest
from rich.console import Console

import coop_arena
from coop_arena.cli import main
from coop_arena.plan import plan

_FACTORIES = '''
import torch
def build(batch):
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)), torch.randn(batch, 8)
def dict_inputs(batch):
    return torch.nn.Linear(8, 8), {"x": torch.randn(batch, 8)}
def str_inputs(batch):
    return torch.nn.Linear(8, 8), "inputs"
def wrong_shape(batch):
    return torch.nn.Linear(8, 8), torch.randn(batch, 5)
def raises(batch):
    raise RuntimeError("no such checkpoint")
'''


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "doc_factories.py").write_text(_FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "doc_factories", raising=False)


def _usage_error(capsys, args) -> str:
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("budget", ["2", "100", "0.4KiB"])
def test_plan_refuses_a_budget_below_the_smallest_arena(capsys, budget):
    """`--budget 2` (meant: 2 GiB, or a ratio) was planned as 2 bytes, silently raised to 512, and every policy
    reported "no"."""
    err = _usage_error(capsys, ["plan", "mlp", "--batch", "4", "--budget", budget])
    assert f"budget '{budget}' is" in err and "smallest arena of 512 bytes" in err and "ratio" in err
    if budget == "2":
        assert "without a unit counts bytes" in err and "2GiB" in err


@pytest.mark.parametrize("factory,message", [
    ("doc_factories:dict_inputs", "returned example inputs dict ('x': Tensor)"),
    ("doc_factories:str_inputs", "returned example inputs str"),
    ("doc_factories:wrong_shape", "fails on its example inputs on meta, with or without a Budget: RuntimeError"),
    ("doc_factories:raises", "doc_factories:raises(2) raised RuntimeError: no such checkpoint"),
    (":build", "names no module"),
    ("doc_factories:", "names no function"),
])
def test_plan_of_a_wrong_factory_is_one_line(capsys, factories, factory, message):
    """A factory whose inputs were a dict or a string, or whose model failed on its own inputs, or that raised,
    ended `coop-arena plan` with a traceback (AttributeError: 'dict' object has no attribute 'to', torch's
    RuntimeError); ':build' said only "Empty module name"."""
    err = _usage_error(capsys, ["plan", factory, "--batch", "2"])
    assert message in err


def test_plan_reads_small_sizes_and_says_why_a_policy_does_not_fit(factories):
    """Sizes were printed in MiB only (a small model's plan read "plain peak 0.0 MiB, budget 0.0 MiB" everywhere),
    and a policy that did not fit showed only its op, cut by an 80-column table ("no (aten.mm.de…")."""
    out = io.StringIO()
    r = plan("doc_factories:build", 2, "0.3", Console(file=out, width=80))
    text = out.getvalue()
    assert "0.0 MiB" not in text and "KiB" in text
    for policy, row in r["policies"].items():
        assert not row["fits"]
        assert f"{policy} does not fit: cannot place" in text.replace("\n", " ")


def test_plan_does_not_warn_about_thrashing_it_reports():
    """A plan at a tight ratio printed the thrashing RuntimeWarning, which advises running `coop-arena plan`, in
    the middle of `coop-arena plan`'s own output; the table already reports the overhead."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        r = plan("mlp", 64, "0.2", Console(file=io.StringIO()))  # 1.75-2.2x at 0.25 (the peak has no weight gradients)
    assert max(row["compute_overhead"] for row in r["policies"].values()) > 3.0


def test_evaluate_refuses_an_unwritable_out_folder_before_sweeping(capsys, tmp_path, monkeypatch):
    """The folder was made after the sweep (about 10 minutes for the suite), which then ended in a traceback."""
    import coop_arena.evaluate as evaluate
    monkeypatch.setattr(evaluate, "evaluate", lambda *a, **k: pytest.fail("swept before checking --out"))
    (tmp_path / "file").write_text("")
    err = _usage_error(capsys, ["evaluate", "--models", "mlp", "--quick", "--out", str(tmp_path / "file" / "out")])
    assert "cannot make that folder" in err


def test_evaluate_where_no_model_could_be_swept_fails(capsys, factories, tmp_path):
    """Every model reported with an error gave exit code 0."""
    code = main(["evaluate", "--models", "doc_factories:wrong_shape", "--quick", "--configs", "coop",
                 "--out", str(tmp_path / "out")])
    assert code == 1
    assert "no model could be swept" in capsys.readouterr().err


def test_demo_at_a_ratio_too_small_reports_instead_of_raising(capsys):
    """`coop-arena demo --ratio 0.01` (accepted by the CLI) ended with an OutOfBudget traceback."""
    assert main(["demo", "--steps", "1", "--ratio", "0.01"]) == 1
    out = capsys.readouterr().out
    assert "coop does not fit: OutOfBudget" in out and "no (OutOfBudget)" in out


def test_budget_documents_every_constructor_argument():
    """`help(coop_arena.Budget)` showed the signature and nothing else: the class had no docstring."""
    doc = inspect.getdoc(coop_arena.Budget)
    assert doc
    for name in inspect.signature(coop_arena.Budget).parameters:
        assert name in doc, name
    for exported in ("Memory", "Tensor"):
        assert "__doc__" in vars(getattr(coop_arena, exported)) and getattr(coop_arena, exported).__doc__


def test_cheap_density_is_a_number_not_a_bool():
    """max_overhead=True was refused, cheap_density=True was taken as 1.0."""
    with pytest.raises(ValueError, match="cheap_density"):
        coop_arena.Budget(1 << 20, device="meta", cheap_density=True)
