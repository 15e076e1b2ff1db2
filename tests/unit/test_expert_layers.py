"""The expert lane's two modes (Note [Expert lane modes]): the layer ring for large steps (Note
[Expert layer ring]) and the slot cache for small ones, against the float64 MoE, proven over
their traces together (Note [Expert lane hazards]); on a GPU (marked cuda) the ring's copies on
ringflow's copy stream, with a slow reader, and the mutant that refills before the retire."""

from __future__ import annotations

import pytest
import torch

from ringflow.errors import ConfigError, HazardError, KernelError
from ringflow.integrations.torch.expert_cache import ExpertCache
from ringflow.integrations.torch.expert_lane import ExpertLane, TorchCompute
from ringflow.integrations.torch.expert_layers import ExpertLayerRing
from ringflow.kernels.reference import moe_ref
from ringflow.orchestrator.expert_hazards import (ExpertOp, check_expert_step, check_lane,
                                                   check_ring)
from tests.helpers.expert_lanes import (E, H, I, LAYERS, SIZES, hosts_on, layer_experts,
                                        on_a_gpu, replay_small_step_after_large_steps, routing,
                                        run_step)


def make_lane(buffers: int = 2, slots: int = 4, layer_tokens: int = 6, device="cpu",
              stream=None, poison_reads=False, from_slots=True, lend=True, hold=False):
    """The lane over LAYERS; with ``hold``, the ring's first ``buffers`` layers held for small
    steps and only the others cached (Note [Small steps read the held layers])."""
    hosts = hosts_on(device)
    held = LAYERS[:buffers] if hold else ()
    caches = {i: ExpertCache(h, slots, device) for i, h in hosts.items() if i not in held}
    ring = (ExpertLayerRing([hosts[i] for i in LAYERS], buffers, device, stream,
                            poison_reads=poison_reads,
                            caches=[caches.get(i) for i in LAYERS] if from_slots else None,
                            lend_slots=lend and not hold, hold=hold)
            if buffers else None)
    return ExpertLane(caches, {i: TorchCompute() for i in LAYERS}, ring, layer_tokens), hosts


@pytest.mark.parametrize("lend", [False, True])
@pytest.mark.parametrize("buffers", [1, 2, 3, 4, 6])
def test_steps_on_both_sides_of_the_threshold_equal_the_float64_moe(buffers, lend):
    lane, hosts = make_lane(buffers, lend=lend)
    for s, tokens in enumerate(SIZES):
        got, want = run_step(lane, hosts, tokens, s)
        for i in LAYERS:
            torch.testing.assert_close(got[i].double(), want[i], rtol=1e-5, atol=1e-5)
    ring = lane.ring
    assert ring.buffers == min(buffers, len(LAYERS))
    assert ring.steps == sum(t >= 6 for t in SIZES)
    # every large step after the first starts with its first layer filled in the tail of the
    # step before it (decode steps in between leave the carried fills alone)
    assert ring.carried_steps == ring.steps - 1
    if lend and ring.buffers < len(LAYERS):  # 9 then 12 tokens: the second took what the
        assert 0 < ring.rows_from_lent <= ring.rows_staged  # first staged (decode steps took
    else:                                                   # some slots between others)
        assert ring.rows_staged == ring.rows_from_lent == 0
    hits = sum(c.hits.item() + c.misses.item() for c in lane.caches.values())
    assert hits > 0  # the small steps went through the caches


def test_a_lender_that_forgot_since_the_stage_lends_nothing():
    """A lending cache that forgot (poisoned slots, entries -1 again) after the stage: the
    next large step's fill must not take the staged rows from it (Note [Ring lends the carried
    layers' slots]: the stage checks each lender's generation)."""
    lane, hosts = make_lane(2, lend=True)
    run_step(lane, hosts, 8, 0)  # the tail stages position 2's experts in 0's and 1's slots
    assert lane.ring.rows_staged > 0
    lane.caches[LAYERS[0]].forget()  # the cache alone, not the ring
    got, want = run_step(lane, hosts, 8, 1)
    for i in LAYERS:
        torch.testing.assert_close(got[i].double(), want[i], rtol=1e-5, atol=1e-5)
    assert 0 < lane.ring.rows_from_lent  # the other lender's rows still served


def test_the_ring_copies_whole_layers_in_order_and_the_traces_prove():
    """One trace of the ring over prefills and decodes, proven; each slot-cache step proven on
    its own; the fills are the layers' positions in turn."""
    lane, hosts = make_lane(buffers=2)
    lane.ring.trace = []
    held = {i: {} for i in LAYERS}
    for s, tokens in enumerate(SIZES):
        traces = {}
        for i, cache in lane.caches.items():
            cache.trace = traces.setdefault(i, [])
        run_step(lane, hosts, tokens, s)
        for i, cache in lane.caches.items():
            if tokens < lane.layer_tokens:  # a slot-cache step: proven per layer
                needed = set(routing(s * 31 + i, tokens)[0].reshape(-1).tolist())
                held[i] = check_expert_step(held[i], needed, traces[i], cache.slots)
            else:  # the ring served it: the cache is untouched, or lent (emptied)
                assert all(op.kind == "forget" for op in traces[i]), traces[i]
    check_ring(lane.ring.trace, lane.ring.buffers)
    # a fill ends on the copy stream; one that takes experts from the slots starts on the
    # compute stream (Note [Ring fills from the slots])
    fills = [p for op in lane.ring.trace if op.kind == "fill" and op.stream == "copy"
             for p, _ in op.pairs]
    reads = [p for op in lane.ring.trace if op.kind == "read" for p, _ in op.pairs]
    assert reads == [0, 1, 2, 3] * lane.ring.steps
    assert fills[:len(reads)] == reads  # filled in the order they are read, carried or not
    from_slots = [op for op in lane.ring.trace if op.kind == "fill" and op.stream == "compute"]
    assert from_slots and lane.ring.rows_from_slots > 0


def joint_trace(lend=False, hold=False, steps=SIZES, exact=True):
    """A lane's joint trace (``ExpertLane.trace_all``) from empty slots over ``steps``, each
    step checked against the float64 MoE when ``exact``."""
    lane, hosts = make_lane(2, lend=lend, hold=hold)
    ops = []
    lane.trace_all(ops)
    lane.forget()  # every slot empty and traced so: where the proof starts
    for s, tokens in enumerate(steps):
        got, want = run_step(lane, hosts, tokens, s)
        for i in LAYERS if exact else ():
            torch.testing.assert_close(got[i].double(), want[i], rtol=1e-5, atol=1e-5)
    return lane, ops


@pytest.mark.parametrize("lend, hold", [(False, False), (True, False), (False, True)])
def test_the_lanes_joint_trace_proves_the_ring_and_the_caches_together(lend, hold):
    """Note [Expert lane hazards]: the ring's fills take rows from the caches' slots (and
    with lent slots write other layers' experts there) between the caches' own installs and
    reads; the joint trace proves both sides: each take names what its slot holds and is
    ordered after the write and before the next install over it."""
    lane, ops = joint_trace(lend, hold)
    check_lane(ops, lane.ring.buffers)
    kinds = {op.kind for op in ops}
    assert {"install", "read", "take", "fill", "forget"} <= kinds
    assert ("lend" in kinds) == lend
    spaces = {op.space for op in ops if op.kind in ("install", "take")}
    assert spaces == set(range(2 if hold else 0, 4))
    assert all(op.stream in ("compute", "copy") for op in ops)


def test_a_take_off_the_lanes_stream_or_of_a_stale_table_is_caught(monkeypatch):
    """A slot copy moved to the copy stream (no event orders the next install over its row
    after it), and fills that take rows by the first step's slot tables (never read again):
    each fails the joint proof."""
    lane, ops = joint_trace()
    moved = [ExpertOp(op.kind, "copy", op.pairs, op.on, op.space) if op.kind == "take" else op
             for op in ops]
    with pytest.raises(HazardError) as err:
        check_lane(moved, 2)
    assert err.value.kind == "cross-stream"
    real = ExpertLayerRing._read_slot_tables

    def once(ring):
        if ring._held is None or not getattr(ring, "_read_once", False):
            ring._read_once = True
            real(ring)
    monkeypatch.setattr(ExpertLayerRing, "_read_slot_tables", once)
    lane, ops = joint_trace(steps=[1, 2, 8, 1, 2, 1, 9], exact=False)
    with pytest.raises(HazardError) as err:
        check_lane(ops, 2)
    assert err.value.kind == "read-before-write"


def test_a_take_of_a_lent_row_a_decode_step_rewrote_is_caught(monkeypatch):
    """Lent slots (Note [Ring lends the carried layers' slots]): a fill that takes every
    staged row, not only those whose slot no install took since, names experts their slots
    no longer hold."""
    real = ExpertLayerRing._staged

    def every_row(ring, position, held):
        stage = ring._stage
        real(ring, position, held)  # uses the stage up
        if stage is None or stage[1] != position or stage[0] >= ring.steps:
            return []
        return [row for row in stage[2] if row[2] not in set(held)]
    monkeypatch.setattr(ExpertLayerRing, "_staged", every_row)
    lane, ops = joint_trace(lend=True, steps=[8, 1, 1, 2, 1, 9], exact=False)
    with pytest.raises(HazardError) as err:
        check_lane(ops, 2)
    assert err.value.kind == "read-before-write"


def test_a_refill_before_the_readers_retire_is_caught(monkeypatch):
    """The mutant of tests/helpers/mutants.py: the copy stream no longer waits for the slot's
    retire event; the proof names a cross-stream hazard."""
    from tests.helpers import mutants
    monkeypatch.setattr(ExpertLayerRing, "_fill", ExpertLayerRing._fill)
    mutants.MUTANTS["layer-refill-before-retire"]()
    lane, hosts = make_lane(buffers=2)
    lane.ring.trace = []
    run_step(lane, hosts, 8, 0)
    with pytest.raises(HazardError) as err:
        check_ring(lane.ring.trace, lane.ring.buffers)
    assert err.value.kind == "cross-stream"


@pytest.mark.parametrize("mutate, kind", [
    (lambda ops: [op for op in ops if not (op.kind == "wait" and op.stream == "compute")],
     "cross-stream"),  # a layer reads its slot without waiting for the fill
    (lambda ops: [ExpertOp("read", op.stream, (((p + 1) % 4, s),)) if op.kind == "read" else op
                  for op in ops for p, s in (op.pairs or ((0, 0),))], "wrong-layer"),
    (lambda ops: [ExpertOp("fill", op.stream, ((p, 7),)) if op.kind == "fill" else op
                  for op in ops for p, s in (op.pairs or ((0, 0),))], "slot-range"),
])
def test_each_ring_hazard_is_named(mutate, kind):
    lane, hosts = make_lane(buffers=2)
    lane.ring.trace = []
    for s, tokens in enumerate([8, 9, 1, 7]):
        run_step(lane, hosts, tokens, s)
    check_ring(lane.ring.trace, 2)
    with pytest.raises(HazardError) as err:
        check_ring(mutate(lane.ring.trace), 2)
    assert err.value.kind == kind


def test_fills_take_what_the_slots_hold_and_copy_only_the_rest():
    """Note [Ring fills from the slots]: after decode steps fill the caches, a large step's
    fills copy from host memory only the experts no slot holds; the buffers hold the layers'
    bytes exactly, whichever way each row came, and the host rows the slots hold are never
    read (changed behind the caches' backs, the buffers keep the slots' bytes)."""
    lane, hosts = make_lane(buffers=4, slots=5)
    for s in range(4):  # decode steps: each cache ends holding 5 of its 12 experts
        run_step(lane, hosts, 2, 10 + s)
    held = {i: set(c.holding().values()) for i, c in lane.caches.items()}
    assert all(len(h) == 5 for h in held.values())
    marked = {}
    for i in LAYERS:  # a host row a slot holds: changed, so where it came from shows
        e = min(held[i])
        marked[i] = (e, hosts[i]["w13"][e].clone())
        hosts[i]["w13"][e].add_(1.0)
    got, want = run_step(lane, hosts, 8, 0)  # 4 buffers: the next step's fills are all issued
    ring = lane.ring
    assert ring.rows_from_slots == 2 * sum(len(h) for h in held.values())  # this step's, carried
    assert ring.rows_from_host == 2 * sum(E - len(h) for h in held.values())
    for (i, views) in zip(LAYERS, ring.views):
        e, before = marked[i]
        assert torch.equal(views["w13"][e], before)  # from the slot, not the changed host row
        rest = [x for x in range(E) if x != e]
        assert torch.equal(views["w13"][rest], hosts[i]["w13"][rest])
        assert torch.equal(views["w2"], hosts[i]["w2"])


def test_a_slot_copy_into_a_buffer_an_unread_fill_still_writes_is_caught():
    """A step that restarts drops fills it never read; refilling their buffers from the slots,
    on the compute stream, must first wait for those fills' copies: the proof catches the
    compute-stream copy that skips the wait."""
    lane, hosts = make_lane(buffers=2)
    lane.ring.trace = []
    for s in range(3):
        run_step(lane, hosts, 1, 20 + s)
    run_step(lane, hosts, 8, 0)  # carries positions 0 and 1, never read below
    lane.ring.begin(2)  # a step restarting at position 2: both carried fills dropped
    lane.ring.end(2)
    check_ring(lane.ring.trace, 2)
    ops = lane.ring.trace
    skipped = [op for j, op in enumerate(ops) if not (
        op.kind == "wait" and op.stream == "compute" and isinstance(op.on, tuple)
        and op.on[0] == "ready" and j + 1 < len(ops) and ops[j + 1].kind in ("take", "fill"))]
    with pytest.raises(HazardError) as err:
        check_ring(skipped, 2)
    assert err.value.kind == "cross-stream"


def test_a_fill_that_raises_gives_its_buffer_back(monkeypatch):
    """A fill that raises half-way (here its slot copy) leaks no buffer: the step's error
    reaches the caller, and the next large step fills every layer and equals the reference."""
    from ringflow.integrations.torch import expert_layers
    lane, hosts = make_lane(buffers=2)
    for s in range(2):
        run_step(lane, hosts, 1, 30 + s)  # the slots hold experts: fills copy from them
    real = expert_layers.fetch_experts
    monkeypatch.setattr(expert_layers, "fetch_experts",
                        lambda *a, **k: (_ for _ in ()).throw(KernelError("copy failed")))
    with pytest.raises(KernelError, match="copy failed"):
        run_step(lane, hosts, 8, 0)
    monkeypatch.setattr(expert_layers, "fetch_experts", real)
    assert lane.ring.pool.free_count == lane.ring.buffers
    got, want = run_step(lane, hosts, 8, 1)
    for i in LAYERS:
        torch.testing.assert_close(got[i].double(), want[i], rtol=1e-5, atol=1e-5)


def test_a_ring_over_caches_of_other_host_tensors_is_refused():
    hosts = [layer_experts(0), layer_experts(1)]
    caches = [ExpertCache(layer_experts(0), 2, "cpu"), ExpertCache(hosts[1], 2, "cpu")]
    with pytest.raises(ConfigError, match="over the ring's host tensors"):
        ExpertLayerRing(hosts, 2, "cpu", caches=caches)


def test_a_step_cut_short_and_a_reload_refill_what_they_must():
    """A large step that raises half-way, then a full one: its fills start over and it equals
    the reference. A reload (``forget``): the carried fills are dropped, the new weights read."""
    lane, hosts = make_lane(buffers=2)
    run_step(lane, hosts, 8, 0)
    ids, weights = routing(5, 8)
    x = torch.randn(8, H)
    lane.forward(LAYERS[0], x, weights, ids)
    lane.ring.begin(1)  # the second layer's compute raised before end()
    got, want = run_step(lane, hosts, 8, 1)
    for i in LAYERS:
        torch.testing.assert_close(got[i].double(), want[i], rtol=1e-5, atol=1e-5)
    for i in LAYERS:  # new weights in the host copies, as a reload leaves them
        for t in hosts[i].values():
            t.mul_(-0.5)
    lane.forget()
    got, want = run_step(lane, hosts, 8, 2)
    for i in LAYERS:
        torch.testing.assert_close(got[i].double(), want[i], rtol=1e-5, atol=1e-5)


def test_poisoned_reads_leave_nan_behind_and_the_next_fill_replaces_it():
    lane, hosts = make_lane(buffers=4, poison_reads=True)
    got, want = run_step(lane, hosts, 8, 0)
    for i in LAYERS:
        torch.testing.assert_close(got[i].double(), want[i], rtol=1e-5, atol=1e-5)
    # every slot was read and then filled with the next step's layer (4 buffers, 4 layers)
    assert all(torch.equal(v["w13"], hosts[i]["w13"]) for i, v in
               zip(LAYERS, lane.ring.views))


def test_bad_rings_and_lanes_are_refused():
    hosts = [layer_experts(0), layer_experts(1)]
    with pytest.raises(ConfigError, match="at least 1 buffer"):
        ExpertLayerRing(hosts, 0, "cpu")
    odd = {"w13": torch.zeros(E, 2 * I, H + 1), "w2": torch.zeros(E, H, I)}
    with pytest.raises(ConfigError, match="share one layout"):
        ExpertLayerRing([hosts[0], odd], 2, "cpu")
    with pytest.raises(ConfigError, match="copy stream"):
        ExpertLayerRing(hosts, 2, "cpu", stream=object())
    ring = ExpertLayerRing(hosts, 2, "cpu")
    with pytest.raises(KernelError, match="positions 0..1"):
        ring.begin(2)
    with pytest.raises(KernelError, match="without begin"):
        ring.end(0)
    caches = {0: ExpertCache(hosts[0], 2, "cpu")}
    with pytest.raises(ConfigError, match="holds 2 layers"):
        ExpertLane(caches, {0: TorchCompute()}, ring)
    with pytest.raises(ConfigError, match="one compute per layer"):
        ExpertLane(caches, {})


# small steps read the held layers (Note [Small steps read the held layers])

@pytest.mark.parametrize("poison_reads", [False, True])
@pytest.mark.parametrize("slots", [4, 7])
@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_held_layers_serve_small_steps_from_their_own_buffers(buffers, slots, poison_reads):
    """Every step on both sides of the threshold equals the float64 MoE; a held layer has no
    cache and every small step reads it from the same buffer (a captured graph holds that
    address), one per held layer per small step; every large step, the first too, starts
    with its first layer carried; the other layers' caches served the small steps."""
    lane, hosts = make_lane(buffers, slots=slots, poison_reads=poison_reads, hold=True)
    ring = lane.ring
    held = LAYERS[:buffers]
    assert lane.held == list(held) and set(lane.caches) == set(LAYERS[buffers:])
    addresses = [ring.views[p]["w13"].data_ptr() for p in range(buffers)]
    reads = []
    real = ring.read_held

    def read_held(p):
        views = real(p)
        reads.append((p, views["w13"].data_ptr()))
        return views

    ring.read_held = read_held
    for s, tokens in enumerate(SIZES):
        got, want = run_step(lane, hosts, tokens, s)
        for i in LAYERS:
            torch.testing.assert_close(got[i].double(), want[i], rtol=1e-5, atol=1e-5)
    small = sum(t < lane.layer_tokens for t in SIZES)
    assert sorted(reads) == sorted((p, addresses[p]) for p in range(buffers)
                                   for _ in range(small))
    assert ring.held_reads == len(reads)
    assert ring.steps == ring.carried_steps == sum(t >= 6 for t in SIZES)
    assert ring.recarried == 0
    assert all(c.hits.item() + c.misses.item() > 0 for c in lane.caches.values())
    rows = lane.report()
    assert [r["layer"] for r in rows] == list(LAYERS)
    assert [r.get("held_in_ring_buffer") for r in rows] == [*range(buffers),
                                                            *[None] * (4 - buffers)]


def test_held_layers_trace_proves_and_its_mutants_are_caught():
    """The held reads in the ring's trace, over large and small steps and a step that starts
    at another position, proven; a held read that skips its fill's ready event, or fills
    after small steps' reads without the copy stream waiting for the compute stream (they
    record no retire event), are cross-stream hazards. Fills from host memory only: a fill
    that takes experts from the slots starts on the compute stream, which orders it anyway."""
    lane, hosts = make_lane(2, hold=True, from_slots=False)
    ring = lane.ring
    ring.trace = []
    waits = []  # the trace index of each held read's wait
    real = ring.read_held

    def read_held(p):
        waits.append(len(ring.trace))
        return real(p)

    ring.read_held = read_held
    lane.forget()  # the held layers carried again, now traced
    for s, tokens in enumerate([1, 8, 2, 9, 1]):
        run_step(lane, hosts, tokens, s)
    lane.forget()  # a reload right after small steps' reads, twice
    run_step(lane, hosts, 1, 5)
    lane.forget()
    run_step(lane, hosts, 1, 6)
    ring.begin(2)  # a large step that starts at position 2, right after small steps
    ring.end(2)
    ops = ring.trace
    check_ring(ops, 2)
    assert all(ops[j].kind == "wait" and ops[j + 1].kind == "read" for j in waits)
    no_wait = [op for j, op in enumerate(ops) if j not in waits]
    with pytest.raises(HazardError) as err:
        check_ring(no_wait, 2)
    assert err.value.kind == "cross-stream"
    unordered = [op for op in ops if not (op.kind == "wait" and op.stream == "copy"
                                          and op.on == "compute")]
    with pytest.raises(HazardError) as err:
        check_ring(unordered, 2)
    assert err.value.kind == "cross-stream"


def test_held_layers_come_back_after_a_reload_and_a_step_cut_short():
    """A reload (``forget``) carries the held layers again at once, with the new weights; a
    large step that raised half-way leaves them out of their buffers, and the next small step
    carries them again before it reads (eagerly: never under a capture)."""
    lane, hosts = make_lane(2, hold=True)
    run_step(lane, hosts, 8, 0)
    for i in LAYERS:
        for t in hosts[i].values():
            t.mul_(-0.5)
    lane.forget()
    assert lane.ring.recarried == 1
    for s, tokens in enumerate([1, 8]):
        got, want = run_step(lane, hosts, tokens, 1 + s)
        for i in LAYERS:
            torch.testing.assert_close(got[i].double(), want[i], rtol=1e-5, atol=1e-5)
    ids, weights = routing(5, 8)
    lane.forward(LAYERS[0], torch.randn(8, H), weights, ids)
    lane.ring.begin(1)  # the second layer's compute raised before end()
    got, want = run_step(lane, hosts, 2, 3)
    for i in LAYERS:
        torch.testing.assert_close(got[i].double(), want[i], rtol=1e-5, atol=1e-5)
    assert lane.ring.recarried == 2


def test_a_large_step_whose_layer_raises_puts_the_held_layers_back():
    """A large step whose compute raises at its second layer: before the error goes on, the
    held layers are carried again into their own buffers, so a small step replayed from a
    graph (no Python: here, computed from the buffers the first read returned) reads them."""
    lane, hosts = make_lane(2, hold=True)
    ring = lane.ring
    views = [ring.read_held(p) for p in range(2)]

    class Raises(TorchCompute):
        def __call__(self, *args, **kwargs):
            raise KernelError("the layer failed")

    good = lane.computes[LAYERS[1]]
    lane.computes[LAYERS[1]] = Raises()
    ids, weights = routing(3, 8)
    lane.forward(LAYERS[0], torch.randn(8, H), weights, ids)
    with pytest.raises(KernelError, match="the layer failed"):
        lane.forward(LAYERS[1], torch.randn(8, H), weights, ids)
    lane.computes[LAYERS[1]] = good
    assert ring.recarried == 1
    assert all(ring.pool.carried[("experts-layers", p)].slot == p for p in range(2))
    ids, weights = routing(4, 2)
    x = torch.randn(2, H)
    for p, i in enumerate(LAYERS[:2]):  # the replay's reads: the same buffers, no Python
        got = TorchCompute()(x, views[p], weights, ids, None)
        torch.testing.assert_close(got.double(), moe_ref(x, hosts[i]["w13"], hosts[i]["w2"],
                                                         weights, ids), rtol=1e-5, atol=1e-5)


def test_held_rings_and_lanes_that_cannot_work_are_refused():
    hosts = [layer_experts(0), layer_experts(1)]
    with pytest.raises(ConfigError, match="more layers than buffers"):
        ExpertLayerRing(hosts, 2, "cpu", hold=True)
    with pytest.raises(ConfigError, match="choose one"):
        ExpertLayerRing(hosts, 1, "cpu", hold=True, lend_slots=True)
    ring = ExpertLayerRing(hosts, 1, "cpu", hold=True)
    with pytest.raises(KernelError, match="positions 0..0 for small steps"):
        ring.read_held(1)
    caches = {0: ExpertCache(hosts[0], 2, "cpu"), 1: ExpertCache(hosts[1], 2, "cpu")}
    with pytest.raises(ConfigError, match="a cache per layer the ring does not hold"):
        ExpertLane(caches, {0: TorchCompute(), 1: TorchCompute()}, ring)


cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA GPU; run `pytest -m cuda` on one")


def gpu_lane(slow: int, poison_reads: bool = True, hold: bool = False):
    return on_a_gpu(make_lane, slow, buffers=2, poison_reads=poison_reads, hold=hold)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("hold", [False, True])
def test_the_joint_trace_of_a_gpu_lane_proves(hold):
    """The joint proof (Note [Expert lane hazards]) over a GPU lane's eager steps: the caches'
    operations on the lane's real stream, the ring's on its copy stream, a slow reader."""
    lane, hosts = gpu_lane(slow=200_000, hold=hold)
    ops = []
    lane.trace_all(ops)
    lane.forget()
    for s, tokens in enumerate(SIZES):
        got, want = run_step(lane, hosts, tokens, s, device="cuda")
        for i in LAYERS:
            torch.testing.assert_close(got[i].double().cpu(), want[i], rtol=1e-5, atol=1e-5)
    check_lane(ops, lane.ring.buffers)
    assert any(op.kind == "take" for op in ops)


@cuda
@pytest.mark.cuda
def test_a_captured_small_step_reads_the_held_layers_each_large_step_carried_again():
    """Note [Small steps read the held layers] on a GPU: a small step of every layer captured
    once (its held layers' waits on the ready events as external wait nodes), replayed after
    each large step, whose slow reads poison the held buffers and whose tail carries them
    again from host memory: each replay equals the float64 MoE with its new routing."""
    lane, hosts = gpu_lane(slow=2_000_000, hold=True)
    replay_small_step_after_large_steps(lane, hosts)
    assert lane.ring.steps == lane.ring.carried_steps == 4


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("hold", [False, True])
def test_the_ring_on_a_gpu_copies_on_its_own_stream_and_is_exact_with_a_slow_reader(hold):
    lane, hosts = gpu_lane(slow=2_000_000, hold=hold)
    for s, tokens in enumerate(SIZES):
        got, want = run_step(lane, hosts, tokens, s, device="cuda")
        for i in LAYERS:
            torch.testing.assert_close(got[i].double().cpu(), want[i], rtol=1e-5, atol=1e-5)
    assert lane.ring.fills >= 4 * lane.ring.steps and lane.ring.carried_steps == \
        lane.ring.steps - (0 if hold else 1)


@cuda
@pytest.mark.cuda
def test_the_gpu_race_catches_a_refill_before_the_retire(monkeypatch):
    """The mutant's copy into the slot a slow layer is about to read lands first: the layer
    computes with the next layer's experts (or the poison), and the output is wrong."""
    from tests.helpers import mutants
    monkeypatch.setattr(ExpertLayerRing, "_fill", ExpertLayerRing._fill)
    mutants.MUTANTS["layer-refill-before-retire"]()
    lane, hosts = gpu_lane(slow=20_000_000)
    wrong = 0
    for s in range(3):
        got, want = run_step(lane, hosts, 8, s, device="cuda")
        wrong += sum(not torch.allclose(got[i].double().cpu(), want[i], rtol=1e-4, atol=1e-4)
                     for i in LAYERS)
    assert wrong > 0


@pytest.mark.parametrize("from_slots,lend", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp8_layers_fill_with_their_scales_bit_for_bit(device, from_slots, lend):
    """A ring over fp8 experts with their scales (Note [fp8 experts]): every buffer a large
    step reads holds its layer's fp8 weights and scales, byte for byte, for two steps (the
    second's first layers carried), with a third of each layer taken from its cache's slots
    (Note [Ring fills from the slots]) or all from host memory, and with the carried layers'
    slots lent to the third layer in the first step's tail (Note [Ring lends the carried
    layers' slots])."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    hosts = []
    for i in LAYERS:
        g = torch.Generator().manual_seed(i)
        host = {name: t.to(torch.float8_e4m3fn) for name, t in layer_experts(i).items()}
        host["w13_scale"] = torch.rand(E, 2 * I // 4, H // 4, generator=g)
        host["w2_scale"] = torch.rand(E, 1, generator=g)
        hosts.append({k: v.pin_memory() for k, v in host.items()} if device != "cpu" else host)
    stream = torch.cuda.Stream() if device != "cpu" else None
    caches = None
    if from_slots:
        caches = [ExpertCache(host, 4, device) for host in hosts]
        for i, cache in enumerate(caches):  # each cache holds 4 experts of its layer
            cache.prefetch(torch.tensor([[i, i + 3], [i + 5, i + 7]], device=device))
    ring = ExpertLayerRing(hosts, 2, device, stream, caches=caches, lend_slots=lend)
    for _ in range(2):
        for position, host in enumerate(hosts):
            views, _ = ring.begin(position)
            for name, t in host.items():
                assert torch.equal(views[name].cpu().view(torch.uint8), t.cpu().view(torch.uint8))
            ring.end(position)
    assert ring.carried_steps == 1
    assert ring.fills == 10  # 4 + 2 carried, then 2 + 2 carried
    # lent: the carried layers' caches are empty after the first tail, so their second fills
    # take nothing from their slots, and layer 2's second fill takes their 8 staged experts
    assert ring.rows_from_slots == (0 if not from_slots else 32 if lend else 40)
    assert ring.rows_from_lent == (8 if lend else 0)
    assert ring.rows_from_slots + ring.rows_from_lent + ring.rows_from_host == E * ring.fills


@pytest.mark.parametrize("buffers, hold", [(2, False), (3, False), (2, True), (1, True)])
def test_the_models_chunk_copies_are_what_the_ring_copies(buffers, hold):
    """``chunk_copies`` (orchestrator/expert_model.py) for the ring, its fills taking what the
    slots hold, and for held layers carried again in every tail, against the ring's count
    over back-to-back large steps."""
    from ringflow.orchestrator.expert_model import chunk_copies
    lane, hosts = make_lane(buffers, lend=False, hold=hold)
    for s in range(3):
        run_step(lane, hosts, 2, s)  # the caches fill first
    for s in range(3):
        run_step(lane, hosts, 8, 10 + s)
    before = lane.ring.rows_from_host
    run_step(lane, hosts, 8, 20)
    slots = next(iter(lane.caches.values())).slots
    assert lane.ring.rows_from_host - before == chunk_copies(
        "held" if hold else "ring", layers=len(LAYERS), experts=E, slots=slots,
        buffers=buffers)
