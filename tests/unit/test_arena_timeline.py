"""tools/arena_timeline.py (Note [Arena timeline]): the trace's replay on two streams, vLLM's
prefetch offloader's rule in the same units, and what it shows of the arena's fills: rows no
read holds are copied before the fill waits for the layer before it."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from ringflow.orchestrator.expert_hazards import ExpertOp

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def timeline():
    spec = importlib.util.spec_from_file_location("arena_timeline",
                                                  ROOT / "tools/arena_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_replay_orders_each_stream_by_its_waits(timeline):
    """Layer 0 computes (2); a copy of 3 experts waits for its retire (2 + 3); layer 1 waits
    for that copy (5 + 2); a copy issued before any wait overlaps layer 0."""
    ops = [ExpertOp("read", "compute", ((0, 0),), on=0),
           ExpertOp("record", "compute", on=("retired", 0)),
           ExpertOp("place", "copy", ((5, 0),), on=2),  # no wait: from t=0
           ExpertOp("wait", "copy", on=("retired", 0)),
           ExpertOp("place", "copy", ((1, 0), (2, 1), (3, 2)), on=1),
           ExpertOp("record", "copy", on=("ready", 1)),
           ExpertOp("wait", "compute", on=("ready", 1)),
           ExpertOp("read", "compute", ((1, 0),), on=1),
           ExpertOp("read", "compute", ((2, 1),), on=1)]  # the same layer: no second cost
    assert timeline.replay(ops, expert_ms=1.0, layer_ms=2.0) == 7.0
    assert timeline.replay(ops[:2] + ops[3:4] + ops[2:3] + ops[4:], 1.0, 2.0) == 8.0


def test_the_replay_starts_nothing_before_the_host_issued_it(timeline):
    """The host issues a layer every 3 ms, an expert copies in 2: layer 0 runs 3-5 and layer
    1 6-8; a copy of 3 experts for the layer after, issued after layer 1's read, starts when
    the host issued it (6), lands at 12, and that layer runs 12-14. Issued before layer 1's
    read, it starts once layer 0 retired (5) and the layer runs 11-13."""
    late = [ExpertOp("read", "compute", ((0, 0),), on=0),
            ExpertOp("record", "compute", on=("retired", 0)),
            ExpertOp("read", "compute", ((2, 1),), on=1),
            ExpertOp("wait", "copy", on=("retired", 0)),
            ExpertOp("place", "copy", ((1, 0), (2, 1), (3, 2)), on=2),
            ExpertOp("record", "copy", on=("ready", 2)),
            ExpertOp("wait", "compute", on=("ready", 2)),
            ExpertOp("read", "compute", ((1, 0),), on=2)]
    assert timeline.replay(late, 2.0, 2.0) == 10.0  # a host never behind: as before
    assert timeline.replay(late, 2.0, 2.0, host_ms=3.0) == 14.0
    early = late[:2] + late[3:6] + late[2:3] + late[6:]
    assert timeline.replay(early, 2.0, 2.0) == 10.0
    assert timeline.replay(early, 2.0, 2.0, host_ms=3.0) == 13.0
    # the offloader's copy is issued after its buffer's last layer: 4 layers, 1 and 3
    # offloaded, one ahead, the host at 3 ms a layer: layer 1 runs 6-7 (issued at 6), layer
    # 3's copy starts once layer 1 ran (7) and lands 12.8 ms later, layer 3 runs from there
    copy = timeline.EXPERTS * 0.1
    assert timeline.offloader(4, [1, 3], 1, 0.1, 1.0, 1, host_ms=3.0) == pytest.approx(
        7.0 + copy + 1.0)


def test_the_offloader_copies_its_first_buffers_before_a_lone_step(timeline):
    """4 layers, 1 and 3 offloaded, one buffer ahead: layer 1's copy is done before the step;
    layer 3's starts once layer 1 retired (its buffer's last user)."""
    copy = timeline.EXPERTS * 0.1
    assert timeline.offloader(4, [1, 3], 1, 0.1, 1.0, 1) == pytest.approx(2.0 + copy + 1.0)
    # back to back: each step copies both; the next step's layer 1 once layer 3 retired
    two = timeline.offloader(4, [1, 3], 1, 0.1, 1.0, 2)
    assert two == pytest.approx(2.0 + copy + 1.0 + copy + 1.0 + copy + 1.0)


def test_a_fill_copies_the_rows_no_read_holds_before_it_waits(timeline):
    """Whole layers beside half ones at real expert counts (the bench's 8 layers): some fill
    of a lone step copies rows before its wait for the layer before to retire, and the
    replay with every wait of a fill hoisted before its copies (the order before this) is
    slower (94.2 ms against 101.4). At the bench's 4 layers the two orders replay alike from
    a steady state; this test used them until the trace warmed with two large steps."""
    _, ops = timeline.lone_trace([128, 42, 42, 42, 128, 42, 42, 42])
    early = [i for i, op in enumerate(ops) if op.kind == "place" and any(
        later.kind == "wait" and later.stream == "copy" and later.on[0] == "retired"
        for later in ops[i + 1:next(j for j in range(i, len(ops))
                                    if ops[j].kind == "record" and ops[j].stream == "copy")])]
    assert early, [(op.kind, op.on) for op in ops]
    hoisted, fill = [], []
    for op in ops:
        if op.stream == "copy" and op.kind in ("place", "wait"):
            fill.append(op)
            continue
        if op.stream == "copy" and op.kind == "record":
            hoisted += [o for o in fill if o.kind == "wait"] + [o for o in fill
                                                                if o.kind == "place"]
            fill = []
        hoisted.append(op)
    assert len(hoisted) == len(ops)
    assert timeline.replay(ops, 0.172, 1.8) < timeline.replay(hoisted, 0.172, 1.8)


def test_the_readmes_command_compares_the_bench_layouts_with_the_offloaders(timeline, capsys):
    """Every `python3 tools/arena_timeline.py` command the vLLM README prints runs as printed;
    the offloader given the same memory as the bench gives it (4 layers: 1 and 3 offloaded, one
    ahead; 8 layers: every layer, four ahead), its ratio printed, and the arena's lone step
    copying at least what the device cannot hold."""
    readme = (ROOT / "integrations/vllm/README.md").read_text()
    printed = re.findall(r"`python3 tools/arena_timeline.py([^`]*)`", readme)
    assert printed
    import torch
    for args in printed:  # each as the README prints it (a --gpu one where there is a GPU)
        if "--gpu" in shlex.split(args) and not torch.cuda.is_available():
            continue
        doc = timeline.main(shlex.split(args))
        assert doc["arena"]["lone_copies"] > 0 and doc["lone_vs_offloader"] > 0
        assert "x" + str(doc["lone_vs_offloader"]) in capsys.readouterr().out
    four = timeline.main(["--slots", "128,64,128,64"])
    assert four["offloaded"] == [1, 3] and four["ahead"] == 1
    eight = timeline.main([])
    assert eight["offloaded"] == list(range(8)) and eight["ahead"] == 4
    # the lone step copies what the device cannot hold, and its tail's share
    assert eight["arena"]["lone_copies"] >= 8 * 128 - sum(eight["slots"])


def test_the_record_names_the_gpu_beside_the_gpu_runs(timeline, tmp_path, monkeypatch):
    """``--gpu --json``: the record's ``gpu`` stays the GPU's name (records.environment) and
    the runs go under ``on_gpu``; at 05e7abc the runs' list took the ``gpu`` key. The GPU run
    is stood in for, so that this runs on a CPU."""
    import json
    from ringflow.bench import records
    run = {"gpu": "stand-in", "ints_by_copy": False, "lone_ms": [1.0], "chunk_ms": [1.0],
           "lone_replay_ms": 1.0, "lone_copies": 1}
    monkeypatch.setattr(timeline, "gpu_times", lambda *a, **k: dict(run))
    monkeypatch.setattr(records, "environment", lambda program: {"gpu": "the GPU's name",
                                                                 "command": program})
    timeline.main(["--gpu", "--json", str(tmp_path / "t.json")])
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["gpu"] == "the GPU's name" and doc["on_gpu"] == [run]


def test_a_lone_step_after_prompts_costs_what_it_costs_after_decode(timeline):
    """The bench's 4 layers: a lone large step right after prompts that ended at their first
    token is as quick as one after decode (the tail gave back the rows the half layers
    borrowed, and the whole layer between them kept its own); the rank that took the last
    layer's rows left it 34.0 ms against 27.4."""
    ours = timeline.arena_times([128, 64, 128, 64], 0.172, 1.8)
    assert ours["lone_after_prompt_ms"] <= ours["lone_ms"] + 0.5


def test_eight_layers_fill_the_whole_first_layers_free_rows_while_the_layer_before_runs(
        timeline):
    """The bench's 8 layers (0 and 4 whole, the others 42 slots): each half layer's fill
    copies into the first layer's rows that no running layer reads before it waits for the
    layer before, so the lone step models 0.97x the prefetch offloader where every fill
    waited for it (the rank before: 0.90x), and chunks no slower."""
    eight = timeline.main([])
    assert eight["lone_vs_offloader"] >= 0.95
    assert eight["chunk_vs_offloader"] >= 1.378


def test_the_front_layout_fills_its_first_half_layer_as_soon_as_the_first_layer_ran(
        timeline):
    """Layers 0 and 1 whole: layer 2's fill takes layer 0's rows once layer 0's read is
    issued, before layer 1's (layer 1 holds only its own experts, so nothing it frees would
    rank before them); it waited for layer 1's before, so an H100's host, issuing vLLM's
    first layers slower than the GPU ran them, started the copy engine late. With the host
    at 5 ms a layer that replays 98.7 ms (the offloader's too) against 100.8."""
    slots = [128, 128, 43, 43, 43, 43, 42, 42]
    _, ops = timeline.lone_trace(slots)
    first_place = next(i for i, op in enumerate(ops) if op.kind == "place" and op.on == 2)
    read_1 = next(i for i, op in enumerate(ops) if op.kind == "read" and op.on == 1)
    read_0 = next(i for i, op in enumerate(ops) if op.kind == "read" and op.on == 0)
    assert read_0 < first_place < read_1
    ours = timeline.arena_times(slots, timeline.EXPERT_BYTES / timeline.PINNED_GBPS / 1e6,
                                2.9, host_ms=5.0)
    theirs = timeline.offloader(8, list(range(8)), 4,
                                timeline.EXPERT_BYTES / timeline.PINNED_GBPS / 1e6, 2.9, 1,
                                host_ms=5.0)
    assert ours["lone_ms"] <= theirs + 0.1


def test_a_fill_left_for_later_is_tried_again_only_once_what_it_reads_moved(timeline,
                                                                           monkeypatch):
    """A fill that found too few rows is not tried again by the next ``begin`` (nothing it
    reads moved): each such try scans every row for nothing, host time on the step's path
    (0.3 ms a layer on this CPU). The step's trace and replay stay."""
    from ringflow.integrations.torch.expert_arena import ExpertArena
    slots = [128, 128, 43, 43, 43, 43, 42, 42]
    lane, _ = timeline.lone_trace(slots)
    tried, real = [], ExpertArena._fill

    def fill(self, position):
        copied = real(self, position)
        tried.append((position, copied >= 0))
        return copied

    monkeypatch.setattr(ExpertArena, "_fill", fill)
    lane.ring.trace = ops = []
    before, waited = lane.ring.fills, lane.ring.fills_waited
    timeline.step(lane, timeline.LARGE, 20)
    left = [p for p, ok in tried if not ok]
    # begin(0) starts the step: fills 0 and 1 find their rows, 2 waits for layer 0's read;
    # end(0) fills 2 and 3 waits; begin(1) does not scan for 3 again, end(1) does (a read
    # retired), and so on: one try left for later per layer's end, where each begin tried
    # again too before (26 tries, 14 of them left for later)
    assert tried[:5] == [(0, True), (1, True), (2, False), (2, True), (3, False)]
    assert len(left) == lane.ring.fills_waited - waited == 9 and len(tried) == 19
    assert lane.ring.fills - before == len(tried) - len(left)
    assert timeline.replay(ops, 0.172, 2.9) == pytest.approx(93.864)


@pytest.mark.parametrize("slots", [[128, 128, 43, 43, 43, 43, 42, 42], [128, 64, 128, 64],
                                   [64, 64, 64, 64], [128, 43, 43, 42, 128, 43, 43, 42]])
def test_the_rows_a_fill_keeps_are_those_a_scan_of_every_row_finds(timeline, monkeypatch,
                                                                    slots):
    """``_kept`` finds a position's rows from its table and the fills' records; a scan of
    every row's content (as the fill did before) must give the same experts at the same rows,
    over lone prompts, chunks and decode steps between them, in every layout the Notes name."""
    from ringflow.integrations.torch.expert_arena import ExpertArena
    real, checked = ExpertArena._kept, []

    def kept(self, position, claimed):
        scan = {}  # every row in order, its content as the Note defines it
        for r, (q, slot) in enumerate(self._owner):
            entry, record = self._tables[q][slot], self._records.get(r)
            c = ((q, entry) if entry >= 0 else record[:2]
                 if record is not None and record[2] == self.caches[q].generation else None)
            if r not in claimed and c is not None and c[0] == position and c[1] not in scan:
                scan[c[1]] = r
        got = real(self, position, claimed)
        assert got == scan, (position, sorted(set(got.items()) ^ set(scan.items()))[:6])
        first = self._first_row[position]
        checked.append(sum(not first <= r < first + self.caches[position].slots
                           for r in got.values()))  # rows found through the records
        return got

    monkeypatch.setattr(ExpertArena, "_kept", kept)
    lane = timeline.arena_lane(slots)
    for s, tokens in enumerate([timeline.LARGE, timeline.LARGE, 1, 2, timeline.LARGE, 1,
                                timeline.LARGE, timeline.LARGE, 2, 1, 1, timeline.LARGE,
                                timeline.LARGE, 1, timeline.LARGE]):
        if s == 12:  # a new generation of every cache: what the fills recorded lapses
            for cache in lane.caches.values():
                cache.lend()
        timeline.step(lane, tokens, 50 + s)
    assert len(checked) >= 2 * len(slots)
    assert sum(checked) > 0 or slots[:2] == [128, 128]  # the front layout keeps none so


def test_a_lone_trace_after_something_else_is_refused(timeline):
    from ringflow.errors import ConfigError
    with pytest.raises(ConfigError, match="after is decode or prompt, not 'chunks'"):
        timeline.lone_trace([128, 64, 128, 64], "chunks")


def test_the_engine_trace_needs_vllm_in_this_process(timeline, monkeypatch):
    from ringflow.errors import ConfigError
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ConfigError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        timeline.engine_trace([128, 64, 128, 64])


@pytest.mark.cuda
def test_the_lane_on_a_gpu_moves_the_experts_its_trace_names(timeline, tmp_path):
    """gpu_times runs the lane with real experts on the GPU: the profiled lone step's bulk
    copies up to its last kernel move the experts its trace places, less what its tail copies
    after that kernel (the H100 at 8 layers: 5.13 GB of 6.08 with the tables written by a
    kernel, all 6.08 when they went through a copy engine and the tail held the compute
    stream). Times are the tool's to print, not asserted."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; run `pytest -m cuda` on one")
    out = timeline.gpu_times([128, 64, 128, 64], layer_ms=1.0, rounds=1, chunks=2,
                             trace=str(tmp_path / "lone.json"))
    assert out["lone_copies"] > 0 and len(out["lone_ms"]) == 1 and out["lone_ms"][0] > 0
    moved = out["copy_gaps"]["bulk_gb"] * 1e9 / timeline.EXPERT_BYTES
    # the profiled step follows other decode steps than the traced one: a few experts apart
    assert 0.5 * out["lone_copies"] <= moved <= 1.1 * out["lone_copies"]
