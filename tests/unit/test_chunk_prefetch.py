"""ChunkPrefetcher on the CPU: every (layer, chunk) unit's slot holds that unit's gather."""

import logging

import pytest
import torch

from ringflow.errors import BudgetError, LifecycleError
from ringflow.integrations.torch.chunk_prefetch import ChunkPrefetcher

SHAPE = (8, 4)


def expected(layers, chunks, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {(l, c): torch.randn(SHAPE, generator=g) for l in range(layers) for c in range(chunks)}


def filler(data, log=None):
    def fill(layer, chunk, slot):
        if log is not None:
            log.append((layer, chunk))
        slot.copy_(data[(layer, chunk)])
    return fill


def ring(depth=1, **kw):
    return ChunkPrefetcher(SHAPE, torch.float32, depth=depth, workspace_bytes=1 << 20,
                           device="cpu", **kw)


def no_leases(r):
    return r.pool.leases() == [] and r.pool.free_count == r.pool.slots


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_each_unit_reads_its_own_gather_and_the_step_hands_every_slot_back(depth):
    data = expected(3, 2, seed=depth)
    r = ring(depth)
    for _ in range(2):  # a second step reuses the plan and the ring
        filled = []
        r.start(3, 2, filler(data, filled))
        for l in range(3):
            for c in range(2):
                assert torch.equal(r.begin(l, c), data[(l, c)])
        r.end()
        assert not r.in_step and no_leases(r)
        assert sorted(filled) == sorted(data)  # each unit gathered exactly once
    assert r.consumed == 12 and r.steps == 2 and r.pool.depth == depth


def test_plans_are_cached_per_unit_count_and_say_their_shape():
    r = ring()
    steppers = []
    for layers, chunks in [(3, 2), (3, 2), (2, 4)]:
        data = expected(layers, chunks, seed=chunks)
        r.start(layers, chunks, filler(data))
        for l in range(layers):
            for c in range(chunks):
                assert torch.equal(r.begin(l, c), data[(l, c)])
        r.end()
        steppers.append(r.stepper)
        assert r.dag.meta["layers"] == layers and r.dag.meta["chunks"] == chunks
    assert steppers[0] is steppers[1] and steppers[2] is not steppers[0]
    assert len(r._steppers) == 2


def test_a_second_start_in_flight_is_refused_and_abandon_recovers(caplog):
    data = expected(3, 2, seed=7)
    r = ring(depth=1)
    r.start(3, 2, filler(data))
    r.begin(0, 0)
    r.begin(0, 1)
    with pytest.raises(LifecycleError, match="abandon"):
        r.start(3, 2, filler(data))
    with caplog.at_level(logging.WARNING, logger="ringflow"):
        r.abandon("the engine changed its chunking")
    named = [rec for rec in caplog.records if rec.levelno == logging.WARNING
             and "the engine changed its chunking" in rec.getMessage()]
    assert len(named) == 1
    assert r.abandoned == {"the engine changed its chunking": 1}
    assert not r.in_step and no_leases(r)
    r.start(3, 2, filler(data))  # the next step works
    for l in range(3):
        for c in range(2):
            assert torch.equal(r.begin(l, c), data[(l, c)])
    r.end()
    assert not r.in_step and no_leases(r)


def test_a_budget_below_one_slot_names_the_context_chunk_slot():
    slot_bytes = SHAPE[0] * SHAPE[1] * 4
    with pytest.raises(BudgetError, match="context-chunk slot") as caught:
        ChunkPrefetcher(SHAPE, torch.float32, depth=1, workspace_bytes=slot_bytes - 1,
                        device="cpu")
    assert caught.value.slot_bytes == slot_bytes and caught.value.budget_bytes == slot_bytes - 1
