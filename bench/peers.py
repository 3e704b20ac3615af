"""Equal-memory comparison: coop_arena's Budget against the other ways to train in less memory.

    python -m bench.peers                   # full size, bench/results/peers.{json,md}
    python -m bench.peers --quick           # small models, a smoke run (written to a temporary folder)
    python -m bench.peers --report bench/results/peers.json   # regenerate peers.md from the json

Models: bench/peer_models.py's `gpt()` and `resnet()`. For each, every configuration below trains the same steps
from the same initial weights (a deepcopy of one model per configuration), the same batch at every step,
`torch.optim.SGD(lr=0.01)`, `opt.zero_grad()` (set_to_none):
  - eager: plain PyTorch;
  - coop r: `coop_arena.Budget(int(r * P), device="cpu")` (its headroom learned, the default) for r in 1.0, 0.75,
    0.5 and the smallest of 0.25, 0.3, ..., 0.7 that runs its warm-up steps without OutOfBudget (each tried on a
    copy of the initial model, in increasing order up to the first that runs); dtr 0.5: the
    same with policy="dtr". P = eager's measured footprint. The Budget is made once per configuration, before any
    measured step, and reused: `opt.zero_grad(); with budget: loss_fn(model(x), y).backward(); opt.step()`;
  - checkpoint all / every 2nd: `torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)` around every
    block of `model.blocks` / every other one (block 0, 2, ...);
  - SAC: selective activation checkpointing around every block: matmul, convolution and attention outputs are
    saved (MUST_SAVE), everything else recomputed (PREFER_RECOMPUTE);
  - compile b: `torch.compile` with `torch._functorch.config.activation_memory_budget = b` (1.0, 0.5, 0.3), set
    around compilation and the warm-up steps (the first call compiles). If compilation raises, the configuration
    is reported as skipped with the exception's first line;
  - coop at a peer's footprint: once every configuration above has been measured, coop once more per peer
    (checkpointing, SAC, compile below 1.0) with `Budget(F)`, F that peer's measured footprint: the comparison at
    equal measured memory, rendered as a table of its own.

Note [Peers measurement]
Footprint: `coop_arena.footprint.measure` (the profiler's allocation events) over zero_grad + forward + backward
  (the optimizer step runs after it, unmeasured), with `keep` = the parameters' gradients and the optimizer's state:
  `excess` = the peak bytes the step allocated that are not model state. Model state (parameters, gradients,
  optimizer state) is excluded; for a coop configuration the arena (`budget.arena.nbytes`, allocated when the Budget
  was made, before the profile) is added. The footprint of a configuration is the largest over the measured steps
  (after the warm-up steps).
Time: `time.process_time()` of whole steps (zero_grad, forward, backward, opt.step) without the profiler, one step
  per configuration per round, rounds interleaved; `torch.set_num_threads(1)`. Ratios: min over rounds / eager's
  min, median / eager's median.
Exactness: after every configuration has run the same number of steps, every parameter and buffer is compared
  with eager's by `torch.equal`.
Compile configurations: each compiles its own forward function `fwd(model, x) = model(x)` (a fresh code object,
  the graph `torch.compile(model)` traces), so no two configurations share a dynamo cache entry and all stay
  compiled through the interleaved rounds. `torch._dynamo.reset()` between configurations would drop the earlier
  configurations' compiled code (it clears every code object's cache) and they would recompile, with the default
  memory budget, in the middle of the timed rounds; it runs before each model's compile configurations instead.
  The graphs dynamo compiled after the warm-up steps are counted (`recompiles` in the json; 0 expected).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch._functorch.config  # noqa: F401  (torch._functorch.config is not imported by `import torch`)
import torch.utils.checkpoint as tuc

import coop_arena
from coop_arena.footprint import measure

from bench.peer_models import MODELS

RESULTS = Path(__file__).parent / "results"
FULL = {"gpt": dict(batch=8, seq=256, vocab=8192, d=256, layers=6), "resnet": dict(batch=32, size=64)}
QUICK = {"gpt": dict(batch=2, seq=64, vocab=512, d=64, layers=2), "resnet": dict(batch=4, size=16, widths=(8, 16, 16, 16))}
RATIOS = (1.0, 0.75, 0.5)
SMALL_RATIOS = (0.25, 0.3, 0.35, 0.4, 0.45, 0.55, 0.6, 0.65, 0.7)  # tried in this order up to the first that runs
DTR_RATIO = 0.5
COMPILE_BUDGETS = (1.0, 0.5, 0.3)
MATCHED = ("checkpoint", "sac", "compile")  # the peers coop is also run at the footprint of (compile below 1.0)
ROUNDS = 15            # the full run takes about 8 minutes at 5 rounds and 30 s per further round (2 cores)
WARMUP = 3  # a Budget learns its headroom over its first two or three blocks (Note [Headroom])
MEASURED = 2
LR = 0.01
MiB = 1 << 20


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".strip()


# ============================================================================================ configurations
def _sac_policy():
    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "convolution", "_scaled_dot_product_flash_attention_for_cpu",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention")
    save = {getattr(aten, n) for n in names if hasattr(aten, n)}

    def policy(ctx, op, *args, **kwargs):
        packet = getattr(op, "overloadpacket", op)
        return tuc.CheckpointPolicy.MUST_SAVE if packet in save else tuc.CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _wrap_blocks(model, every: int, selective: bool) -> None:
    """Checkpoint `model.blocks[0], [every], [2 * every], ...`: each chosen block's forward (an instance attribute,
    so parameter names and order stay as they are) runs its class's forward under non-reentrant checkpointing."""
    kwargs = {}
    if selective:
        kwargs["context_fn"] = functools.partial(tuc.create_selective_checkpoint_contexts, _sac_policy())
    for i, blk in enumerate(model.blocks):
        if i % every:
            continue
        inner = type(blk).forward.__get__(blk)

        def forward(x, _inner=inner):
            return tuc.checkpoint(_inner, x, use_reentrant=False, **kwargs)

        blk.forward = forward


def _fresh_forward():
    """`fwd(model, x) = model(x)` with a code object of its own (dynamo keeps compiled code on code objects)."""
    ns: dict = {}
    exec(compile("def fwd(model, x):\n    return model(x)\n", "<bench.peers fwd>", "exec"), ns)
    return ns["fwd"]


class Config:
    """One configuration: its model copy, optimizer, and what was measured."""

    def __init__(self, name: str, kind: str, **params):
        self.name, self.kind, self.params = name, kind, params
        self.model = self.opt = self.budget = self.forward = None
        self.status = "ok"          # ok | error | skipped
        self.reason = None          # error or skip reason
        self.error_type = None      # the exception's class name
        self.arena_bytes = 0
        self.steps = 0
        self.footprints: list[int] = []
        self.excesses: list[int] = []
        self.times: list[float] = []
        self.stats: dict | None = None
        self.temporary_peak = 0
        self.warmup_seconds = 0.0
        self.notes: list[str] = []
        self.warned: dict = {}      # warning category -> {"count", "first"}: what the engine or torch warned

    @property
    def alive(self) -> bool:
        return self.status == "ok"

    # ------------------------------------------------------------------ setup
    def setup(self, base, P: int | None) -> None:
        self.model = copy.deepcopy(base)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        if self.kind == "coop":
            nbytes = self.params["nbytes"] if "nbytes" in self.params else int(self.params["ratio"] * P)
            self.budget = coop_arena.Budget(nbytes, device="cpu", policy=self.params.get("policy", "coop"))
        elif self.kind in ("checkpoint", "sac"):
            _wrap_blocks(self.model, self.params.get("every", 1), self.kind == "sac")
        if self.kind == "compile":
            compiled = torch.compile(_fresh_forward(), backend=self.params["backend"])
            model = self.model
            self.forward = lambda x: compiled(model, x)
        else:
            self.forward = self.model

    # ------------------------------------------------------------------ steps
    def fwd_bwd(self, x, y, loss_fn) -> None:
        self.opt.zero_grad()
        if self.budget is not None:
            with self.budget:
                loss_fn(self.forward(x), y).backward()
            st = self.budget.stats
            self.temporary_peak = max(self.temporary_peak, st.temporary_peak)
            self.stats = dict(st.as_dict(), footprint_peak=getattr(st, "footprint_peak", None))
        else:
            loss_fn(self.forward(x), y).backward()

    def keep(self):
        out = [p.grad for p in self.model.parameters() if p.grad is not None]
        for state in self.opt.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return out

    def run(self, what: str, fn):
        """Run one step through `fn`; an exception ends the configuration (compile errors before any measured
        step make it skipped) and is recorded."""
        if not self.alive:
            return None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("default")
                try:
                    out = fn()
                finally:
                    self._record(caught)
            self.steps += 1
            return out
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            text = first_line(e)
            self.error_type = type(e).__name__
            if self.kind == "compile" and what == "warm-up":
                self.status, self.reason = "skipped", text
            else:
                self.status, self.reason = "error", f"{what} step {self.steps + 1}: {text}"
            log(f"{self.name}: {self.status}: {self.reason}")
            traceback.print_exc()
            self.model = self.opt = self.budget = self.forward = None  # free its memory
            return None

    def _record(self, caught) -> None:
        for w in caught:
            if issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning, FutureWarning)):
                continue  # torch's own API notices, not about the step
            cat = w.category.__name__
            if cat not in self.warned:
                text = str(w.message).strip().splitlines()[0] if str(w.message).strip() else ""
                self.warned[cat] = {"count": 0, "first": text, "step": self.steps + 1}
                log(f"{self.name}: step {self.steps + 1}: {cat}: {text[:300]}")
            self.warned[cat]["count"] += 1

    def warmup(self, x, y, loss_fn, n: int) -> None:
        def one():
            self.fwd_bwd(x, y, loss_fn)
            self.opt.step()

        t = time.perf_counter()
        for _ in range(n):
            if self.kind == "compile":
                with torch._functorch.config.patch(activation_memory_budget=self.params["memory_budget"]):
                    self.run("warm-up", one)
            else:
                self.run("warm-up", one)
        self.warmup_seconds = time.perf_counter() - t

    def measure(self, x, y, loss_fn) -> None:
        def one():
            fp = measure(lambda: self.fwd_bwd(x, y, loss_fn), keep=self.keep, device="cpu")
            self.opt.step()
            return fp

        fp = self.run("measured", one)
        if fp is not None:
            if self.budget is not None:  # the arena as this step had it (the learned headroom may have shrunk it)
                self.arena_bytes = self.budget.arena.nbytes
            self.excesses.append(fp.excess)
            self.footprints.append(fp.excess + self.arena_bytes)

    def timed(self, x, y, loss_fn) -> None:
        def one():
            t = time.process_time()
            self.fwd_bwd(x, y, loss_fn)
            self.opt.step()
            return time.process_time() - t

        dt = self.run("timed", one)
        if dt is not None:
            self.times.append(dt)


def configurations(compile_backend: str) -> list[Config]:
    out = [Config("eager", "eager")]
    out += [Config(f"coop {r:g}", "coop", ratio=r) for r in RATIOS]
    # (the smallest ratio is added once it is found)
    out.append(Config(f"coop dtr {DTR_RATIO:g}", "coop", ratio=DTR_RATIO, policy="dtr"))
    out.append(Config("checkpoint every block", "checkpoint", every=1))
    out.append(Config("checkpoint every 2nd block", "checkpoint", every=2))
    out.append(Config("SAC (save mm/conv/attention) every block", "sac", every=1))
    out += [Config(f"compile, activation_memory_budget={b:g}", "compile", memory_budget=b, backend=compile_backend)
            for b in COMPILE_BUDGETS]
    return out


def at_equal_memory(configs: list[Config]) -> list[Config]:
    """A coop configuration per peer in MATCHED that was measured: `Budget(nbytes)` with nbytes = that peer's
    measured footprint, so that the two are compared at equal memory (a Budget's footprint is at most its nbytes
    after its first step, which the measured steps follow)."""
    out = []
    for peer in configs:
        if peer.kind in MATCHED and peer.alive and peer.footprints and peer.params.get("memory_budget") != 1.0:
            fp = max(peer.footprints)
            out.append(Config(f"coop at {peer.name}'s footprint", "coop", nbytes=fp, matches=peer.name))
    return out


def smallest_ratio(base, data, loss_fn, P: int) -> tuple[list[dict], Config | None]:
    """Try SMALL_RATIOS in increasing order, each as a configuration of its own: made, then its warm-up steps (whole
    steps: the Budget learns its headroom over its first blocks, Note [Headroom]), up to the first that runs them.
    Returns what each did and the configuration of the smallest that ran, warmed up."""
    x, y = data
    tried, ran = [], []
    for r in SMALL_RATIOS:
        cfg = Config(f"coop {r:g} (smallest)", "coop", ratio=r, smallest=True)
        t = time.perf_counter()
        try:
            cfg.setup(base, P)
        except Exception as e:  # noqa: BLE001
            cfg.status, cfg.reason, cfg.error_type = "error", f"setup: {first_line(e)}", type(e).__name__
        else:
            cfg.warmup(x, y, loss_fn, WARMUP)
        if cfg.alive:
            result, extra = "ran", dict(evictions=cfg.stats["evictions"],
                                        compute_overhead=cfg.stats["compute_overhead"])
            ran.append(cfg)
        else:
            result = cfg.error_type if cfg.error_type == "OutOfBudget" else "error"
            extra = dict(error=cfg.reason, step=cfg.steps + 1)
        tried.append(dict(ratio=r, result=result, seconds=round(time.perf_counter() - t, 2), **extra))
        log(f"  smallest ratio: {r:g}: {result}")
        if ran:
            break
    best = min(ran, key=lambda c: c.params["ratio"]) if ran else None
    for cfg in ran:
        if cfg is not best:
            cfg.model = cfg.opt = cfg.budget = cfg.forward = None
    return tried, best


def compare(ref, model) -> dict:
    """Bitwise comparison of every parameter and buffer with eager's (`ref`); names of those that differ."""
    params = [n for (n, a), (_, b) in zip(ref.named_parameters(), model.named_parameters(), strict=True)
              if not torch.equal(a, b)]
    buffers = [n for (n, a), (_, b) in zip(ref.named_buffers(), model.named_buffers(), strict=True)
               if not torch.equal(a, b)]
    diff = max((float((a.detach().double() - b.detach().double()).abs().max()) for a, b in
                zip(ref.parameters(), model.parameters())), default=0.0)
    return dict(bitwise_equal=not params and not buffers, params_equal=not params, buffers_equal=not buffers,
                params_differing=params, buffers_differing=buffers, max_abs_param_diff=diff)


# ================================================================================================ the run
def prepare(name: str, cfg: Config, base, P: int, data, loss_fn) -> None:
    """Make `cfg`, run its warm-up steps, then its measured ones (an error ends it, recorded)."""
    x, y = data
    log(f"{name}: {cfg.name}: warm-up")
    try:
        cfg.setup(base, P)
    except Exception as e:  # noqa: BLE001 - e.g. a Budget that cannot be made
        cfg.status, cfg.reason = "error", f"setup: {first_line(e)}"
        log(f"{name}: {cfg.name}: {cfg.reason}")
        return
    cfg.warmup(x, y, loss_fn, WARMUP)
    for _ in range(MEASURED):
        cfg.measure(x, y, loss_fn)
    if cfg.alive:
        log(f"{name}: {cfg.name}: footprint {max(cfg.footprints) / MiB:.1f} MiB "
            f"({max(cfg.footprints) / P:.2f} of eager), warm-up {cfg.warmup_seconds:.1f} s")


def run_model(name: str, kwargs: dict, rounds: int, compile_backend: str) -> dict:
    t0 = time.perf_counter()
    base, data, loss_fn = MODELS[name](**kwargs)
    x, y = data
    n_params = sum(p.numel() for p in base.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    configs = configurations(compile_backend)
    eager = configs[0]
    log(f"{name}: {n_params:,} parameters, {len(base.blocks)} blocks")

    # eager first: its footprint is P
    eager.setup(base, None)
    eager.warmup(x, y, loss_fn, WARMUP)
    for _ in range(MEASURED):
        eager.measure(x, y, loss_fn)
    if not eager.alive or not eager.footprints:
        raise RuntimeError(f"{name}: eager failed: {eager.reason}")
    P = max(eager.footprints)
    log(f"{name}: eager footprint {P / MiB:.1f} MiB")

    search, small = smallest_ratio(base, data, loss_fn, P)
    failed = [t for t in search if t["result"] != "ran"]
    if small is None:
        small = Config(f"coop {SMALL_RATIOS[0]:g}..{SMALL_RATIOS[-1]:g} (smallest)", "coop", ratio=None,
                       smallest=True)
        small.status, small.reason = "error", "none of " + ", ".join(f"{r:g}" for r in SMALL_RATIOS) + " ran"
    elif failed:
        small.notes.append("failed: " + ", ".join(f"{t['ratio']:g} ({t['result']})" for t in failed))
    configs.insert(1 + len(RATIOS), small)

    compile_reset = False
    for cfg in configs[1:]:
        if not cfg.alive:
            continue
        if cfg is small:  # warmed up by the search
            for _ in range(MEASURED):
                cfg.measure(x, y, loss_fn)
            continue
        if cfg.kind == "compile" and not compile_reset:
            torch._dynamo.reset()  # Note [Peers measurement]: once, before this model's compile configurations
            compile_reset = True
        prepare(name, cfg, base, P, data, loss_fn)
    for cfg in at_equal_memory(configs):  # each made once its peer's footprint is known
        prepare(name, cfg, base, P, data, loss_fn)
        configs.append(cfg)

    from torch._dynamo.utils import counters
    graphs_before = counters["stats"]["unique_graphs"]
    for k in range(rounds):
        t = time.perf_counter()
        for cfg in configs:
            cfg.timed(x, y, loss_fn)
        log(f"{name}: round {k + 1}/{rounds}: {time.perf_counter() - t:.1f} s")
    recompiles = counters["stats"]["unique_graphs"] - graphs_before

    rows = []
    e_times = eager.times
    for cfg in configs:
        row = dict(name=cfg.name, kind=cfg.kind, params=cfg.params, status=cfg.status, reason=cfg.reason,
                   error_type=cfg.error_type, steps=cfg.steps, arena_bytes=cfg.arena_bytes, notes=list(cfg.notes),
                   warnings=cfg.warned)
        if cfg.footprints:
            fp = max(cfg.footprints)
            row.update(footprint_bytes=fp, footprints=cfg.footprints, excess_bytes=max(cfg.excesses),
                       fraction_of_eager=fp / P)
        if cfg.status == "ok" and cfg.times:
            row.update(step_seconds=cfg.times, ratio_min=min(cfg.times) / min(e_times),
                       ratio_median=statistics.median(cfg.times) / statistics.median(e_times))
        if cfg.status == "ok" and cfg.steps == eager.steps:
            row.update(compare(eager.model, cfg.model))
        if cfg.kind == "coop" and cfg.stats is not None:
            st = cfg.stats
            row["stats"] = dict(evictions=st["evictions"], rematerializations=st["rematerializations"],
                                compute_overhead=st["compute_overhead"], temporary_peak=st["temporary_peak"],
                                temporary_peak_max=cfg.temporary_peak, footprint_peak=st.get("footprint_peak"),
                                budget=st["budget"], peak_bytes=st["peak_bytes"], replayed_ops=st["replayed_ops"])
        if cfg.kind == "compile":
            row["warmup_seconds"] = round(cfg.warmup_seconds, 1)
        rows.append(row)
    return dict(kwargs=kwargs, parameters=n_params, parameter_bytes=param_bytes, blocks=len(base.blocks),
                eager_footprint_bytes=P, eager_step_seconds_median=statistics.median(e_times) if e_times else None,
                smallest_search=search, recompiles=recompiles, configs=rows,
                seconds=round(time.perf_counter() - t0, 1))


# ================================================================================================ report
def _mib(b) -> str:
    return f"{b / MiB:,.1f}"


def _times(row: dict) -> str:
    """A row's CPU time ratio to eager, min / median over rounds ("-" where it has none)."""
    return f"{row['ratio_min']:.2f} / {row['ratio_median']:.2f}" if "ratio_min" in row else "-"


def _bitwise(row: dict) -> str:
    return ("yes" if row["bitwise_equal"] else "no") if "bitwise_equal" in row else "-"


def _short(text: str, n: int = 150) -> str:
    return text if len(text) <= n else text[: n - 1].rstrip() + "…"


def _notes(row: dict) -> str:
    parts = []
    if row["status"] == "skipped":
        parts.append(f"skipped: {_short(row['reason'])}")
    elif row["status"] == "error":
        parts.append(f"error: {_short(row['reason'])}")
    st = row.get("stats")
    if st and row["status"] == "ok":
        fp = st.get("footprint_peak")
        parts.append(f"arena {_mib(row['arena_bytes'])} MiB; evictions {st['evictions']}, "
                     f"rematerializations {st['rematerializations']}, compute overhead {st['compute_overhead']:.2f}x, "
                     f"temporary peak {_mib(st['temporary_peak'])} MiB"
                     + (f", footprint_peak {_mib(fp)} MiB" if fp is not None else ""))
    if row["kind"] == "compile" and row["status"] == "ok":
        parts.append(f"compiled in the warm-up steps ({row.get('warmup_seconds', 0):.0f} s wall)")
    if row.get("bitwise_equal") is False:
        if row["params_differing"]:
            parts.append(f"{len(row['params_differing'])} parameters differ (max abs diff "
                         f"{row['max_abs_param_diff']:.2g})")
        if row["buffers_differing"]:
            kinds = sorted({n.rsplit('.', 1)[-1] for n in row["buffers_differing"]})
            why = (" (BatchNorm running statistics updated again when a block is recomputed)"
                   if row["kind"] in ("checkpoint", "sac") and not row["params_differing"] else "")
            parts.append(f"{len(row['buffers_differing'])} buffers differ: {', '.join(kinds)}{why}")
    warned = row.get("warnings") or {}
    if warned:
        parts.append("warned: " + ", ".join(f"{c} (from step {w['step']}, {w['count']}x)" for c, w in warned.items()))
    parts += row.get("notes", [])
    return "; ".join(parts).replace("|", "\\|").replace("\n", " ")


def render(data: dict) -> str:
    lines = [
        "# Equal-memory comparison: coop_arena against checkpointing, SAC and torch.compile",
        "",
        f"Command: `{data['command']}`",
        "",
        f"- Date: {data['date']}; machine: {data['machine']}, {data['cores']} cores, Python {data['python']}, "
        f"torch {data['torch']}, `torch.set_num_threads({data['threads']})`; the whole run took "
        f"{data['wall_seconds'] / 60:.1f} min.",
        f"- Every configuration trains the same {data['steps']} steps ({data['warmup']} warm-up, "
        f"{data['measured']} measured, {data['rounds']} timed) from the same initial weights on the same batch, "
        f"SGD(lr={data['lr']}), `opt.zero_grad()` (set_to_none).",
        "- Footprint: `coop_arena.footprint.measure` replays the torch profiler's allocation events "
        "(`profile_memory=True`) of zero_grad + forward + backward (the optimizer step runs after it, unmeasured) "
        "and takes the peak of the bytes the step allocated, less model state: parameters, their gradients and the "
        "optimizer's state are excluded. A coop configuration's arena (allocated once, when the Budget is made) is "
        "added. Largest over the measured steps. Kernels' own scratch that bypasses PyTorch's allocator is not seen.",
        "- Fraction = footprint / eager's footprint (P); coop r means `Budget(int(r * P), device=\"cpu\")`; "
        "coop at a peer's footprint means `Budget(F)` with F that peer's measured footprint.",
        "- CPU time: `time.process_time()` of whole steps (zero_grad, forward, backward, opt.step) without the "
        "profiler, one step per configuration per round, rounds interleaved; min = min over rounds / eager's min, "
        "median = median / eager's median.",
        "- Bitwise = every parameter and buffer `torch.equal` to eager's after the same steps.",
        f"- torch.compile backend: `{data['compile_backend']}`; `activation_memory_budget` set around compilation "
        "and the warm-up steps; each configuration compiles its own forward function (`torch._dynamo.reset()` "
        "once before each model's compile configurations; Note [Peers measurement] in bench/peers.py). Compilation "
        "time is not in the CPU times.",
    ]
    for name, m in data["models"].items():
        kw = ", ".join(f"{k}={v}" for k, v in m["kwargs"].items())
        lines += ["", f"## {name}", "",
                  f"`{name}({kw})`: {m['parameters']:,} parameters ({_mib(m['parameter_bytes'])} MiB), "
                  f"{m['blocks']} blocks; eager footprint P = {_mib(m['eager_footprint_bytes'])} MiB, eager step "
                  f"{m['eager_step_seconds_median']:.3f} s CPU (median); this model took {m['seconds'] / 60:.1f} min.",
                  ""]
        search = "; ".join(f"{t['ratio']:g}: {t['result']}" + (f" at step {t['step']}" if "step" in t else "")
                           for t in m["smallest_search"])
        tried = ", ".join(f"{t['ratio']:g}" for t in m["smallest_search"])
        lines += [f"Smallest coop ratio: {tried} tried in this order, each as a configuration of its own, through "
                  f"its warm-up steps, up to the first that ran: {search}.", ""]
        if m.get("recompiles"):
            lines += [f"Warning: dynamo compiled {m['recompiles']} graph(s) during the timed rounds.", ""]
        lines += ["| configuration | footprint MiB | fraction of eager | CPU time ratio min / median | "
                  "bitwise equal to eager | notes |", "|---|---:|---:|---:|---|---|"]
        for row in m["configs"]:
            fp = _mib(row["footprint_bytes"]) if "footprint_bytes" in row else "-"
            frac = f"{row['fraction_of_eager']:.2f}" if "fraction_of_eager" in row else "-"
            lines.append(f"| {row['name']} | {fp} | {frac} | {_times(row)} | {_bitwise(row)} | {_notes(row)} |")
        lines += _equal_memory(m["configs"])
    return "\n".join(lines)


def _equal_memory(rows: list[dict]) -> list[str]:
    """Each peer beside coop run at the peer's measured footprint (`Budget(nbytes=that footprint)`)."""
    by_name = {r["name"]: r for r in rows}
    pairs = [(by_name[r["params"]["matches"]], r) for r in rows if "matches" in r["params"]]
    if not pairs:
        return []

    def faster(peer, coop, key):
        if key not in peer or key not in coop:
            return "-"
        return "coop" if coop[key] < peer[key] else "peer" if peer[key] < coop[key] else "tie"

    out = ["", "At equal memory: coop with `Budget(nbytes)` set to each peer's measured footprint (its own footprint "
           "measured the same way); CPU time ratio to eager, min / median over rounds:", "",
           "| peer | peer footprint MiB | peer time | coop footprint MiB | coop time | faster by min / median "
           "| coop bitwise |", "|---|---:|---:|---:|---:|---|---|"]
    for peer, coop in pairs:
        fp = _mib(coop["footprint_bytes"]) if "footprint_bytes" in coop else f"- ({_short(coop['reason'] or '', 80)})"
        out.append(f"| {peer['name']} | {_mib(peer['footprint_bytes'])} | {_times(peer)} | {fp} | {_times(coop)} | "
                   f"{faster(peer, coop, 'ratio_min')} / {faster(peer, coop, 'ratio_median')} | {_bitwise(coop)} |")
    return out


# ================================================================================================ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small models, a smoke run (under 2 minutes)")
    ap.add_argument("--rounds", type=int, default=None, help=f"timed rounds (default {ROUNDS}, 2 with --quick)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for peers.json and peers.md (default bench/results; with --quick a temporary folder)")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--compile-backend", default=None,
                    help="torch.compile backend (default inductor; with --quick aot_eager_decomp_partition, the same "
                         "partitioner and memory budget without code generation, which takes minutes here)")
    ap.add_argument("--report", type=Path, default=None, metavar="JSON",
                    help="only regenerate the markdown next to this json (peers.json -> peers.md)")
    args = ap.parse_args(argv)
    if args.report is not None:
        data = json.loads(args.report.read_text())
        md = args.report.with_suffix(".md")
        md.write_text(render(data) + "\n")
        print(f"wrote {md}")
        return 0
    rounds = args.rounds if args.rounds is not None else (2 if args.quick else ROUNDS)
    if rounds < 1:
        ap.error("--rounds must be at least 1")
    backend = args.compile_backend or ("aot_eager_decomp_partition" if args.quick else "inductor")
    out = args.out or (Path(tempfile.gettempdir()) / "bench_peers_quick" if args.quick else RESULTS)
    sizes = QUICK if args.quick else FULL
    command = ("python -m bench.peers " + " ".join(sys.argv[1:] if argv is None else argv)).strip()

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    models = {}
    for name in args.models:
        models[name] = run_model(name, sizes[name], rounds, backend)
    data = dict(command=command, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                torch=torch.__version__, python=platform.python_version(), machine=platform.machine(),
                cores=os.cpu_count(), threads=torch.get_num_threads(), quick=args.quick, rounds=rounds,
                warmup=WARMUP, measured=MEASURED, steps=WARMUP + MEASURED + rounds, lr=LR, compile_backend=backend,
                wall_seconds=round(time.perf_counter() - t0, 1), models=models)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(data, indent=1, default=_json_default) + "\n")
    (out / "peers.md").write_text(render(data) + "\n")
    print(render(data))
    log(f"wrote {out / 'peers.json'} and {out / 'peers.md'} ({data['wall_seconds'] / 60:.1f} min)")
    return 0


def _json_default(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, tuple):
        return list(v)
    return str(v)


if __name__ == "__main__":
    sys.exit(main())
