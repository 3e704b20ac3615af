"""`coop-arena plan`: a dry run that reports whether a step fits, per policy."""

import io
import pytest
from rich.console import Console

from coop_arena.cli import main
from coop_arena.plan import parse_budget, plan


@pytest.mark.parametrize("text,expected", [("0.5", ("ratio", 0.5)), ("1", ("ratio", 1.0)), ("8GiB", ("bytes", 8 * 2**30)),
                                           ("512MiB", ("bytes", 512 * 2**20)), ("1e9", ("bytes", 1e9)),
                                           ("300kb", ("bytes", 300e3)), ("2", ("bytes", 2.0))])
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "5 parsecs", "-1GiB", "0"])
def test_parse_budget_rejects(text):
    with pytest.raises(ValueError, match="cannot read budget|less than one byte"):
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
