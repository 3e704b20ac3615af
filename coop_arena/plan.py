"""`coop-arena plan`: will a training step fit a budget, and at what recompute overhead? A dry run on the
`meta` device (no data, the same engine and cost model as a real run), so a laptop can plan a GPU budget."""

from __future__ import annotations

import importlib
import inspect
import math
import re
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .blocks import ALIGNMENT as _SMALLEST  # the smallest arena a Budget makes
from .budget import Budget
from .errors import CoopArenaError, OutOfBudget, UnsupportedOp, in_units
from .policy import POLICIES
from .snapshot import write as write_snapshot

_FACTORY = "module:function, where function(batch) returns (model, example_inputs)"

SNAPSHOT_EVENTS = 1 << 20  # the memory events coop's run keeps for --snapshot and --plot (Note [Memory snapshots])
PLOT_FORMATS = (".png", ".svg", ".pdf")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_budget(text: str) -> tuple[str, float]:
    """("ratio", r) for a number in (0, 1], ("bytes", n) for a size such as 8GiB, 512MiB or 1e9."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read budget {text!r}: give bytes with a unit (8GiB, 512MiB, 1e9) or a ratio "
                         f"of the plain peak in (0, 1] (0.5)")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(value):
        raise ValueError(f"budget {text!r} is not a finite number")
    if not unit and 0 < value <= 1:
        return "ratio", value
    if not unit and not value.is_integer():
        raise ValueError(f"budget {text!r} is neither a ratio of the plain peak in (0, 1] nor a whole number of "
                         f"bytes: give a ratio such as 0.5, or bytes with a unit (8GiB, 512MiB)")
    if value * _UNITS[unit] < 1:
        raise ValueError(f"budget {text!r} is less than one byte")
    return "bytes", value * _UNITS[unit]


def check_models(specs) -> None:
    """ValueError naming every spec that is neither a suite model, an example nor `module:function`."""
    from . import examples, suite
    unknown = [m for m in specs if m not in suite.SUITE and m not in examples.MODELS and ":" not in m]
    if unknown:
        raise ValueError(f"unknown model{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}: use one "
                         f"of {', '.join([*suite.SUITE, *examples.MODELS])} or module:function")


def load(spec: str, batch: int):
    """(model, inputs) from a name in the suite, in coop_arena.examples or `module:function(batch)`, on meta."""
    from . import examples, suite
    if spec in suite.SUITE:
        why = suite.available(spec)
        if why:
            raise ValueError(why)
        model, inputs = suite.SUITE[spec].build(batch)
    elif ":" in spec:
        mod, fn = spec.split(":", 1)
        if not mod or not fn:
            raise ValueError(f"model {spec!r} names no {'module' if not mod else 'function'}: give {_FACTORY}")
        try:
            module = importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"cannot import {mod!r} for model {spec!r}: {e}") from e
        factory = getattr(module, fn, None)
        if factory is None:
            raise ValueError(f"module {mod!r} has no attribute {fn!r} (model {spec!r}: {_FACTORY})")
        if not callable(factory):
            raise ValueError(f"{spec!r} is a {type(factory).__name__}, not callable: give {_FACTORY}")
        try:
            inspect.signature(factory).bind(batch)
            called_right = True
        except TypeError:  # not function(batch): the call below fails before running any of its code
            called_right = False
        except ValueError:  # (a callable without a signature)
            called_right = True
        with torch.device("meta"):  # a large model is never materialized
            try:
                made = factory(batch)
            except Exception as e:
                if not called_right:
                    raise ValueError(f"{spec}({batch}) failed: {e} (give {_FACTORY})") from e
                # the user's own code: one line, the traceback is theirs to see
                raise ValueError(f"{spec}({batch}) raised {type(e).__name__}: {_first_line(e)} (call it "
                                 f"directly to see where)") from e
        if not (isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
            raise ValueError(f"{spec}({batch}) returned {_kind(made)}, not (model, example_inputs) with an "
                             f"nn.Module first")
        model, inputs = made
        items = inputs if isinstance(inputs, (tuple, list)) else (inputs,)
        if not all(isinstance(x, torch.Tensor) for x in items):
            raise ValueError(f"{spec}({batch}) returned example inputs {_kind(inputs)}: give a tensor or a tuple or "
                             f"list of tensors, which the step passes to the model as positional arguments")
    else:
        check_models([spec])
        model, inputs = examples.example(spec, batch)
    return to_meta(model), tuple(x.to("meta") for x in (inputs if isinstance(inputs, (tuple, list)) else (inputs,)))


def _kind(x) -> str:
    """What a value is, for an error message: its type, and the types inside a tuple, list or dict."""
    if isinstance(x, (tuple, list)):
        return f"{type(x).__name__} ({', '.join(type(v).__name__ for v in x)})"
    if isinstance(x, dict):
        return f"dict ({', '.join(f'{k!r}: {type(v).__name__}' for k, v in x.items())})"
    return type(x).__name__


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def _size(n: int) -> str:
    """Bytes for a table: in the largest unit that gives at least 1."""
    return in_units(n, 1) or f"{n} B"


def to_meta(model: torch.nn.Module) -> torch.nn.Module:
    """`model.to("meta")`, keeping tied parameters tied. PyTorch cannot convert a CPU parameter to meta in place, so
    `Module.to` makes a new Parameter for each module that holds it: a GPT's tied embedding and head became two
    parameters, and the dry run planned another step than the device's (no accumulation into the shared weight's
    gradient, another op sequence, other evictions)."""
    owners: dict[int, list] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, name))
    model = model.to("meta")
    for places in owners.values():
        shared = places[0][0]._parameters[places[0][1]]
        for module, name in places[1:]:
            module._parameters[name] = shared
    return model


def _forward_backward(model, inputs) -> torch.Tensor:
    """The planned training step: backward from the sum of the model's first output, which it returns."""
    out = model(*inputs)
    if isinstance(out, Mapping):  # a transformers ModelOutput: its first field that is set (the logits)
        out = next(iter(out.values()))
    out = out[0] if isinstance(out, (tuple, list)) else out
    if not (isinstance(out, torch.Tensor) and out.requires_grad):
        what = "Tensor with no grad" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"the model's output ({what}) has nothing to train: a planned step runs backward "
                         f"from the sum of the model's first output")
    out.float().sum().backward()
    return out


def step(model, inputs, budget: Budget) -> None:
    """One training step of `model` on `inputs` under `budget` (loss: the sum of the first output)."""
    try:
        with budget:
            out = _forward_backward(model, inputs)  # noqa: F841 (held to the block's end, as a training loop
            # holds its output for metrics: its copy-out at exit is part of what a plan measures)
    finally:
        for p in model.parameters():
            p.grad = None


def _output_file(path, flag: str, suffixes: tuple = ()) -> Path:
    """`path` as the file an option (`flag`) writes: ValueError, before any work, where it cannot be one."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {str(path)!r} is a folder: give a file name")
    if not p.parent.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: no folder {str(p.parent)!r} to write it in")
    if suffixes and p.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} {str(path)!r}: give a file name ending in {', '.join(suffixes)}")
    return p


def plan(spec: str, batch: int | None, budget_text: str, console: Console | None = None, *,
         snapshot=None, plot=None) -> dict:
    """Plain peak, lower bound, and per policy: fits?, overhead, evictions, fragmentation. `batch=None` takes
    the suite's batch size for a suite model, 8 otherwise. `snapshot`: a file to pickle the memory snapshot of
    coop's run to (Budget.memory_snapshot(), PyTorch's format); `plot`: a .png, .svg or .pdf file for the arena's
    occupancy over that run (figures.occupancy). Both are written whether the run fits or not."""
    from .suite import default_batch
    if snapshot is not None:
        snapshot = _output_file(snapshot, "--snapshot")
    if plot is not None:
        plot = _output_file(plot, "--plot", PLOT_FORMATS)
    kind, value = parse_budget(budget_text)
    if kind == "bytes" and value < _SMALLEST:
        text = budget_text.strip()
        bare = re.fullmatch(r"[0-9.eE+-]+", text) is not None  # a number without a unit
        raise ValueError(f"budget {budget_text!r} is {value:g} bytes"
                         f"{' (a number above 1 without a unit counts bytes)' if bare else ''}, less than the "
                         f"smallest arena of {_SMALLEST} bytes: give more bytes with a unit"
                         f"{f' ({text}GiB, {text}MiB)' if bare else ' (8GiB, 512MiB)'} or a ratio of the plain peak "
                         f"in (0, 1] (0.5)")
    if console is None:
        console = Console()
        if not console.is_terminal:  # (80 columns cut the op a step stops at)
            console = Console(width=160)
    batch = default_batch(spec, batch)
    model, inputs = load(spec, batch)
    probe = Budget(1 << 50, device="meta")
    try:
        step(model, inputs, probe)
    except UnsupportedOp as e:  # (an op a dry run cannot run: the command says so in one line)
        raise ValueError(f"{spec!r} cannot be planned in a dry run: {e}") from e
    except (CoopArenaError, ValueError):
        raise
    except Exception as e:  # the model's own error (wrong input shapes or dtypes), or the engine's
        try:
            _forward_backward(model, inputs)  # on meta without a Budget: does the model fail there too?
        except Exception as plain:
            raise ValueError(f"the training step of {spec!r} fails on its example inputs on meta, with or without a "
                             f"Budget: {type(plain).__name__}: {_first_line(plain)} (run model(*example_inputs) "
                             f"without a Budget to see where)") from e
        finally:
            for p in model.parameters():
                p.grad = None
        raise  # it fails only under the Budget: coop_arena's error, with its traceback
    peak, lower = probe.stats.peak_bytes, probe.stats.lower_bound
    nbytes = max(int(value * peak) if kind == "ratio" else int(value), _SMALLEST)
    result = {"model": spec, "batch": batch, "plain_peak": peak, "lower_bound": lower, "budget": nbytes,
              "policies": {}}
    table = Table(title=f"{spec}, batch {batch}: plain peak {_size(peak)}, lower bound {_size(lower)}, budget "
                        f"{_size(nbytes)} ({nbytes / peak:.0%} of peak)")
    for col in ("policy", "fits", "compute overhead", "evictions", "fragmentation", "arena peak"):
        table.add_column(col, justify="right")
    from .evaluate import CONFIGS  # the evaluation's baselines: dtr and dte with address-oblivious placement
    for policy in POLICIES:
        traced = policy == "coop" and (snapshot is not None or plot is not None)
        b = Budget(nbytes, device="meta", **CONFIGS[policy], **(dict(trace_len=SNAPSHOT_EVENTS) if traced else {}))
        try:
            with warnings.catch_warnings():  # (the table reports the overhead; the warning would advise `plan`)
                warnings.filterwarnings("ignore", message="this step is thrashing", category=RuntimeWarning)
                step(model, inputs, b)
            st = b.stats
            row = {"fits": True, "compute_overhead": st.compute_overhead, "evictions": st.evictions,
                   "fragmentation": st.fragmentation, "peak_bytes": st.peak_bytes,
                   "restores_in_turn": st.restores_in_turn}
            table.add_row(policy, "yes*" if st.restores_in_turn else "yes", f"{st.compute_overhead:.3f}x",
                          str(st.evictions), f"{st.fragmentation:.3f}", _size(st.peak_bytes))
        except OutOfBudget as e:
            row = {"fits": False, "error": str(e)}
            table.add_row(policy, f"no ({e.op})", "-", "-", "-", "-")
        result["policies"][policy] = row
        if traced:
            _save_run(b, snapshot, plot, f"{spec}, batch {batch}, coop in {_size(nbytes)}", result)
    console.print(table)
    if any(r.get("restores_in_turn") for r in result["policies"].values()):
        console.print("* fits only because some ops' inputs, which did not fit back at once, were restored one at a "
                      "time (stats.restores_in_turn, Note [Restore plans]): this budget is at the edge, where small "
                      "changes to the model or the batch may not fit.")
    for policy, row in result["policies"].items():
        if not row["fits"]:
            console.print(f"{policy} does not fit: {row['error']}", highlight=False)
    if snapshot is not None:
        console.print(f"Memory snapshot of coop's run: {snapshot} (open it at https://pytorch.org/memory_viz, or "
                      f"python -m torch.cuda._memory_viz trace_plot {snapshot} -o trace.html)", highlight=False)
    if plot is not None:
        console.print(f"Arena occupancy of coop's run: {plot}", highlight=False)
    return result


def _save_run(budget: Budget, snapshot: Path | None, plot: Path | None, title: str, result: dict) -> None:
    """Write the memory snapshot of `budget`'s last block to `snapshot` and its occupancy figure to `plot`."""
    snap = budget.memory_snapshot()
    try:
        if snapshot is not None:
            result["snapshot"] = str(write_snapshot(snap, snapshot))
        if plot is not None:
            from .figures import occupancy
            result["plot"] = str(occupancy(snap, plot, title))
    except OSError as e:
        raise ValueError(f"cannot write {e.filename or snapshot}: {e.strerror or e}") from e
