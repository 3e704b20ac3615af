"""The arena's device, its byte moves and its stream guard (coop_arena/arena.py), on the CPU.

The CUDA branches are covered here by their logic (device resolution with the CUDA queries replaced, the stream
check with fake streams, the Triton move kernel in Triton's interpreter); tests/test_gpu.py runs them for real.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import coop_arena
from coop_arena import arena as arena_mod, footprint
from coop_arena.arena import Arena, resolve_device
from coop_arena.errors import InternalError
from coop_arena.storage import State
from training import bitwise_equal, state, train

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


# ------------------------------------------------------------------------------------------------- devices
@pytest.mark.parametrize("spelling", ["cpu", "cpu:0", torch.device("cpu"), torch.device("cpu", 0)])
def test_cpu_spellings_resolve_to_the_device_tensors_report(spelling):
    assert resolve_device(spelling) == torch.randn(1).device == torch.device("cpu")
    budget = coop_arena.Budget(1 << 20, device=spelling)
    w = torch.randn(8, 8)
    with budget:
        y = (w @ w).relu().sum()
    assert budget.device == torch.device("cpu") and budget.stats.ops == 3 and budget.stats.peak_bytes > 0
    assert torch.equal(y, (w @ w).relu().sum())


@pytest.mark.parametrize("spelling", ["meta", "meta:0", torch.device("meta")])
def test_meta_spellings(spelling):
    assert resolve_device(spelling) == torch.empty(1, device="meta").device


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default is CUDA on this machine (tests/test_gpu.py)")
def test_default_device_without_cuda_is_cpu():
    assert resolve_device(None) == torch.device("cpu")


@pytest.fixture
def two_gpus(monkeypatch):
    """torch.cuda as a machine with two GPUs whose current device is cuda:1 would answer."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_cuda_spellings_get_the_current_index(two_gpus):
    for spelling in (None, "cuda", torch.device("cuda")):
        assert resolve_device(spelling) == torch.device("cuda", 1)
    for spelling in ("cuda:0", torch.device("cuda", 0)):
        assert resolve_device(spelling) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match=r"2 CUDA device\(s\) \(cuda:0 to cuda:1\)"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("spelling", ["tpu", "gpu", "cuda:x", 3.5])
def test_bad_spellings(spelling):
    with pytest.raises(ValueError, match="cpu, cuda, meta"):
        resolve_device(spelling)


def test_training_under_cpu_0_is_bitwise_plain_pytorch():
    probe = coop_arena.Budget(1 << 26, device="cpu:0")
    train("gpt", probe, steps=1)
    budget = coop_arena.Budget(int(0.5 * probe.stats.peak_bytes), device="cpu:0")
    seen = []
    model = train("gpt", budget, check=lambda b: seen.append(b.stats))
    assert all(s.evictions > 0 and s.rematerializations > 0 for s in seen), seen
    assert bitwise_equal(state(train("gpt")), state(model))


def test_outputs_asked_for_on_another_device_are_made_there():
    """`x.cpu()` or `zeros(..., device="cpu")` in a block on CUDA: an op whose `device=` is not the arena's returns
    a plain tensor on that device, as without a Budget; here a CPU arena and meta stand in for CUDA and the CPU."""
    budget = coop_arena.Budget(1 << 20, device="cpu")
    x = torch.randn(4)
    with budget:
        y = x * 2
        made = {"zeros": torch.zeros(3, device="meta"), "empty": torch.empty(3, device="meta"),
                "full": torch.full((3,), 2.0, device="meta"), "to": y.to("meta")}
        here = torch.zeros(3, device="cpu:0")
    assert {k: (type(t), t.device.type) for k, t in made.items()} == dict.fromkeys(made, (torch.Tensor, "meta"))
    assert made["to"].shape == (4,) and isinstance(here, coop_arena.Tensor) and torch.equal(here, torch.zeros(3))


def test_cpu_indices_masks_and_lengths_are_taken_as_pytorch_takes_them():
    """PyTorch indexes a device tensor with CPU integer or bool tensors and wants pack_padded_sequence's lengths on
    the CPU; a block on CUDA (here meta stands in for it, with evictions at 60 % of the peak) takes them the same
    way, through a backward. A floating-point CPU tensor among the arena's (a model left on the CPU) is still
    refused with what to do."""
    from torch.nn.utils.rnn import pack_padded_sequence

    def step(budget):
        torch.manual_seed(0)
        lstm, head = torch.nn.LSTM(8, 16).to("meta"), torch.nn.Linear(16, 4).to("meta")
        with budget:
            seq = torch.randn(12, 6, 8, device="meta")
            packed = lstm(pack_padded_sequence(seq, torch.tensor([12, 10, 9, 7, 4, 2])))[0]
            h = head(packed.data)
            picked = h[torch.tensor([0, 3, 5])] + h[torch.arange(h.shape[0]) % 2 == 0][:3]
            picked.sum().backward()
        return packed.batch_sizes, picked.shape

    probe = coop_arena.Budget(1 << 26, device="meta")
    step(probe)
    budget = coop_arena.Budget(probe.stats.peak_bytes * 3 // 5, device="meta")
    sizes, shape = step(budget)
    assert sizes.device.type == "cpu" and sizes.tolist() == [6, 6, 5, 5, 4, 4, 4, 3, 3, 2, 1, 1]
    assert shape == (3, 4) and budget.stats.evictions > 0 and budget.stats.rematerializations > 0
    weights = torch.randn(4, 4)  # a float tensor from before the block, on the CPU
    with pytest.raises(coop_arena.BudgetUsageError, match="move the model and its inputs to meta"):
        with coop_arena.Budget(1 << 20, device="meta"):
            torch.randn(3, 4, device="meta") @ weights


def test_inputs_moved_to_the_arenas_device_inside_the_block():
    """`with budget: model(x.cuda())` is a common loop: the copy into the arena reads the CPU tensor, which is
    fine (only ops that compute on tensors of two devices are refused). Meta stands in for CUDA here; the copy
    is an arena tensor, recorded with the CPU source, and evicted and rebuilt from it."""
    x = torch.randn(64, 64)
    budget = coop_arena.Budget(64 * 64 * 4 * 3, device="meta")
    with budget:
        moved = [x.to("meta"), x.to("meta", non_blocking=True), x.float().to(device="meta") * 2]
        assert all(isinstance(m, coop_arena.Tensor) for m in moved)
        fillers = [torch.ones(64, 64, device="meta") + i for i in range(3)]
        assert moved[0]._cell.storage.state is State.EVICTED
        (moved[0] + 1).sum()  # restored by copying from the CPU tensor again
    assert budget.stats.rematerializations > 0 and len(fillers) == 3


def test_which_device_arguments_are_another_device_than_a_cuda_arena(two_gpus):
    """The CUDA branch of the check above, for an arena on cuda:1 while cuda:1 is current: `device="cuda"` is
    the arena's device (what `torch.rand(n, device="cuda")` in a model means), cuda:0 and the CPU are not."""
    from coop_arena.dispatch import Dispatch
    d = Dispatch.__new__(Dispatch)
    d.device = torch.device("cuda", 1)
    verdicts = {str(x): d._elsewhere(x) for x in (None, torch.device("cuda"), torch.device("cuda", 1),
                                                  torch.device("cuda", 0), torch.device("cpu"), torch.device("meta"))}
    assert verdicts == {"None": False, "cuda": False, "cuda:1": False, "cuda:0": True, "cpu": True, "meta": True}


def test_replaced_library_methods_find_the_budget_in_an_autograd_engine_thread():
    """On CUDA the autograd engine runs a backward (and FSDP2's backward hooks, sharded.py) on a thread of its own
    per device, which inherits the dispatch modes of the thread that called backward: patches.current() must find
    the Budget there as in its own thread. A thread that enters the Budget's mode stands in for the engine's."""
    from coop_arena import patches
    budget = coop_arena.Budget(1 << 20, device="cpu")
    seen = {}

    def engine_thread(mode):
        with mode:
            seen["with the mode"] = patches.current()
        seen["without"] = patches.current()

    original = torch.autograd._engine_run_backward  # (where backward() and grad() enter the engine)
    with budget:
        mine = patches.current()
        worker = threading.Thread(target=engine_thread, args=(budget._mode,))
        worker.start()
        worker.join()
        assert torch.autograd._engine_run_backward is not original
    assert mine is budget._bookkeeping and seen == {"with the mode": mine, "without": None}
    assert patches.current() is None and torch.autograd._engine_run_backward is original


# --------------------------------------------------------------------------------------------------- moves
def _memmove(buf: torch.Tensor, src: int, dst: int, n: int) -> torch.Tensor:
    ref = buf.clone().numpy()
    ref[dst:dst + n] = ref[src:src + n].copy()
    return torch.from_numpy(ref)


# (src, dst, nbytes): disjoint both ways, overlapping down and up, by one byte, nothing to do
MOVES = [(0, 3000, 2000), (3000, 0, 2000), (1000, 512, 3001), (512, 1000, 3001), (7, 8, 4000), (40, 40, 100),
         (5, 9, 0)]


def _check_moves(arena: Arena) -> None:
    arena.buffer.copy_(torch.randint(0, 256, (arena.nbytes,), dtype=torch.uint8,
                                     generator=torch.Generator().manual_seed(0)))
    for src, dst, n in MOVES:
        expected = _memmove(arena.buffer, src, dst, n)
        arena.move(src, dst, n)
        assert torch.equal(arena.buffer, expected), (src, dst, n)


@pytest.mark.parametrize("copy_kernel", [None, False])
def test_move_on_cpu_is_a_memmove(copy_kernel):
    _check_moves(Arena(8192, torch.device("cpu"), 8192, copy_kernel=copy_kernel))


@pytest.mark.parametrize("bounce", [16, 256, 1 << 16])
def test_a_move_in_chunks_is_a_memmove(monkeypatch, bounce):
    # the path of a CUDA arena without the Triton kernel, run on the CPU: chunks through a small bounce buffer
    # (moves by less than it), direct chunks (moves by more), one whole chunk
    monkeypatch.setattr(arena_mod, "BOUNCE_MIN", bounce)
    arena = Arena(8192, torch.device("cpu"), 8192, copy_kernel=False)
    arena._move = Arena._move_chunked
    _check_moves(arena)


def test_an_overlapping_move_on_the_cpu_allocates_nothing():
    """A block slid by a few KiB is moved by one memmove: nothing outside the arena, whatever its size (Note
    [Overlapping moves])."""
    arena = Arena(64 << 20, torch.device("cpu"), 64 << 20, copy_kernel=False)
    arena.buffer[: 8 << 20].copy_(torch.randint(0, 256, (8 << 20,), dtype=torch.uint8))
    expected = _memmove(arena.buffer, 0, 4096, 32 << 20)
    fp = footprint.measure(lambda: arena.move(0, 4096, 32 << 20))
    assert torch.equal(arena.buffer, expected)
    assert fp.peak == 0 and fp.allocations == 0
    expected = _memmove(arena.buffer, 4096 + 512, 4096, 32 << 20)  # down, by less than a bounce buffer
    fp = footprint.measure(lambda: arena.move(4096 + 512, 4096, 32 << 20))
    assert torch.equal(arena.buffer, expected) and fp.peak == 0


def test_an_overlapping_move_in_chunks_allocates_only_its_bounce_buffer():
    arena = Arena(64 << 20, torch.device("cpu"), 64 << 20, copy_kernel=False)
    arena._move = Arena._move_chunked  # (the path of a CUDA arena without the Triton kernel)
    arena.buffer[: 8 << 20].copy_(torch.randint(0, 256, (8 << 20,), dtype=torch.uint8))
    expected = _memmove(arena.buffer, 0, 4096, 32 << 20)
    fp = footprint.measure(lambda: arena.move(0, 4096, 32 << 20))
    assert torch.equal(arena.buffer, expected)
    assert fp.peak == arena._bounce_bytes() == (64 << 20) >> 8  # 256 KiB, not the 32 MiB moved
    fp = footprint.measure(lambda: arena.move(4096, 4096 + (40 << 20), 16 << 20))  # disjoint: no allocation
    assert fp.peak == 0


@pytest.fixture
def kernel_calls(monkeypatch):
    """Calls of the Triton arena_move kernel launcher (the real one runs)."""
    if not INTERPRET:
        pytest.skip("the Triton kernel runs on CPU tensors only with TRITON_INTERPRET=1 set before triton is "
                    "imported (`make test` sets it)")
    from coop_arena.kernels import copy as kcopy
    calls, real = [], kcopy.arena_move

    def spy(buf, src, dst, nbytes):
        calls.append((src, dst, nbytes))
        real(buf, src, dst, nbytes)

    monkeypatch.setattr(kcopy, "arena_move", spy)
    return calls


def test_move_with_the_kernel_forced_is_a_memmove(kernel_calls):
    _check_moves(Arena(8192, torch.device("cpu"), 8192, copy_kernel=True))
    assert kernel_calls == [m for m in MOVES if m[2] > 0 and m[0] != m[1]]


def test_relocations_through_the_kernel_keep_training_exact(kernel_calls):
    from test_relocation import _train
    probe = coop_arena.Budget(1 << 26, device="cpu", headroom=0)
    _train(probe, steps=1)
    # (headroom=0: a learned headroom would make the arena again between blocks, without the kernel)
    budget = coop_arena.Budget(int(0.5 * probe.stats.peak_bytes), device="cpu", headroom=0)
    budget.arena = Arena(budget.arena.nbytes, budget.device, budget.memory.table.usable, copy_kernel=True)
    params = _train(budget)
    st = budget.stats
    assert st.relocations > 0 and len(kernel_calls) >= st.relocations  # both steps moved; stats are the last's
    assert bitwise_equal(_train(None), params)


def test_kernel_forced_where_it_cannot_run(monkeypatch):
    from coop_arena.kernels import _util
    monkeypatch.setattr(_util, "INTERPRET", False)
    with pytest.raises(ValueError, match="copy_kernel=True.*cannot run on cpu"):
        Arena(1024, torch.device("cpu"), 1024, copy_kernel=True)


def test_move_on_meta_does_nothing_and_ranges_are_checked():
    meta = Arena(4096, torch.device("meta"), 4096)
    meta.move(0, 1000, 2000)  # no data, no error
    cpu = Arena(4096, torch.device("cpu"), 4096)
    for src, dst, n in [(0, 3000, 2000), (-1, 0, 10), (0, 10, -1)]:
        with pytest.raises(InternalError, match="arena move"):
            cpu.move(src, dst, n)



def test_a_copy_kernel_that_cannot_run_falls_back_to_copy_with_a_warning(monkeypatch):
    """On CUDA the Triton kernels are tried when the arena is made (the logic, with CUDA stood in for): a
    Triton that cannot build its launcher gives a warning and copy_, not a failure at the first relocation;
    asked for explicitly (copy_kernel=True) it is an error."""
    import coop_arena.kernels as kernels
    import coop_arena.kernels.copy as kcopy
    arena = Arena(8192, torch.device("cpu"), 8192)
    arena.device = torch.device("cuda")
    monkeypatch.setattr(kernels, "kernels_available", lambda device: True)
    launches = []
    monkeypatch.setattr(kcopy, "arena_move", lambda buf, src, dst, n: launches.append((src, dst, n)))
    mover = arena._pick_mover(None)
    # every kernel launched once: the disjoint copy, the serial overlapping moves both ways
    assert launches == [(0, 512, 512), (0, 1, 512), (1, 0, 512)] and mover is not Arena._move_torch
    mover(arena, 1024, 2048, 64)
    assert launches[-1] == (1024, 2048, 64)

    def broken(buf, src, dst, n):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(kcopy, "arena_move", broken)
    with pytest.warns(RuntimeWarning, match="Triton copy kernel cannot run on cuda.*C compiler.*copy_"):
        assert arena._pick_mover(None) is Arena._move_torch
    with pytest.raises(RuntimeError, match="C compiler"):
        arena._pick_mover(True)(arena, 0, 512, 512)


# ------------------------------------------------------------------------------------------------- streams
class FakeStream:
    """Stands in for torch.cuda.Stream: an id, and the waits asked of it."""

    def __init__(self, sid: int):
        self.cuda_stream, self.waited = sid, []

    def wait_stream(self, other):
        self.waited.append(other)


@pytest.fixture
def streams(monkeypatch):
    """Two fake streams; `streams.current` is the one the arena sees as current."""
    class Streams:
        a, b = FakeStream(0xA), FakeStream(0xB)
        current = a

    s = Streams()
    monkeypatch.setattr(arena_mod, "_current_stream", lambda device: s.current)
    monkeypatch.setattr(arena_mod, "_stream_id", lambda device: s.current.cuda_stream)
    return s


def test_an_op_on_another_stream_is_refused_before_anything_changes(streams):
    budget = coop_arena.Budget(1 << 20, device="cpu")
    w = torch.randn(16, 16)
    with budget:
        y = w @ w
        streams.current = streams.b
        with pytest.raises(coop_arena.BudgetUsageError, match="stream 0xb.*stream 0xa"):
            y.relu()
        with pytest.raises(coop_arena.BudgetUsageError, match="coop_arena.pinned.*stream 0xb"):
            with coop_arena.pinned(y):
                pass
        assert budget.stats.ops == 1 and budget.memory.used_bytes > 0
        streams.current = streams.a
        z = y.relu().sum()  # back on the block's stream: usable
    assert budget.stats.ops == 3 and torch.equal(z, (w @ w).relu().sum())
    assert streams.a.waited == [] and streams.b.waited == []


def test_a_block_on_a_new_stream_waits_for_the_previous_one(streams):
    budget = coop_arena.Budget(1 << 20, device="cpu")
    w = torch.randn(16, 16)
    with budget:
        y = (w @ w).sum()
    streams.current = streams.b
    with budget:  # the previous block's copies ran on a: b waits for them, then the block runs on b
        z = (w @ w).sum()
    assert streams.b.waited == [streams.a] and torch.equal(y, z)
    with budget:  # same stream again: no wait
        (w @ w).sum()
    assert streams.b.waited == [streams.a]


def test_an_engines_own_op_may_run_on_its_own_stream(streams):
    """FSDP2 runs its all-gathers on streams of its own; those ops read nothing from the arena and run outside it
    (bookkeeping.py), so the stream guard lets them through. An op of the step on that stream is still refused."""
    budget = coop_arena.Budget(1 << 20, device="cpu")
    w = torch.randn(16, 16)
    with budget:
        y = w @ w
        bookkeeping = budget._runtime.bookkeeping
        bookkeeping.active = lambda: True  # an engine's hook runs (FSDP2's pre-forward all-gather)
        streams.current = streams.b
        gathered = torch.cat([w, w]) * 2  # plain tensors while an engine's hook runs: not the step's
        assert type(gathered) is torch.Tensor and torch.equal(gathered, torch.cat([w, w]) * 2)
        with pytest.raises(coop_arena.BudgetUsageError, match="stream 0xb.*stream 0xa"):
            y.relu()
        streams.current = streams.a
        del bookkeeping.active
        z = y.relu().sum()
    assert budget.stats.ops == 3 and torch.equal(z, (w @ w).relu().sum())


# ------------------------------------------------------------------------------------- the prepared GPU check
ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the parts run (make gpu-check)")
def test_gpu_check_without_a_gpu_skips_each_part_with_its_reason(tmp_path):
    assert _gpu_check().main(["--parts", "kernels,gpt2,resnet50", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {p: r["status"] for p, r in report["parts"].items()} == dict.fromkeys(["kernels", "gpt2", "resnet50"],
                                                                                "skipped")
    assert all("no CUDA device" in r["reason"] for r in report["parts"].values())
    assert [t["verdict"] for t in report["targets"]] == ["n/a"] * 3
    assert "no CUDA device" in (tmp_path / "gpu_check.md").read_text()


def test_gpu_check_measures_tiny_models_on_the_cpu(tmp_path):
    """The model parts end to end (child processes, records, summary) with tiny models on the CPU."""
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--parts",
                           "gpt2,resnet50", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    for part in ("gpt2", "resnet50"):
        result = report["parts"][part]
        assert result["status"] == "ok", result
        kinds = [r["kind"] for r in result["records"]]
        assert kinds[:3] == ["model", "plain", "engine_peak"] and kinds[3:] == ["run"] * 9
        plain, engine = result["records"][1], result["records"][2]
        assert plain["reproducible"] and engine["evictions"] == 0 and engine["peak_bytes"] > 0
        assert engine["arena_moves"] == "copy_"  # the CPU's (on CUDA: "triton", unless the kernel failed there)
        runs = result["records"][3:]
        ok = [r for r in runs if r["status"] == "ok"]
        assert all(r["status"] in ("ok", "error") for r in runs) and ok
        assert all(r["bitwise_equal"] and len(r["steps"]) == 3 for r in ok), "a Budget run differs from plain PyTorch"
        assert any(r["steps"][-1]["stats"]["rematerializations"] > 0 for r in ok)
        assert all("OutOfBudget" in r["error"] or "Thrashing" in r["error"] for r in runs if r["status"] == "error")
    verdicts = [t["verdict"] for t in report["targets"]]
    assert verdicts[:2] != ["n/a", "n/a"] and verdicts[2] == "n/a"  # no device memory counters on the CPU
    text = (tmp_path / "gpu_check.md").read_text()
    assert "## gpt2" in text and "## resnet50" in text and "| coop | 0.5 |" in text
    assert "arena moves by copy_" in text


def test_gpu_check_records_a_failed_engine_peak_probe_and_sizes_no_run(monkeypatch, capsys):
    """The runs' budgets are ratios of the engine's peak: when the ample probe step fails (here: its Budget
    raises OutOfBudget), the part records why, with the budget it tried, marks itself an error, and runs none."""
    import time
    check = _gpu_check()
    real = check.run_steps

    def tight_probe(model, init, inputs, loss_of, budget, dev, steps=check.STEPS):
        if budget is not None and steps == 1:
            budget = coop_arena.Budget(4096, device="cpu")  # far below one step's working set
        return real(model, init, inputs, loss_of, budget, dev, steps)
    monkeypatch.setattr(check, "run_steps", tight_probe)
    check.measure_model("gpt2", "cpu", time.monotonic() + 300, True)
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["kind"] for r in records] == ["model", "plain", "engine_peak"]
    probe = records[-1]
    assert probe["status"] == "error" and "OutOfBudget" in probe["error"] and probe["nbytes"] > 4096
    assert "no Budget run is sized" in probe["reason"]
    report = {"command": "gpu_check.py --smoke", "smoke": True, "started": "now", "seconds": 1.0,
              "environment": dict.fromkeys(["device", "torch", "cuda", "triton", "python"], "-"),
              "child_environment": {}, "parts": {"gpt2": {"status": "error", "seconds": 1.0, "records": records}}}
    report["targets"] = check.targets(report)
    assert [t["verdict"] for t in report["targets"]] == ["n/a"] * 3
    assert "Engine peak: one step under an ample Budget" in check.summary(report)


def test_gpu_check_runs_a_python_that_has_torch_but_not_this_package(tmp_path):
    """`make gpu-check` runs whichever Python already has torch as it is, installing nothing: the check's child
    processes import this checkout, coop_arena.kernels included (mapped to kernels/ as pyproject.toml does)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python*/site-packages"))
    # this environment's packages as plain paths: their .pth files (this package's editable install) do not run
    (site / "torch_only.pth").write_text("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # (a PYTHONPATH naming a checkout would import it)
    probe = subprocess.run([python, "-c", "import torch, triton, coop_arena"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=120, env=env)
    assert "No module named 'coop_arena'" in probe.stderr, probe.stderr[-2000:]
    kernels = subprocess.run([python, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import gpu_check; "
                              f"gpu_check.use_this_checkout(); import coop_arena.kernels.copy as k; print(k.__file__)"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert kernels.stdout.strip() == str(ROOT / "kernels" / "copy.py"), kernels.stderr[-2000:]
    done = subprocess.run([python, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--parts", "resnet50", "--out",
                           str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    part = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]["resnet50"]
    assert part["status"] == "ok" and [r["kind"] for r in part["records"]][:3] == ["model", "plain", "engine_peak"], part


def test_a_pytest_part_stopped_at_its_limit_keeps_the_tests_that_finished():
    """The GPU layer runs verbose and unbuffered: when it is stopped before pytest writes its junit file, the
    outcome of each test that finished is read from its lines."""
    out = ("tests/test_gpu.py::test_default_device_is_the_current_cuda_device PASSED           [  5%]\n"
           "tests/test_gpu.py::test_training_is_bitwise_plain_pytorch_under_eviction[mlp] FAILED [ 10%]\n"
           "tests/test_gpu.py::test_a_cudnn_lstm_with_dropout_replays_the_same_bits SKIPPED (needs) [ 15%]\n"
           "tests/test_kernels.py::test_move_gpu_layer[0] PASSED [ 20%]\n"
           "some other output PASSED\n")
    got = _gpu_check()._verbose_results(out)
    assert got["counts"] == {"passed": 2, "failed": 1, "errors": 0, "skipped": 1}
    assert [f["test"] for f in got["failures"]] == [
        "tests/test_gpu.py::test_training_is_bitwise_plain_pytorch_under_eviction[mlp]"]

