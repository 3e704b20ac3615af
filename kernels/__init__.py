"""Triton kernels for coop_arena (installed as coop_arena.kernels).

Submodules (each imports triton): `copy` (arena_move, copy_into), `pointwise` (bias_gelu, seeded_dropout).
This package itself does not import triton; `kernels_available(device)` says whether the kernels can run there.

Note [The checkout's root on sys.path]
Rationale: this folder is `coop_arena.kernels` once installed, but from the checkout's root (`python -m ...`, a
  REPL, `make test`) Python also finds it as a top-level package named `kernels`, which is the import name of
  Hugging Face's `kernels`, a dependency of transformers since 5.25: `import transformers`'s GPT-2 then ran
  `from kernels import CUDAProperties` against this folder and failed with ImportError.
Approach: imported under the top-level name, this module steps aside: when another `kernels` is found on
  sys.path outside the checkout, that one is loaded in its place (`sys.modules["kernels"]`, which the import
  returns). Without another, nothing changes.
Limitations: `importlib.util.find_spec("kernels")` still finds this folder first; it only reports that some
  `kernels` exists, which stays true.
"""

if __name__ == "kernels":  # the checkout's root is on sys.path: see the Note above
    def _step_aside() -> bool:
        import importlib.machinery
        import importlib.util
        import os
        import sys

        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        path = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != root]
        spec = importlib.machinery.PathFinder.find_spec("kernels", path)
        if spec is None or spec.loader is None:
            return False
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop("kernels", None)
            raise
        return True

if __name__ != "kernels" or not _step_aside():
    from ._util import kernels_available

    __all__ = ["kernels_available"]
