"""The Triton kernels compiled for a GPU (sm_90), on a machine without one.

The CPU suite runs the kernels in Triton's interpreter, which neither specialises arguments nor lowers anything
to the GPU: a kernel only the compiler rejects passes there and fails at its first launch on a GPU (where the
arena then falls back to copy_ with a warning, and the kernel tests fail). Two such faults in _num_tiles: an int
argument equal to 1 arrives as a constexpr, which has no `.to`; and `tl.to_tensor`, which Triton 3.6 (the one
installed beside torch 2.11) does not have. This test fails on each, the second under such a Triton.

Here every launcher runs as it would on a GPU, but in a child process without TRITON_INTERPRET, under a stand-in
driver that reports one sm_90 GPU, and each launch compiles (Triton's own compiler, ptxas included) and stops
before launching (JITFunction.run with warmup=True). The child imports this checkout's kernels/ (as
bench/gpu_check.py does) and compiles into an empty cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGET = ("cuda", 90, 32)  # (backend, compute capability, warp size): the H100 / H200


def test_every_launcher_compiles_for_a_gpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    out = done.stdout + done.stderr
    if done.returncode == 0 and out.startswith("skip: "):
        pytest.skip(out.splitlines()[0][len("skip: "):])
    assert done.returncode == 0, out[-6000:]
    assert "compiled" in out, out[-2000:]


# ------------------------------------------------------------------------------------------------- the child
def _launches(kcopy, kpoint):
    """(label, call) of every configuration to compile: each kernel through its launcher with each element width
    and layout the launchers tell apart, and the serial move kernel at the sizes Triton specialises on. Each call is
    made before the next is yielded (the lambdas read the loop's current values)."""
    import torch

    buf = torch.zeros(1 << 20, dtype=torch.uint8)
    moves = [(0, 512, 512), (1, 700, 333), (0, 1, 512), (1, 0, 512), (0, 64 << 10, 200 << 10)]
    for src, dst, n in moves:
        yield f"arena_move({src}, {dst}, {n})", lambda: kcopy.arena_move(buf, src, dst, n)
    for n in (1, 2**31 - 1, 2**31 + 1):  # a constexpr, the largest int32, an int64 (compiled, never run)
        for forward in (True, False):
            yield (f"_move_serial_kernel(n={n}, FORWARD={forward})",
                   lambda: kcopy._move_serial_kernel[(1,)](buf[1:], buf, n, FORWARD=forward, BLOCK=kcopy.SERIAL_BLOCK))
    yield "_copy_bytes_kernel(n=2**31 + 1)", lambda: kcopy._copy_bytes_kernel[(1,)](buf, buf, 2**31 + 1, BLOCK=1024)
    for dtype in (torch.int8, torch.float16, torch.float32, torch.int64):
        yield f"copy_into {dtype} contiguous", lambda: kcopy.copy_into(torch.empty(33, dtype=dtype),
                                                                        torch.ones(33, dtype=dtype))
        yield f"copy_into {dtype} transposed", lambda: kcopy.copy_into(torch.empty(8, 16, dtype=dtype),
                                                                        torch.ones(16, 8, dtype=dtype).t())
    yield "copy_into 4-D permuted", lambda: kcopy.copy_into(torch.empty(5, 4, 3, 2),
                                                            torch.ones(2, 3, 4, 5).permute(3, 2, 1, 0))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for approximate in ("none", "tanh"):
            yield (f"bias_gelu {dtype} {approximate}",
                   lambda: kpoint.bias_gelu(torch.zeros(4, 64, dtype=dtype), torch.zeros(64, dtype=dtype),
                                            approximate=approximate))
        yield f"seeded_dropout {dtype}", lambda: kpoint.seeded_dropout(torch.zeros(4, 64, dtype=dtype), 0.3, 2**40)


def _child() -> int:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    gpu_check.use_this_checkout()  # this checkout's kernels/, installed or not

    import torch
    import triton
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    try:
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget
        assert "nvidia" in backends and hasattr(driver, "set_active")
    except (ImportError, AssertionError) as e:
        print(f"skip: Triton {triton.__version__} cannot compile for an NVIDIA GPU here ({type(e).__name__}: {e})")
        return 0
    ptxas = os.environ.get("TRITON_PTXAS_PATH") or Path(triton.__file__).parent / "backends/nvidia/bin/ptxas"
    if not Path(ptxas).is_file():
        print(f"skip: Triton {triton.__version__} has no ptxas here ({ptxas})")
        return 0

    class OneGPU:
        """The driver of a machine with one GPU of TARGET, as far as compiling needs one."""

        def get_current_target(self):
            return GPUTarget(*TARGET)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

    driver.set_active(OneGPU())
    run = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kw: run(self, *args, grid=grid, warmup=True, **kw)

    import coop_arena.kernels.copy as kcopy
    import coop_arena.kernels.pointwise as kpoint
    kcopy.require_kernels = kpoint.require_kernels = lambda t, op: None  # CPU tensors stand in for CUDA ones

    failed = 0
    for label, launch in _launches(kcopy, kpoint):
        try:
            launch()
        except Exception as e:
            failed += 1
            cause = e
            while cause.__cause__ is not None:
                cause = cause.__cause__
            last = (str(cause).strip().splitlines() or [""])[-1]  # (a CompilationError ends with its cause)
            print(f"FAILED {label}: {type(e).__name__}: {str(e).strip()[:1500]}\n  cause: {type(cause).__name__}: "
                  f"{last[:500]}")
    print(f"triton {triton.__version__}, target {TARGET}: {failed} launch(es) failed to compile" if failed else
          f"triton {triton.__version__}, target {TARGET}: every launch compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_child())
