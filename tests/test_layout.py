"""The checkout's layout against other packages: from its root, `kernels/` (installed as coop_arena.kernels) must not
hide another top-level `kernels` (Hugging Face's, which transformers >= 5.25 imports). Note [The checkout's root on
sys.path] in kernels/__init__.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHOW = "import kernels; print(kernels.__file__); print(getattr(kernels, 'MARK', None))"


def _run_from_root(extra_path: list[str]) -> list[str]:
    """`python -c SHOW` run in the checkout's root, which `-c` puts first on sys.path (as `-m` and a REPL do)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(extra_path)}
    out = subprocess.run([sys.executable, "-c", SHOW], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def test_another_kernels_package_is_imported_in_place_of_the_checkouts(tmp_path):
    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text("MARK = 'the-other-kernels'\nfrom .sub import VALUE\n")
    (other / "sub.py").write_text("VALUE = 1\n")  # its own submodules resolve in its own folder
    assert _run_from_root([str(tmp_path)]) == [str(other / "__init__.py"), "the-other-kernels"]


def test_transformers_gpt2_imports_from_the_checkouts_root():
    code = "import transformers.models.gpt2.modeling_gpt2 as m; print(m.GPT2LMHeadModel.__name__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "GPT2LMHeadModel"


def test_without_another_the_checkouts_folder_imports_as_before():
    # the search outside the checkout finds nothing (as where no other `kernels` is installed): the folder stays
    code = ("import importlib.machinery as m; find = m.PathFinder.find_spec; "
            "m.PathFinder.find_spec = lambda name, path=None, target=None: "
            "None if name == 'kernels' and path is not None else find(name, path, target); " + SHOW)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(ROOT / "kernels" / "__init__.py"), "None"]


def test_coop_arena_kernels_is_this_checkouts_folder():
    import coop_arena.kernels as k
    assert Path(k.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    assert callable(k.kernels_available)
