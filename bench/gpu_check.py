"""The prepared GPU check: one run on a machine with an NVIDIA GPU writes `gpu_check.json` and `gpu_check.md`
under bench/results/ (`make gpu-check`, under 8 minutes, no network).

    python bench/gpu_check.py [--out bench/results] [--seconds 450] [--parts pytest,kernels,gpt2,resnet50]

Parts, each in a child process with a time limit, so a hang, a crash or running out of device memory is
recorded and the next part still runs (whatever a part measured before its limit is kept):
- pytest: the `@pytest.mark.gpu` layer of tests/ (and bench/test_kernels_bench.py when pytest-benchmark is
  installed), with its outcome per test.
- kernels: the Triton kernels compiled for real: arena_move disjoint, overlapping by a large distance (chunked
  launches) and by a small one (one program), against a torch copy through a temporary; copy_into against
  copy_. Bandwidth counts bytes read plus bytes written.
- gpt2 (GPT-2 small from a transformers config, batch 8 x 512) and resnet50 (torchvision's, batch 64 at 224 x
  224): plain PyTorch, run twice (the second is the reference, and must reproduce the first for a bitwise
  comparison to mean anything); the engine's own peak (one step under an ample Budget: "the plain peak
  measured with the same engine"; if that step fails, the part records why and runs no Budget, since their
  sizes come from it); then 3 steps under Budgets at 1.0, 0.5 and 0.3 of it with coop, dtr and
  dte (max_overhead as in `coop-arena evaluate`). Per run: step time against plain (median of steps 2 and 3),
  evictions, recomputations, device peak against nbytes + temporary_peak, parameters after 3 steps against
  plain. Children run under torch.use_deterministic_algorithms(True, warn_only=True), with
  CUBLAS_WORKSPACE_CONFIG set for them (cuBLAS's documented requirement for reproducible results); the
  warnings of ops that have no deterministic implementation are recorded.

Device memory of a step: `held` is torch.cuda.memory_allocated() just before the step (the arena included,
since it is allocated with the Budget), `extra` is max_memory_allocated() during the step minus `held`. The
Budget's device peak is nbytes + extra - the gradients' bytes (gradients are model-sized state outside the
budget by design, like the parameters). Targets are reported, never asserted. Without CUDA every part but the
pytest layer (whose tests then skip) is recorded as skipped, with its reason.

`--smoke` runs the model parts with tiny models on the CPU (tests/test_device.py does, to check this script).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.abc
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
PARTS = {"pytest": 140, "kernels": 45, "gpt2": 140, "resnet50": 95}  # part -> its own time limit (seconds)
TOTAL_SECONDS = 420          # every part together: with a venv to make, the make target stays under 8 minutes
MIN_PART_SECONDS = 20        # a part with less time left than this is skipped
RATIOS = (1.0, 0.5, 0.3)
POLICIES = ("coop", "dtr", "dte")
STEPS = 3
MAX_OVERHEAD = 10.0          # as `coop-arena evaluate` (coop_arena/evaluate.py, which needs rich and tqdm)
CHILD_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # cuBLAS reads it at start; see the module docstring
MIB = 1 << 20


# ============================================================================================ the package
class _KernelsFinder(importlib.abc.MetaPathFinder):
    """`coop_arena.kernels` from kernels/, as pyproject.toml's package-dir maps it."""

    def find_spec(self, name, path=None, target=None):
        if name != "coop_arena.kernels":
            return None
        return importlib.util.spec_from_file_location(name, ROOT / "kernels" / "__init__.py",
                                                      submodule_search_locations=[str(ROOT / "kernels")])


def use_this_checkout() -> None:
    """Import coop_arena from this checkout in a child, installed or not: `make gpu-check` runs whichever Python
    already has torch and triton, and installs nothing into it."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if not any(isinstance(f, _KernelsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _KernelsFinder())


# ============================================================================================ models
class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = self.body(x)
        out += x if self.down is None else self.down(x)
        return F.relu(out, inplace=True)


class ResNet(nn.Module):
    """ResNet-50's layout (He et al. 2016, torchvision's v1.5: stride on the 3x3), for machines without
    torchvision; `blocks` and `width` shrink it for the CPU smoke run."""

    def __init__(self, blocks=(3, 4, 6, 3), width: int = 64, classes: int = 1000):
        super().__init__()
        layers = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                  nn.MaxPool2d(3, 2, 1)]
        cin = width
        for stage, n in enumerate(blocks):
            for i in range(n):
                layers.append(Bottleneck(cin, width * 2**stage, 2 if i == 0 and stage > 0 else 1))
                cin = 4 * width * 2**stage
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        return self.head(torch.flatten(F.adaptive_avg_pool2d(self.features(x), 1), 1))


def build(name: str, device: str, smoke: bool):
    """(model, inputs, loss(model, inputs), description) on `device`, initialised from seed 0; `smoke`: a tiny
    model of the same kind. Without transformers or torchvision, the same layouts written out here."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name == "gpt2":
        from coop_arena.examples import GPT
        batch, seq, vocab = (4, 16, 64) if smoke else (8, 512, 50257)
        ids = torch.randint(0, vocab, (batch, seq), generator=g).to(device)
        size, why = {}, "smoke run"
        if not smoke:
            try:
                import transformers
                with torch.device(device):
                    model = transformers.GPT2LMHeadModel(transformers.GPT2Config())
                return model, ids, lambda m, x: m(input_ids=x, labels=x).loss, \
                    f"transformers {transformers.__version__} GPT2LMHeadModel(GPT2Config()), batch {batch} x {seq} " \
                    f"(attention: SDPA's math backend, deterministic)"
            except Exception as e:  # not installed, or built for another torch
                size, why = dict(vocab=vocab, d=768, heads=12, layers=12, seq=1024), f"{type(e).__name__}: {e}"
        with torch.device(device):
            model = GPT(**size)
        return model, ids, lambda m, x: F.cross_entropy(m(x).flatten(0, 1), x.flatten()), \
            f"coop_arena.examples.GPT({size}) ({why}), batch {batch} x {seq}"
    if name == "resnet50":
        batch, size, classes = (2, 32, 10) if smoke else (64, 224, 1000)
        x = torch.randn(batch, 3, size, size, generator=g).to(device)
        y = torch.randint(0, classes, (batch,), generator=g).to(device)
        loss = lambda m, inputs: F.cross_entropy(m(inputs[0]), inputs[1])
        shape, why = dict(blocks=(1, 1, 1, 1), width=8, classes=classes), "smoke run"
        if not smoke:
            try:
                import torchvision
                model = torchvision.models.resnet50(weights=None).to(device)
                return model, (x, y), loss, f"torchvision {torchvision.__version__} resnet50(), batch {batch}"
            except Exception as e:  # not installed, or built for another torch
                shape, why = {}, f"{type(e).__name__}: {e}"
        return ResNet(**shape).to(device), (x, y), loss, f"bench/gpu_check.py ResNet({shape}) ({why}), batch {batch}"
    raise ValueError(f"unknown model {name!r}")


# ============================================================================================ measuring
class Device:
    """Synchronisation and memory counters of the device the check runs on (none on the CPU)."""

    def __init__(self, device: str):
        self.cuda = torch.device(device).type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def start(self):
        """Memory held now; resets the peak."""
        if not self.cuda:
            return None
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()

    def peak(self):
        return torch.cuda.max_memory_allocated() if self.cuda else None


def run_steps(model, init, inputs, loss_of, budget, dev: Device, steps: int = STEPS) -> tuple[list, list]:
    """`steps` training steps from the initial state `init` (inside `budget` when one is given); returns (one
    record per step, the parameters and buffers after the last)."""
    model.load_state_dict(init)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    records = []
    for i in range(steps):
        torch.manual_seed(100 + i)  # dropout draws the same bits in every run
        opt.zero_grad(set_to_none=True)
        dev.sync()
        held = dev.start()
        t0 = time.perf_counter()
        with budget if budget is not None else contextlib.nullcontext():
            loss = loss_of(model, inputs)
            loss.backward()
        dev.sync()
        seconds = time.perf_counter() - t0
        peak = dev.peak()
        grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        rec = {"step": i + 1, "seconds": seconds, "held": held, "extra": None if peak is None else peak - held,
               "max_memory_allocated": peak, "grad_bytes": grads}
        if budget is not None:
            rec["stats"] = budget.stats.as_dict()
        records.append(rec)
        del loss
        opt.step()
    opt.zero_grad(set_to_none=True)
    return records, [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def step_seconds(records: list) -> float:
    """Median step time, leaving out the first step (first-call costs) when there are more."""
    times = [r["seconds"] for r in records]
    return statistics.median(times[1:] if len(times) > 1 else times)


def compare(ref: list, got: list) -> dict:
    equal = len(ref) == len(got) and all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ref, got))
    diff = 0.0 if equal else max(((a.double() - b.double()).abs().max().item() for a, b in zip(ref, got)
                                  if a.is_floating_point() and a.shape == b.shape), default=float("nan"))
    return {"bitwise_equal": equal, "max_abs_diff": diff}


def emit(kind: str, **fields) -> None:
    """One record to the parent, as a JSON line (kept even if the child is stopped later)."""
    print(json.dumps({"kind": kind, **fields}, default=str), flush=True)


def error_fields(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {str(e)[:1500]}", "where": traceback.format_exc(limit=-3)[-1500:]}


def measure_model(name: str, device: str, deadline: float, smoke: bool) -> None:
    import coop_arena

    dev = Device(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, inputs, loss_of, description = build(name, device, smoke)
        model.train()
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        emit("model", description=description, parameters=sum(p.numel() for p in model.parameters()))
        first, params_first = run_steps(model, init, inputs, loss_of, None, dev)
        plain, reference = run_steps(model, init, inputs, loss_of, None, dev)
    alerts = sorted({str(w.message)[:300] for w in caught if "deterministic" in str(w.message)})
    plain_seconds = step_seconds(plain)
    plain_extra = max((r["extra"] for r in plain), default=None) if dev.cuda else None
    emit("plain", seconds=plain_seconds, steps=plain, warmup_steps=first,
         max_memory_allocated=max(r["max_memory_allocated"] for r in plain) if dev.cuda else None,
         extra=plain_extra, reproducible=compare(params_first, reference)["bitwise_equal"],
         nondeterministic_alerts=alerts)
    del params_first

    ample = 1 << 28 if plain_extra is None else 2 * plain_extra + 256 * MIB
    if dev.cuda:
        ample = min(ample, int(0.8 * torch.cuda.mem_get_info()[0]))
    try:
        probe = coop_arena.Budget(ample, device=device)
        records, _ = run_steps(model, init, inputs, loss_of, probe, dev, steps=1)
    except Exception as e:  # the runs below are sized from this peak: without it there are none
        emit("engine_peak", nbytes=ample, status="error", **error_fields(e),
             reason=f"one step under an ample Budget of {ample} bytes failed, so no Budget run is sized from the "
                    f"engine's peak")
        return
    engine_peak = probe.stats.peak_bytes
    probe_seconds = step_seconds(records)
    # (on CUDA the arena moves bytes with the Triton kernel; one that does not compile there falls back to copy_
    # with only a warning, and every run would then pass without the kernel ever relocating a tensor)
    moves = "copy_" if probe.arena._move is type(probe.arena)._move_torch else "triton"
    emit("engine_peak", nbytes=ample, status="ok", peak_bytes=engine_peak, evictions=probe.stats.evictions,
         lower_bound=probe.stats.lower_bound, ops=probe.stats.ops, seconds=probe_seconds, arena_moves=moves)
    del probe, records

    for policy in POLICIES:
        for ratio in RATIOS:
            nbytes = int(ratio * engine_peak)
            left = deadline - time.monotonic()
            # (a step under a Budget is host-bound, many times a plain GPU step: sized from the engine's own first
            # step, which also paid the one-time costs)
            if left < max(10.0, STEPS * max(probe_seconds, plain_seconds)):
                emit("run", policy=policy, ratio=ratio, nbytes=nbytes, status="skipped",
                     reason=f"time budget ran out ({left:.0f} s left for this part)")
                continue
            budget = None
            try:
                # the arena alone at each ratio of the engine's peak (headroom=0): the targets below are the
                # arena's; the footprint with the learned headroom is bench/peers.py's comparison
                budget = coop_arena.Budget(nbytes, device=device, policy=policy, max_overhead=MAX_OVERHEAD,
                                           headroom=0)
                steps, params = run_steps(model, init, inputs, loss_of, budget, dev)
                emit("run", policy=policy, ratio=ratio, nbytes=nbytes, status="ok", seconds=step_seconds(steps),
                     vs_plain=step_seconds(steps) / plain_seconds, steps=steps, **compare(reference, params))
            except Exception as e:  # OutOfBudget, Thrashing, device out of memory, a bug: recorded
                emit("run", policy=policy, ratio=ratio, nbytes=nbytes, status="error",
                     stats=None if budget is None or budget.stats is None else budget.stats.as_dict(),
                     **error_fields(e))
            finally:
                del budget
                gc.collect()
                if dev.cuda:
                    torch.cuda.empty_cache()


def _cuda_seconds(fn, reps: int = 10) -> float:
    """Median seconds of `fn` on the device (CUDA events), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure_kernels(deadline: float) -> None:
    from coop_arena.kernels.copy import MIN_PARALLEL_CHUNK, arena_move, copy_into

    n = 128 * MIB
    buf = torch.randint(0, 256, (512 * MIB,), dtype=torch.uint8, device="cuda")
    moves = [("disjoint", 0, 256 * MIB), ("overlap_by_16MiB", 16 * MIB, 0), ("overlap_by_64KiB", 64 << 10, 0),
             ("overlap_by_4KiB", 4096, 0)]
    for label, src, dst in moves:
        if time.monotonic() > deadline:
            emit("kernel", name=f"arena_move {label}", status="skipped", reason="time budget ran out")
            continue
        try:
            before = buf.clone()
            t0 = time.perf_counter()
            arena_move(buf, src, dst, n)
            torch.cuda.synchronize()
            first = time.perf_counter() - t0  # includes compiling the kernel on first use
            expected = before
            expected[dst:dst + n] = before[src:src + n].clone()
            correct = bool(torch.equal(buf, expected))
            del before, expected
            ours = _cuda_seconds(lambda: arena_move(buf, src, dst, n))
            theirs = _cuda_seconds(lambda: buf[dst:dst + n].copy_(buf[src:src + n].clone()))
            emit("kernel", name=f"arena_move {label}", status="ok", bytes=n, correct=correct,
                 serial=abs(dst - src) < min(n, MIN_PARALLEL_CHUNK), first_call_seconds=first,
                 seconds=ours, gb_per_s=2 * n / ours / 1e9, torch_seconds=theirs, torch_gb_per_s=2 * n / theirs / 1e9)
        except Exception as e:
            emit("kernel", name=f"arena_move {label}", status="error", **error_fields(e))
    buf = None  # frees the 512 MiB before the next part
    src = torch.randn(8192, 8192, device="cuda")
    for label, s in (("contiguous", src), ("transposed", src.t().contiguous().t())):
        if time.monotonic() > deadline:
            emit("kernel", name=f"copy_into {label}", status="skipped", reason="time budget ran out")
            continue
        try:
            dst = torch.empty(8192, 8192, device="cuda")
            copy_into(dst, s)
            correct = bool(torch.equal(dst, s))
            nbytes = s.numel() * s.element_size()
            ours = _cuda_seconds(lambda: copy_into(dst, s))
            theirs = _cuda_seconds(lambda: dst.copy_(s))
            emit("kernel", name=f"copy_into {label}", status="ok", bytes=nbytes, correct=correct, seconds=ours,
                 gb_per_s=2 * nbytes / ours / 1e9, torch_seconds=theirs, torch_gb_per_s=2 * nbytes / theirs / 1e9)
        except Exception as e:
            emit("kernel", name=f"copy_into {label}", status="error", **error_fields(e))


def child(part: str, seconds: float, smoke: bool) -> None:
    use_this_checkout()
    deadline = time.monotonic() + seconds
    torch.use_deterministic_algorithms(True, warn_only=True)
    device = "cpu" if smoke else "cuda"
    if smoke:
        torch.set_num_threads(1)  # small CPU ops on shared cores: as the test suite runs them
    try:
        if part == "kernels":
            measure_kernels(deadline)
        else:
            with _deterministic_attention(part):
                measure_model(part, device, deadline, smoke)
    except Exception as e:
        emit("error", **error_fields(e))


def _deterministic_attention(part: str):
    """GPT-2's attention (float32, dropout 0.1) would take the memory-efficient SDPA kernel, whose backward splits
    the keys and adds into the query gradient with atomics: under warn_only deterministic mode plain PyTorch does
    not reproduce itself, so no Budget run could be compared with it. The math backend is deterministic; plain
    and Budget runs both use it."""
    if part != "gpt2":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.MATH])


# ============================================================================================ the parent
def _run_child(cmd: list, seconds: float, env: dict) -> tuple[str, str, int | None, float]:
    """(stdout, stderr, return code or None on timeout, seconds) of a child stopped after `seconds`."""
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds, env=env, cwd=ROOT)
        return done.stdout, done.stderr, done.returncode, time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return out, err, None, time.monotonic() - t0


def _junit(path: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures, skips = [], {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child_el in case:
            if child_el.tag in ("failure", "error"):
                outcome = "failed" if child_el.tag == "failure" else "errors"
                failures.append({"test": name, "outcome": child_el.tag,
                                 "message": (child_el.get("message") or "")[:500],
                                 "traceback": (child_el.text or "")[-2000:]})  # one run: keep enough to act on
            elif child_el.tag == "skipped":
                outcome = "skipped"
                reason = child_el.get("message") or ""
                if reason == "collection skipped":  # a module-level skip: its reason is the element's text
                    reason = (child_el.text or reason).strip().splitlines()[-1]
                reason = reason[:200]
                skips[reason] = skips.get(reason, 0) + 1
        counts[outcome] += 1
    return {"counts": counts, "failures": failures, "skip_reasons": skips}


_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b", re.M)
_OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped", "XFAIL": "xfailed",
             "XPASS": "xpassed"}


def _verbose_results(out: str) -> dict:
    """The outcome of each test that finished, from pytest -v's lines: what is left of a run stopped at its time
    limit, before pytest wrote its junit file."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for name, outcome in _VERBOSE.findall(out):
        key = _OUTCOMES[outcome]
        counts[key] = counts.get(key, 0) + 1
        if key in ("failed", "errors"):
            failures.append({"test": name, "outcome": "failure" if key == "failed" else "error",
                             "message": "(the run was stopped before pytest reported details)"})
    return {"counts": counts, "failures": failures}


def run_pytest(seconds: float, env: dict, out: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        # -u and -v: each finished test's line reaches the parent even if the run is stopped at its limit
        # (the kernels' default layer too: on a GPU it runs compiled, with the odd sizes and dtypes of the CPU suite)
        cmd = [sys.executable, "-u", str(Path(__file__).resolve()), "--pytest", "-v", "-rs", "-m", "gpu or kernels",
               "tests"]
        try:
            import pytest_benchmark  # noqa: F401
            out.mkdir(parents=True, exist_ok=True)
            cmd += ["bench/test_kernels_bench.py", f"--benchmark-json={out / 'gpu_kernels.json'}",
                    "--benchmark-max-time=0.2"]  # (rounds of a fraction of a second: the part has a time limit)
            note = None
        except ImportError:
            note = "pytest-benchmark is not installed: bench/test_kernels_bench.py was left out"
        cmd += ["--continue-on-collection-errors", f"--junitxml={junit}"]
        out, err, code, took = _run_child(cmd, seconds, env)
        part = {"command": " ".join(cmd[1:]), "seconds": took, "returncode": code, "tail": (out + err)[-3000:]}
        if note:
            part["note"] = note
        if junit.exists():
            part.update(_junit(junit))
        elif out:
            part.update(_verbose_results(out))
    if code is None:
        part.update(status="timeout", reason=f"stopped after its limit of {seconds:.0f} s")
    else:
        part["status"] = "ok" if code == 0 else ("no tests" if code == 5 else "failed")
    return part


def run_part(part: str, seconds: float, env: dict, smoke: bool) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", part, "--seconds", str(max(seconds - 10, 5))]
    if smoke:
        cmd.append("--smoke")
    out, err, code, took = _run_child(cmd, seconds, env)
    records = []
    for line in out.splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "kind" in rec:
            records.append(rec)
    result = {"seconds": took, "returncode": code, "records": records}
    if code is None:
        result.update(status="timeout", reason=f"stopped after its limit of {seconds:.0f} s; records before it kept",
                      stderr_tail=err[-2000:])
    elif code != 0 or any(r["kind"] == "error" or (r["kind"] == "engine_peak" and r.get("status") == "error")
                          for r in records):
        result.update(status="error", stderr_tail=err[-3000:])
    else:
        result["status"] = "ok"
    return result


def environment() -> dict:
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "host": platform.node(), "device": None}
    try:
        import triton
        env["triton"] = triton.__version__
    except Exception as e:
        env["triton"] = f"not importable: {type(e).__name__}: {e}"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update(device=p.name, device_memory=p.total_memory, device_count=torch.cuda.device_count())
    return env


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--pytest"]:  # the pytest part's child: pytest on this checkout
        use_this_checkout()
        import pytest
        return int(pytest.main(argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--seconds", type=float, default=TOTAL_SECONDS, help="time for every part together")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated subset of " + ", ".join(PARTS))
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU (a check of this script)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.out = str(Path(args.out).resolve())  # children run with cwd=ROOT: a relative --out means the caller's cwd
    if args.child:
        child(args.child, args.seconds, args.smoke)
        return 0
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}")
    t0 = time.monotonic()
    deadline = t0 + args.seconds
    cuda = torch.cuda.is_available()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled kernels, not the interpreter
    env.update(CHILD_ENV)
    report = {"command": " ".join([Path(sys.argv[0]).name] + argv),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "environment": environment(), "smoke": args.smoke, "child_environment": CHILD_ENV,
              "limits": {"total_seconds": args.seconds, "parts": PARTS}, "parts": {}}
    for part in parts:
        left = deadline - time.monotonic()
        if not cuda and not args.smoke and part != "pytest":
            result = {"status": "skipped", "reason": "no CUDA device here (torch.cuda.is_available() is False)"}
        elif args.smoke and part in ("pytest", "kernels"):
            result = {"status": "skipped", "reason": "--smoke runs only the model parts, on the CPU"}
        elif left < MIN_PART_SECONDS:
            result = {"status": "skipped", "reason": f"the time budget ran out ({left:.0f} s of {args.seconds:.0f} left)"}
        elif part == "pytest":
            result = run_pytest(min(PARTS[part], left), env, Path(args.out))
        else:
            result = run_part(part, min(PARTS[part], left), env, args.smoke)
        report["parts"][part] = result
        print(f"gpu_check: {part}: {result['status']}" + (f" ({result['reason']})" if "reason" in result else ""),
              flush=True)
    report["seconds"] = time.monotonic() - t0
    report["targets"] = targets(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(summary(report))
    print(f"gpu_check: wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'} in {report['seconds']:.0f} s")
    return 0


# ============================================================================================ the summary
def _records(report: dict, part: str, kind: str) -> list:
    return [r for r in report["parts"].get(part, {}).get("records", []) if r["kind"] == kind]


def device_peak(run: dict):
    """(largest nbytes + extra - gradients over the steps, nbytes + temporary_peak or None) of a run."""
    peaks, bounds = [], []
    for s in run.get("steps", []):
        if s["extra"] is None:
            return None, None
        peaks.append(run["nbytes"] + s["extra"] - s["grad_bytes"])
        temp = s["stats"].get("temporary_peak")
        bounds.append(None if temp is None else run["nbytes"] + temp)
    if not peaks:
        return None, None
    return max(peaks), (None if None in bounds else max(bounds))


def targets(report: dict) -> list:
    """The issue's targets, each with what was measured and met / missed / n/a (never asserted)."""
    out = []
    runs = {(r["policy"], r["ratio"]): r for r in _records(report, "gpt2", "run")}
    for ratio, limit in ((1.0, 1.10), (0.5, 1.25)):
        r = runs.get(("coop", ratio))
        measured = r.get("vs_plain") if r else None
        out.append({"target": f"GPT-2 small, coop at ratio {ratio}: step time <= {limit}x plain",
                    "measured": measured,
                    "verdict": "n/a" if measured is None else ("met" if measured <= limit else "missed")})
    checked = within = 0
    over = 0
    for part in ("gpt2", "resnet50"):
        for r in _records(report, part, "run"):
            peak, bound = device_peak(r)
            if peak is not None and bound is not None:
                checked += 1
                within += peak <= bound
                over = max(over, peak - bound)
    # (library workspaces, cuDNN's convolution and cuBLAS's, come from the caching allocator without passing the
    # dispatcher: the engine cannot count them, so a run may be over by about their size)
    out.append({"target": "device peak <= nbytes + temporary_peak (every run that finished)",
                "measured": (f"{within} of {checked} runs; at most {over / 2**20:.1f} MiB over (library workspaces "
                             f"the engine does not see are part of that)") if checked else None,
                "verdict": "n/a" if not checked else ("met" if within == checked else "missed")})
    return out


def _gib(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def summary(report: dict) -> str:
    env = report["environment"]
    lines = ["# GPU check", "",
             f"`{report['command']}` ({'`make gpu-check`' if not report['smoke'] else 'smoke run on the CPU'}), "
             f"{report['started']}, {report['seconds']:.0f} s. Device: {env['device'] or 'none'}; torch "
             f"{env['torch']} (CUDA {env['cuda']}), triton {env['triton']}, Python {env['python']}. Children ran "
             f"with {', '.join(f'{k}={v}' for k, v in report['child_environment'].items())} and "
             f"torch.use_deterministic_algorithms(True, warn_only=True).", "",
             "## Targets (reported, not asserted)", ""]
    for t in report["targets"]:
        m = t["measured"]
        shown = "not measured" if m is None else (f"{m:.2f}x" if isinstance(m, float) else m)
        lines.append(f"- {t['target']}: {shown} — **{t['verdict']}**")
    lines += ["", "## Parts", "", "| part | status | seconds | note |", "|---|---|---|---|"]
    for name, p in report["parts"].items():
        note = p.get("reason") or p.get("note") or ""
        if "counts" in p:
            note = ", ".join(f"{v} {k}" for k, v in p["counts"].items()) + (f"; {note}" if note else "")
            if p.get("skip_reasons"):
                note += "; skipped: " + "; ".join(f"{n} x {r}" for r, n in p["skip_reasons"].items())
        secs = f"{p['seconds']:.0f}" if "seconds" in p else ""
        lines.append(f"| {name} | {p['status']} | {secs} | {note} |")
    pytest_part = report["parts"].get("pytest", {})
    for f in pytest_part.get("failures", []):
        lines.append(f"- pytest {f['outcome']}: `{f['test']}`: {f['message'][:200]}")
        tail = f.get("traceback", "").strip().splitlines()[-12:]
        if tail:
            lines += ["", "  ```"] + [f"  {line}" for line in tail] + ["  ```"]
    kernels = _records(report, "kernels", "kernel")
    if kernels:
        lines += ["", "## Triton kernels", "", "| kernel | correct | GB/s | torch GB/s | first call (s) |",
                  "|---|---|---|---|---|"]
        for k in kernels:
            if k["status"] != "ok":
                lines.append(f"| {k['name']} | {k['status']}: {k.get('error') or k.get('reason')} | | | |")
                continue
            first = f"{k['first_call_seconds']:.2f}" if "first_call_seconds" in k else ""
            lines.append(f"| {k['name']}{' (serial)' if k.get('serial') else ''} | {k['correct']} | "
                         f"{k['gb_per_s']:.0f} | {k['torch_gb_per_s']:.0f} | {first} |")
    for part in ("gpt2", "resnet50"):
        if part not in report["parts"]:
            continue
        lines += ["", f"## {part}", ""]
        p = report["parts"][part]
        for m in _records(report, part, "model"):
            lines.append(f"Model: {m['description']}; {m['parameters'] / 1e6:.1f} M parameters.")
        for pl in _records(report, part, "plain"):
            lines.append(f"Plain PyTorch: {pl['seconds'] * 1e3:.1f} ms per step, max_memory_allocated "
                         f"{_gib(pl['max_memory_allocated'])} GiB, step extra {_gib(pl['extra'])} GiB; reproduces "
                         f"itself bitwise: {pl['reproducible']}." +
                         (f" Ops without a deterministic implementation: {'; '.join(pl['nondeterministic_alerts'])}"
                          if pl["nondeterministic_alerts"] else ""))
        for e in _records(report, part, "engine_peak"):
            if e.get("status") == "error":
                lines.append(f"Engine peak: {e['reason']} ({_gib(e['nbytes'])} GiB): {e['error']}")
                continue
            lines.append(f"Engine peak (ample Budget of {_gib(e['nbytes'])} GiB, {e['evictions']} evictions): "
                         f"{_gib(e['peak_bytes'])} GiB; lower bound {_gib(e['lower_bound'])} GiB; {e['ops']} ops; "
                         f"arena moves by {e.get('arena_moves', 'n/a')}.")
        for e in _records(report, part, "error"):
            lines.append(f"Error: {e['error']}")
        if p.get("status") in ("timeout", "skipped"):
            lines.append(f"Part {p['status']}: {p.get('reason', '')}")
        runs = _records(report, part, "run")
        if runs:
            lines += ["", "| policy | ratio | budget GiB | ms/step | vs plain | evictions | recomputed | overhead | "
                          "device peak GiB | nbytes + temporary_peak GiB | params = plain |",
                      "|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in runs:
                head = f"| {r['policy']} | {r['ratio']} | {_gib(r['nbytes'])} |"
                if r["status"] != "ok":
                    lines.append(f"{head} {r['status']}: {(r.get('error') or r.get('reason') or '')[:160]} "
                                 f"| | | | | | | |")
                    continue
                st = r["steps"][-1]["stats"]
                peak, bound = device_peak(r)
                lines.append(f"{head} {r['seconds'] * 1e3:.1f} | {r['vs_plain']:.2f}x | {st['evictions']} | "
                             f"{st['rematerializations']} | {st['compute_overhead']:.2f} | {_gib(peak)} | "
                             f"{_gib(bound)} | {r['bitwise_equal']}"
                             f"{'' if r['bitwise_equal'] else ' (max diff %.3g)' % r['max_abs_diff']} |")
    lines += ["", "Device peak = nbytes + (max_memory_allocated during the step - memory held before it) - the "
                  "gradients' bytes; counters are the last step's.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
