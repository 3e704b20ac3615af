"""Memory snapshots in PyTorch's format (Note [Memory snapshots] in coop_arena/snapshot.py): a real CPU step under a
tight Budget, read by torch.cuda._memory_viz's own functions (plain Python, no GPU), and `coop-arena plan
--snapshot/--plot`."""

import base64
import contextlib
import copy
import io
import json
import pickle
import re
import warnings
from collections import Counter

import pytest
import torch
import torch.cuda._memory_viz as viz
from rich.console import Console

import coop_arena
from coop_arena.cli import main
from coop_arena.examples import MODELS, batch, loss_fn
from coop_arena.plan import plan
from coop_arena.snapshot import FILENAME, kind, memory_snapshot, timeline, write

_LINES = dict(format_flamegraph=lambda lines: lines)  # the flame graph's input, without its Perl script


def _step(budget, inside=None):
    """One training step of a small MLP under `budget` (a tight one thrashes: the warning says so)."""
    torch.manual_seed(0)
    model = MODELS["mlp"](width=64, depth=8)
    x, y = batch("mlp", 0)
    with budget, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="this step is thrashing", category=RuntimeWarning)
        loss = loss_fn("mlp", model(x), y)
        loss.backward()
        if inside is not None:
            inside(budget)
    return loss


@pytest.fixture(scope="module")
def tight():
    """A Budget of a third of the step's plain peak, after one block: it evicts and recomputes."""
    plain = coop_arena.Budget(1 << 20, device="cpu", headroom=0)
    _step(plain)
    budget = coop_arena.Budget(plain.stats.peak_bytes // 3, device="cpu", headroom=0)
    _step(budget)
    return budget


def _replay(entries, segment):
    """Replay a device trace as an allocator would: (bytes in use after each entry, blocks live at the end by
    address). Asserts every free frees a live block of its size and every alloc lies in the segment, overlapping
    nothing live."""
    live, used, curve = {}, 0, []
    lo, hi = segment["address"], segment["address"] + segment["total_size"]
    for e in entries:
        if e["action"] == "alloc":
            a, n = e["addr"], e["size"]
            assert lo <= a and a + n <= hi, e
            assert all(a + n <= b or b + m <= a for b, m in live.items()), e
            live[a] = n
            used += n
        elif e["action"] == "free_requested":
            assert live.get(e["addr"]) == e["size"], e
        elif e["action"] == "free_completed":
            assert live.pop(e["addr"]) == e["size"], e
            used -= e["size"]
        curve.append(used)
    return curve, live


def test_a_tight_steps_snapshot_replays_to_its_peak(tight):
    st = tight.stats
    assert st.evictions > 0 and st.rematerializations > 0
    snap = tight.memory_snapshot()
    (segment,) = snap["segments"]
    (entries,) = snap["device_traces"]
    assert segment["total_size"] == st.budget and segment["address"] == tight._traced_at != 0
    curve, live = _replay(entries, segment)
    # the entries' sizes are the aligned blocks the table holds, so their running sum is the arena's used bytes
    assert max(curve) == st.peak_bytes
    assert [used for _, used in timeline(snap)] == [used for used, e in zip(curve, entries)
                                                    if e["action"] != "free_requested"]
    assert [(b["address"], b["size"]) for b in segment["blocks"] if b["state"] == "active_allocated"] == sorted(
        live.items())
    assert segment["allocated_size"] == curve[-1] == sum(live.values())
    assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]

    events = Counter(e.kind for e in tight.trace)
    kinds = Counter(kind(e) for e in entries)
    assert kinds["restore"] == events["restore"] == st.rematerializations  # (no old versions in this step)
    assert kinds["alloc"] == events["alloc"]
    # every eviction is a free_requested and a free_completed: the policy's (stats.evictions) and the engine's own
    assert kinds["evict"] == 2 * events["evict"] and events["evict"] >= st.evictions
    freed_resident = kinds["free"] // 2
    assert 0 < freed_resident < events["free"]  # a free of an evicted storage releases nothing: no entry
    assert kinds["move"] == 3 * events["move"]  # a free at the old address, an alloc at the new
    assert len(entries) == sum(kinds[k] for k in ("alloc", "restore", "evict", "free", "move"))

    for e in entries:  # each entry names what happened, to which storage, at which op
        (frame,) = e["frames"]
        assert frame["filename"] == FILENAME and frame["line"] == 0
        assert re.search(r"storage \d+", frame["name"]) and "aten." in frame["name"] or "block exit" in frame["name"]
    names = [e["frames"][0]["name"] for e in entries]
    assert "aten.addmm.default (storage 0)" in names
    assert any(re.fullmatch(r"restore storage \d+ of aten\.\w+\.\w+ \(for aten\.\w+\.\w+\)", n) for n in names)
    assert any(re.fullmatch(r"evict storage \d+ \(at aten\.\w+\.\w+\)", n) for n in names)


def test_pytorchs_memory_viz_reads_it(tight, capsys, tmp_path):
    with open(write(tight.memory_snapshot(), tmp_path / "step.pickle"), "rb") as f:
        snap = pickle.load(f)
    (entries,) = snap["device_traces"]
    text = viz.trace(snap)
    assert text.startswith(f"Device 0 ----------------\n{len(entries)} entries\n")
    frees = sum(e["action"] == "free_completed" for e in entries)
    assert text.count("\ndel ") == text.count("# free completed for ") == frees == (len(entries) - sum(
        e["action"] == "alloc" for e in entries)) // 2
    summary = viz.segsum(snap)  # checks that the blocks add up to the segment, and allocated + free to reserved
    assert "segments: 1" in summary
    lines = viz.memory(snap, **_LINES).splitlines()  # "stack;frames bytes" per block and per unrequested gap
    assert sum(int(line.rsplit(" ", 1)[1]) for line in lines) == snap["segments"][0]["total_size"]
    for b in snap["segments"][0]["blocks"]:
        if b["state"] == "active_allocated":
            assert f"stream_0;active_allocated;{FILENAME}:0:{b['frames'][0]['name']} {b['requested_size']}" in lines
    assert viz.segments(snap, **_LINES).startswith(f"stream_0;seg_{snap['segments'][0]['address']};")
    assert viz.compare(snap["segments"], snap["segments"], **_LINES) == ""  # nothing only before or only after
    for html in (viz.trace_plot(snap), viz.segment_plot(snap)):  # the viewer's page, the snapshot inside it
        files = json.loads(re.search(r"const local_files = (\[.*?\])\n", html).group(1))
        assert pickle.loads(base64.b64decode(files[0]["base64"])) == snap
    viz.trace_plot(copy.deepcopy(snap), filter_freed=True)  # pairs each free with its alloc, and says where not
    assert "without free_requested" not in capsys.readouterr().out


def test_a_snapshot_inside_the_block_is_the_live_table():
    seen = {}

    def inside(budget):
        seen["snapshot"], seen["table"] = budget.memory_snapshot(), budget.snapshot()

    budget = coop_arena.Budget(48 << 10, device="cpu", headroom=0)
    _step(budget, inside)
    snap, table = seen["snapshot"], seen["table"]
    (segment,) = snap["segments"]
    base = segment["address"]
    assert [(b["address"] - base, b["size"], b["state"] == "active_allocated") for b in segment["blocks"]] == [
        (b["offset"], b["size"], b["sid"] is not None) for b in table]
    _, live = _replay(snap["device_traces"][0], segment)  # the trace leads to that table
    assert sorted(live.items()) == [(b["address"], b["size"]) for b in segment["blocks"]
                                    if b["state"] == "active_allocated"]
    assert all(b["frames"] for b in segment["blocks"] if b["state"] == "active_allocated")
    assert "segments: 1" in viz.segsum(snap)


def test_a_cut_trace_warns_and_still_opens():
    budget = coop_arena.Budget(48 << 10, device="cpu", headroom=0, trace_len=40)
    _step(budget)
    with pytest.warns(RuntimeWarning, match="as many as trace_len keeps"):
        snap = budget.memory_snapshot()
    assert len(budget.trace) == 40 and "segments: 1" in viz.segsum(snap) and viz.trace(snap)
    _replay(snap["device_traces"][0], snap["segments"][0])  # what it left out leaves no free without its alloc


def test_events_name_the_op_they_were_for(tight):
    ops = Counter(e.op for e in tight.trace)
    assert None not in ops and ops["aten.addmm.default"] > 0 and ops["block exit"] > 0
    ops = [e.op for e in tight.trace]
    exit_from = ops.index("block exit")  # the exit's own events (deaths at the end, copies out) come last
    assert set(ops[exit_from:]) == {"block exit"}


def test_an_optimizer_step_in_the_block_is_the_cause_of_what_it_settles():
    torch.manual_seed(0)
    model = MODELS["mlp"](width=64, depth=8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batch("mlp", 0)
    budget = coop_arena.Budget(56 << 10, device="cpu", headroom=0)
    with budget, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="this step is thrashing", category=RuntimeWarning)
        out = model(x)  # held across the step, as a training loop holds its outputs for metrics
        loss_fn("mlp", out, y).backward()
        optimizer.step()  # settles what was computed from the parameters it overwrites: frees what none can reach
    assert Counter(e.kind for e in budget.trace if e.op == "SGD.step")["free"] > 0


def test_memory_snapshot_refuses_bad_arguments():
    for bad in (dict(capacity=0), dict(capacity=True), dict(alignment=1.5), dict(address=-1), dict(device="0")):
        with pytest.raises(ValueError):
            memory_snapshot([], **{"capacity": 512, "alignment": 512, **bad})


def test_plan_writes_a_snapshot_and_a_plot(tmp_path):
    pickled, png = tmp_path / "step.pickle", tmp_path / "step.png"
    r = plan("mlp", 16, "0.3", Console(file=io.StringIO()), snapshot=pickled, plot=png)
    coop = r["policies"]["coop"]
    with open(pickled, "rb") as f:
        snap = pickle.load(f)
    (segment,) = snap["segments"]
    assert segment["address"] == 0 and segment["device"] == 0  # a dry run on meta
    assert segment["total_size"] <= r["budget"]
    curve, _ = _replay(snap["device_traces"][0], segment)
    assert max(curve) == coop["peak_bytes"]
    assert sum(kind(e) == "evict" for e in snap["device_traces"][0]) >= 2 * coop["evictions"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert max(used for _, used in timeline(snap)) == coop["peak_bytes"]


def test_plan_of_a_step_that_cannot_fit_writes_its_out_of_budget(tmp_path):
    r = plan("cnn", 8, "64KiB", Console(file=io.StringIO()), snapshot=tmp_path / "oom.pickle")
    assert not r["policies"]["coop"]["fits"]
    with open(tmp_path / "oom.pickle", "rb") as f:
        snap = pickle.load(f)
    last = snap["device_traces"][0][-1]
    assert kind(last) == "oom" and last["size"] == 64 << 10 and last["device_free"] >= 0
    assert "for aten.native_batch_norm.default" in last["frames"][0]["name"]
    assert "raise OutOfMemoryError # 64.0KiB requested" in viz.trace(snap)


def test_cli_flags(tmp_path, capsys):
    pickled, png = tmp_path / "s.pickle", tmp_path / "p.png"
    assert main(["plan", "mlp", "--batch", "8", "--budget", "0.4", "--snapshot", str(pickled),
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "pytorch.org/memory_viz" in out and str(png) in out
    with open(pickled, "rb") as f:
        assert "segments: 1" in viz.segsum(pickle.load(f))
    assert png.stat().st_size > 1000
    for args, message in ((["--plot", str(tmp_path / "p.gif")], "ending in .png, .svg, .pdf"),
                          (["--snapshot", str(tmp_path / "no" / "s.pickle")], "no folder"),
                          (["--snapshot", str(tmp_path)], "is a folder")):
        with pytest.raises(SystemExit) as e, contextlib.redirect_stdout(io.StringIO()):
            main(["plan", "mlp", "--batch", "8", *args])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
