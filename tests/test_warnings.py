"""Every warning a user can meet is reported at the user's line (the `with budget:` line, the model call,
`loss.backward()`), not inside coop_arena or torch: `coop_arena.errors.warn` finds that frame. And the thrashing
warning speaks of the user's model and names a command the user can run."""

from __future__ import annotations

import io
import re
import sys
import warnings
from contextlib import redirect_stdout

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import coop_arena
from coop_arena.arena import Arena

HERE = __file__


def line() -> int:
    """The caller's line number, plus one: the line after the call."""
    return sys._getframe(1).f_lineno + 1


def caught_here(caught, category, match: str):
    """The one warning of `category` whose text matches, asserted to point at this file."""
    ours = [w for w in caught if issubclass(w.category, category) and re.search(match, str(w.message))]
    assert len(ours) == 1, [(w.category.__name__, str(w.message)[:80]) for w in caught]
    assert ours[0].filename == HERE, (ours[0].filename, ours[0].lineno)
    return ours[0]


# ------------------------------------------------------------------------------------------------- thrashing
DEPTH, WIDTH = 48, 64  # the chain of tests/test_workflows.py's thrashing test


def forward(layers, x):
    h = x
    for layer in layers:
        h = torch.tanh(layer(h))
    return h.square().mean()


def test_thrashing_points_at_the_users_line_and_names_a_runnable_command():
    torch.manual_seed(0)
    layers, x = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)), torch.randn(32, WIDTH)
    probe = coop_arena.Budget(1 << 26, device="cpu")
    with probe:
        forward(layers, x).backward()
    budget = coop_arena.Budget(probe.stats.peak_bytes // 10, device="cpu", headroom=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with budget:
            loss = forward(layers, x)
            loss.backward()
    w = caught_here(caught, RuntimeWarning, "this step is thrashing")
    assert budget.stats.compute_overhead > 3.0
    msg = str(w.message)
    assert "paper" not in msg and "your model" in msg
    command = re.search(r"`(coop-arena plan your_module:make_model --batch <your batch size> --budget ([0-9.]+))`",
                        msg)
    assert command, msg
    assert "make_model(batch) in your_module.py that returns (model, example_inputs)" in msg


def test_the_thrashing_warnings_command_runs(tmp_path, monkeypatch):
    """The command the warning names, with its placeholders filled in, is one `coop-arena plan` accepts."""
    (tmp_path / "your_module.py").write_text(
        "import torch\n"
        "def make_model(batch):\n"
        "    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()), torch.randn(batch, 16)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from coop_arena.cli import main
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["plan", "your_module:make_model", "--batch", "4", "--budget", "0.45"]) == 0
    assert "your_module:make_model, batch 4" in out.getvalue().replace("\n", " ")


# --------------------------------------------------------------------------------- warnings at a block's end
def test_footprint_exceeded_points_at_the_with_line():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))
    x = torch.randn(4, 3, 32, 32)
    budget = coop_arena.Budget(8 << 20, device="cpu")  # the first block's arena is the whole budget
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        at = line()
        with budget:
            model(x).sum().backward()
    assert caught_here(caught, coop_arena.FootprintExceeded, "outside its arena").lineno == at


def test_a_block_whose_ops_ran_elsewhere_points_at_the_with_line():
    lin, x = nn.Linear(8, 8), torch.randn(2, 8)
    budget = coop_arena.Budget(4096, device="meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        at = line()
        with budget:
            lin(x).sum().backward()
    assert caught_here(caught, RuntimeWarning, "none of this block's ops ran").lineno == at


def test_a_mode_left_active_points_at_the_with_line():
    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    other = Other()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            at = line()
            with coop_arena.Budget(1 << 20, device="cpu"):
                torch.ones(3) * 2
                other.__enter__()
        finally:
            other.__exit__(None, None, None)
    assert caught_here(caught, RuntimeWarning, "still active").lineno == at


# ------------------------------------------------------------------------------------- warnings at a call
def test_a_cut_trace_points_at_the_memory_snapshot_call():
    budget = coop_arena.Budget(48 << 10, device="cpu", headroom=0, trace_len=40)
    with budget:
        h = torch.randn(64, 64)
        for _ in range(30):
            h = h.tanh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        at = line()
        budget.memory_snapshot()
    assert caught_here(caught, RuntimeWarning, "as many as trace_len keeps").lineno == at


def test_a_compiled_module_points_at_the_model_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with coop_arena.Budget(1 << 20, device="cpu"):
                at = line()
                compiled(x)
        assert caught_here(caught, coop_arena.CompileNotApplied, "uncompiled").lineno == at
    finally:
        torch._dynamo.reset()


def test_autocast_in_a_dry_run_points_at_the_model_call():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).to("meta")
    x = torch.randn(4, 32, device="meta")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with coop_arena.Budget(1 << 20, device="meta"), torch.autocast("cpu", dtype=torch.bfloat16):
            at = line()
            y = model(x)
            y.float().sum().backward()
    assert caught_here(caught, coop_arena.AutocastNotPlanned, "no effect").lineno == at


def test_a_copy_kernel_that_cannot_run_points_at_the_caller(monkeypatch):
    """The logic of the CUDA fallback, with CUDA stood in for (as in tests/test_device.py)."""
    import coop_arena.kernels as kernels
    import coop_arena.kernels.copy as kcopy
    arena = Arena(8192, torch.device("cpu"), 8192)
    arena.device = torch.device("cuda")
    monkeypatch.setattr(kernels, "kernels_available", lambda device: True)

    def broken(buf, src, dst, n):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(kcopy, "arena_move", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        at = line()
        assert arena._pick_mover(None) is Arena._move_torch
    assert caught_here(caught, RuntimeWarning, "Triton copy kernel cannot run").lineno == at


def test_default_filters_show_the_warning_once_per_user_line():
    """The registry is the user's module's, as for warnings.warn: the default action shows it once per line."""
    from coop_arena import errors
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            errors.warn("once here", UserWarning)
    assert len(caught) == 1 and caught[0].filename == HERE


def test_a_warning_from_python_dash_c_is_shown(tmp_path):
    """`python -c` code (and any __main__ whose loader cannot give its source) gets the warning printed, not an
    ImportError from looking up the source line."""
    import subprocess
    code = ("import torch, coop_arena\n"
            "m = torch.nn.Linear(64, 64); x = torch.randn(64, 64)\n"
            "b = coop_arena.Budget(1 << 20, device='cpu')\n"
            "with b: m(x).sum().backward()\n"
            "print('done')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "done" in r.stdout and "FootprintExceeded" in r.stderr and "<string>:4" in r.stderr
