"""The layer ring borrowing the slot caches' memory (Note [Borrowed layer buffers]): the arena's
layout, steps on both sides of the threshold against the float64 MoE, the joint proof of the
ring and the caches, and the three mutants of the handover caught, by the proof and by the
numbers; on a GPU (marked cuda) the same with ringflow's copy stream and a slow reader."""

from __future__ import annotations

import pytest
import torch

from ringflow.errors import ConfigError, HazardError
from ringflow.integrations.torch.expert_arena import ExpertArena
from ringflow.integrations.torch.expert_cache import ExpertCache
from ringflow.integrations.torch.expert_lane import ExpertLane, TorchCompute
from ringflow.integrations.torch.expert_layers import ExpertLayerRing
from ringflow.orchestrator.expert_hazards import check_borrowing, check_ring
from tests.unit.test_expert_layers import LAYERS, SIZES, SlowCompute, layer_experts, run_step


def borrowing_lane(buffers: int = 2, slots: int = 4, borrow: bool = True, device="cpu",
                   stream=None, poison: bool = False):
    """A lane over one arena (its caches' memory after its ring's own buffers), as the vLLM
    room builds it."""
    hosts = {i: layer_experts(i) for i in LAYERS}
    if device != "cpu":
        hosts = {i: {k: v.pin_memory() for k, v in h.items()} for i, h in hosts.items()}
    order = sorted(hosts)
    arena = ExpertArena([hosts[i] for i in order], [slots] * len(order), buffers, device,
                        lend=borrow)
    caches = {i: ExpertCache(hosts[i], slots, device, storage=arena.cache_storage[n])
              for n, i in enumerate(order)}

    def lend():
        for cache in caches.values():
            cache.evict(poison_slots=poison)

    ring = ExpertLayerRing([hosts[i] for i in order], buffers, device, stream,
                           poison_reads=poison, storage=arena.ring_storage,
                           lend=lend if arena.borrowed else None)
    lane = ExpertLane(caches, {i: TorchCompute() for i in LAYERS}, ring, layer_tokens=6)
    lane._arena = arena
    return lane, hosts


def joint_trace(lane) -> list:
    ops: list = []
    lane.ring.trace = ops
    for i, cache in lane.caches.items():
        cache.trace, cache.trace_stream, cache.trace_owner = ops, "compute", i
    return ops


def test_the_arena_lays_the_caches_after_the_ring_and_lends_whole_layers():
    hosts = [layer_experts(i) for i in LAYERS]
    layer = sum(t.numel() * t.element_size() for t in hosts[0].values())  # 18 KiB: aligned
    arena = ExpertArena(hosts, [4] * 4, 2, "cpu")  # the caches: 4 x 4 of 12 experts
    assert arena.layer_bytes == layer and arena.cache_bytes == 4 * 4 * layer // 12
    assert arena.borrowed == 1 and arena.bytes == 2 * layer + arena.cache_bytes
    assert arena.ring_storage.shape == (3, layer)
    first = arena.cache_storage[0]["w13"]
    assert first.data_ptr() == arena.ring_storage[2].data_ptr()  # the borrowed row: the caches
    assert ExpertArena(hosts, [4] * 4, 2, "cpu", lend=False).borrowed == 0
    assert ExpertArena(hosts, [12] * 4, 2, "cpu").borrowed == 2  # never past the layers
    assert ExpertArena(hosts, [4] * 4, 0, "cpu").ring_storage is None
    with pytest.raises(ConfigError, match="one slot count per layer"):
        ExpertArena(hosts, [4] * 3, 2, "cpu")


@pytest.mark.parametrize("buffers", [1, 2, 3])
def test_borrowed_buffers_serve_large_steps_and_carry_more_exactly(buffers):
    lane, hosts = borrowing_lane(buffers)
    plain, _ = borrowing_lane(buffers, borrow=False)
    ring = lane.ring
    assert ring.borrowed == min(1, 4 - buffers) and ring.buffers == buffers + ring.borrowed
    for s, tokens in enumerate(SIZES):
        for one in (lane, plain):
            got, want = run_step(one, hosts, tokens, s)
            for i in LAYERS:
                torch.testing.assert_close(got[i].double(), want[i], rtol=1e-5, atol=1e-5)
    assert ring.steps == plain.ring.steps == sum(t >= 6 for t in SIZES)
    assert ring.lends > 0 and ring.carried_steps == ring.steps - 1
    # back-to-back large steps (SIZES 9, 12 and 7, 7) start with one more layer filled ahead
    # (a borrowed buffer); a step after a decode step does not (the decode took it back)
    back_to_back = sum(a >= 6 and b >= 6 for a, b in zip(SIZES, SIZES[1:]))
    assert ring.carried_layers == plain.ring.carried_layers + ring.borrowed * back_to_back


def test_the_joint_trace_of_ring_and_caches_proves():
    lane, hosts = borrowing_lane(2)
    ops = joint_trace(lane)
    for s, tokens in enumerate(SIZES):
        run_step(lane, hosts, tokens, s)
    check_borrowing(ops, lane.ring.own)
    check_ring([op for op in ops if op.owner == "ring"], lane.ring.buffers)
    assert any(op.owner == "ring" and op.kind == "fill" and op.pairs[0][1] >= lane.ring.own
               for op in ops)  # something was borrowed
    assert sum(op.kind == "evict" for op in ops) == 4 * lane.ring.lends  # every cache, each lend


@pytest.mark.parametrize("mutant, kind, wrong", [
    ("borrow-before-lend", "cross-stream", False),  # the CPU copies in line: numbers right
    ("no-give-back", "cross-stream", True),  # the next large step reads the caches' bytes
    ("lend-without-evict", "stale-cache", True),  # a decode step reads a layer as its experts
])
def test_each_handover_mutant_is_caught(monkeypatch, mutant, kind, wrong):
    from tests.helpers import mutants
    for name in ("_after_lend", "give_back", "_borrow"):
        monkeypatch.setattr(ExpertLayerRing, name, getattr(ExpertLayerRing, name))
    mutants.MUTANTS[mutant]()
    lane, hosts = borrowing_lane(2)
    ops = joint_trace(lane)
    bad = 0
    for s, tokens in enumerate(SIZES):
        got, want = run_step(lane, hosts, tokens, s)
        bad += sum(not torch.allclose(got[i].double(), want[i], rtol=1e-5, atol=1e-5)
                   for i in LAYERS)
    with pytest.raises(HazardError) as err:
        check_borrowing(ops, lane.ring.own)
    assert err.value.kind == kind
    assert (bad > 0) == wrong


def test_a_reload_gives_the_memory_back_before_the_caches_are_poisoned():
    lane, hosts = borrowing_lane(2, poison=True)
    run_step(lane, hosts, 8, 0)  # lent, the next step's first layers carried
    assert lane.ring.lent
    for h in hosts.values():
        for t in h.values():
            t.mul_(-0.5)
    lane.forget()
    assert not lane.ring.lent
    for s, tokens in enumerate([1, 8, 2, 9]):
        got, want = run_step(lane, hosts, tokens, s + 1)
        for i in LAYERS:
            torch.testing.assert_close(got[i].double(), want[i], rtol=1e-5, atol=1e-5)


def test_a_ring_with_borrowed_rows_needs_a_lend():
    hosts = [layer_experts(i) for i in LAYERS]
    arena = ExpertArena(hosts, [4] * 4, 2, "cpu")
    with pytest.raises(ConfigError, match="lend function exactly when"):
        ExpertLayerRing(hosts, 2, "cpu", storage=arena.ring_storage)
    with pytest.raises(ConfigError, match="lend function exactly when"):
        ExpertLayerRing(hosts, 2, "cpu", storage=arena.ring_storage[:2], lend=lambda: None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU; run `pytest -m cuda` on one")
def test_borrowing_on_a_gpu_is_exact_with_a_slow_reader_and_poisoned_slots():
    """ringflow's copy stream fills borrowed buffers while slow layers compute; every slot is
    poisoned after its read and at each lend, so a read or install out of order sees NaN."""
    from ringflow.graphs.streams import dedicated_streams
    owner = type("Owner", (), {})()
    stream = dedicated_streams(owner, torch.device("cuda", 0), ["copy"], 0)["copy"]
    lane, hosts = borrowing_lane(2, device="cuda", stream=stream, poison=True)
    lane.computes = {i: SlowCompute(2_000_000) for i in LAYERS}
    for s, tokens in enumerate(SIZES * 2):
        got, want = run_step(lane, hosts, tokens, s, device="cuda")
        for i in LAYERS:
            torch.testing.assert_close(got[i].double().cpu(), want[i], rtol=1e-5, atol=1e-5)
    assert lane.ring.lends > 0 and lane.ring.carried_steps == lane.ring.steps - 1
    torch.cuda.synchronize()
