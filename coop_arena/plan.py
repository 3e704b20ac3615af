"""`coop-arena plan`: will a training step fit a budget, and at what recompute overhead? A dry run on the
`meta` device (no data, the same engine and cost model as a real run), so a laptop can plan a GPU budget."""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Mapping

import torch
from rich.console import Console
from rich.table import Table

from .budget import Budget
from .errors import OutOfBudget, UnsupportedOp
from .policy import POLICIES

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
        try:
            module = importlib.import_module(mod)
        except ImportError as e:
            raise ValueError(f"cannot import {mod!r} for model {spec!r}: {e}") from e
        factory = getattr(module, fn, None)
        if factory is None:
            raise ValueError(f"module {mod!r} has no attribute {fn!r} (model {spec!r}: module:function, where "
                             f"function(batch) returns (model, example_inputs))")
        if not callable(factory):
            raise ValueError(f"{spec!r} is a {type(factory).__name__}, not callable: give module:function, where "
                             f"function(batch) returns (model, example_inputs)")
        with torch.device("meta"):  # a large model is never materialized
            try:
                made = factory(batch)
            except TypeError as e:  # not function(batch)
                raise ValueError(f"{spec}({batch}) failed: {e} (give module:function, where function(batch) "
                                 f"returns (model, example_inputs))") from e
        if not (isinstance(made, (tuple, list)) and len(made) == 2 and isinstance(made[0], torch.nn.Module)):
            raise ValueError(f"{spec}({batch}) returned {type(made).__name__}, not (model, example_inputs) with an "
                             f"nn.Module first")
        model, inputs = made
    else:
        check_models([spec])
        model, inputs = examples.example(spec, batch)
    return to_meta(model), tuple(x.to("meta") for x in (inputs if isinstance(inputs, (tuple, list)) else (inputs,)))


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


def step(model, inputs, budget: Budget) -> None:
    """One training step of `model` on `inputs` under `budget` (loss: the sum of the first output)."""
    try:
        with budget:
            out = model(*inputs)
            if isinstance(out, Mapping):  # a transformers ModelOutput: its first field that is set (the logits)
                out = next(iter(out.values()))
            out = out[0] if isinstance(out, (tuple, list)) else out
            if not (isinstance(out, torch.Tensor) and out.requires_grad):
                what = "Tensor with no grad" if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"the model's output ({what}) has nothing to train: a planned step runs backward "
                                 f"from the sum of the model's first output")
            out.float().sum().backward()
    finally:
        for p in model.parameters():
            p.grad = None


def plan(spec: str, batch: int | None, budget_text: str, console: Console | None = None) -> dict:
    """Plain peak, lower bound, and per policy: fits?, overhead, evictions, fragmentation. `batch=None` takes
    the suite's batch size for a suite model, 8 otherwise."""
    from .suite import default_batch
    console = console or Console()
    kind, value = parse_budget(budget_text)
    batch = default_batch(spec, batch)
    model, inputs = load(spec, batch)
    probe = Budget(1 << 50, device="meta")
    try:
        step(model, inputs, probe)
    except UnsupportedOp as e:  # (an op a dry run cannot run: the command says so in one line)
        raise ValueError(f"{spec!r} cannot be planned in a dry run: {e}") from e
    peak, lower = probe.stats.peak_bytes, probe.stats.lower_bound
    nbytes = int(value * peak) if kind == "ratio" else int(value)
    result = {"model": spec, "batch": batch, "plain_peak": peak, "lower_bound": lower, "budget": nbytes,
              "policies": {}}
    table = Table(title=f"{spec}, batch {batch}: plain peak {peak / 2**20:.1f} MiB, lower bound "
                        f"{lower / 2**20:.1f} MiB, budget {nbytes / 2**20:.1f} MiB ({nbytes / peak:.0%} of peak)")
    for col in ("policy", "fits", "compute overhead", "evictions", "fragmentation", "arena peak"):
        table.add_column(col, justify="right")
    from .evaluate import CONFIGS  # the evaluation's baselines: dtr and dte with address-oblivious placement
    for policy in POLICIES:
        b = Budget(max(nbytes, 512), device="meta", **CONFIGS[policy])
        try:
            step(model, inputs, b)
            st = b.stats
            row = {"fits": True, "compute_overhead": st.compute_overhead, "evictions": st.evictions,
                   "fragmentation": st.fragmentation, "peak_bytes": st.peak_bytes,
                   "restores_in_turn": st.restores_in_turn}
            table.add_row(policy, "yes*" if st.restores_in_turn else "yes", f"{st.compute_overhead:.3f}x",
                          str(st.evictions), f"{st.fragmentation:.3f}", f"{st.peak_bytes / 2**20:.1f} MiB")
        except OutOfBudget as e:
            row = {"fits": False, "error": str(e)}
            table.add_row(policy, f"no ({e.op})", "-", "-", "-", "-")
        result["policies"][policy] = row
    console.print(table)
    if any(r.get("restores_in_turn") for r in result["policies"].values()):
        console.print("* fits only because some ops' inputs, which did not fit back at once, were restored one at a "
                      "time (stats.restores_in_turn, Note [Restore plans]): this budget is at the edge, where small "
                      "changes to the model or the batch may not fit.")
    return result
