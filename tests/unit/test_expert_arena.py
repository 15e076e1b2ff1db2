"""The expert arena (Note [Large steps stream through the slots]): large steps computed from
the caches' own rows through expert maps, against the float64 MoE, the bytes each step copies, the
joint proof with the caches' operations and the mutants it must catch; on a GPU (marked cuda)
its copies on ringflow's copy stream under a slow reader and a captured small step replayed
while a carried fill lands."""

from __future__ import annotations

import pytest
import torch

from ringflow.errors import ConfigError, HazardError, KernelError
from ringflow.integrations.torch.expert_arena import ExpertArena, arena_rows
from ringflow.integrations.torch.expert_cache import ExpertCache
from ringflow.integrations.torch.expert_lane import ExpertLane, TorchCompute
from ringflow.kernels.reference import moe_ref
from ringflow.orchestrator.expert_hazards import ExpertOp, check_lane
from tests.helpers.expert_lanes import (E, H, K, LAYERS, SIZES, assert_exact, hosts_on,
                                        layer_experts, on_a_gpu,
                                        replay_small_step_after_large_steps, routing, run_step)

#: every other layer whole, the others half (the bench's 4-layer layout: layers 0 and 2 keep
#: all 128 experts, 1 and 3 64 each); what a large step copies is counted against it below
WHOLE = [E, E // 2, E, E // 2]
#: a whole first layer beside three with a third of their experts each: the later layers'
#: fills take the first layer's rows that the layer before does not read before those it reads
THIN = [E, E // 3, E // 3, E // 3]


def make_lane(slots: int | list[int] = 3, device="cpu", stream=None, poison_reads=False,
              layer_tokens: int = 6):
    """A lane over LAYERS whose large steps stream through its caches' rows: ``slots`` per
    layer (a list: each layer's)."""
    hosts = hosts_on(device)
    counts = slots if isinstance(slots, list) else [slots] * len(LAYERS)
    rows, views = arena_rows(hosts[LAYERS[0]], counts, device)
    caches = {i: ExpertCache(hosts[i], n, device, rows=v)
              for i, n, v in zip(LAYERS, counts, views)}
    arena = ExpertArena([caches[i] for i in LAYERS], rows, stream, poison_reads)
    return ExpertLane(caches, {i: TorchCompute() for i in LAYERS}, arena, layer_tokens,
                      early_start=True), hosts


@pytest.mark.parametrize("poison_reads", [False, True])
@pytest.mark.parametrize("slots", [3, 4, 6, 9, 12, WHOLE, THIN])
def test_steps_on_both_sides_of_the_threshold_equal_the_float64_moe(slots, poison_reads):
    lane, hosts = make_lane(slots, poison_reads=poison_reads)
    for s, tokens in enumerate(SIZES):
        assert_exact(*run_step(lane, hosts, tokens, s))
    arena = lane.ring
    assert arena.windows == sum(c.slots for c in lane.caches.values()) // E
    assert arena.steps == sum(t >= 6 for t in SIZES)
    assert arena.carried_steps == arena.steps - 1  # each later step's first layer came early
    assert sum(c.hits.item() + c.misses.item() for c in lane.caches.values()) > 0
    assert lane.bytes == sum(c.bytes for c in lane.caches.values()) + arena.bytes


@pytest.mark.parametrize("slots, copied", [(3, 4 * E), (12, 0), (WHOLE, 3 * (E // 2))])
def test_back_to_back_large_steps_copy_what_the_rows_cannot_keep(slots, copied):
    """Rows for one layer: each chosen layer is copied whole once per step (its rows last
    held another layer). Rows for every layer: the tail carries them all and the next step
    copies nothing. Whole layers beside half ones: each half layer's missing half is copied
    into the whole layer's rows before it, once that layer ran (the second into the rows
    the first used, once it ran), and the tail copies the whole layer's half back."""
    lane, hosts = make_lane(slots)
    for s in range(2):
        run_step(lane, hosts, 8, s)
    for s in range(2, 5):
        before = lane.ring.rows_from_host
        assert_exact(*run_step(lane, hosts, 8, s))
        assert lane.ring.rows_from_host - before == copied


def test_a_map_is_written_only_where_its_rows_moved(monkeypatch):
    """Rows for every layer: back to back large steps find each layer where the step before
    left it, so no map is staged again (each staging is a pinned tensor, a kernel and a copy
    on the step's path) and the steps still equal the float64 MoE; a half layer's map, whose
    rows may move, is written where they did: fewer stagings than fills."""
    from ringflow.integrations.torch import expert_arena
    staged = []
    real = expert_arena.device_ints
    monkeypatch.setattr(expert_arena, "device_ints",
                        lambda values, device: staged.append(list(values)) or real(values,
                                                                                  device))
    lane, hosts = make_lane(12)
    for s in range(2):
        run_step(lane, hosts, 8, s)
    staged.clear()
    for s in range(2, 4):
        assert_exact(*run_step(lane, hosts, 8, s))
    assert staged == []
    lane, hosts = make_lane(WHOLE)
    for s in range(2):
        run_step(lane, hosts, 8, s)
    staged.clear()
    fills = lane.ring.fills
    for s in range(2, 4):
        assert_exact(*run_step(lane, hosts, 8, s))
    assert 0 < len(staged) < lane.ring.fills - fills


def test_half_rows_copy_fewer_than_layers_whole_back_to_back():
    """Rows for two of four layers: between the floor (the experts that do not fit) and every
    layer whole (what a window of consecutive rows per layer copied)."""
    lane, hosts = make_lane(6)
    for s in range(2):
        run_step(lane, hosts, 8, s)
    before = lane.ring.rows_from_host
    for s in range(2, 6):
        assert_exact(*run_step(lane, hosts, 8, s))
    per_step = (lane.ring.rows_from_host - before) / 4
    assert 4 * E - 4 * 6 <= per_step < 4 * E


def test_a_lone_large_step_copies_only_what_the_device_does_not_hold():
    """Whole layers beside half ones, after decode: a large step copies, before its last
    layer computes, exactly each half layer's experts that its slots do not hold (every
    other expert is on the device), each into the rows of a layer that already ran; its tail
    copies the whole layer's borrowed rows back, so the whole layers' tables are full again
    for the decode steps after it."""
    lane, hosts = make_lane(WHOLE)
    run_step(lane, hosts, 8, 0)  # the whole layers' slots fill (their tables adopt them)
    for s in range(1, 7):
        run_step(lane, hosts, 1 + s % 2, s)
    held = {q: {e for e in lane.caches[i].expert_in[:lane.caches[i].slots].tolist() if e >= 0}
            for q, i in enumerate(LAYERS)}
    assert all(len(held[q]) == E for q in (0, 2))  # decode kept the whole layers whole
    lane.ring.trace = ops = []
    assert_exact(*run_step(lane, hosts, 8, 9))
    last_read = max(i for i, op in enumerate(ops) if op.kind == "read" and op.on == 3)
    placed = [(op.on, op.space, e) for op in ops[:last_read] if op.kind == "place"
              for e, _ in op.pairs]
    assert sorted((q, e) for q, _, e in placed) == sorted(
        (q, e) for q in (1, 3) for e in set(range(E)) - held[q])
    assert all(space == 0 for _, space, _ in placed)  # into layer 0's rows, once it ran
    tail = [op for op in ops[last_read:] if op.kind == "place"]
    assert {op.on for op in tail} == {0} and {op.space for op in tail} == {0}
    for q in (0, 2):
        c = lane.caches[LAYERS[q]]
        assert sorted(c.expert_in[:c.slots].tolist()) == list(range(E))


def test_prompts_one_token_apart_leave_the_whole_layer_between_them_whole():
    """Lone large steps with one decode step between (prompts that end at their first
    token): the half layers borrow rows of layer 0 only, whose tail gives them back, so
    layer 2 stays whole and each step copies only the half layers' missing experts before
    its last layer. Taking layer 2's rows, the layer that ran last (the rank before), left
    it to copy them back between layers 1 and 3, on the step's path."""
    lane, hosts = make_lane(WHOLE)
    run_step(lane, hosts, 8, 0)
    for s in range(1, 4):
        assert_exact(*run_step(lane, hosts, 8, 10 * s))
        run_step(lane, hosts, 1, 10 * s + 1)
        c = lane.caches[LAYERS[2]]
        assert sorted(c.expert_in[:c.slots].tolist()) == list(range(E))
    lane.ring.trace = ops = []
    assert_exact(*run_step(lane, hosts, 8, 99))
    last_read = max(i for i, op in enumerate(ops) if op.kind == "read" and op.on == 3)
    placed = {(op.on, op.space) for op in ops[:last_read] if op.kind == "place"}
    assert placed == {(1, 0), (3, 0)}


def test_a_fill_takes_the_whole_first_layers_free_rows_before_those_the_layer_before_reads():
    """A whole first layer beside three thin ones: layer 1 borrows 8 of layer 0's 12 rows;
    layer 2's fill copies 4 into layer 0's other rows before it waits for layer 1 to retire
    (only then the 4 more it needs of the rows layer 1 reads), and layer 3's likewise, so
    the copy engine is not idle through the layer before. The rank before took every row
    that layer 1 read first: each fill waited for the layer before for all its copies. The
    tail gives all of layer 0's rows back."""
    lane, hosts = make_lane(THIN)
    run_step(lane, hosts, 8, 0)
    for s in range(1, 7):
        run_step(lane, hosts, 1 + s % 2, s)
    lane.ring.trace = ops = []
    assert_exact(*run_step(lane, hosts, 8, 9))
    copies = [op for op in ops if op.stream == "copy"]
    for p in (2, 3):
        fill = [op for op in copies if op.on == p or op.on == ("retired", p - 1)]
        first_wait = next(i for i, op in enumerate(fill) if op.kind == "wait")
        early = [op for op in fill[:first_wait] if op.kind == "place"]
        assert early and all(op.space == 0 for op in early), [(op.kind, op.on) for op in fill]
    c = lane.caches[LAYERS[0]]
    assert sorted(c.expert_in[:c.slots].tolist()) == list(range(E))


def test_a_large_step_after_decode_keeps_in_place_what_the_slots_cached():
    """The first layer's fill keeps in place the experts its own cache installed during
    decode and copies only the others; its small steps' entries stay in its table."""
    lane, hosts = make_lane(slots=6)  # 24 rows, two layers' worth: position 0 in its own
    for s in range(4):
        run_step(lane, hosts, 2, s)  # small steps fill the caches
    first = lane.caches[LAYERS[0]]
    cached = {e for e in first.expert_in[:first.slots].tolist() if e >= 0}
    assert cached
    lane.ring.trace = ops = []
    assert_exact(*run_step(lane, hosts, 8, 9))
    read = next(i for i, op in enumerate(ops) if op.kind == "read" and op.on == 0)
    placed = {e for op in ops[:read] if op.kind == "place" and op.on == 0 for e, _ in op.pairs}
    assert placed == set(range(E)) - cached  # the rest came from host memory
    assert lane.ring.rows_in_place >= len(cached)


def joint_trace(steps=SIZES, slots=3, exact=True, poison_reads=False):
    lane, hosts = make_lane(slots, poison_reads=poison_reads)
    ops = []
    lane.trace_all(ops)
    lane.forget()  # every slot empty and traced so: where the proof starts
    for s, tokens in enumerate(steps):
        got, want = run_step(lane, hosts, tokens, s)
        if exact:
            assert_exact(got, want)
    return lane, ops


@pytest.mark.parametrize("slots, poison_reads", [(3, False), (6, True), (12, False),
                                                  (WHOLE, True), (WHOLE, False),
                                                  (THIN, True)])
def test_the_joint_trace_proves_the_arena_and_the_caches_together(slots, poison_reads):
    lane, ops = joint_trace(slots=slots, poison_reads=poison_reads)
    check_lane(ops, 0)
    kinds = {op.kind for op in ops}
    assert {"install", "read", "place", "forget"} <= kinds
    assert ("drop" in kinds) == (slots != 12)  # a fill into another layer's rows
    assert ("poison" in kinds) == poison_reads
    assert {op.space for op in ops if op.kind == "place"} == set(range(4))


@pytest.mark.parametrize("mutate, kind", [
    # a small step that does not wait for a carried fill before it installs over its rows
    (lambda ops: [op for op in ops if not (op.kind == "wait" and op.stream == "compute"
                                           and op.on and op.on[0] == "ready"
                                           and not _before_read(ops, op))], "cross-stream"),
    # a fill that does not wait for its rows' last reader
    (lambda ops: [op for op in ops if not (op.kind == "wait" and op.stream == "copy"
                                           and op.on and op.on[0] == "retired")], "cross-stream"),
    # a layer that reads its rows without waiting for the fill
    (lambda ops: [op for op in ops if not (op.kind == "wait" and op.stream == "compute"
                                           and _before_read(ops, op))], "cross-stream"),
    # a map naming a row of another layer's expert
    (lambda ops: [ExpertOp("read", op.stream, op.pairs, (op.on + 1) % 4, op.space)
                  if op.kind == "read" and op.on is not None else op for op in ops],
     "read-before-write"),
])
@pytest.mark.parametrize("slots", [3, WHOLE, THIN])
def test_each_arena_hazard_is_named(mutate, kind, slots):
    _, ops = joint_trace(steps=[8, 1, 2, 9, 1, 7], slots=slots)
    check_lane(ops, 0)
    with pytest.raises(HazardError) as err:
        check_lane(mutate(ops), 0)
    assert err.value.kind == kind


def _before_read(ops, wait):
    """Whether ``wait`` is a layer's wait for its fill (the arena's read comes next)."""
    i = next(j for j, op in enumerate(ops) if op is wait)
    return i + 1 < len(ops) and ops[i + 1].kind == "read" and ops[i + 1].on is not None


# large steps started before their forward (Note [Large steps start early])

#: what the engine says before each step (``prepare_step``), then the step's own tokens:
#: prepared and run; a prepare for a step that runs small after all (a small step follows,
#: then a large one prepared twice); a large step not prepared
PREPARED = [(8, 8), (1, 1), (2, 2), (9, 9), (12, 1), (6, 6), (7, 7), (7, 7), (1, 1), (None, 8),
            (1, 1)]


def prepared_trace(slots=3, twice=(6,)):
    lane, hosts = make_lane(slots)
    ops = []
    lane.trace_all(ops)
    lane.forget()
    for s, (said, tokens) in enumerate(PREPARED):
        started = said is not None and lane.prepare_step(said)
        assert started == (said is not None and said >= lane.layer_tokens)
        if tokens in twice and started:
            assert lane.prepare_step(said)  # a second prepare before the forward
        assert_exact(*run_step(lane, hosts, tokens, s))
        if started:  # as vLLM's execute_model hook does after the forward
            assert not lane.finish_step(said)  # every forward here began from position 0
    return lane, ops


@pytest.mark.parametrize("slots", [3, 6, 12])
def test_large_steps_started_early_equal_the_float64_moe_and_the_joint_trace_proves(slots):
    """Steps prepared by the engine before their forward: each large one's start (the top-up
    and the fills ahead) is issued at the prepare, its first layer goes on from there;
    outputs equal the float64 MoE on both sides of the threshold, a prepare whose step runs
    small leaves nothing wrong behind, each started step is counted once, and the lane's joint
    trace proves with every early start in it."""
    lane, ops = prepared_trace(slots)
    arena = lane.ring
    large = sum(t >= 6 for _, t in PREPARED)
    prepared = sum(said is not None and said >= 6 for said, _ in PREPARED)
    assert arena.early_starts == prepared + 1  # the twice-prepared step: one more
    # a start per large step, one per prepare whose step ran small, one per second prepare
    assert arena.steps == large + 1 + 1
    # used: every prepared step that ran large; dropped: the one that ran small, and the
    # first of the two prepares of one step
    assert (arena.early_used, arena.early_dropped) == (prepared - 1, 2)
    ring = lane.report()[0]["ring"]
    assert (ring["early_starts"], ring["early_used"], ring["early_dropped"]) == \
        (arena.early_starts, arena.early_used, arena.early_dropped)
    check_lane(ops, 0)


def test_a_prepared_step_that_a_graph_replays_is_dropped_after_it(caplog):
    """vLLM replays a step from a CUDA graph (its layer_tokens at or below the largest
    captured size) after execute_model started it early: no lane Python runs, the captured
    small steps install over the prepared rows. ``finish_step`` drops the unused prepare
    (said once), so the next large step, not prepared, starts afresh and is exact; left in
    place, that step would read what the replays overwrote (the mutant below)."""
    import logging

    def replayed(lane, seed):  # what a replay does: the caches' small steps, no lane Python
        for i in LAYERS:
            ids, _ = routing(seed * 7 + i, 1)
            for _ in lane.caches[i].serve(ids):
                pass

    for finish in (True, False):
        lane, hosts = make_lane(slots=6)
        run_step(lane, hosts, 8, 0)
        for s in range(2):
            run_step(lane, hosts, 1, 1 + s)
        assert lane.prepare_step(8)
        for s in range(3):
            replayed(lane, 10 + s)
        if finish:
            with caplog.at_level(logging.INFO, logger="ringflow"):
                assert lane.finish_step(8) and not lane.finish_step(8)
            got, want = run_step(lane, hosts, 8, 20)
            assert_exact(got, want)
            assert (lane.ring.early_used, lane.ring.early_dropped) == (0, 1)
            said = [r.getMessage() for r in caplog.records if "early_start" in r.getMessage()]
            assert len(said) == 1 and "a CUDA graph replay" in said[0]
        else:  # the mutant: the prepare stays, the next step skips its start
            got, want = run_step(lane, hosts, 8, 20)
            assert any(not torch.allclose(got[i].double(), want[i], rtol=1e-5, atol=1e-5)
                       for i in LAYERS)


def test_an_early_start_issues_the_top_up_before_the_forward():
    """After decode steps, a prepared large step's top-up (its first layer's experts the
    arena lacks) is in the trace before the first layer's read, with nothing of the step's
    forward between the prepare and it; begin(0) starts nothing more."""
    lane, hosts = make_lane(slots=6)
    run_step(lane, hosts, 8, 0)
    for s in range(3):
        run_step(lane, hosts, 1, 1 + s)  # decode installs over the carried rows
    lane.ring.trace = ops = []
    steps = lane.ring.steps
    assert lane.prepare_step(8)
    prepared = len(ops)
    assert any(op.kind == "place" and op.on == 0 for op in ops)  # the top-up, issued now
    assert lane.ring.steps == steps + 1
    assert_exact(*run_step(lane, hosts, 8, 9))
    assert lane.ring.steps == steps + 1  # begin(0) went on from the prepare
    first_read = next(i for i, op in enumerate(ops) if op.kind == "read" and op.on == 0)
    assert first_read >= prepared


def test_an_early_start_without_its_wait_for_earlier_steps_is_caught(monkeypatch):
    """The mutant: a prepare whose fills skip the copy stream's wait for the compute stream
    (the decode steps before it read and installed the rows it overwrites): a cross-stream
    hazard in the joint proof."""
    real = ExpertArena.prepare

    def unordered(arena):
        monkeypatch.setattr(arena, "_copy_after_compute", lambda: None)
        try:
            return real(arena)
        finally:
            monkeypatch.delattr(arena, "_copy_after_compute")

    monkeypatch.setattr(ExpertArena, "prepare", unordered)
    _, ops = prepared_trace(slots=3)
    with pytest.raises(HazardError) as err:
        check_lane(ops, 0)
    assert err.value.kind == "cross-stream"


def test_a_first_layer_on_another_stream_than_its_prepare_is_refused(monkeypatch):
    lane, hosts = make_lane(slots=6)
    arena = lane.ring
    monkeypatch.setattr(arena, "_stream_id", lambda: "side")
    assert lane.prepare_step(8)
    monkeypatch.setattr(arena, "_stream_id", lambda: "compute")
    with pytest.raises(KernelError, match="prepared on stream side and its first layer runs "
                                          "on compute.*early_start to false"):
        arena.begin(0)
    lane.forward(LAYERS[0], torch.randn(1, H), *reversed(routing(1, 1)))  # a small step:
    assert_exact(*run_step(lane, hosts, 8, 3))  # then a large one starts afresh, exact


def test_nothing_starts_early_without_early_start_nor_in_the_layer_ring():
    from tests.unit.test_expert_layers import make_lane as ring_lane
    lane, _ = make_lane(slots=6)
    lane.early_start = False
    assert not lane.prepare_step(8) and lane.ring.steps == lane.ring.early_starts == 0
    lane, _ = ring_lane(2)
    lane.early_start = True
    assert not lane.prepare_step(8) and not lane.prepare_step(1)


def test_rows_a_small_step_rewrote_are_copied_again(monkeypatch):
    """A fill that believes its records over the slot tables (a decode step installed over a
    row since) keeps a row that no longer holds its expert: the proof names it."""
    real = ExpertArena._content

    def records_first(arena, r):
        rec = arena._records.get(r)
        return rec[:2] if rec is not None else real(arena, r)
    monkeypatch.setattr(ExpertArena, "_content", records_first)
    monkeypatch.setattr(ExpertArena, "_recorded",  # as a fill's kept rows read them
                        lambda arena, r: arena._records[r][:2] if r in arena._records else None)
    _, ops = joint_trace(steps=[8, 1, 2, 1, 9], exact=False)
    with pytest.raises(HazardError) as err:
        check_lane(ops, 0)
    assert err.value.kind == "read-before-write"


def test_a_reload_and_a_step_cut_short_refill_what_they_must():
    lane, hosts = make_lane(slots=6)
    run_step(lane, hosts, 8, 0)
    for i in LAYERS:  # new host weights (a reload), then forget
        for t in hosts[i].values():
            t.mul_(-0.5)
    lane.forget()
    assert_exact(*run_step(lane, hosts, 8, 1))
    assert_exact(*run_step(lane, hosts, 1, 2))
    lane.ring.begin(0)  # the first layer's compute raised before end()
    lane.ring.begin(0)  # the next step starts over
    lane.ring.end(0)
    lane.ring.begin(2)  # and one that restarts at position 2
    with pytest.raises(KernelError, match="end"):
        lane.ring.end(3)
    lane.ring.end(2)
    assert_exact(*run_step(lane, hosts, 8, 3))
    assert_exact(*run_step(lane, hosts, 1, 4))


def test_bad_arenas_are_refused():
    hosts = [layer_experts(i) for i in LAYERS]
    rows, views = arena_rows(hosts[0], [2] * 4, "cpu")
    caches = [ExpertCache(h, 2, "cpu", rows=v) for h, v in zip(hosts, views)]
    with pytest.raises(ConfigError, match="fewer than one layer's 12: give them at least 3"):
        ExpertArena(caches, rows)
    rows, views = arena_rows(hosts[0], [3] * 4, "cpu")
    caches = [ExpertCache(h, 3, "cpu", rows=v) for h, v in zip(hosts, views)]
    with pytest.raises(ConfigError, match="not rows 3"):
        ExpertArena([caches[0], caches[2], caches[1], caches[3]], rows)
    with pytest.raises(ConfigError, match="copy stream"):
        ExpertArena(caches, rows, stream=object())
    with pytest.raises(ConfigError, match=r"\[slots, \.\.\.\]"):
        ExpertCache(hosts[0], 4, "cpu", rows=views[0])
    arena = ExpertArena(caches, rows)
    with pytest.raises(KernelError, match="positions 0..3"):
        arena.begin(4)


cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU; run `pytest -m cuda` on one")


def gpu_lane(slow: int, slots: int | list[int] = 3, poison_reads: bool = True):
    return on_a_gpu(make_lane, slow, slots=slots, poison_reads=poison_reads)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("slots", [3, 6, WHOLE, THIN])
def test_the_arena_on_a_gpu_is_exact_with_a_slow_reader_and_its_trace_proves(slots):
    lane, hosts = gpu_lane(slow=2_000_000, slots=slots)
    ops = []
    lane.trace_all(ops)
    lane.forget()
    for s, tokens in enumerate(SIZES):
        assert_exact(*run_step(lane, hosts, tokens, s, device="cuda"))
    check_lane(ops, 0)
    assert lane.ring.carried_steps == lane.ring.steps - 1


@cuda
@pytest.mark.cuda
def test_large_steps_started_early_on_a_gpu_are_exact_and_refuse_another_stream():
    """Note [Large steps start early] on the copy stream, a slow reader at every layer, small
    steps installing over the carried rows between (poisoned rows after each read): each
    prepared step equals the float64 MoE, the trace proves; a first layer issued on another
    stream than its prepare's is refused by name (its early fills were ordered after the
    prepare's stream only)."""
    lane, hosts = gpu_lane(slow=2_000_000, slots=3)
    ops = []
    lane.trace_all(ops)
    lane.forget()
    for s, (said, tokens) in enumerate(PREPARED):
        started = said is not None and lane.prepare_step(said)
        assert_exact(*run_step(lane, hosts, tokens, s, device="cuda"))
        if started:
            lane.finish_step(said)
    check_lane(ops, 0)
    prepared = sum(x is not None and x >= 6 for x, _ in PREPARED)
    assert (lane.ring.early_starts, lane.ring.early_used) == (prepared, prepared - 1)
    lane.trace_all(None)
    assert lane.prepare_step(8)
    with torch.cuda.stream(torch.cuda.Stream()):
        with pytest.raises(KernelError, match="prepared on stream"):
            run_step(lane, hosts, 8, 50, device="cuda")
    torch.cuda.synchronize()


@cuda
@pytest.mark.cuda
def test_a_refill_before_the_retire_is_wrong_on_a_gpu():
    """The copy stream no longer waits for its rows' last reader (no read is ever noted):
    with rows for one layer and a slow layer, the next layer's experts land under the read."""
    lane, hosts = gpu_lane(slow=20_000_000, poison_reads=False)

    class Never(list):
        def __getitem__(self, i):
            return None

        def __setitem__(self, i, v):
            pass
    lane.ring._read_by = Never(lane.ring._read_by)
    wrong = 0
    for s in range(3):
        got, want = run_step(lane, hosts, 8, s, device="cuda")
        wrong += sum(not torch.allclose(got[i].double().cpu(), want[i], rtol=1e-4, atol=1e-4)
                     for i in LAYERS)
    assert wrong > 0


@cuda
@pytest.mark.cuda
def test_a_captured_small_step_waits_for_the_carried_fill_at_every_replay():
    """A small step of every layer captured once (its waits on the positions' ready events as
    external wait nodes), replayed right after each large step, whose slow last layer holds
    back the carried fill into the rows the small step installs over: each replay equals the
    float64 MoE with its new routing."""
    lane, hosts = gpu_lane(slow=2_000_000)
    replay_small_step_after_large_steps(lane, hosts)
    assert lane.ring.carried_steps == 3


def test_a_reload_with_fills_in_flight_and_cut_steps_prove():
    """A forget right after a large step (its carried fill still copying on a GPU: the caches'
    poison must follow it), a step cut short at each layer, and a large step that resumes
    where the last one stopped after small steps in between: exact, and the trace proves."""
    lane, hosts = make_lane(slots=6)
    ops = []
    lane.trace_all(ops)
    lane.forget()
    run_step(lane, hosts, 8, 0)
    lane.forget()  # the tail's carried fill in flight
    assert_exact(*run_step(lane, hosts, 8, 1))
    lane.ring.begin(0)  # the first layer raised before end()
    lane.ring.begin(0)
    lane.ring.end(0)
    lane.ring.begin(1)  # and the second
    assert_exact(*run_step(lane, hosts, 8, 2))
    # a large step stopped after its first layer; small steps install; the next resumes at
    # the layer it expected: it must still read the tables again and wait for the small steps
    lane.ring.begin(0)
    lane.ring.end(0)
    assert_exact(*run_step(lane, hosts, 1, 3))
    g = torch.Generator().manual_seed(5)
    for i in LAYERS[1:]:
        ids, w = routing(77 + i, 8)
        x = torch.randn(8, H, generator=g)
        torch.testing.assert_close(lane.forward(i, x, w, ids).double(),
                                   moe_ref(x, hosts[i]["w13"], hosts[i]["w2"], w, ids),
                                   rtol=1e-5, atol=1e-5)
    check_lane(ops, 0)


@pytest.mark.parametrize("seed", range(12))
def test_random_lanes_stay_exact_and_consistent(seed):
    """Random arenas (2 to 4 layers, uneven slots, lookahead or not, poisoned reads or not)
    under random steps (large, small, cut short, restarted elsewhere, reloads): every output
    is the float64 MoE's, every cache's tables agree with each other and with the bytes in
    its slots, every row the arena believes it holds has those bytes, and the trace proves."""
    import random

    from ringflow.integrations.torch.expert_lookahead import Lookahead
    rnd = random.Random(seed)
    n = rnd.choice([2, 3, 4])
    slots = [rnd.randint(max(1, E // n // 2), E) for _ in range(n)]
    while sum(slots) < E:
        slots[rnd.randrange(n)] += 1
    g = torch.Generator().manual_seed(seed)
    hosts = [layer_experts(100 * seed + q) for q in range(n)]
    rows, views = arena_rows(hosts[0], slots, "cpu")
    caches = [ExpertCache(hosts[q], slots[q], "cpu", rows=views[q],
                          in_place_tokens=rnd.choice([0, 1])) for q in range(n)]
    poison_reads = rnd.random() < 0.5
    arena = ExpertArena(caches, rows, None, poison_reads)
    looks = {}
    if rnd.random() < 0.7:
        for q in range(n - 1):
            router = torch.randn(H, E, generator=g)
            looks[q] = Lookahead(lambda x, r=router: x @ r, caches[q + 1], K)
    lane = ExpertLane(dict(enumerate(caches)), {q: TorchCompute() for q in range(n)}, arena,
                      6, looks)
    ops = []
    lane.trace_all(ops)
    lane.forget()
    for step in range(40):
        kind = rnd.choices(["large", "small", "cut", "restart", "reload"], [4, 5, 1, 1, 0.5])[0]
        if kind == "reload":
            for h in hosts:
                for t in h.values():
                    t.mul_(-0.5)
            lane.forget()
            continue
        tokens = rnd.randint(1, 5) if kind == "small" else rnd.randint(6, 10)
        start = rnd.randrange(1, n) if kind == "restart" else 0
        stop = rnd.randrange(start, n) if kind == "cut" else n
        for q in range(start, stop):
            ids, w = routing(1000 * seed + 10 * step + q, tokens)
            x = torch.randn(tokens, H, generator=g)
            torch.testing.assert_close(lane.forward(q, x, w, ids).double(),
                                       moe_ref(x, hosts[q]["w13"], hosts[q]["w2"], w, ids),
                                       rtol=1e-4, atol=1e-4)
        if kind == "cut" and stop < n:  # the next layer's compute raised after begin()
            arena.begin(stop)
        for q, c in enumerate(caches):
            held = c.expert_in[:c.slots].tolist()
            where = c.slot_of[:c.experts].tolist()
            assert len({e for e in held if e >= 0}) == sum(e >= 0 for e in held)
            for s, e in enumerate(held):
                if e >= 0:
                    assert where[e] == s and torch.equal(c.weights["w13"][s], hosts[q]["w13"][e])
            assert all(held[s] == e for e, s in enumerate(where) if s >= 0)
        if not poison_reads and arena._tables is not None and kind != "small":
            for r in range(len(arena._owner)):
                known = arena._content(r)
                if known is not None:
                    assert torch.equal(rows["w13"][r], hosts[known[0]]["w13"][known[1]])
    check_lane(ops, 0)
